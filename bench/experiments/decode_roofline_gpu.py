"""How close the tensor-core decode comes to reading K and V at DRAM speed, and what closes
the rest: per shape, in interleaved rounds (the device's speed drifts by ~10 % between runs
of one configuration, NOTES-gpu v54), the kernels alone after a clean L2 flush for

  * `read`: stream_read.cu's grid-wide read of K and V (the roofline),
  * `blocks sN`: paged_read over the dense cache, a block per (sequence, kv head, key range)
    of N ranges, as the decode reads (the roofline of that access pattern),
  * the table's configuration and forced ones (`--mma WxKxS[@splits]`), each at every
    `--prefetch` size (cp.async's L2 prefetch qualifier, launch_decode.DECODE_L2_PREFETCH),
  * torch SDPA's flash backend (the whole call).

    PYTHONPATH=. python3 bench/experiments/decode_roofline_gpu.py \\
        [--shapes 'B8 H32/8 Nq1 Nk128k D128 float16' ...] [--mma table table:stages=2 4x16x3@2] \\
        [--prefetch 0 128 256] [--rounds 3] [--repetitions 7]

Each line: a variant's microseconds (min and median over the rounds) and its share of the
measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import cupy
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_gpu_decode import _as_float64, _options, copy_bandwidth, reference_group, \
    shape_arrays, torch_flash
from decode_costs_gpu import parse_shape, stream_read, timed_us

from tileattn.gpu import launch_decode, tiles
from tileattn.gpu.launch_decode import decode_shape, forward_decode
from tileattn.gpu.operands import problem_of
from tileattn.testing import assert_attention_close

SHAPES = ["B8 H32/8 Nq1 Nk128k D128 float16", "B64 H8/1 Nq1 Nk128k D128 float16",
          "B1 H32/32 Nq1 Nk256k D128 float16", "B8 H32/8 Nq1 Nk4k D256 float16"]
_BLOCK_READ = None


def block_read(k, v, splits: int):
    """paged_read over the dense cache (B, Hkv, N, D): one page a sequence."""
    global _BLOCK_READ
    if _BLOCK_READ is None:
        path = os.path.join(os.path.dirname(__file__), "stream_read.cu")
        _BLOCK_READ = cupy.RawModule(code=open(path).read()).get_function("paged_read")
    batch, n_kv_heads, n_k, head_dim = k.shape
    row_chunks = head_dim * k.itemsize // 16
    table = cupy.arange(batch, dtype=cupy.int32)[:, None]
    sink = cupy.zeros(1, dtype=cupy.uint32)
    arguments = (k, v, table, np.int32(1), np.int64(n_k * row_chunks),
                 np.int64(n_k * row_chunks), np.int32(n_kv_heads), np.int32(splits), sink)
    return lambda: _BLOCK_READ((batch * n_kv_heads * splits,), (256,), arguments)


def decode_variant(q, k, v, problem, dshape, text: str, prefetch: int, expected, group):
    """(label, launch) of a tensor-core decode configuration: 'table[:field=value,...]' (the
    table's, with decode_mma_tiles' fields forced) or 'WxKxS', either with '@splits'."""
    shape, _, splits = text.partition("@")
    shape, _, fields = shape.partition(":")
    forced = {name: int(value) for name, value in
              (item.split("=") for item in fields.split(",") if item)}
    if shape != "table":
        warps, keys, stages = map(int, shape.split("x"))
        forced.update(warps=warps, warp_keys=keys, stages=stages)
    config = tiles.decode_mma_tiles(problem, dshape, **forced)
    if splits:
        config = tiles.decode_mma_tiles(problem, dshape, splits=int(splits), warps=config.warps,
                                        warp_keys=config.warp_keys, stages=config.stages,
                                        row_warps=config.row_warps, row_tiles=config.row_tiles)
    if not tiles.decode_fits(problem, config):
        return None
    o = cupy.empty(q.shape[:3] + (v.shape[3],), dtype=q.dtype)
    lse = cupy.empty(q.shape[:3], dtype=cupy.float32)
    saved, launch_decode.DECODE_L2_PREFETCH = launch_decode.DECODE_L2_PREFETCH, prefetch
    try:
        launch = forward_decode(q, k, v, o, lse, _options(q, k, v), config)[0]
    finally:
        launch_decode.DECODE_L2_PREFETCH = saved
    launch(q, k, v, o, lse)
    assert_attention_close(_as_float64(o[0, :group]).get(), expected, q.dtype, name=text)
    label = (f"{config.warps}x{config.warp_keys}x{config.stages}@{config.splits}"
             f" r{config.rows}{' (' + text + ')' if shape == 'table' else ''} prefetch {prefetch}")
    return label, lambda: launch(q, k, v, o, lse)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=SHAPES)
    parser.add_argument("--mma", nargs="*", default=["table", "4x16x3@2"])
    parser.add_argument("--prefetch", nargs="*", type=int, default=[0, 128, 256])
    parser.add_argument("--block-splits", nargs="*", type=int, default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repetitions", type=int, default=7)
    args = parser.parse_args()
    bandwidth = bandwidth_header(args.rounds)
    rng = cupy.random.default_rng(0)
    for text in args.shapes:
        shape = parse_shape(text)
        q, k, v = shape_arrays(shape, rng)
        problem = problem_of(q, k, v, _options(q, k, v))
        dshape = decode_shape(q, k, _options(q, k, v))
        group = shape.n_q_heads // shape.n_kv_heads
        expected = reference_group(q, k, v).get()
        variants = [("read", stream_read(k, v))]
        variants += [(f"blocks s{s}", block_read(k, v, s)) for s in args.block_splits]
        for mma in args.mma:
            for prefetch in args.prefetch:
                variant = decode_variant(q, k, v, problem, dshape, mma, prefetch, expected,
                                         group)
                if variant is not None:
                    variants.append(variant)
        report_rounds(shape, variants + flash_variant(q, k, v), args.rounds, args.repetitions,
                      bandwidth, 40)
        del q, k, v
        cupy.get_default_memory_pool().free_all_blocks()


def bandwidth_header(rounds: int) -> float:
    """The measured copy bandwidth (bytes a second), printed with the device's name."""
    bandwidth = copy_bandwidth()
    print(f"# {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s; us after a clean flush, min / median of "
          f"{rounds} rounds", flush=True)
    return bandwidth


def flash_variant(q, k, v) -> list:
    """``[("torch flash", call)]`` where torch's flash backend takes the shape, else []."""
    flash = torch_flash(q, k, v)
    return [("torch flash", flash)] if flash else []


def report_rounds(shape, variants, rounds: int, repetitions: int, bandwidth: float,
                  width: int) -> None:
    """Times `variants` (``(label, call)``) in `rounds` interleaved rounds after a clean
    flush and prints each one's min and median microseconds and its share of `bandwidth`."""
    times = {label: [] for label, _ in variants}
    for _ in range(rounds):
        for label, function in variants:
            times[label].append(timed_us(function, "clean", repetitions))
    print(f"## {shape.name} ({shape.kv_bytes / 2**20:,.0f} MiB)")
    for label, samples in times.items():
        best = min(samples)
        print(f"  {label:{width}s} {best:9.1f} {statistics.median(samples):9.1f}  "
              f"{shape.kv_bytes / (best * 1e-6) / bandwidth:.3f}", flush=True)


if __name__ == "__main__":
    main()
