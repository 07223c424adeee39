"""CUDA-event timing shared by the GPU benchmarks."""

from __future__ import annotations

import statistics

_FLUSH = None


def median_event_ms(function, repetitions: int, warmup: int, flush_l2: bool = True,
                    clean_flush: bool = False, after_flush=None) -> float:
    """Median milliseconds of CUDA-event times around `function`, after `warmup` untimed
    calls; with `flush_l2` the 50 MB L2 cache is flushed before each call: by a 128 MiB
    write, or with `clean_flush` by a 128 MiB read. A written flush leaves ~50 MB of dirty
    lines that the timed call pays to write back (at 3 TB/s ~17 us of DRAM time shared with
    its own reads: 8 us on a 256 MiB read, bench/NOTES-gpu.md v32); a read leaves clean
    lines, as a decode step's predecessors (weight reads) do. The flush is queued before
    the start event, so host time past its ~45 us lands inside the timing; `after_flush`,
    where given, runs between the flush and the start event (bench/experiments:
    paged_flush_gpu.py hides the host's time behind a kernel there, or waits)."""
    import cupy  # here, so that scripts importing this run --help without a GPU

    global _FLUSH
    if flush_l2 and _FLUSH is None:
        _FLUSH = cupy.empty(128 << 20, dtype=cupy.uint8)
        _FLUSH.fill(0)
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repetitions):
        if flush_l2 and clean_flush:
            _FLUSH.sum(dtype=cupy.uint32)
        elif flush_l2:
            _FLUSH.fill(0)
        if after_flush is not None:
            after_flush()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        function()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def back_to_back_ms(function, repetitions: int, warmup: int = 2, rounds: int = 3) -> float:
    """Milliseconds per call of `repetitions` calls queued back to back (FlashAttention's
    benchmark method), the median of `rounds` such runs."""
    import cupy

    for _ in range(warmup):
        function()
    times = []
    for _ in range(rounds):
        cupy.cuda.Device().synchronize()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(repetitions):
            function()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / repetitions)
    return statistics.median(times)
