"""CUDA-event timing shared by the GPU benchmarks that time from a cold L2 cache."""

from __future__ import annotations

import statistics

_FLUSH = None


def flushed_median_ms(function, repetitions: int, warmup: int) -> float:
    """Median milliseconds of CUDA-event times around `function`, the 50 MB L2 cache flushed
    (a 128 MiB write) before each call, after `warmup` untimed calls. The flush is queued
    before the start event, so host time past its ~45 us lands inside the timing."""
    import cupy  # here, so that scripts importing this run --help without a GPU

    global _FLUSH
    if _FLUSH is None:
        _FLUSH = cupy.empty(128 << 20, dtype=cupy.uint8)
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repetitions):
        _FLUSH.fill(0)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        function()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)
