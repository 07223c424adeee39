"""How a kernel call spreads over threads: its own pool, one thread per 32 MFLOP of work.

The kernels are plain ``nogil`` functions that claim tasks from a shared counter until none
are left (`schedule.claim_next`). `run` starts one copy on this thread and ``n - 1`` on a
pool of Python threads, then waits only for the copies that started: a copy still queued
when the work ran out is cancelled, as it would find nothing to do.

Why not Numba's ``prange``: its OpenMP layer (GNU libgomp) joins every thread of the team at
the end of a parallel region, and a thread that ran out of work spins for several
milliseconds first. On the shared 2-core development machine with another process holding
one core, the finished thread spun on the only free core while the thread it waited for
could not be scheduled: B=1, H=8, N=512, D=64 forward 12-16 ms on two threads against 2.6-5 ms
on one. ``OMP_WAIT_POLICY=passive`` removed the spinning but not the join, which still waited
up to a scheduler time slice for a thread that had not started (N=256 forward 3.3 ms against
1.5 ms on one thread with both cores busy). Here the caller never waits for a thread that has
not started, so a busy machine costs at most the wake-up of the pool thread, and nothing
spins. It also compiles faster: no parfor lowering (bench/NOTES-cpu.md, session 4).

Small problems run on one thread: a pool thread starts 30-115 us after it is woken (more
the longer the pool slept), more than a call of 64 x 64 keys on 8 heads takes on one
thread. `threads_for` gives a call a second thread from `SECOND_THREAD_FLOPS` of work and
one thread per `FLOPS_PER_THREAD` beyond, at most ``numba.get_num_threads()`` (so
``numba.set_num_threads`` still limits tileattn; `allowed` asks it).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading

import numba
import numba.np.ufunc.parallel
import numpy as np

FLOPS_PER_THREAD = 32e6
"""About 0.5 ms of one core's work at the kernels' ~65 GFLOP/s (bench/NOTES-cpu.md)."""

SECOND_THREAD_FLOPS = 16e6
"""A second thread pays from ~0.25 ms of one core's work, where its start is well under
half the call: 2 cores, forwards of 17-52 MFLOP (B1 H8 N 96-160 D 64 and the like) took
1.12-1.50x less time on two threads than on one, also with the other core busy; below
16 MFLOP 0.89-1.00x (bench/NOTES-cpu.md, session 34). Further threads keep
`FLOPS_PER_THREAD` each: each one woken adds its start to a short call."""


def allowed() -> int:
    """``numba.get_num_threads()``: the calling thread's count (`numba.set_num_threads` sets
    it per thread), asked on every call, never remembered.

    Numba's function takes a lock to check that its threading layer is up before it calls
    the layer's C getter: ~2 us, a tenth of a small forward's host time on the 2-core
    development host, where the C getter alone (a ctypes call) takes ~0.3. Once the layer is
    up, this calls that getter, and falls back to Numba's function where the getter is not
    there or answers what Numba would refuse (a count below one)."""
    count = _count_getter()()
    return count if count > 0 else numba.get_num_threads()


@functools.cache
def _count_getter():
    numba.get_num_threads()  # starts the threading layer, which defines the getter
    return getattr(numba.np.ufunc.parallel, "_get_num_threads", numba.get_num_threads)


def threads_for(flops: float) -> int:
    """One thread per `FLOPS_PER_THREAD` of work, two from `SECOND_THREAD_FLOPS`, at least
    one, at most `allowed`."""
    wanted = int(flops // FLOPS_PER_THREAD)
    if wanted < 2 and flops >= SECOND_THREAD_FLOPS:
        wanted = 2
    return max(1, min(allowed(), wanted))


@functools.cache
def _pool(size: int) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=size,
                                                 thread_name_prefix="tileattn-cpu",
                                                 initializer=_helpers.register)


# A forked child starts a pool of its own: the parent's pool threads do not exist there, and
# its queue's lock may have been held by a thread mid-submit at the fork.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_pool.cache_clear)


class _HelperPlaces:
    """Where the pool's threads may run: away from the caller's core while a call starts.

    Linux wakes a thread on the core of the thread that woke it when that core looks
    cheaper than an idle one (wake-affine), and moves it only at the next load balancing,
    milliseconds later: after a pause, a call's pool thread then queued behind the caller on
    one core while the other idled (2 cores, MHA Nq 32 over 4k keys after a 30 ms pause
    11.5 ms, 5.9 back to back; 6.5 with the pool thread pinned to the other core:
    bench/NOTES-cpu.md, session 31). So before waking them the caller allows the pool's
    threads every core it may use but its own (`away`), and gives its core back to those
    still running once its own share is done (`back`): a pool thread that waits for a busy
    core then takes the caller's. Linux only (os.sched_setaffinity, sched_getcpu); a
    no-op elsewhere, on one core, and for threads the pool has not started yet."""

    def __init__(self):
        self._threads: dict[int, frozenset | None] = {}  # native id -> cores last allowed
        self._current_core = _current_core_function()
        if hasattr(os, "register_at_fork"):  # a forked child has none of these threads, and
            os.register_at_fork(after_in_child=self._threads.clear)  # their ids may be reused

    def register(self) -> None:
        """A pool thread's initializer."""
        self._threads[threading.get_native_id()] = None

    def away(self) -> frozenset | None:
        """Every pool thread allowed the caller's cores but the one it runs on; those cores
        (to give back), or None where nothing was changed."""
        if self._current_core is None or not self._threads:
            return None
        try:
            cores = frozenset(os.sched_getaffinity(0))
        except OSError:
            return None
        away = cores - {self._current_core()}
        if not away or away == cores:
            return None
        self._allow(away)
        return cores

    def back(self, cores: frozenset) -> None:
        self._allow(cores)

    def everywhere(self) -> None:
        """Pool threads that a narrower call placed allowed every core of the caller's
        again (a wide call does not place them)."""
        if self._current_core is None or not any(self._threads.values()):
            return
        try:
            self._allow(frozenset(os.sched_getaffinity(0)))
        except OSError:
            return

    def _allow(self, cores: frozenset) -> None:
        for thread, allowed in list(self._threads.items()):
            if allowed != cores:
                try:
                    os.sched_setaffinity(thread, cores)
                except OSError:  # a thread that has exited, or cores taken away meanwhile
                    continue
                self._threads[thread] = cores


PLACED_MAX_THREADS = 4
"""Calls of up to this many threads place their pool threads (`_HelperPlaces`); wider ones
leave them where Linux puts them. The 16-core Intel host of the H200 machines, B1 Hq 32
Hkv 32 Nq 1 over 8k keys, D 128, float32, medians of 7 (us, placement on / off): 4
threads 9891 / 10708 after a 0.2 s pause, 10297 / 11068 back to back; 8 threads 6452 /
5643 and 5402 / 5049; 16 threads 4567 / 4456 and 3769 / 3356; Nq 8 at 16 threads 7156 /
6438 and 6435 / 6002 (bench/experiments/decode_threads_cpu.py, bench/NOTES-cpu.md
session 37). Moving every pool thread off the caller's core pays where threads are few
against the cores (a woken thread queued behind the caller: session 31's two cores), and
costs where they fill the host, whose caller then has no core to move to."""


def _current_core_function():
    """libc's sched_getcpu through ctypes (~0.3 us), or None where there is none."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        import ctypes

        function = ctypes.CDLL(None).sched_getcpu
    except (ImportError, OSError, AttributeError):
        return None
    function.restype = ctypes.c_int
    function.argtypes = []
    return function if function() >= 0 else None


_helpers = _HelperPlaces()


def run(kernel, n_threads: int, *args) -> None:
    """``kernel(*args, next_task)`` on `n_threads` threads, this one included; `next_task`
    is the shared task counter (int64, one element) the copies claim from."""
    next_task = np.zeros(1, np.int64)
    if n_threads <= 1:
        kernel(*args, next_task)
        return
    pool = _pool(numba.config.NUMBA_NUM_THREADS)
    if n_threads <= PLACED_MAX_THREADS:
        cores = _helpers.away()
    else:
        _helpers.everywhere()
        cores = None
    helpers = [pool.submit(kernel, *args, next_task) for _ in range(n_threads - 1)]
    try:
        kernel(*args, next_task)
    finally:
        if cores is not None and any(helper.running() for helper in helpers):
            _helpers.back(cores)  # (those not started yet are cancelled below)
        for helper in helpers:
            if not helper.cancel():
                helper.result()
