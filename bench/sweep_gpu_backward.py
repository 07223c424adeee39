"""Sweep of the tensor-core backward's tiles (owned rows x streamed rows per kernel).

    PYTHONPATH=. python3 bench/sweep_gpu_backward.py [--dtype float16] [--n 4096] [--wgmma]

For D = 64 (B = 4, H = 32) and D = 128 (B = 4, H = 16), causal and not: each kernel's tiles
(owned 64 or 128 rows x streamed 32, 64 or 128 rows) are varied while the other kernel keeps
its default (`_launch.MMA_BACKWARD_TILES`; float32, the 3xTF32 kernels: owned 64 or 128
x streamed 16, 32 or 64 around `_launch.TF32_BACKWARD_TILES`, where shared memory holds
them). Each configuration is first checked against the float64 golden model on a small
problem with every option on, then the whole backward is timed on the large one beside
torch's FlashAttention-2 backward (float32: its memory-efficient backward), derived as
forward+backward minus forward, measured in the same run.

--wgmma sweeps the Hopper kernels instead: every dQ tile (owned 128 or 192 queries x
streamed 64 or 128 keys) with every dK/dV tile (owned 128 or 192 keys x 64 queries) that
builds without spilling, with 2 stages, plus the default with 3 stages
(`_launch.WGMMA_BACKWARD_TILES` and `_launch.WGMMA_BANDED_BACKWARD_TILES` hold the winners);
`--alternatives` adds the mma.sync two-kernel default and the single passes
(deterministic=False). Timing: calls back to back (bench_gpu.back_to_back_ms).
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import cupy
import numpy as np

import tileattn
from tileattn.gpu import _launch
from tileattn.testing import assert_attention_close
from tileattn.validation import validate

from bench_gpu import Case, back_to_back_ms, fa_functions, make_inputs
from sweep_gpu_forward import EVERY_OPTION, plain_options, sweep_arguments

OWNED, STREAMED = (64, 128), (32, 64, 128)
# float32 (3xTF32) tiles take twice the shared memory of 16-bit ones: more owned rows (more
# warps) with fewer streamed ones. (192 owned rows do not build: the single pass's dQ split
# needs the warp count to divide the head dim, and the kernel compiles it either way.)
FLOAT32_OWNED, FLOAT32_STREAMED = (64, 128), (16, 32, 64)
SHARED_LIMIT = 227 * 1024  # sm_90's opt-in limit per block


# dK/dV blocks of 192 keys spill at D = 128 (v7 in bench/NOTES-gpu.md).
WGMMA_DKDV_OWNED = {64: (128, 192), 128: (128,)}


def wgmma_candidates(head_dim: int, alternatives: bool = False) -> list:
    """(tiles, single pass) pairs: every dQ x dK/dV tile pair at the default's stages and
    the default with 3 stages; with `alternatives` also the single passes."""
    default = _launch.WGMMA_BACKWARD_TILES[head_dim]
    tiles = [replace(default, dq=dq, dkdv=(owned, 64), stages=2)
             for dq in ((128, 64), (128, 128), (192, 64))
             for owned in WGMMA_DKDV_OWNED[head_dim]] + [replace(default, stages=3)]
    fitting = [(t, False) for t in tiles
               if max(t.shared_bytes(e, head_dim) for e in ("dq", "dkdv")) <= SHARED_LIMIT]
    if not alternatives:
        return fitting
    # The single pass: D = 64 splits dQ over the warpgroups by keys (any owned rows), D = 128
    # by column blocks (128 owned keys).
    single = {default, replace(default, dkdv=(128, 64))}
    if head_dim == 64:
        single.add(replace(default, dq=(128, 64)))
    return [(t, True) for t in sorted(single, key=repr) if head_dim in (64, t.dkdv[0])] + fitting


def mma_candidates(dtype: str, head_dim: int) -> list:
    """Each mma.sync kernel's tiles varied while the other keeps its default, where shared
    memory holds them."""
    float32 = dtype == "float32"
    default = (_launch.TF32_BACKWARD_TILES if float32 else _launch.MMA_BACKWARD_TILES)[head_dim]
    sizes = list(itertools.product(*((FLOAT32_OWNED, FLOAT32_STREAMED) if float32
                                     else (OWNED, STREAMED))))
    candidates = [dict(default, dq=t) for t in sizes]
    candidates += [dict(default, dkdv=t) for t in sizes if t != default["dkdv"]]
    return [tiles for tiles in candidates
            if max(_launch.mma_backward_shared_bytes(entry, head_dim, *tiles[entry],
                                                     element_size=4 if float32 else 2)
                   for entry in ("dq", "dkdv")) <= SHARED_LIMIT]


def check(dtype, head_dim, tiles, backward=_launch.backward_tensor_core, **keywords):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 4, n, head_dim)).astype(dtype) for n in (200, 263, 263))
    do = rng.standard_normal(q.shape).astype(dtype)
    options = {key: value for key, value in EVERY_OPTION.items() if key != "deterministic"}
    o, lse = tileattn.forward(*map(cupy.asarray, (q, k, v)), backend="gpu", return_lse=True,
                              **options)
    grads = backward(*map(cupy.asarray, (do, q, k, v)), o, lse,
                     validate(q, k, v, **EVERY_OPTION).options, tiles, **keywords)
    golden = [x.astype(np.float64) for x in (do, q, k, v)]
    wanted = tileattn.backward(*golden, o.get().astype(np.float64), lse.get(),
                               backend="reference", **options)
    for name, grad, want in zip(("dq", "dk", "dv"), grads, wanted):
        assert_attention_close(grad.get(), want, dtype, name=name)


def main() -> None:
    args = sweep_arguments(__doc__.splitlines()[0], wgmma_flag=True)
    backward = _launch.backward_wgmma if args.wgmma else _launch.backward_tensor_core
    rows = []
    for head_dim in map(int, args.head_dims.split(",")):
        heads = 2048 // head_dim
        if args.wgmma:
            candidates = wgmma_candidates(head_dim, args.alternatives)
        else:
            candidates = [(tiles, None) for tiles in mma_candidates(args.dtype, head_dim)]
        for causal in (False, True):
            case = Case(args.dtype, 16384 // args.n, heads, args.n, head_dim, causal=causal,
                        direction="backward")
            q, k, v, do = make_inputs(case)
            # float32's anchor: torch's memory-efficient kernel (3xTF32 too); flash has none.
            anchor_name = "efficient" if args.dtype == "float32" else "flash"
            anchor = fa_functions(case, q, k, v, do).get(anchor_name)
            if anchor:
                anchor_ms = back_to_back_ms(anchor[1], args.repetitions) - back_to_back_ms(
                    anchor[0], args.repetitions)
                anchor_tflops = case.flops / anchor_ms / 1e9
            else:
                anchor_tflops = float("nan")
            options = plain_options(q, k, v, causal)
            o, lse = tileattn.forward(q, k, v, backend="gpu", return_lse=True, causal=causal)
            if args.wgmma and args.alternatives:
                for single_pass in (False, True):
                    ms = back_to_back_ms(
                        lambda arrays=(do, q, k, v, o, lse), single_pass=single_pass:
                        _launch.backward_tensor_core(*arrays, options, single_pass=single_pass),
                        args.repetitions)
                    print(f"{case.name:<42} mma.sync {'single pass' if single_pass else ''}: "
                          f"{ms:7.3f} ms {case.flops / ms / 1e9:6.1f} TFLOP/s", flush=True)
            for tiles, single_pass in candidates:
                keywords = {} if single_pass is None else {"single_pass": single_pass}
                if not causal:
                    try:
                        check(np.dtype(args.dtype), head_dim, tiles, backward, **keywords)
                    except AssertionError as error:  # a wrong kernel is reported, not timed
                        print(f"{case.name:<42} {tiles}: WRONG, {error}", flush=True)
                        continue
                ms = back_to_back_ms(
                    lambda arrays=(do, q, k, v, o, lse), tiles=tiles, keywords=keywords:
                    backward(*arrays, options, tiles, **keywords), args.repetitions)
                tflops = case.flops / ms / 1e9
                described = tiles if isinstance(tiles, dict) else dict(
                    dq=tiles.dq, dkdv=tiles.dkdv, stages=tiles.stages)
                if single_pass:
                    described["single pass"] = True
                rows.append((case.name, described, ms, tflops, tflops / anchor_tflops))
                print(f"{case.name:<42} {described}: {ms:7.3f} ms "
                      f"{tflops:6.1f} TFLOP/s ({tflops / anchor_tflops:.2f}x {anchor_name} "
                      f"{anchor_tflops:.1f})", flush=True)
            del q, k, v, do, o, lse
            cupy.get_default_memory_pool().free_all_blocks()
    print("\n| case | dQ tiles | dK/dV tiles | stages | single pass | ms | TFLOP/s | / anchor |")
    print("| --- | --- | --- | ---: | --- | ---: | ---: | ---: |")
    for name, tiles, ms, tflops, ratio in rows:
        dq, dkdv = tiles["dq"], tiles["dkdv"]
        print(f"| {name} | {dq[0]}x{dq[1]} | {dkdv[0]}x{dkdv[1]} | {tiles.get('stages', 2)} | "
              f"{'yes' if tiles.get('single pass') else 'no'} | {ms:.3f} | {tflops:.1f} | "
              f"{ratio:.2f} |")


if __name__ == "__main__":
    main()
