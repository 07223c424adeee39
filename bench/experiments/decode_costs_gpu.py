"""Where a decode step's time goes, shape by shape: the decode kernel and the merge timed
apart, beside a plain read of the same K and V (the roofline a decode can reach) and torch
SDPA's flash backend, after an L2 flush that leaves dirty lines (a 128 MiB write, as
bench_gpu_decode.py) and after one that leaves clean ones (a 128 MiB read).

    PYTHONPATH=. python3 bench/experiments/decode_costs_gpu.py [--shapes 'B8 H32/8 Nq1 Nk4k D128 float16' ...]
        [--min-mib 128 --max-mib 512] [--quick] [--baseline DIR] [--force stages=3 splits=x0.5]
        [--profile] [--merge-warps 16 32]

Default shapes: the issue's grid at Nq = 1, float16, whose K and V take 128-512 MiB (the
range where the decode fell short of copy bandwidth, NOTES-gpu v31). Per shape: the read,
the table's launches (all) and the decode kernel alone, the merge kernel alone, the whole
step with the merge kernel and with the merge fused into the decode kernel whatever the
table says, --baseline DIR's kernel (an older attention_decode_mma.cu, with the merge
kernel), torch flash, the tiles --force names, and the step with the merge kernel at each
of --merge-warps's warp counts. --profile only runs each shape's kernels
a few times, for `ncu --kernel-name regex:attention_decode`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import cupy
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_gpu_decode import (QUICK, Shape, _as_float64, _options, copy_bandwidth, grid,
                              reference_group, shape_arrays, torch_flash)

from gpu_timing import median_event_ms
from tileattn.gpu import _compile, launch_decode, tiles
from tileattn.gpu.launch_decode import decode_shape, forward_decode
from tileattn.gpu.operands import problem_of
from tileattn.testing import assert_attention_close

_READ = None


def stream_read(a, b):
    """A launch reading every byte of a and b once (stream_read.cu)."""
    global _READ
    if _READ is None:
        path = os.path.join(os.path.dirname(__file__), "stream_read.cu")
        _READ = cupy.RawModule(code=open(path).read()).get_function("stream_read")
    sink = cupy.zeros(1, dtype=cupy.uint32)
    blocks = 8 * cupy.cuda.Device().attributes["MultiProcessorCount"]
    chunks = (np.int64(a.nbytes // 16), np.int64(b.nbytes // 16))
    return lambda: _READ((blocks,), (256,), (a, chunks[0], b, chunks[1], sink))


def timed_us(function, flush: str, repetitions: int) -> float:
    """Median microseconds after an L2 flush: "dirty" (a 128 MiB write) or "clean" (a
    128 MiB read: the cache holds clean lines, nothing to write back)."""
    return 1e3 * median_event_ms(function, repetitions, warmup=1, clean_flush=flush == "clean")


def baseline_source(directory: str) -> str:
    """DIR/attention_decode_mma.cu with the package's headers spliced in; a kernel older than
    the split counters gets their (unused) parameter, so that today's launcher can call it."""
    text = open(os.path.join(directory, launch_decode.DECODE_MMA_SOURCE)).read()
    if "split_counts" not in text:
        text = text.replace("float* partial_o, float* partial_lse, i64 n_q",
                            "float* partial_o, float* partial_lse, u32* split_counts, i64 n_q")
    spliced: set[str] = set()

    def header(match):
        name = match.group(1)
        if name in spliced:
            return ""
        spliced.add(name)
        return _compile._splice(name, spliced)
    return re.sub(r'^#include "([A-Za-z0-9_]+\.cuh)"\s*$', header, text, flags=re.MULTILINE)


def build(q, k, v, config, source_name: str | None = None, fused_floats: int | None = None):
    """(DecodeLaunch, o, lse) for `config`, from the package's source or `source_name` (an
    older kernel, always with the merge kernel), the merge fused up to `fused_floats`
    partials (None: the table's DECODE_FUSED_MERGE_FLOATS)."""
    options = _options(q, k, v)
    o = cupy.empty(q.shape[:3] + (v.shape[3],), dtype=q.dtype)
    lse = cupy.empty(q.shape[:3], dtype=cupy.float32)
    saved = launch_decode.DECODE_MMA_SOURCE, tiles.DECODE_FUSED_MERGE_FLOATS
    if source_name is not None:
        launch_decode.DECODE_MMA_SOURCE, tiles.DECODE_FUSED_MERGE_FLOATS = source_name, 0
    if fused_floats is not None:
        tiles.DECODE_FUSED_MERGE_FLOATS = fused_floats
    try:
        launch = forward_decode(q, k, v, o, lse, options, config)[0]
    finally:
        launch_decode.DECODE_MMA_SOURCE, tiles.DECODE_FUSED_MERGE_FLOATS = saved
    return launch, o, lse


def parse_shape(text: str) -> Shape:
    b, h, nq, nk, d, dtype = text.split()
    hq, hkv = h[1:].split("/")
    return Shape(int(b[1:]), int(hq), int(hkv), int(nq[2:]), int(nk[2:-1]) * 1024,
                 int(d[1:]), dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", help="'B8 H32/8 Nq1 Nk4k D128 float16' ...")
    parser.add_argument("--min-mib", type=float, default=128)
    parser.add_argument("--max-mib", type=float, default=512)
    parser.add_argument("--baseline", help="a folder holding an older attention_decode_mma.cu")
    parser.add_argument("--force", nargs="*", default=[],
                        help="tile fields forced, e.g. stages=3 'warps=2,warp_keys=32' splits=x0.5")
    parser.add_argument("--repetitions", type=int, default=15)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--merge-warps", nargs="*", type=int, default=[],
                        help="the step with the merge kernel at these warps (MERGE_WARPS)")
    parser.add_argument("--quick", action="store_true", help="bench_gpu_decode's quick shapes too")
    args = parser.parse_args()

    if args.shapes:
        shapes = [parse_shape(s) for s in args.shapes]
    else:
        shapes = [s for s in grid() if s.n_q == 1 and s.dtype == "float16"
                  and args.min_mib <= s.kv_bytes / 2**20 <= args.max_mib]
    if args.quick:
        shapes += [s for s in QUICK if s not in shapes]
    if args.baseline:
        baseline = baseline_source(args.baseline)
        original = _compile.source
        _compile.source = lambda name: baseline if name == "baseline" else original(name)

    bandwidth = copy_bandwidth()
    print(f"# {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s (read + written); us after a clean / dirty flush",
          flush=True)
    print("| shape | MiB | splits x blocks | fused | read | all | share | decode alone | "
          "merge kernel | merge kernel, all | fused, all | baseline, all | flash | flash/all "
          "| read dirty | all dirty | flash dirty | forced |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rng = cupy.random.default_rng(0)
    for shape in shapes:
        q, k, v = shape_arrays(shape, rng)
        options = _options(q, k, v)
        problem = problem_of(q, k, v, options)
        dshape = decode_shape(q, k, options)
        config = tiles.decode_mma_tiles(problem, dshape)
        group = shape.n_q_heads // shape.n_kv_heads
        expected = reference_group(q, k, v).get()

        def checked(launch, o, lse, label):
            launch(q, k, v, o, lse)
            assert_attention_close(_as_float64(o[0, :group]).get(), expected, q.dtype,
                                   name=f"{label} {shape.name}")
            return lambda: launch(q, k, v, o, lse)

        launch, o, lse = build(q, k, v, config)
        run = checked(launch, o, lse, "table")
        if args.profile:
            for _ in range(3):
                run()
            cupy.cuda.Device().synchronize()
            print(f"profiled {shape.name}: {config}", flush=True)
            continue
        clean = lambda function: timed_us(function, "clean", args.repetitions)  # noqa: E731
        dirty = lambda function: timed_us(function, "dirty", args.repetitions)  # noqa: E731
        read = stream_read(k, v)
        read_us, all_us = clean(read), clean(run)
        scratch = launch.scratch()
        decode_us = clean(lambda: launch.decode(q, k, v, o, lse, *scratch))
        cells = []
        separate = build(q, k, v, config, fused_floats=0)
        fused = build(q, k, v, config, fused_floats=1 << 40)
        merge_us = "-"
        if separate[0].merge is not None:
            part = separate[0].scratch()
            merge_us = f"{clean(lambda: separate[0].merge(part[0], part[1], o, lse)):.1f}"
        for variant, label in ((separate, "merge kernel"), (fused, "fused")):
            cells.append(f"{clean(checked(*variant, label)):.1f}" if config.splits > 1 else "-")
        if args.baseline:
            cells.append(f"{clean(checked(*build(q, k, v, config, 'baseline'), 'baseline')):.1f}")
        else:
            cells.append("-")
        flash = torch_flash(q, k, v)
        flash_us = clean(flash) if flash else float("nan")
        forced = []
        for forced_fields in args.force:
            fields = dict(item.split("=") for item in forced_fields.split(","))
            fields = {name: (max(1, round(config.splits * float(value[1:])))
                             if value.startswith("x") else int(value))
                      for name, value in fields.items()}
            other_config = tiles.decode_mma_tiles(problem, dshape, **fields)
            if other_config.shared_bytes(shape.head_dim, shape.head_dim) > problem.shared_limit:
                forced.append(f"{forced_fields}: over the shared memory")
                continue
            other = build(q, k, v, other_config)
            forced.append(f"{forced_fields} ({other_config.splits} splits): "
                          f"{clean(checked(*other, forced_fields)):.1f}")
        for warps in args.merge_warps if separate[0].merge is not None else ():
            saved, launch_decode.MERGE_WARPS = launch_decode.MERGE_WARPS, warps
            try:
                variant = build(q, k, v, config, fused_floats=0)
            finally:
                launch_decode.MERGE_WARPS = saved
            forced.append(f"merge {warps} warps: {clean(checked(*variant, 'merge warps')):.1f}")
        fused_here = launch.merge is None and config.splits > 1
        print(f"| {shape.name} | {shape.kv_bytes / 2**20:.0f} | {config.splits} x "
              f"{launch.decode.grid[0]} | {'yes' if fused_here else 'no'} | {read_us:.1f} | "
              f"{all_us:.1f} | {shape.kv_bytes / (all_us * 1e-6) / bandwidth:.2f} | "
              f"{decode_us:.1f} | {merge_us} | {' | '.join(cells)} | {flash_us:.1f} | "
              f"{flash_us / all_us:.2f} | {dirty(read):.1f} | {dirty(run):.1f} | "
              f"{dirty(flash) if flash else float('nan'):.1f} | {'; '.join(forced)} |",
              flush=True)


if __name__ == "__main__":
    main()
