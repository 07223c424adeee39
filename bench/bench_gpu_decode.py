"""Decode benchmark (issue 20): tileattn's split-KV decode beside torch SDPA's flash backend.

    PYTHONPATH=. python3 bench/bench_gpu_decode.py            # the issue's whole grid
    PYTHONPATH=. python3 bench/bench_gpu_decode.py --quick    # a representative subset (< 2 min)
    PYTHONPATH=. python3 bench/bench_gpu_decode.py --only ' float16' 'Nq1 ' --min-mib 256
                                                             # part of the grid
    PYTHONPATH=. python3 bench/bench_gpu_decode.py --quick --paged
                                                             # K/V in pools of pages instead

Grid: B in {1, 8, 64}, (Hq, Hkv) in {(32, 32), (32, 8), (8, 1)}, Nk in {4k, 32k, 128k, 256k},
Nq in {1, 4, 8}, D in {64, 128, 256}, float16 and bfloat16; shapes whose K and V would take
more than a third of the free memory are skipped (torch needs room beside them). Not causal:
torch's `is_causal` aligns the mask top-left, which for Nq < Nk is not decoding's
bottom-right mask (tileattn's), so both run unmasked (Nq = 1 is the same either way).

Per shape, first validated, then timed: tileattn's o for batch 0's first K/V group of heads
against a float64 CuPy computation (the golden formula) within tileattn.testing's tolerance,
torch's the same way; then CUDA events around each call, L2 flushed before each (a 128 MiB
read, which leaves clean lines; with --dirty-flush a write), median of the repetitions.
Columns: the bytes of K and V (what decoding must read), the time of a `tileattn.forward`
call (its host time past the flush's ~45 us included), the share of the device-to-device copy bandwidth measured at the start of this run (2 x bytes /
time of a 2 GiB copy), the same two for the chosen kernels alone (their launch replayed,
whose host time hides under the flush), torch flash's time (enable_gqa where Hq != Hkv) and
torch / tileattn (> 1: tileattn faster), and the kernel tileattn chose; with --compare (on
in --quick) also the time of the kernel it did not choose (the CUDA-core decode beside the
tensor-core one, the prefill family beside the CUDA-core decode, the decode kernel beside
prefill up to 64 packed rows, the unfolded call's kernel where a GQA decode folds onto the
prefill), which checks the dispatch thresholds.
Each row is printed as soon as it is measured. Last, the host time per call of a tiny
decode shape (calls back to back, wall time / calls), tileattn and torch.

With --paged, the same shapes instead with K and V in shuffled pools of pages of 16, 64 and
256 (the issue's paged rows; torch has no paged path): per page size the call after the
flush, and back to back (host time drops out) against the contiguous call back to back.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time
from dataclasses import dataclass

import cupy
import numpy as np

import tileattn
from tileattn.gpu import _forward_run, launch_forward, tiles
from tileattn.gpu.launch_decode import decode_shape, forward_decode
from tileattn.gpu.operands import problem_of
from tileattn.testing import assert_attention_close, bfloat16
from tileattn.validation import validate

from gpu_timing import back_to_back_ms, median_event_ms
from paged_pools import page_pool

try:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # torch is optional: its columns are left out
    torch = None


@dataclass(frozen=True)
class Shape:
    batch: int
    n_q_heads: int
    n_kv_heads: int
    n_q: int
    n_k: int
    head_dim: int
    dtype: str

    @property
    def kv_bytes(self) -> int:
        return 2 * self.batch * self.n_kv_heads * self.n_k * self.head_dim * 2

    @property
    def name(self) -> str:
        return (f"B{self.batch} H{self.n_q_heads}/{self.n_kv_heads} Nq{self.n_q} "
                f"Nk{self.n_k // 1024}k D{self.head_dim} {self.dtype}")


def grid() -> list[Shape]:
    return [Shape(b, hq, hkv, nq, nk, d, dtype)
            for dtype, d, (hq, hkv), b, nk, nq in itertools.product(
                ("float16", "bfloat16"), (64, 128, 256), ((32, 32), (32, 8), (8, 1)),
                (1, 8, 64), (4096, 32768, 131072, 262144), (1, 4, 8))]


# The table (float16, D = 128), MQA with speculative rows, GQA at Nq = 8 (32 packed
# rows), D = 64 and 256, bfloat16, and a small latency-bound shape.
QUICK = [
    Shape(8, 32, 8, 1, 4096, 128, "float16"),
    Shape(8, 32, 8, 1, 131072, 128, "float16"),
    Shape(64, 32, 8, 1, 4096, 128, "float16"),
    Shape(1, 32, 32, 1, 65536, 128, "float16"),
    Shape(1, 8, 1, 1, 262144, 128, "float16"),
    Shape(1, 8, 1, 4, 262144, 128, "float16"),
    Shape(8, 32, 8, 8, 32768, 128, "float16"),
    Shape(8, 32, 32, 1, 131072, 128, "float16"),
    Shape(8, 32, 8, 4, 32768, 64, "bfloat16"),
    Shape(1, 8, 1, 1, 131072, 256, "float16"),
    Shape(64, 32, 8, 1, 32768, 256, "bfloat16"),
    Shape(1, 32, 8, 1, 4096, 64, "float16"),
]


# --------------------------------------------------------------------------- arrays


def _random(shape: tuple, dtype: str, rng) -> cupy.ndarray:
    """Normal values in `dtype`, made one leading slice at a time (no float32 copy of the
    whole array); bfloat16 rounded to nearest even on the bits."""
    out = cupy.empty(shape, dtype=np.float16 if dtype == "float16" else np.uint16)
    for index in range(shape[0]):
        values = rng.standard_normal(shape[1:], dtype=cupy.float32)
        if dtype == "float16":
            out[index] = values.astype(cupy.float16)
        else:
            bits = values.view(cupy.uint32)
            out[index] = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(cupy.uint16)
    return out if dtype == "float16" else out.view(bfloat16())


def shape_arrays(shape: Shape, rng) -> tuple:
    """Random q, k and v of a decode shape, (B, H, N, D) each."""
    return (_random((shape.batch, shape.n_q_heads, shape.n_q, shape.head_dim), shape.dtype, rng),
            _random((shape.batch, shape.n_kv_heads, shape.n_k, shape.head_dim), shape.dtype, rng),
            _random((shape.batch, shape.n_kv_heads, shape.n_k, shape.head_dim), shape.dtype, rng))


def _as_float64(x):
    if x.dtype.name == "bfloat16":
        return (x.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32) \
            .astype(cupy.float64)
    return x.astype(cupy.float64)


def _as_torch(x):
    t = torch.from_dlpack(x.view(cupy.int16))
    return t.view(torch.float16 if x.dtype.name == "float16" else torch.bfloat16)


def _from_torch(t, dtype):
    return cupy.from_dlpack(t.contiguous().view(torch.int16)).view(dtype)


def reference_group(q, k, v):
    """float64 o of batch 0's first K/V head and the query heads that share it."""
    group = q.shape[1] // k.shape[1]
    q64, k64, v64 = _as_float64(q[0, :group]), _as_float64(k[0, 0]), _as_float64(v[0, 0])
    scores = q64 @ k64.T / math.sqrt(q.shape[-1])
    scores -= scores.max(axis=-1, keepdims=True)
    probs = cupy.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs @ v64


# --------------------------------------------------------------------------- timing


def copy_bandwidth(n_bytes: int = 2 << 30, repetitions: int = 10) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second)."""
    source = cupy.ones(n_bytes // 4, dtype=cupy.float32)
    target = cupy.empty_like(source)
    times = []
    for _ in range(repetitions + 2):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        target.data.copy_from_device_async(source.data, n_bytes)  # cudaMemcpyAsync, D2D
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    del source, target
    return 2 * n_bytes / statistics.median(times[2:])


# How the L2 cache is flushed before each timed call: by a 128 MiB read (clean lines, as a
# decode step's predecessors leave it), or with --dirty-flush by a 128 MiB write, whose ~50
# MB of dirty lines every timed kernel then pays to write back (NOTES-gpu v32: ~8 us of a
# 256 MiB read, the same for torch's kernels).
FLUSH = {"clean": True}


def median_us(function, repetitions: int) -> float:
    """Median of CUDA-event times, the L2 cache flushed before each call."""
    return 1e3 * median_event_ms(function, repetitions, warmup=1, clean_flush=FLUSH["clean"])


def host_us_per_call(function, calls: int = 2000) -> float:
    function()
    cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        function()
    elapsed = time.perf_counter() - start
    cupy.cuda.Device().synchronize()
    return elapsed / calls * 1e6


# --------------------------------------------------------------------------- one shape


def torch_flash(q, k, v):
    """torch SDPA's flash backend on the same arrays (no copy), or None where it refuses."""
    if torch is None:
        return None
    tq, tk, tv = (_as_torch(a) for a in (q, k, v))
    gqa = q.shape[1] != k.shape[1]

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.no_grad():
            return F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=gqa)
    try:
        run()
    except (RuntimeError, TypeError):
        return None
    return run


def _options(q, k, v):
    return validate(q, k, v, causal=False, window=None, scale=None, softcap=None,
                    alibi_slopes=None, dropout_p=0.0, seed=None, block_q=None, block_k=None,
                    deterministic=True).options


def _describe(choice) -> str:
    if choice.family != "decode":
        return choice.family
    config = choice.tiles
    kind = "decode-mma" if isinstance(config, tiles.DecodeMmaTiles) else "decode"
    return f"{kind} rows={config.rows} k={config.block_k}x{config.stages} splits={config.splits}"


def choice_of(q, k, v) -> str:
    run = _forward_run(q, k, v, _options(q, k, v))
    if run.folds:
        choice = run.choice
        return f"folded {choice.family} {choice.tiles} splits={choice.key_splits}"
    return _describe(run.choice)


def chosen_kernels(q, k, v):
    """The chosen kernels' launch replayed directly, for the kernel-only column: a replay
    costs ~10-20 us of host time, less than the L2 flush queued before it, so the events
    around it time the kernels alone, where a `tileattn.forward` call's host time (~110 us)
    would lie between them."""
    options = _options(q, k, v)
    o = cupy.empty(q.shape[:3] + (v.shape[3],), dtype=q.dtype)
    lse = cupy.empty(q.shape[:3], dtype=cupy.float32)
    if _forward_run(q, k, v, options).folds:
        # A folded decode's launches take views made per call: the dispatch's own
        # forward, its plan cached (its few microseconds of host time hide under the flush).
        def run_folded():
            launch_forward.forward(q, k, v, options, o, lse)
            return o
        return run_folded
    launch = launch_forward.launch(launch_forward.choose(q, k, v, options), q, k, v, o, lse,
                                   options)

    def run():
        launch(q, k, v, o, lse)
        return o
    return run


def alternative(q, k, v):
    """The kernel the dispatch did not choose, built once: the CUDA-core decode kernel where
    the tensor-core one runs, the prefill family's where the CUDA-core decode runs, the
    decode kernel where a prefill family runs (up to 64 packed rows); so that the table shows
    what the thresholds in tiles.choose_decode trade; where the call folds onto the prefill,
    the unfolded call's kernel. ``(name, function)`` or None."""
    options = _options(q, k, v)
    problem = problem_of(q, k, v, options)
    o = cupy.empty(q.shape[:3] + (v.shape[3],), dtype=q.dtype)
    lse = cupy.empty(q.shape[:3], dtype=cupy.float32)
    chosen = launch_forward.choose(q, k, v, options)
    if _forward_run(q, k, v, options).folds:
        launch = launch_forward.launch(chosen, q, k, v, o, lse, options)
        name = f"unfolded ({_describe(chosen)})"
    elif chosen.family == "decode" and isinstance(chosen.tiles, tiles.DecodeMmaTiles):
        config = tiles.decode_tiles(problem, decode_shape(q, k, options))
        launch, _ = forward_decode(q, k, v, o, lse, options, config)
        name = "decode (CUDA cores)"
    elif chosen.family == "decode":
        choice = tiles.choose_forward(problem)
        launch = launch_forward.launch(choice, q, k, v, o, lse, options)
        name = f"prefill ({choice.family})"
    else:
        shape = decode_shape(q, k, options)
        if shape.rows > tiles.DECODE_ROWS[-1].max_rows:
            return None
        config = tiles.decode_tiles(problem, shape)
        if not tiles.decode_fits(problem, config):
            return None
        launch, _ = forward_decode(q, k, v, o, lse, options, config)
        name = "decode"

    def run():
        launch(q, k, v, o, lse)
        return o
    return name, run


def run_shape(shape: Shape, bandwidth: float, repetitions: int,
              compare: bool) -> str | None:
    free = cupy.cuda.Device().mem_info[0]
    if shape.kv_bytes > free / 3:
        return None
    rng = cupy.random.default_rng(0)
    q, k, v = shape_arrays(shape, rng)
    dtype = q.dtype
    expected = reference_group(q, k, v).get()
    group = shape.n_q_heads // shape.n_kv_heads
    ours = lambda: tileattn.forward(q, k, v, backend="gpu")  # noqa: E731
    assert_attention_close(_as_float64(ours()[0, :group]).get(), expected, dtype,
                           name=f"tileattn o, {shape.name}")
    ours_us = median_us(ours, repetitions)
    kernels = chosen_kernels(q, k, v)
    assert_attention_close(_as_float64(kernels()[0, :group]).get(), expected, dtype,
                           name=f"tileattn kernels o, {shape.name}")
    kernel_us = median_us(kernels, repetitions)
    line = (f"| {shape.name} | {shape.kv_bytes / 2**20:,.0f} | {ours_us:,.1f} | "
            f"{shape.kv_bytes / (ours_us * 1e-6) / bandwidth:.2f} | {kernel_us:,.1f} | "
            f"{shape.kv_bytes / (kernel_us * 1e-6) / bandwidth:.2f} |")
    flash = torch_flash(q, k, v)
    if flash is None:
        line += " n/a | n/a |"
    else:
        torch_o = _from_torch(flash(), dtype)
        try:
            assert_attention_close(_as_float64(torch_o[0, :group]).get(), expected, dtype,
                                   name="torch o")
            flash_us = median_us(flash, repetitions)
            line += f" {flash_us:,.1f} | {flash_us / ours_us:.2f} |"
        except AssertionError:
            line += " wrong | n/a |"
    line += f" {choice_of(q, k, v)} |"
    other = alternative(q, k, v) if compare else None
    if other is not None:
        name, function = other
        assert_attention_close(_as_float64(function()[0, :group]).get(), expected, dtype,
                               name=f"{name} o, {shape.name}")
        line += f" {name}: {median_us(function, repetitions):,.1f} us |"
    return line


PAGE_SIZES = (16, 64, 256)


def run_paged_shape(shape: Shape, bandwidth: float, repetitions: int) -> list[str] | None:
    """Rows of `shape` with K and V in shuffled pools of pages (PAGE_SIZES), every sequence
    full length, called as a server's decode loop calls: lengths and block table on the
    device, unchecked. Per page size: the call's time after the L2 flush and its share of
    copy bandwidth, then the call back to back (FlashAttention's method: calls queue behind
    the kernels, so the host time drops out) against the contiguous call back to back. None
    where the pools (a second copy of K and V) would not fit beside it."""
    if 2 * shape.kv_bytes > cupy.cuda.Device().mem_info[0] / 3:
        return None
    rng = cupy.random.default_rng(0)
    q, k, v = shape_arrays(shape, rng)
    expected = reference_group(q, k, v).get()
    group = shape.n_q_heads // shape.n_kv_heads
    seqlens_k = cupy.full(shape.batch, shape.n_k, dtype=cupy.int32)
    contiguous_queued = 1e3 * back_to_back_ms(lambda: tileattn.forward(q, k, v, backend="gpu"),
                                              repetitions)
    lines = []
    for page_size in PAGE_SIZES:
        k_pool, table = page_pool(k, [shape.n_k] * shape.batch, page_size,
                                  np.random.default_rng(page_size))
        v_pool, _ = page_pool(v, [shape.n_k] * shape.batch, page_size,
                              np.random.default_rng(page_size))

        def paged():
            return tileattn.forward(q, k_pool, v_pool, backend="gpu", block_table=table,
                                    seqlens_k=seqlens_k, check_lengths=False)
        assert_attention_close(_as_float64(paged()[0, :group]).get(), expected, q.dtype,
                               name=f"paged o, {shape.name}, pages of {page_size}")
        call_us = median_us(paged, repetitions)
        queued_us = 1e3 * back_to_back_ms(paged, repetitions)
        lines.append(f"| {shape.name} | {page_size} | {shape.kv_bytes / 2**20:,.0f} | "
                     f"{call_us:,.1f} | {shape.kv_bytes / (call_us * 1e-6) / bandwidth:.2f} | "
                     f"{queued_us:,.1f} | {shape.kv_bytes / (queued_us * 1e-6) / bandwidth:.2f} "
                     f"| {contiguous_queued:,.1f} | {contiguous_queued / queued_us:.2f} |")
    return lines


def overhead() -> None:
    """Host time per call of a tiny decode shape (the decode path: Nk = 512, MQA)."""
    rng = cupy.random.default_rng(1)
    q = _random((1, 8, 1, 64), "float16", rng)
    k = _random((1, 1, 512, 64), "float16", rng)
    v = _random((1, 1, 512, 64), "float16", rng)
    out = cupy.empty((1, 8, 1, 64), dtype=cupy.float16)
    print(f"host overhead, B1 Hq8/Hkv1 Nq1 Nk512 D64 float16 ({choice_of(q, k, v)}):", flush=True)
    print(f"  tileattn.forward            {host_us_per_call(lambda: tileattn.forward(q, k, v)):6.1f} "
          "us per call", flush=True)
    print(f"  tileattn.forward(out=...)   "
          f"{host_us_per_call(lambda: tileattn.forward(q, k, v, out=out)):6.1f} us per call",
          flush=True)
    flash = torch_flash(q, k, v)
    if flash is not None:
        print(f"  torch SDPA flash            {host_us_per_call(flash):6.1f} us per call",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a representative subset")
    parser.add_argument("--repetitions", type=int, default=None)
    parser.add_argument("--only", nargs="*", default=[],
                        help="grid shapes whose name contains each of these (' float16', "
                             "'Nq1 ', 'D128')")
    parser.add_argument("--min-mib", type=int, default=0,
                        help="grid shapes of at least this many MiB of K and V")
    parser.add_argument("--compare", action="store_true",
                        help="also time the kernel the dispatch did not choose (--quick does)")
    parser.add_argument("--dirty-flush", action="store_true",
                        help="flush L2 by a write (dirty lines), not by a read")
    parser.add_argument("--paged", action="store_true",
                        help="the shapes with K/V in pools of pages of 16, 64 and 256 instead")
    parser.add_argument("--fold-decode", choices=("table", "on", "off"), default="table",
                        help="fold GQA decodes of many packed rows onto the prefill "
                             "(tiles.FOLD_DECODE_ENABLED) or not; table: as it is set")
    args = parser.parse_args()
    if args.fold_decode != "table":
        tiles.FOLD_DECODE_ENABLED = args.fold_decode == "on"
    FLUSH["clean"] = not args.dirty_flush
    repetitions = args.repetitions or (10 if args.quick else 20)
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    bandwidth = copy_bandwidth()
    print(f"{name}, {props['multiProcessorCount']} SMs; device-to-device copy "
          f"{bandwidth / 1e12:.2f} TB/s; torch {torch.__version__ if torch else 'absent'}; "
          f"median of {repetitions}, L2 flushed by a 128 MiB "
          f"{'read' if FLUSH['clean'] else 'write'}", flush=True)
    shapes = QUICK if args.quick else [
        s for s in grid() if s.kv_bytes >= args.min_mib * 2**20
        and all(part in s.name + " " for part in args.only)]
    if args.paged:
        print("\n| shape | page size | K+V MiB | paged call us | share of copy bw | back to "
              "back us | their share | contiguous, back to back us | contiguous / paged |\n"
              "|---|---|---|---|---|---|---|---|---|", flush=True)
        for shape in shapes:
            lines = run_paged_shape(shape, bandwidth, repetitions)
            print("\n".join(lines) if lines is not None else f"| {shape.name} | skipped: K/V "
                  "and its pools over a third of free memory |", flush=True)
            cupy.get_default_memory_pool().free_all_blocks()
        return
    print("\n| shape | K+V MiB | tileattn us | share of copy bw | kernels alone us | their "
          "share | flash us | flash / tileattn | tileattn kernel |\n"
          "|---|---|---|---|---|---|---|---|---|", flush=True)
    for shape in shapes:
        line = run_shape(shape, bandwidth, repetitions, args.quick or args.compare)
        print(line if line is not None else f"| {shape.name} | skipped: K/V over a third of "
              "free memory |", flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
        if torch is not None:
            torch.cuda.empty_cache()
    print(flush=True)
    overhead()


if __name__ == "__main__":
    main()
