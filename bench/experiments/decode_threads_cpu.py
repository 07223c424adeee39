"""Where a many-core host's decode call spends what the K/V read does not explain: one
decode shape (float32, default B1 Hq 32 Hkv 32 Nq 1 over 8k keys, D 128) timed on the CPU
backend at several thread counts, after a pause (the benchmark's 0.2 s, pool threads
asleep) and back to back, with the pool threads' placement (`threads._helpers`: moved off
the caller's core before each call and back after) on and off; torch SDPA beside; then
the pieces of a call's thread start alone: os.sched_setaffinity of one pool thread, a
ThreadPoolExecutor submit, and an empty kernel run on every thread. `--tasks-per-thread`
times the decode again at each count of (batch, kv head, key split) tasks a thread
(`decode.TASKS_PER_THREAD`, the split count's target), placement as the backend does it.

    python bench/experiments/decode_threads_cpu.py [--threads 4 8 16] [--nk 8192]
        [--heads 32 32] [--nq 1] [--repetitions 9] [--tasks-per-thread 4 8 16]

Medians in microseconds; K and V's bytes over the time as GB/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import numba
import numpy as np

import tileattn
import tileattn.cpu
from tileattn.cpu import decode as cpu_decode
from tileattn.cpu import threads as cpu_threads

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = None


def median_us(function, repetitions: int, pause: float) -> float:
    function()
    times = []
    for _ in range(repetitions):
        if pause:
            time.sleep(pause)
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


@numba.njit(nogil=True)
def _nothing(next_task):
    next_task[0] += 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="*", default=[2, 4, 8, 16])
    parser.add_argument("--nk", type=int, default=8192)
    parser.add_argument("--heads", type=int, nargs=2, default=[32, 32])
    parser.add_argument("--nq", type=int, default=1)
    parser.add_argument("--repetitions", type=int, default=9)
    parser.add_argument("--tasks-per-thread", type=int, nargs="*", default=[])
    args = parser.parse_args()
    hq, hkv = args.heads
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, hq, args.nq, 128), np.float32)
    k = rng.standard_normal((1, hkv, args.nk, 128), np.float32)
    v = rng.standard_normal((1, hkv, args.nk, 128), np.float32)
    gigabytes = (k.nbytes + v.nbytes) / 1e9
    print(f"# {os.cpu_count()} cpus, affinity {len(os.sched_getaffinity(0))}; "
          f"B1 Hq {hq} Hkv {hkv} Nq {args.nq} Nk {args.nk} D128 float32, "
          f"K+V {gigabytes * 1e3:.0f} MB")
    call = lambda: tileattn.forward(q, k, v, backend="cpu")  # noqa: E731
    if torch is not None:
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        torch_call = lambda: F.scaled_dot_product_attention(tq, tk, tv,  # noqa: E731
                                                            enable_gqa=hq != hkv)
    current_core = cpu_threads._helpers._current_core
    for n in args.threads:
        numba.set_num_threads(n)
        if torch is not None:
            torch.set_num_threads(n)
        cells = []
        for pause in (0.2, 0.0):
            for placement in (True, False):
                cpu_threads._helpers._current_core = current_core if placement else None
                us = median_us(call, args.repetitions, pause)
                cells.append(f"{'paused' if pause else 'back to back'} placement "
                             f"{'on' if placement else 'off'} {us:8.0f} "
                             f"({gigabytes / (us * 1e-6):.0f} GB/s)")
            if torch is not None:
                us = median_us(torch_call, args.repetitions, pause)
                cells.append(f"{'paused' if pause else 'back to back'} torch {us:8.0f} "
                             f"({gigabytes / (us * 1e-6):.0f} GB/s)")
        cpu_threads._helpers._current_core = current_core
        default_tasks = cpu_decode.TASKS_PER_THREAD
        for tasks in args.tasks_per_thread:
            cpu_decode.TASKS_PER_THREAD = tasks
            tileattn.cpu._FORWARD_PLANS.clear()  # plans keep their split count
            paused, hot = (median_us(call, args.repetitions, pause) for pause in (0.2, 0.0))
            cells.append(f"{tasks} tasks a thread: paused {paused:8.0f} back to back {hot:8.0f} "
                         f"({gigabytes / (hot * 1e-6):.0f} GB/s)")
        cpu_decode.TASKS_PER_THREAD = default_tasks
        tileattn.cpu._FORWARD_PLANS.clear()
        empty = median_us(lambda: cpu_threads.run(_nothing, n), args.repetitions, 0.2)
        empty_hot = median_us(lambda: cpu_threads.run(_nothing, n), args.repetitions, 0.0)
        print(f"threads {n}: " + "; ".join(cells)
              + f"; empty run paused {empty:.0f} back to back {empty_hot:.0f}", flush=True)
    # The pieces alone.
    pool = cpu_threads._pool(numba.config.NUMBA_NUM_THREADS)
    ids = list(cpu_threads._helpers._threads)
    if ids:
        cores = os.sched_getaffinity(0)
        start = time.perf_counter()
        for _ in range(100):
            os.sched_setaffinity(ids[0], cores)
        print(f"sched_setaffinity of one thread: {1e6 * (time.perf_counter() - start) / 100:.1f} us"
              f" ({len(ids)} pool threads)")
    event = threading.Event()
    start = time.perf_counter()
    futures = [pool.submit(event.is_set) for _ in range(100)]
    submitted = time.perf_counter()
    for future in futures:
        future.result()
    print(f"ThreadPoolExecutor submit: {1e6 * (submitted - start) / 100:.1f} us each")


if __name__ == "__main__":
    main()
