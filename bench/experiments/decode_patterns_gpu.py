"""Which way of streaming K and V through shared memory reads DRAM fastest, with no products
in the way: stream_read.cu's tile_read (the decode's copy pattern, cp.async into stages, a
barrier a stage) over a dense cache, swept over keys a stage, stages, K and V together or
in turn, cp.async's L2 prefetch, blocks an SM (forced by the shared memory a block asks for)
and key ranges a (sequence, kv head); beside stream_read (a grid-wide read) and torch SDPA's
flash decode of the same cache.

    PYTHONPATH=. python3 bench/experiments/decode_patterns_gpu.py [--shapes 8x8x131072x128 ...]
        [--top 12 | --all] [--repetitions 6] [--stages 2 3 --keys 64 --zfill 0 1 --pad 0 16 ...]

Shapes are B x Hkv x N x D (float16). Per shape: the fastest configurations and a few named
ones, microseconds after a clean L2 flush and the share of the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import cupy
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_gpu_decode import copy_bandwidth
from decode_costs_gpu import stream_read, timed_us

SOURCE = os.path.join(os.path.dirname(__file__), "stream_read.cu")
SHARED_PER_SM = 228 * 1024  # an H100/H200 SM's shared memory; the runtime keeps 1 KiB a block


def tile_read(stages: int, keys: int, alternate: int, prefetch: int, zfill: int, pad: int,
              row_bytes: int):
    options = (f"-DSTAGES={stages}", f"-DKEYS={keys}", f"-DROW_BYTES={row_bytes}",
               f"-DALTERNATE={alternate}", f"-DL2_PREFETCH={prefetch}", f"-DZFILL={zfill}",
               f"-DPAD={pad}", "-std=c++17")
    return cupy.RawModule(code=open(SOURCE).read(), options=options).get_function("tile_read")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*",
                        default=["8x8x131072x128", "1x32x262144x128", "64x8x32768x256"])
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--repetitions", type=int, default=6)
    parser.add_argument("--splits", nargs="*", type=int, default=[1, 2, 4, 6, 8, 12])
    parser.add_argument("--stages", nargs="*", type=int, default=[2, 3, 4])
    parser.add_argument("--keys", nargs="*", type=int, default=[32, 64, 128])
    parser.add_argument("--alternate", nargs="*", type=int, default=[0, 1])
    parser.add_argument("--prefetch", nargs="*", type=int, default=[0, 128])
    parser.add_argument("--zfill", nargs="*", type=int, default=[0],
                        help="1: copies with a source size, as the kernels'")
    parser.add_argument("--pad", nargs="*", type=int, default=[0],
                        help="bytes between shared-memory rows (the kernels: 16)")
    parser.add_argument("--per-sm", nargs="*", type=int, default=[1, 2, 3, 4])
    parser.add_argument("--all", action="store_true", help="print every variant, sorted")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"# copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    kernels = {}
    for text in args.shapes:
        batch, n_kv_heads, n_k, head_dim = map(int, text.split("x"))
        k = cupy.ones((batch, n_kv_heads, n_k, head_dim), dtype=cupy.float16)
        v = cupy.ones_like(k)
        sink = cupy.zeros(1, dtype=cupy.uint32)
        row_bytes = head_dim * 2
        results = [("stream_read (grid-wide)", timed_us(stream_read(k, v), "clean",
                                                         args.repetitions))]
        try:
            import torch
            import torch.nn.functional as F
            from torch.nn.attention import SDPBackend, sdpa_kernel
            kt, vt = torch.as_tensor(k, device="cuda"), torch.as_tensor(v, device="cuda")
            q = torch.ones((batch, 4 * n_kv_heads if n_kv_heads <= 8 else n_kv_heads, 1,
                            head_dim), dtype=torch.float16, device="cuda")

            def flash():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    F.scaled_dot_product_attention(q, kt, vt, enable_gqa=True)
            results.append(("torch flash", timed_us(flash, "clean", args.repetitions)))
        except ImportError:
            pass
        for stages, keys, alternate, prefetch, zfill, pad in itertools.product(
                args.stages, args.keys, args.alternate, args.prefetch, args.zfill, args.pad):
            stage_bytes = 2 * keys * (row_bytes + pad)
            if stages * stage_bytes > 227 * 1024:
                continue
            key = (stages, keys, alternate, prefetch, zfill, pad, row_bytes)
            if key not in kernels:
                kernels[key] = tile_read(*key)
            function = kernels[key]
            for per_sm, splits in itertools.product(args.per_sm, args.splits):
                shared = (SHARED_PER_SM // per_sm - 1024) // 16 * 16
                shared = min(shared, 227 * 1024)
                if stages * stage_bytes > shared or n_k % (splits * 2 * keys):
                    continue
                function.max_dynamic_shared_size_bytes = shared
                blocks = batch * n_kv_heads * splits
                arguments = (k, v, np.int64(n_k), np.int32(splits), sink)
                us = timed_us(lambda: function((blocks,), (128,), arguments, shared_mem=shared),
                              "clean", args.repetitions)
                results.append((f"{'in turn' if alternate else 'together'} keys {keys} "
                                f"stages {stages} prefetch {prefetch} {per_sm}/SM "
                                f"splits {splits}{' zfill' if zfill else ''}"
                                f"{f' pad {pad}' if pad else ''}", us))
        kv_bytes = 2 * k.nbytes
        print(f"## {text} ({kv_bytes / 2**20:,.0f} MiB), {len(results)} variants")
        named = [r for r in results if not r[0].startswith(("together", "in turn"))]
        shown = sorted(results, key=lambda r: r[1])
        for label, us in named + (shown if args.all else shown[:args.top]):
            print(f"  {label:60s} {us:9.1f}  {kv_bytes / (us * 1e-6) / bandwidth:.3f}")
        for label, us in results:
            if label.startswith("together keys 64 stages 2 prefetch 128"):
                print(f"  = {label:58s} {us:9.1f}  {kv_bytes / (us * 1e-6) / bandwidth:.3f}")
        sys.stdout.flush()
        del k, v
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
