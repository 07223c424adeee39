"""Sweep the decode kernel's split count (and thread count) on bench_gpu_decode's quick shapes,
kernels alone (a cached launch replayed under the L2 flush), to set tiles.decode_splits.

    PYTHONPATH=. python3 bench/experiments/sweep_gpu_decode.py [--threads 128 256]

Each line: shape, then per split count the kernels' microseconds and share of the measured
copy bandwidth; the split count tiles.decode_splits chose is marked with *.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import cupy

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_gpu_decode import QUICK, _options, _random, copy_bandwidth, median_us

from tileattn.gpu import tiles
from tileattn.gpu.launch_decode import decode_shape, forward_decode
from tileattn.gpu.operands import problem_of

SPLITS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def sweep_shape(shape, bandwidth: float, threads_list, repetitions: int, rng,
                splits_list=SPLITS) -> None:
    q = _random((shape.batch, shape.n_q_heads, shape.n_q, shape.head_dim), shape.dtype, rng)
    k = _random((shape.batch, shape.n_kv_heads, shape.n_k, shape.head_dim), shape.dtype, rng)
    v = _random((shape.batch, shape.n_kv_heads, shape.n_k, shape.head_dim), shape.dtype, rng)
    options = _options(q, k, v)
    problem = problem_of(q, k, v, options)
    dshape = decode_shape(q, k, options)
    if dshape.rows > tiles.DECODE_ROWS[-1].max_rows:
        return
    chosen = tiles.decode_tiles(problem, dshape).splits
    o = cupy.empty(q.shape[:3] + (v.shape[3],), dtype=q.dtype)
    lse = cupy.empty(q.shape[:3], dtype=cupy.float32)
    for threads in threads_list:
        cells = []
        for splits in splits_list:
            config = tiles.decode_tiles(problem, dshape, splits=splits, threads=threads)
            if not tiles.decode_fits(problem, config):
                continue
            launch, _ = forward_decode(q, k, v, o, lse, options, config)
            us = median_us(functools.partial(launch, q, k, v, o, lse), repetitions)
            share = shape.kv_bytes / (us * 1e-6) / bandwidth
            mark = "*" if splits == chosen else ""
            cells.append(f"{splits}{mark}:{us:.0f}us/{share:.2f}")
        config = tiles.decode_tiles(problem, dshape, threads=threads)
        print(f"{shape.name} threads={threads or 'table'} k={config.block_k}x{config.stages} "
              f"B*Hkv={dshape.batch_kv_heads}: "
              + "  ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="*", default=[None])
    parser.add_argument("--repetitions", type=int, default=10)
    parser.add_argument("--stage-bytes", type=int, default=None,
                        help="override tiles.DECODE_STAGE_BYTES (K+V bytes of one stage)")
    parser.add_argument("--stage-target", type=int, default=None,
                        help="override tiles.DECODE_STAGE_TARGET (bytes of all stages)")
    parser.add_argument("--splits", type=int, nargs="*", default=list(SPLITS))
    parser.add_argument("--only", default="", help="shapes whose name contains this")
    args = parser.parse_args()
    if args.stage_bytes:
        tiles.DECODE_STAGE_BYTES = args.stage_bytes
    if args.stage_target:
        tiles.DECODE_STAGE_TARGET = args.stage_target
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rng = cupy.random.default_rng(0)
    for shape in QUICK:
        if args.only in shape.name:
            sweep_shape(shape, bandwidth, args.threads, args.repetitions, rng, args.splits)
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
