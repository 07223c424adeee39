"""Where a packed batch loses against one dense sequence, kernel by kernel: bench_gpu_varlen.py's
packed batch (32 sequences of 128..8192 tokens, seeded, Hq = Hkv = 16, D = 128) and one dense
sequence of the same total length, each through `tileattn.forward` and `tileattn.backward`
with the table's tiles, calls back to back, every kernel launch timed by CUDA events.

    PYTHONPATH=. python3 bench/experiments/varlen_kernels_gpu.py [--dtype float16] [--full]
        [--calls 10]

Each line: kernel | packed ms | dense ms | packed rate / dense rate, the rate counting the
kept pairs of each layout (FlashAttention's count, halved for causal). The kernels' sum
against the whole calls' time shows the host and launch gaps. Launches are timed where
they go through `tileattn.gpu.operands.Launch` (every attention, delta and descriptor
kernel); anything else lands in the gaps.
"""

from __future__ import annotations

import argparse
import os
import sys

import cupy

import tileattn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import bench_gpu_varlen  # noqa: E402
from bench_gpu_varlen import make_packed_batch, parse_args  # noqa: E402
from kernel_timer_gpu import profile  # noqa: E402

bench_gpu_varlen.cupy = cupy  # the benchmark imports CuPy in its main(), which is not run


def by_name(times: dict) -> dict[str, float]:
    """`profile`'s (name, grid) times summed per kernel name (the layouts' grids differ)."""
    summed: dict[str, float] = {}
    for (name, _), ms in times.items():
        summed[name] = summed.get(name, 0.0) + ms
    return summed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--full", action="store_true", help="no causal mask")
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    causal = not args.full
    batch = make_packed_batch(parse_args(["--dtype", args.dtype]), args.dtype)
    packed = [batch.q, batch.k, batch.v, batch.do]
    dense = [a[None] for a in packed]
    varlen = {"cu_seqlens_q": batch.cu_seqlens, "cu_seqlens_k": batch.cu_seqlens}
    kept = float(sum(int(n) ** 2 for n in batch.lengths))
    dense_kept = float(batch.total) ** 2
    print(f"{args.dtype}, {'causal' if causal else 'full'}, {batch.total} tokens in "
          f"{len(batch.lengths)} sequences; dense kept pairs / packed {dense_kept / kept:.1f}")
    o, lse = tileattn.forward(*packed[:3], causal=causal, backend="gpu", return_lse=True,
                              **varlen)
    od, lsed = tileattn.forward(*dense[:3], causal=causal, backend="gpu", return_lse=True)
    passes = {
        "forward": (lambda: tileattn.forward(*packed[:3], causal=causal, backend="gpu",
                                             **varlen),
                    lambda: tileattn.forward(*dense[:3], causal=causal, backend="gpu")),
        "backward": (lambda: tileattn.backward(packed[3], *packed[:3], o, lse, causal=causal,
                                               backend="gpu", **varlen),
                     lambda: tileattn.backward(dense[3], *dense[:3], od, lsed, causal=causal,
                                               backend="gpu")),
    }
    print("| pass | kernel | packed ms | dense ms | packed rate / dense rate |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, (packed_call, dense_call) in passes.items():
        packed_kernels, packed_whole = profile(packed_call, args.calls)
        dense_kernels, dense_whole = profile(dense_call, args.calls)
        packed_kernels, dense_kernels = (by_name(t) for t in (packed_kernels, dense_kernels))
        for kernel in sorted(set(packed_kernels) | set(dense_kernels)):
            p, d = packed_kernels.get(kernel, 0.0), dense_kernels.get(kernel, 0.0)
            ratio = (d / dense_kept) / (p / kept) if p and d else float("nan")
            print(f"| {name} | {kernel} | {p:.3f} | {d:.3f} | {ratio:.3f} |")
        p, d = sum(packed_kernels.values()), sum(dense_kernels.values())
        print(f"| {name} | kernels' sum | {p:.3f} | {d:.3f} | "
              f"{(d / dense_kept) / (p / kept):.3f} |")
        print(f"| {name} | whole call | {packed_whole:.3f} | {dense_whole:.3f} | "
              f"{(dense_whole / dense_kept) / (packed_whole / kept):.3f} |", flush=True)


if __name__ == "__main__":
    main()
