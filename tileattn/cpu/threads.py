"""How a kernel call spreads over threads: its own pool, one thread per 8 MFLOP of work.

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

Small problems run on one thread: waking a sleeping pool thread and dispatching a kernel to
it takes 0.1-0.2 ms when the other core is busy, more than a call of 64 x 64 keys on 8 heads
takes on one thread. `threads_for` gives a call one thread per `FLOPS_PER_THREAD`, at most
``numba.get_num_threads()`` (so ``numba.set_num_threads`` still limits tileattn).

Helpers that just ran a kernel wait for the next one spinning, briefly (`SPIN_SECONDS`), in
compiled code that holds no GIL: waking a sleeping thread (a futex) and handing it the GIL
took 60-100 us on the development VM, a call's whole length at the sizes that split over
two threads. A helper joins a call only once the calling thread has claimed its first task,
so that thread is inside its kernel and the GIL is free; after the spin it sleeps on an
event, and a call that finds it asleep wakes it but never waits for it (as above).
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time

import numba
import numpy as np
from numba import njit

from .schedule import compare_exchange, exchange, fetch_add, load_acquire, store_release

FLOPS_PER_THREAD = 8e6
"""About 0.12 ms of one core's work at the kernels' ~65 GFLOP/s: with helpers spinning, a
second thread pays from there (2-core host, B1 H8 N128 D64 forward 440 -> 265 us, an MHA
decode step over 8 MB 258 -> 162 us; 32e6 while every call woke a sleeping thread,
bench/NOTES-cpu.md sessions 4 and 14)."""

SPIN_SECONDS = 2e-4
"""How long a helper spins for the next call before it sleeps: longer than the host gaps
between a decode step's kernels, short enough that an idle process costs a core for a
fraction of a millisecond only."""


def threads_for(flops: float) -> int:
    """One thread per `FLOPS_PER_THREAD` of work, at least one, at most
    ``numba.get_num_threads()``."""
    return max(1, min(numba.get_num_threads(), int(flops // FLOPS_PER_THREAD)))


# The spinning helpers' shared state: int64 slots a cache line apart. GENERATION counts the
# calls; JOINED is generation * JOIN_SLOTS + the helpers that joined it, and the caller
# closes a call by making its count JOIN_SLOTS - 1; DONE counts helpers that finished;
# TASKS is the call's task counter (the kernels' `next_task`); ALLOWED how many may join.
GENERATION, JOINED, DONE, TASKS, ALLOWED = 0, 8, 16, 24, 32
JOIN_SLOTS = 1024


@njit(nogil=True, cache=True)
def _await_call(control, seen, deadline_spins):
    """Spin until a call newer than generation `seen` has started (its caller claimed a
    task), then join it if it is open and not full. Returns the generation joined, minus
    the generation when it could not join, or 0 when the spins ran out."""
    for _ in range(deadline_spins):
        generation = load_acquire(control, GENERATION)
        if generation == seen or load_acquire(control, TASKS) == 0:
            continue
        while True:
            joined = load_acquire(control, JOINED)
            count = joined - generation * JOIN_SLOTS
            if count < 0 or count >= load_acquire(control, ALLOWED):
                return -generation
            if compare_exchange(control, JOINED, joined, joined + 1):
                return generation
    return 0


@njit(nogil=True, cache=True)
def _publish(control, generation, allowed):
    control[TASKS] = 0
    control[DONE] = 0
    control[ALLOWED] = allowed
    control[JOINED] = generation * JOIN_SLOTS
    store_release(control, GENERATION, generation)


@njit(nogil=True, cache=True)
def _close_and_wait(control, generation):
    """Close the call to late helpers and wait (spinning, no GIL) for those that joined."""
    joined = exchange(control, JOINED, generation * JOIN_SLOTS + JOIN_SLOTS - 1)
    count = joined - generation * JOIN_SLOTS
    while load_acquire(control, DONE) < count:
        pass


@njit(nogil=True, cache=True)
def _finish(control):
    fetch_add(control, DONE, 1)


class _SpinningHelpers:
    """`size` helper threads that run calls' kernels and spin between them."""

    def __init__(self, size: int):
        self.lock = threading.Lock()  # one call at a time; others take the plain pool
        self.control = np.zeros(40, np.int64)
        self.tasks = self.control[TASKS:TASKS + 1]
        self.generation = 0
        self.job = None
        self.error = None
        self.spins = _spins_for(SPIN_SECONDS)
        self.asleep = [threading.Event() for _ in range(size)]
        self.sleeping = [False] * size
        for index in range(size):
            threading.Thread(target=self._serve, args=(index,), daemon=True,
                             name=f"tileattn-cpu-{index}").start()

    def _serve(self, index: int) -> None:
        seen = 0
        while True:
            generation = _await_call(self.control, seen, self.spins)
            if generation > 0:
                seen = generation
                kernel, args = self.job
                try:
                    kernel(*args, self.tasks)
                except BaseException as error:  # re-raised by the caller
                    self.error = error
                finally:
                    _finish(self.control)
            elif generation < 0:
                seen = -generation
            else:
                self.sleeping[index] = True
                if self.control[GENERATION] == seen:
                    self.asleep[index].wait()
                self.asleep[index].clear()
                self.sleeping[index] = False

    def run(self, kernel, helpers: int, args: tuple) -> None:
        self.generation += 1
        generation = self.generation
        self.job, self.error = (kernel, args), None
        _publish(self.control, generation, helpers)
        for index, sleeping in enumerate(self.sleeping[:helpers]):
            if sleeping:
                self.asleep[index].set()
        try:
            kernel(*args, self.tasks)
        finally:
            _close_and_wait(self.control, generation)
        if self.error is not None:
            raise self.error


def _spins_for(seconds: float) -> int:
    """How many of `_await_call`'s idle iterations take about `seconds`."""
    control = np.zeros(40, np.int64)
    _await_call(control, 0, 10)  # compiled
    start = time.perf_counter()
    _await_call(control, 0, 100_000)
    per_spin = (time.perf_counter() - start) / 100_000
    return max(1000, int(seconds / max(per_spin, 1e-10)))


@functools.cache
def _helpers(size: int) -> _SpinningHelpers:
    return _SpinningHelpers(size)


@functools.cache
def _pool(size: int) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=size,
                                                 thread_name_prefix="tileattn-cpu")


def run(kernel, n_threads: int, *args) -> None:
    """``kernel(*args, next_task)`` on `n_threads` threads, this one included; `next_task`
    is the shared task counter (int64, one element) the copies claim from."""
    if n_threads > 1:
        helpers = _helpers(numba.config.NUMBA_NUM_THREADS - 1)
        if helpers.lock.acquire(blocking=False):
            try:
                helpers.run(kernel, n_threads - 1, args)
            finally:
                helpers.lock.release()
            return
    next_task = np.zeros(1, np.int64)
    futures = []
    if n_threads > 1:  # another thread's call holds the spinning helpers
        pool = _pool(numba.config.NUMBA_NUM_THREADS)
        futures = [pool.submit(kernel, *args, next_task) for _ in range(n_threads - 1)]
    try:
        kernel(*args, next_task)
    finally:
        for future in futures:
            if not future.cancel():
                future.result()
