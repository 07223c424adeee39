"""Sweep of the Hopper (wgmma) forward's tiles, beside the mma.sync forward and torch's
flash and cuDNN forwards measured in the same run.

    PYTHONPATH=. python3 bench/sweep_gpu_wgmma.py [--dtype float16] [--n 4096]

For D = 64 (H = 32) and D = 128 (H = 16) at batch * N = 16k, causal and not: every
query tile (64, 128, 192, 256; `--block-q` picks some) x key tile (64, 128) x stage count
(2, 3) that fits shared memory and registers, each with registers capped for one block per
multiprocessor and, where shared memory holds more, for 512 threads per multiprocessor
(blocks_per_sm = 256 / query tile). Each configuration is first checked against the
float64 golden model on a small problem with every option on (sweep_gpu_forward.check),
then timed on the large one (calls back to back, bench_gpu.back_to_back_ms). The winners
go into `_launch.WGMMA_DEFAULT_TILES` and `_launch.WGMMA_SHORT_TILES`.
"""

from __future__ import annotations

import itertools

import cupy
import numpy as np

from tileattn.gpu import _launch
from bench_gpu import Case, back_to_back_ms, fa_functions, make_inputs
from sweep_gpu_forward import check, plain_options, sweep_arguments

SHARED_LIMIT = 227 * 1024  # sm_90's opt-in limit per block
SM_SHARED = 228 * 1024  # per multiprocessor, with 1 KiB of it reserved per resident block


def run(q, k, v, options, tiles):
    o = cupy.empty(q.shape, dtype=q.dtype)
    lse = cupy.empty(q.shape[:3], dtype=cupy.float32)
    _launch.forward_wgmma(q, k, v, o, lse, options, tiles)
    return o, lse


def main() -> None:
    args = sweep_arguments(__doc__.splitlines()[0])
    rows = []
    for head_dim in map(int, args.head_dims.split(",")):
        heads = 2048 // head_dim
        for causal in (False, True):
            case = Case(args.dtype, 16384 // args.n, heads, args.n, head_dim, causal=causal)
            q, k, v, do = make_inputs(case)
            options = plain_options(q, k, v, causal)
            anchors = {name: functions[0] for name, functions in
                       fa_functions(case, q, k, v, do).items() if name in ("flash", "cudnn")}
            mma_blocks = _launch.MMA_DEFAULT_BLOCKS[head_dim]
            anchors["mma.sync"] = lambda q=q, k=k, v=v: _launch.forward_tensor_core(
                q, k, v, cupy.empty(q.shape, q.dtype), cupy.empty(q.shape[:3], cupy.float32),
                options, mma_blocks)
            rates = {name: case.flops / back_to_back_ms(function, args.repetitions) / 1e9
                     for name, function in anchors.items()}
            print(f"{case.name}: " + ", ".join(f"{name} {rate:.1f}"
                                               for name, rate in rates.items()), flush=True)
            block_qs = (tuple(map(int, args.block_q.split(","))) if args.block_q
                        else _launch.WGMMA_BLOCK_Q)
            for block_q, block_k, stages, dense in itertools.product(
                    block_qs, _launch.WGMMA_BLOCK_K, (2, 3), (False, True)):
                tiles = _launch.WgmmaTiles(block_q, block_k, stages,
                                           256 // block_q if dense else 1)
                resident = tiles.blocks_per_sm * (tiles.shared_bytes(head_dim) + 1024)
                if (tiles.shared_bytes(head_dim) > SHARED_LIMIT or resident > SM_SHARED
                        or (dense and tiles.blocks_per_sm == 1) or not tiles.builds(head_dim)):
                    continue
                if not causal:
                    check(np.dtype(args.dtype), head_dim, tiles, forward=run)
                ms = back_to_back_ms(
                    lambda q=q, k=k, v=v, tiles=tiles: run(q, k, v, options, tiles),
                    args.repetitions)
                tflops = case.flops / ms / 1e9
                rows.append((case.name, tiles, tflops, rates))
                print(f"  {block_q}x{block_k} stages {stages} x{tiles.blocks_per_sm}: "
                      f"{tflops:6.1f} TFLOP/s "
                      f"({tflops / rates.get('flash', np.nan):.2f}x flash)", flush=True)
            del q, k, v, do
            cupy.get_default_memory_pool().free_all_blocks()
    print("\n| case | tiles | stages | blocks/SM | TFLOP/s | / flash | / cudnn | / mma.sync |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, tiles, tflops, rates in rows:
        ratios = " | ".join(f"{tflops / rates[a]:.2f}" if a in rates else "-"
                            for a in ("flash", "cudnn", "mma.sync"))
        print(f"| {name} | {tiles.block_q}x{tiles.block_k} | {tiles.stages} | "
              f"{tiles.blocks_per_sm} | {tflops:.1f} | "
              f"{ratios} |")


if __name__ == "__main__":
    main()
