"""CPU benchmark (issue 3): tileattn backend="cpu" beside torch SDPA and naive NumPy.

    PYTHONPATH=. python bench/bench_cpu.py                 # N in 1024..8192, causal and not
    PYTHONPATH=. python bench/bench_cpu.py --quick         # N in 1024, 2048; fewer repeats
    PYTHONPATH=. python bench/bench_cpu.py --sizes 4096 --block-q 128 --block-k 512

Correctness first: tileattn is checked against the float64 golden model on small problems
with every option the benchmark uses, and on each benchmark problem its output is compared
with torch's (or NumPy's) before anything is timed. Timing: the implementations take turns,
one call each per round, and the best round counts; on a machine shared with other work
that is the figure least disturbed by it, and taking turns exposes all of them to the same
disturbance. Before each timed call the benchmark sleeps `SETTLE_SECONDS`: OpenBLAS's
worker threads (behind NumPy's matmul) keep spinning for about 2**28 cycles after a call,
and whoever ran next lost half the cores to them (measured: tileattn forward at N=2048 ran
at 85 GFLOP/s right after naive NumPy, 135 after a pause). FLOPs are FlashAttention's count: forward ``4 B H N^2 D``, halved when causal;
forward + backward is 3.5x the forward.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

import tileattn
from tileattn import anchors
from tileattn.testing import assert_attention_close

DEFAULT_SIZES = (1024, 2048, 4096, 8192)
QUICK_SIZES = (1024, 2048)
SETTLE_SECONDS = 0.3
NAIVE_MAX_N = 4096  # 8 heads of 8192^2 float32 scores would take 2 GiB per matrix


def flops(batch, heads, n, head_dim, causal, direction):
    forward = 4.0 * batch * heads * n * n * head_dim * (0.5 if causal else 1.0)
    return forward * (3.5 if direction == "forward+backward" else 1.0)


# --------------------------------------------------------------------------- correctness


def validate_against_golden(blocks):
    """Small problems through the public API against the float64 golden model."""
    rng = np.random.default_rng(1)
    for causal in (False, True):
        q, k, v, do = (rng.standard_normal((2, 4, 300, 64)).astype(np.float32)
                       for _ in range(4))
        options = dict(causal=causal, **blocks)
        o, lse = tileattn.forward(q, k, v, backend="cpu", return_lse=True, **options)
        grads = tileattn.backward(do, q, k, v, o, lse, backend="cpu", **options)
        q64, k64, v64, do64 = (a.astype(np.float64) for a in (q, k, v, do))
        golden_o, golden_lse = tileattn.forward(q64, k64, v64, backend="reference",
                                                return_lse=True, **options)
        golden_grads = tileattn.backward(do64, q64, k64, v64, golden_o, golden_lse,
                                         backend="reference", **options)
        assert_attention_close(o, golden_o, np.float32, name="o")
        for name, grad, golden in zip(("dq", "dk", "dv"), grads, golden_grads):
            assert_attention_close(grad, golden, np.float32, name=name)


# --------------------------------------------------------------------------- implementations


def implementations(blocks, with_torch, with_naive):
    """name -> (forward(q, k, v, do, causal), forward_backward(...)), NumPy in, NumPy out."""
    def tileattn_forward(q, k, v, do, causal):
        return tileattn.forward(q, k, v, causal=causal, backend="cpu", **blocks)

    def tileattn_forward_backward(q, k, v, do, causal):
        o, lse = tileattn.forward(q, k, v, causal=causal, backend="cpu", return_lse=True,
                                  **blocks)
        return (o,) + tileattn.backward(do, q, k, v, o, lse, causal=causal, backend="cpu",
                                        **blocks)

    table = {"tileattn": (tileattn_forward, tileattn_forward_backward)}
    if with_torch:
        import torch

        def torch_forward(q, k, v, do, causal):
            tensors = [torch.from_numpy(a) for a in (q, k, v)]
            return anchors.torch_sdpa(*tensors, causal).numpy()

        def torch_forward_backward(q, k, v, do, causal):
            tensors = [torch.from_numpy(a) for a in (q, k, v)]
            grads = anchors.torch_sdpa(*tensors, causal, backward=True,
                                       do=torch.from_numpy(do))
            return tuple(g.numpy() for g in grads)

        table["torch"] = (torch_forward, torch_forward_backward)
    if with_naive:
        table["numpy"] = (lambda q, k, v, do, causal: anchors.naive_forward(np, q, k, v,
                                                                           causal)[0],
                          lambda q, k, v, do, causal: anchors.naive_forward_backward(
                              np, q, k, v, do, causal))
    return table


def check_agreement(table, q, k, v, do, causal, direction):
    """On the benchmark problem, tileattn must agree with the anchors (float32 tolerance)."""
    index = 0 if direction == "forward" else 1
    ours = table["tileattn"][index](q, k, v, do, causal)
    for name, functions in table.items():
        if name == "tileattn":
            continue
        theirs = functions[index](q, k, v, do, causal)
        if direction == "forward":
            assert_attention_close(ours, theirs, np.float32, name=f"o vs {name}")
        else:
            # torch returns (dq, dk, dv); ours and naive NumPy return (o, dq, dk, dv)
            for grad_name, a, b in zip(("dq", "dk", "dv"), ours[-3:], theirs[-3:]):
                assert_attention_close(a, b, np.float32, name=f"{grad_name} vs {name}")


def time_in_turns(table, arguments, direction, rounds):
    """Best-of-`rounds` seconds per implementation, the implementations taking turns."""
    index = 0 if direction == "forward" else 1
    best = {name: float("inf") for name in table}
    for _ in range(rounds):
        for name, functions in table.items():
            time.sleep(SETTLE_SECONDS)
            start = time.perf_counter()
            functions[index](*arguments)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


# --------------------------------------------------------------------------- report


def markdown(rows, names):
    header = ["N", "causal", "pass"] + [f"{n} GFLOP/s" for n in names]
    header += [f"tileattn / {n}" for n in names if n != "tileattn"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        rates = row["gflops"]
        cells = [str(row["n"]), "yes" if row["causal"] else "no", row["direction"]]
        cells += [f"{rates[n]:.1f}" if n in rates else "—" for n in names]
        cells += [f"{rates['tileattn'] / rates[n]:.2f}x" if n in rates else "—"
                  for n in names if n != "tileattn"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                        help="comma-separated sequence lengths")
    parser.add_argument("--quick", action="store_true", help="N in 1024, 2048; 3 rounds")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, help="timing rounds (default 5, quick 3)")
    parser.add_argument("--passes", default="forward,forward+backward")
    parser.add_argument("--causal", default="no,yes", help="no, yes or no,yes")
    parser.add_argument("--block-q", type=int)
    parser.add_argument("--block-k", type=int)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--no-naive", action="store_true")
    parser.add_argument("--out", help="directory for results.json and results.md")
    args = parser.parse_args(argv)

    sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    rounds = args.rounds or (3 if args.quick else 5)
    blocks = {key: value for key, value in (("block_q", args.block_q),
                                            ("block_k", args.block_k)) if value}
    with_torch = anchors.torch_available() and not args.no_torch
    validate_against_golden(blocks)
    print("tileattn cpu matches the float64 golden model (forward and backward, causal and not)")

    rng = np.random.default_rng(0)
    rows = []
    names = ["tileattn"] + (["torch"] if with_torch else []) + \
        ([] if args.no_naive else ["numpy"])
    for n in sizes:
        shape = (args.batch, args.heads, n, args.head_dim)
        q, k, v, do = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
        table = implementations(blocks, with_torch, not args.no_naive and n <= NAIVE_MAX_N)
        for causal in (c == "yes" for c in args.causal.split(",")):
            for direction in args.passes.split(","):
                check_agreement(table, q, k, v, do, causal, direction)
                seconds = time_in_turns(table, (q, k, v, do, causal), direction, rounds)
                work = flops(args.batch, args.heads, n, args.head_dim, causal, direction)
                row = {"n": n, "causal": causal, "direction": direction,
                       "seconds": seconds,
                       "gflops": {name: work / s / 1e9 for name, s in seconds.items()}}
                rows.append(row)
                print(markdown([row], names).splitlines()[-1], flush=True)
    report = markdown(rows, names)
    print()
    print(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = {"machine": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(), "batch": args.batch, "heads": args.heads,
                "head_dim": args.head_dim, "rounds": rounds, "blocks": blocks}
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
