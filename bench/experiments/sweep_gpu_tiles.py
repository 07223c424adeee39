"""Sweep of a kernel family's tiles at any head dims: the experiment behind tileattn/gpu/tiles.py.

    PYTHONPATH=. python3 bench/experiments/sweep_gpu_tiles.py --family wgmma --direction forward \
        --dims 80,96,160 [--dtype float16] [--n 1024,4096] [--queries 1,128] [--dropout 0.1 |
        --softcap 30 | --alibi] [--causal both|yes|no] [--only NAMES] [--nondeterministic |
        --dq-parts]

For each head dim (D or D:Dv), causal and not, and sequence length (batch * N = 16k tokens,
hidden about 2048; with --queries, each count of query rows over N keys, causal aligned
bottom-right, at the same batch and heads: a prefill chunk over a cache, or few queries
pooling many keys), every candidate configuration of the family is first checked against
the float64 golden model on a small problem with every option on, then timed on the large
one (calls back to back, bench_gpu.back_to_back_ms) beside the row the table chooses now,
and by CUDA events around each of its launches ("kernels ms", the median call's sum: what a
tiling changes where a short call's host time hides it back to back; not for the mma.sync
and 3xTF32 backward, whose launches bypass the timer). A backward is timed alone, after one
forward of the table's (TFLOP/s: 2.5x the forward's count). A forward candidate runs with
the key shares a dense call of its tiles gets (`tiles.with_key_splits`: few query tiles
over many keys).
Candidates that do not fit shared memory, or that the compiler refuses, are reported and
skipped. The winners become rows of the family's table, each with a note naming this sweep.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from dataclasses import replace

import cupy
import numpy as np

from tileattn.gpu import launch_backward, launch_forward, tiles
from tileattn.gpu.launch_decode import decode_shape
from tileattn.gpu.operands import problem_of, shared_memory_limit
from tileattn.testing import assert_attention_close
from tileattn.validation import validate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from bench_gpu import Case, back_to_back_ms, make_inputs  # noqa: E402
from kernel_timer_gpu import profile  # noqa: E402

EVERY_OPTION = dict(causal=True, window=(100, None), softcap=4.0,
                    alibi_slopes=None, dropout_p=0.1, seed=7)


def candidates(family: str, direction: str):
    """Every configuration worth timing for a family and direction."""
    if family == "wgmma" and direction == "forward":
        for block_q, block_k, stages, per_sm in itertools.product(
                (64, 128, 192), (64, 128), (2, 3), (1, 2, 3, 4)):
            # 3-4 resident blocks only of one warpgroup (128-170 registers a thread)
            if per_sm == 1 or (block_q <= 128 and per_sm == 2) or block_q == 64:
                yield tiles.WgmmaTiles(block_q, block_k, stages, per_sm)
                if stages == 3:  # the overlapped schedule needs a third stage
                    yield tiles.WgmmaTiles(block_q, block_k, stages, per_sm, overlap=True)
        yield tiles.WgmmaTiles(256, 64, 2)  # four warpgroups: 128 registers, D <= 128
    elif family == "wgmma":
        for dq, dkdv, stages, split in itertools.product(
                ((128, 64), (192, 64), (128, 32), (64, 64)),
                ((128, 64), (192, 64), (128, 32), (64, 64)), (2, 3), (False, True)):
            yield tiles.WgmmaBackwardTiles(dq, dkdv, stages, split)
    elif family == "f64" and direction == "forward":  # float64 on FP64 tensor cores
        for block_q, block_k in itertools.product((32, 64, 128), (16, 32, 64)):
            yield tiles.F64Tiles(block_q, block_k)
    elif family == "f64":  # its backward: the two kernels, dK and dV together or apart
        sizes = ((64, 32), (64, 16), (32, 32), (32, 16), (128, 16))
        for dq, dkdv, split in itertools.product(sizes, sizes, (False, True)):
            yield tiles.MmaBackwardTiles(dq, dkdv, split)
    elif direction == "forward" and family == "mma":
        for block_q, block_k, rows, in_registers in itertools.product(
                (64, 128), (32, 64, 128), (16, 32), (True, False)):
            yield tiles.MmaTiles(block_q, block_k, rows, in_registers)
    elif direction == "forward":
        for block_q, block_k, rows in itertools.product((64, 128), (16, 32, 64), (16, 32)):
            yield tiles.Tf32Tiles(block_q, block_k, rows)
        if cupy.cuda.Device().compute_capability == "90":  # 3xTF32 on wgmma (sm_90a)
            for block_q, block_k in itertools.product((64, 128), (32, 64)):
                yield tiles.Tf32WgmmaTiles(block_q, block_k)
    else:
        sizes = ((128, 64), (64, 64), (128, 32), (64, 32), (32, 32), (128, 16), (64, 16))
        pairings = ((False, ()), (True, ()), (False, ("dkdv",)), (False, ("dq",)),
                    (False, ("dq", "dkdv")), (True, ("dq",)))
        for dq, dkdv, (split, paired) in itertools.product(sizes, sizes, pairings):
            yield tiles.MmaBackwardTiles(dq, dkdv, split, paired)


# --nondeterministic: the backward with deterministic=False (the mma.sync / 3xTF32 single
# pass where the tiles take it, attention_mma_backward.cu).
DETERMINISTIC = True
# --dq-parts: the mma.sync / 3xTF32 backward as its single pass with a dQ slot per key block
# (launch_backward.backward_mma(dq_parts=True): deterministic, not yet a table's row).
DQ_PARTS = False


def _options(q, k, v, **options):
    defaults = dict(causal=False, window=None, scale=None, softcap=None, alibi_slopes=None,
                    dropout_p=0.0, seed=None, block_q=None, block_k=None,
                    deterministic=DETERMINISTIC)
    return validate(q, k, v, **{**defaults, **options}).options


def run(choice, direction, q, k, v, do, options, forward=None):
    """The forward with `choice`, or the backward with it after the table's forward (or
    after `forward`'s o and lse, as the timed backward calls take them)."""
    o, lse = forward or launch_forward.run(choice if direction == "forward" else
                                           tiles.choose_forward(problem_of(q, k, v, options)),
                                           q, k, v, options)
    if direction == "forward":
        return o, lse
    if DQ_PARTS:
        return launch_backward.backward_mma(do, q, k, v, o, lse, options, choice.tiles,
                                            single_pass=True, dq_parts=True)
    return launch_backward.run(choice, do, q, k, v, o, lse, options)


def check(choice, direction, case: Case) -> None:
    """The configuration against the float64 golden model, every option on."""
    import tileattn

    small = replace(case, batch=1, heads=2, n=300)
    q, k, v, do = make_inputs(small, seed=1)
    options = dict(EVERY_OPTION, alibi_slopes=np.array([0.2, 0.3]))
    host = [a.get().astype(np.float64) for a in (q, k, v, do)]
    resolved = _options(*host[:3], **options)
    result = run(choice, direction, q, k, v, do, resolved)
    golden_o, golden_lse = tileattn.forward(*host[:3], backend="reference", return_lse=True,
                                            **options)
    if direction == "forward":
        assert_attention_close(result[0].get(), golden_o, q.dtype, name="o")
        return
    o = launch_forward.run(tiles.choose_forward(problem_of(q, k, v, resolved)), q, k, v,
                           resolved)[0]
    golden = tileattn.backward(host[3], *host[:3], o.get().astype(np.float64), golden_lse,
                               backend="reference", **options)
    for name, grad, want in zip(("dq", "dk", "dv"), result, golden):
        assert_attention_close(grad.get(), want, q.dtype, name=name)


def _checked(job) -> str | None:
    """check() in a worker process (it compiles the configuration's kernels, with every option
    and without, into the disk caches): None when right, else why not."""
    global DETERMINISTIC, DQ_PARTS
    choice, direction, case, DETERMINISTIC, DQ_PARTS = job
    try:
        check(choice, direction, case)
        q, k, v, do = make_inputs(replace(case, batch=1, heads=1))
        run(choice, direction, q, k, v, do, _options(q, k, v, causal=case.causal))
        cupy.cuda.Device().synchronize()
        return None
    except Exception as error:  # a configuration the compiler refuses, or a wrong one
        return str(error).splitlines()[0][:160]


def _named(config, only: str) -> bool:
    """Whether `config` is one of `only`'s comma-separated names: a wgmma forward's
    block_q x block_k x stages [/ blocks per SM] [o: the overlapped schedule], an mma /
    3xTF32 backward's
    owned x streamed [p] - owned x streamed [p] [-split] (dQ, then dK/dV; p: on warp
    pairs); other families are always timed."""
    names = only.split(",")
    if isinstance(config, tiles.MmaBackwardTiles):
        dq, dkdv = ("{}x{}{}".format(*getattr(config, entry), "p" * (entry in config.paired))
                    for entry in ("dq", "dkdv"))
        return f"{dq}-{dkdv}{'-split' if config.split else ''}" in names
    if isinstance(config, tiles.WgmmaBackwardTiles):
        dq, dkdv = ("{}x{}".format(*getattr(config, entry)) for entry in ("dq", "dkdv"))
        return (f"{dq}-{dkdv}x{config.stages}{'-split' if config.split else ''}"
                in names)
    if not isinstance(config, tiles.WgmmaTiles):
        return True
    name = f"{config.block_q}x{config.block_k}x{config.stages}"
    suffix = "o" if config.overlap else ""
    return (f"{name}/{config.blocks_per_sm}{suffix}" in names
            or (config.blocks_per_sm == 1 and f"{name}{suffix}" in names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("wgmma", "mma", "tf32", "f64"), default="wgmma")
    parser.add_argument("--direction", choices=("forward", "backward"), default="forward")
    parser.add_argument("--dims", default="80,96,160", help="D or D:Dv, comma-separated")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--n", default="1024,4096")
    parser.add_argument("--queries", default=None,
                        help="query rows over the N keys, comma-separated (default: N)")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="time with this dropout_p (the table's dropout rows)")
    parser.add_argument("--softcap", type=float, default=None,
                        help="time with this softcap (the table's score-option rows)")
    parser.add_argument("--alibi", action="store_true",
                        help="time with ALiBi, a slope per head (the score-option rows)")
    parser.add_argument("--only", default=None,
                        help="candidates to time, e.g. 192x128x2,128x64x2/2 (wgmma forward: "
                             "block_q x block_k x stages [/ blocks per SM] [o: overlapped "
                             "schedule, e.g. 128x64x3/2o]) or "
                             "64x16p-64x16p (mma / tf32 backward: dQ's owned x streamed "
                             "rows, dK/dV's, p on warp pairs, -split: dK and dV apart) or "
                             "192x64-128x64x3 (wgmma backward: dQ's, dK/dV's, stages, "
                             "-split); default: all")
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both",
                        help="time causal problems, problems without a mask, or both")
    parser.add_argument("--nondeterministic", action="store_true",
                        help="backward with deterministic=False (the single pass where the "
                             "tiles serve it; candidates' shared memory as the two kernels')")
    parser.add_argument("--dq-parts", action="store_true",
                        help="mma / tf32 backward: the single pass with a dQ slot per key "
                             "block (deterministic; launch_backward.backward_mma(dq_parts))")
    args = parser.parse_args()
    if args.dq_parts and (args.family == "wgmma" or args.direction != "backward"):
        parser.error("--dq-parts is the mma / tf32 backward's")
    if args.family == "f64" and args.dtype != "float64":
        parser.error("f64 is float64's family (--dtype float64)")
    global DETERMINISTIC, DQ_PARTS
    DETERMINISTIC = not args.nondeterministic
    DQ_PARTS = args.dq_parts
    limit = shared_memory_limit(cupy.cuda.Device().id)
    flops_factor = 1.0 if args.direction == "forward" else 2.5  # the backward alone
    print("| D | Dv | causal | N | tiles | ms | kernels ms | TFLOP/s | table's row |")
    print("| ---: | ---: | --- | ---: | --- | ---: | ---: | ---: | --- |")
    for dim in args.dims.split(","):
        head_dim, value_dim = map(int, dim.split(":")) if ":" in dim else (int(dim),) * 2
        step = 8 if args.family in ("tf32", "f64") else 16
        widths = tiles.Widths.padded(head_dim, value_dim, step)
        masks = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
        queries = [None] if args.queries is None else [int(x) for x in args.queries.split(",")]
        for causal, n, n_q in itertools.product(masks, map(int, args.n.split(",")), queries):
            case = Case(args.dtype, max(1, 16384 // n), max(1, round(2048 / head_dim)), n,
                        head_dim, causal=causal, value_dim=value_dim)
            q, k, v, do = make_inputs(case)
            flops = case.flops
            if n_q is not None:  # the last n_q rows: causal keeps what a chunk at the end keeps
                q, do = (cupy.ascontiguousarray(a[:, :, n - n_q:]) for a in (q, do))
                flops = 4.0 * case.batch * case.heads * n_q * n * (head_dim + value_dim) / 2
                if causal:
                    flops -= 2.0 * case.batch * case.heads * n_q * n_q * (
                        head_dim + value_dim) / 2
            label = n if n_q is None else f"{n_q}x{n}"
            slopes = (np.linspace(0.05, 0.5, q.shape[1]) if args.alibi else None)
            options = _options(q, k, v, causal=causal, dropout_p=args.dropout,
                               seed=7 if args.dropout else None, softcap=args.softcap,
                               alibi_slopes=slopes)
            problem = problem_of(q, k, v, options)
            chosen = (tiles.choose_forward(problem) if args.direction == "forward"
                      else tiles.choose_backward(problem))
            # A backward is timed alone, after one forward of the table's.
            forward = (None if args.direction == "forward" else
                       launch_forward.run(tiles.choose_forward(problem), q, k, v, options))
            results = []
            configs = []
            for config in candidates(args.family, args.direction):
                if args.only and not _named(config, args.only):
                    continue
                if args.direction == "forward":
                    fits = config.shared_bytes(widths) <= limit
                else:
                    fits = tiles.backward_fits(config, widths, limit,
                                               {"tf32": 4, "f64": 8}.get(args.family, 2))
                if fits:
                    configs.append(config)
            # Checked (and compiled) in parallel first, then timed one by one.
            import multiprocessing

            with multiprocessing.get_context("spawn").Pool(16) as pool:
                verdicts = pool.map(_checked, [(tiles.Choice(args.family, c), args.direction,
                                                case, DETERMINISTIC, DQ_PARTS)
                                               for c in configs])
            for config, verdict in zip(configs, verdicts):
                if verdict is not None:
                    print(f"  skipped {config}: {verdict}")
                    continue
                choice = tiles.Choice(args.family, config)
                if args.direction == "forward":  # the key shares a dense call adds (few rows)
                    choice = tiles.with_key_splits(choice, decode_shape(q, k, options, n))
                def call():
                    run(choice, args.direction, q, k, v, do, options, forward)

                ms = back_to_back_ms(call, args.repetitions)
                kernels = profile(call, args.repetitions)[0]
                # launch_backward.backward_mma calls its kernels directly, not through the
                # Launch that the timer wraps: only the delta kernel would count
                kernels_ms = (f"{sum(kernels.values()):.3f}" if args.family == "wgmma"
                              or args.direction == "forward" else "-")
                tflops = flops_factor * flops / ms / 1e9
                results.append((tflops, config))
                mark = "<- table" if config == chosen.tiles else ""
                if choice.key_splits > 1:
                    mark += f" ({choice.key_splits} key shares)"
                print(f"| {head_dim} | {value_dim} | {causal} | {label} | {config} | "
                      f"{ms:.3f} | {kernels_ms} | {tflops:.1f} | {mark} |", flush=True)
            if results:
                best = max(results, key=lambda r: r[0])
                print(f"best D={head_dim} Dv={value_dim} causal={causal} N={label}: "
                      f"{best[1]} {best[0]:.1f} TFLOP/s; table: {chosen.tiles}", flush=True)
            del q, k, v, do, forward
            cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
