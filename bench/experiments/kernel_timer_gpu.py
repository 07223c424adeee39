"""CUDA events around every kernel a call launches through `tileattn.gpu.operands.Launch`
(every tensor-core attention, delta, descriptor and merge launch; the generic kernels' and
CuPy's own launches land in the gaps between them), for the experiments that ask where a
call's time goes: `with KernelTimer() as timer: call(); timer.take()`, or `profile`."""

from __future__ import annotations

import statistics
from collections import defaultdict

import cupy

from tileattn.gpu import _compile, operands


class KernelTimer:
    """Wraps `Launch.__call__` to put a pair of CUDA events around every launch; `take`
    synchronises and returns milliseconds per (kernel name, grid), summed over a call."""

    def __init__(self):
        self.events = []
        self._original = operands.Launch.__call__
        timer = self

        def timed(launch, *operands_):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            timer._original(launch, *operands_)
            end.record()
            timer.events.append((launch.function, launch.grid[0], start, end))

        self._timed = timed

    def __enter__(self):
        operands.Launch.__call__ = self._timed
        return self

    def __exit__(self, *exc):
        operands.Launch.__call__ = self._original

    def take(self) -> dict[tuple[str, int], float]:
        cupy.cuda.Device().synchronize()
        # Entry names from the compile cache, whose keys end in the kernel's entry point.
        names = {id(function): key[-1] for key, function in _compile._kernels.items()}
        times: dict[tuple[str, int], float] = defaultdict(float)
        for function, grid, start, end in self.events:
            name = names.get(id(function), repr(function)[:40])
            times[(name, grid)] += cupy.cuda.get_elapsed_time(start, end)
        self.events.clear()
        return times


def profile(call, calls: int) -> tuple[dict[tuple[str, int], float], float]:
    """Median ms per (kernel name, grid) and of the whole call (from an idle device, so
    the host's time before the first launch counts), over `calls` calls."""
    for _ in range(2):
        call()
    per_kernel = defaultdict(list)
    whole = []
    with KernelTimer() as timer:
        for _ in range(calls):
            begin, finish = cupy.cuda.Event(), cupy.cuda.Event()
            begin.record()
            call()
            finish.record()
            for name, ms in timer.take().items():
                per_kernel[name].append(ms)
            whole.append(cupy.cuda.get_elapsed_time(begin, finish))
    return ({name: statistics.median(ms) for name, ms in per_kernel.items()},
            statistics.median(whole))
