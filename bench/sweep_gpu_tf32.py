"""Sweep of the float32 (3xTF32) forward's tiles, beside torch SDPA's memory-efficient
backend and tileattn's CUDA-core float32 forward, measured in the same run.

    PYTHONPATH=. python3 bench/sweep_gpu_tf32.py [--n 4096]

For D = 64 (H = 32) and D = 128 (H = 16) at batch * N = 16k, causal and not: every query
tile (64, 128) x key tile (32, 64) x warp rows (16, 32) that fits shared memory. Each
configuration is first checked against the float64 golden model on a small problem with
every option on (sweep_gpu_forward.check), then timed on the large one (CUDA events,
median). The winners go into `_launch.TF32_DEFAULT_TILES`.
"""

from __future__ import annotations

import itertools

import cupy
import numpy as np

from tileattn.gpu import _launch
from bench_gpu import Case, fa_functions, make_inputs, median_ms
from sweep_gpu_forward import check, plain_options, sweep_arguments


def run(q, k, v, options, tiles):
    o = cupy.empty(q.shape, dtype=q.dtype)
    lse = cupy.empty(q.shape[:3], dtype=cupy.float32)
    _launch.forward_tf32(q, k, v, o, lse, options, tiles)
    return o, lse


def main() -> None:
    args = sweep_arguments(__doc__.splitlines()[0])
    limit = _launch.shared_memory_limit(cupy.cuda.Device().id)
    rows = []
    for head_dim in map(int, args.head_dims.split(",")):
        heads = 2048 // head_dim
        for causal in (False, True):
            case = Case("float32", 16384 // args.n, heads, args.n, head_dim, causal=causal)
            q, k, v, do = make_inputs(case)
            options = plain_options(q, k, v, causal)
            anchors = {name: functions[0] for name, functions in
                       fa_functions(case, q, k, v, do).items() if name == "efficient"}
            anchors["cuda-core"] = lambda q=q, k=k, v=v: _launch.forward_generic(
                q, k, v, cupy.empty(q.shape, q.dtype), cupy.empty(q.shape[:3], cupy.float32),
                options)
            rates = {name: case.flops / median_ms(function, args.repetitions) / 1e9
                     for name, function in anchors.items()}
            print(f"{case.name}: " + ", ".join(f"{name} {rate:.1f}"
                                               for name, rate in rates.items()), flush=True)
            for block_q, block_k, warp_rows in itertools.product(
                    _launch.TF32_BLOCK_Q, _launch.TF32_BLOCK_K, (16, 32)):
                tiles = _launch.Tf32Tiles(block_q, block_k, warp_rows)
                if tiles.shared_bytes(head_dim) > limit:
                    continue
                if not causal:
                    check(np.dtype("float32"), head_dim, tiles, forward=run)
                ms = median_ms(lambda q=q, k=k, v=v, tiles=tiles: run(q, k, v, options, tiles),
                               args.repetitions)
                tflops = case.flops / ms / 1e9
                rows.append((case.name, tiles, tflops, rates))
                print(f"  {block_q}x{block_k} warp rows {warp_rows}: {tflops:6.1f} TFLOP/s "
                      f"({tflops / rates.get('efficient', np.nan):.2f}x efficient)", flush=True)
            del q, k, v, do
            cupy.get_default_memory_pool().free_all_blocks()
    print("\n| case | tiles | warp rows | TFLOP/s | / efficient | / cuda-core |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, tiles, tflops, rates in rows:
        ratios = " | ".join(f"{tflops / rates[a]:.2f}" if a in rates else "-"
                            for a in ("efficient", "cuda-core"))
        print(f"| {name} | {tiles.block_q}x{tiles.block_k} | {tiles.warp_rows} | "
              f"{tflops:.1f} | {ratios} |")


if __name__ == "__main__":
    main()
