"""Sweep the decode kernels' split count (and thread count, or the tensor-core kernel's warps,
keys and stages) on bench_gpu_decode's quick shapes, kernels alone (a cached launch replayed
under the L2 flush), to set tiles.decode_splits and the decode tables.

    PYTHONPATH=. python3 bench/experiments/sweep_gpu_decode.py [--threads 128 256]
        [--grid 256 [--grid-max 512] --only 'Nq1 ' float16] [--stage-bytes B --stage-target T --splits ...]
        [--kernel tensor_cores --mma 4x16x3 4x16x2 1x64x2x4 table ...] [--splits auto]

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
from bench_gpu_decode import QUICK, _options, grid, copy_bandwidth, median_us, shape_arrays

from tileattn.gpu import tiles
from tileattn.gpu.launch_decode import decode_shape, forward_decode
from tileattn.gpu.operands import problem_of

SPLITS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _variants(problem, dshape, kernel: str, threads_list, mma_shapes):
    """(label, tiles for a split count) for each configuration swept."""
    if kernel == "tensor_cores":
        if not tiles.decode_on_tensor_cores(problem, dshape):
            return []
        def forced(shape):  # "WxKxS" or "WxKxSxR": key warps, keys a warp, stages, row warps
            warps, keys, stages, row_warps = (list(map(int, shape.split("x"))) + [1])[:4]
            return functools.partial(tiles.decode_mma_tiles, problem, dshape, warps=warps,
                                     warp_keys=keys, stages=stages, row_warps=row_warps)
        return [(f"mma {shape}", (functools.partial(tiles.decode_mma_tiles, problem, dshape)
                                  if shape == "table" else forced(shape)))
                for shape in mma_shapes]
    return [(f"cuda-cores threads={threads or 'table'}", functools.partial(
                lambda threads, splits: tiles.decode_tiles(problem, dshape, splits=splits,
                                                           threads=threads), threads))
            for threads in threads_list]


def sweep_shape(shape, bandwidth: float, repetitions: int, rng, splits_list=SPLITS,
                kernel: str = "cuda_cores", threads_list=(None,), mma_shapes=()) -> None:
    q, k, v = shape_arrays(shape, rng)
    options = _options(q, k, v)
    problem = problem_of(q, k, v, options)
    dshape = decode_shape(q, k, options)
    if dshape.rows > tiles.DECODE_ROWS[-1].max_rows:
        return
    table = tiles.choose_decode(problem, dshape)
    o = cupy.empty(q.shape[:3] + (v.shape[3],), dtype=q.dtype)
    lse = cupy.empty(q.shape[:3], dtype=cupy.float32)
    for label, make in _variants(problem, dshape, kernel, threads_list, mma_shapes):
        cells = []
        for splits in splits_list:
            config = make(None if splits == "auto" else splits)
            if not tiles.decode_fits(problem, config):
                continue
            splits = config.splits
            launch, _ = forward_decode(q, k, v, o, lse, options, config)
            us = median_us(functools.partial(launch, q, k, v, o, lse), repetitions)
            share = shape.kv_bytes / (us * 1e-6) / bandwidth
            mark = ("*" if table is not None and type(table.tiles) is type(config)
                    and splits == table.tiles.splits else "")
            cells.append(f"{splits}{mark}:{us:.0f}us/{share:.2f}")
        config = make(1)
        print(f"{shape.name} {label} k={config.block_k}x{config.stages} "
              f"B*Hkv={dshape.batch_kv_heads}: " + "  ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=("cuda_cores", "tensor_cores"),
                        default="cuda_cores")
    parser.add_argument("--threads", type=int, nargs="*", default=[None],
                        help="CUDA-core kernel: threads a block (default: the table's)")
    parser.add_argument("--mma", nargs="*", default=["4x16x3"],
                        help="tensor-core kernel: WARPSxWARP_KEYSxSTAGES[xROW_WARPS] shapes "
                             "(row warps 1 unless given), or 'table' for the table's")
    parser.add_argument("--repetitions", type=int, default=10)
    parser.add_argument("--stage-bytes", type=int, default=None,
                        help="override tiles.DECODE_STAGE_BYTES (K+V bytes of one stage)")
    parser.add_argument("--stage-target", type=int, default=None,
                        help="override tiles.DECODE_STAGE_TARGET (bytes of all stages)")
    parser.add_argument("--splits", type=lambda text: text if text == "auto" else int(text),
                        nargs="*", default=list(SPLITS),
                        help="split counts to time, or 'auto': each configuration's own "
                             "(tiles.decode_splits at its residency)")
    parser.add_argument("--only", nargs="*", default=[],
                        help="shapes whose name contains each of these")
    parser.add_argument("--grid", type=int, default=None, metavar="MIB",
                        help="bench_gpu_decode's whole grid, shapes of >= MIB MiB of K/V "
                             "that fit a third of free memory, instead of its quick list")
    parser.add_argument("--grid-max", type=int, default=None, metavar="MIB",
                        help="with --grid, only shapes of <= MIB MiB of K/V")
    args = parser.parse_args()
    if args.stage_bytes:
        tiles.DECODE_STAGE_BYTES = args.stage_bytes
    if args.stage_target:
        tiles.DECODE_STAGE_TARGET = args.stage_target
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rng = cupy.random.default_rng(0)
    shapes = QUICK
    if args.grid is not None:
        free = cupy.cuda.Device().mem_info[0]
        most = min(free / 3, (args.grid_max or float("inf")) * 2**20)
        shapes = [s for s in grid() if args.grid * 2**20 <= s.kv_bytes <= most]
    for shape in shapes:
        if all(part in shape.name + " " for part in args.only):
            sweep_shape(shape, bandwidth, args.repetitions, rng, args.splits, args.kernel,
                        args.threads, args.mma)
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
