"""What paging costs a decode step, and whether the memory system or the kernel pays it:
per shape, a plain read of K and V (stream_read.cu's paged_read) and the decode call, each
over the dense cache (the decode also with seqlens_k: a padded call), over pools whose pages lie in sequence order, and over shuffled pools
(bench/paged_pools.py), all timed back to back (calls queue behind the kernels, so host
time drops out; shapes of >= 1 GiB, where L2 holds little of K and V).

    PYTHONPATH=. python3 bench/experiments/paged_decode_gpu.py [--shapes 'B8 H32/8 Nq1 Nk128k D128 float16' ...]
        [--pages 16 256] [--repetitions 10] [--profile] [--paired-page-rows off on]

--paired-page-rows times the paged decode with launch_decode.DECODE_PAIRED_PAGE_ROWS at each
setting given (plans cleared between them), a row each.

--profile runs each call twice, untimed, for `ncu --kernel-name regex:attention_decode`.
"""

from __future__ import annotations

import argparse
import os
import sys

import cupy
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_gpu_decode import Shape, _as_float64, copy_bandwidth, reference_group, shape_arrays
from decode_costs_gpu import parse_shape

import tileattn
import tileattn.gpu
from gpu_timing import back_to_back_ms as timed_back_to_back
from paged_pools import page_pool
from tileattn.gpu import launch_decode
from tileattn.testing import assert_attention_close

SHAPES = [
    Shape(8, 32, 8, 1, 131072, 128, "float16"),
    Shape(64, 32, 8, 1, 4096, 128, "float16"),
    Shape(1, 32, 32, 1, 65536, 128, "float16"),
    Shape(8, 32, 8, 8, 32768, 128, "float16"),
    Shape(8, 32, 8, 4, 32768, 64, "bfloat16"),
]
_READ = None


class InOrder:
    """A stand-in generator whose permutation keeps the pages in sequence order."""

    @staticmethod
    def permutation(n):
        return np.arange(n)


def paged_read(k_pool, v_pool, table, page_size: int, shape: Shape):
    """A launch of paged_read over a pool (pages, Hkv, page_size, D) and its table."""
    global _READ
    if _READ is None:
        path = os.path.join(os.path.dirname(__file__), "stream_read.cu")
        _READ = cupy.RawModule(code=open(path).read()).get_function("paged_read")
    sink = cupy.zeros(1, dtype=cupy.uint32)
    row_chunks = shape.head_dim * 2 // 16
    blocks = shape.batch * shape.n_kv_heads
    splits = max(1, -(-8 * cupy.cuda.Device().attributes["MultiProcessorCount"] // blocks))
    table = table.astype(cupy.int32)
    arguments = (k_pool, v_pool, table, np.int32(table.shape[1]),
                 np.int64(shape.n_k * row_chunks), np.int64(page_size * row_chunks),
                 np.int32(shape.n_kv_heads), np.int32(splits), sink)
    return lambda: _READ((blocks * splits,), (256,), arguments)


def twice_untimed(function, _repetitions) -> float:
    """--profile's stand-in for the timing: two calls, for ncu to see."""
    function()
    function()
    cupy.cuda.Device().synchronize()
    return 1.0


def run_shape(shape: Shape, page_sizes, bandwidth: float, repetitions: int,
              profile: bool = False, paired_settings=("default",)) -> None:
    rng = cupy.random.default_rng(0)
    q, k, v = shape_arrays(shape, rng)
    expected = reference_group(q, k, v).get()
    group = shape.n_q_heads // shape.n_kv_heads
    seqlens_k = cupy.full(shape.batch, shape.n_k, dtype=cupy.int32)

    def share(ms):
        return shape.kv_bytes / (ms * 1e-3) / bandwidth

    back_to_back_ms = twice_untimed if profile else timed_back_to_back
    dense_table = cupy.arange(shape.batch, dtype=cupy.int32)[:, None]
    read_dense = back_to_back_ms(paged_read(k, v, dense_table, shape.n_k, shape), repetitions)
    decode_dense = back_to_back_ms(lambda: tileattn.forward(q, k, v, backend="gpu"), repetitions)
    print(f"| {shape.name} | dense | - | {share(read_dense):.2f} | {1e3 * decode_dense:,.1f} | "
          f"{share(decode_dense):.2f} | 1.00 |", flush=True)
    padded_ms = back_to_back_ms(lambda: tileattn.forward(q, k, v, backend="gpu",
                                                         seqlens_k=seqlens_k,
                                                         check_lengths=False), repetitions)
    print(f"| {shape.name} | dense, seqlens_k | - | - | {1e3 * padded_ms:,.1f} | "
          f"{share(padded_ms):.2f} | {decode_dense / padded_ms:.2f} |", flush=True)
    for page_size in page_sizes:
        for order_name, order in (("in order", InOrder()),
                                  ("shuffled", np.random.default_rng(page_size))):
            k_pool, table = page_pool(k, [shape.n_k] * shape.batch, page_size, order)
            v_pool, _ = page_pool(v, [shape.n_k] * shape.batch, page_size, order
                                  if isinstance(order, InOrder)
                                  else np.random.default_rng(page_size))

            def paged():
                return tileattn.forward(q, k_pool, v_pool, backend="gpu", block_table=table,
                                        seqlens_k=seqlens_k, check_lengths=False)
            read_ms = back_to_back_ms(paged_read(k_pool, v_pool, table, page_size, shape),
                                      repetitions)
            for paired in paired_settings:
                label = order_name
                if paired != "default":
                    launch_decode.DECODE_PAIRED_PAGE_ROWS = paired == "on"
                    tileattn.gpu.clear_plans()
                    label = f"{order_name}, paired rows {paired}"
                assert_attention_close(_as_float64(paged()[0, :group]).get(), expected, q.dtype,
                                       name=f"paged o, {shape.name}, pages of {page_size}")
                decode_ms = back_to_back_ms(paged, repetitions)
                print(f"| {shape.name} | {label} | {page_size} | {share(read_ms):.2f} | "
                      f"{1e3 * decode_ms:,.1f} | {share(decode_ms):.2f} | "
                      f"{decode_dense / decode_ms:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=None)
    parser.add_argument("--pages", nargs="*", type=int, default=[16, 256])
    parser.add_argument("--repetitions", type=int, default=10)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--paired-page-rows", nargs="*", choices=["off", "on"],
                        default=["default"])
    args = parser.parse_args()
    shapes = SHAPES if not args.shapes else [parse_shape(text) for text in args.shapes]
    bandwidth = copy_bandwidth()
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}; copy "
          f"{bandwidth / 1e12:.2f} TB/s; back to back, median of 3 runs of "
          f"{args.repetitions}\n\n| shape | pool | page | read's share of copy bw | decode us | "
          "decode's share | dense / paged decode |\n|---|---|---|---|---|---|---|")
    for shape in shapes:
        run_shape(shape, args.pages, bandwidth, args.repetitions, args.profile,
                  args.paired_page_rows)


if __name__ == "__main__":
    main()
