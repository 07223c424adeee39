"""Where a paged prefill loses to contiguous keys in single calls after an L2 flush:
bench_gpu_varlen.py part 2's problem (B 4, 512 new rows onto 8192 cached keys, D 128,
float16, causal, pages of 64 in shuffled order, device tables unchecked), each call timed
five ways:

    PYTHONPATH=. python3 bench/experiments/paged_flush_gpu.py [--pages 16,64,256]

* ``write flush``: the benchmark's timing (a 128 MiB write before each call, the host's
  time past the flush inside the timing);
* ``read flush``: a 128 MiB read instead (clean lines, no write-back in the call's time);
* ``write flush, host hidden``: the write flush, then a kernel that spins for 300 us
  before the start event, so the call's host time is queued behind it: the kernels' time
  on a cold L2 alone;
* ``synced``: the write flush waited for before the start event (the whole host time of
  the call inside the timing, as after a server's synchronisation);
* ``back to back``: calls queued one after another (the host overlapped, L2 warm with the
  previous call's tail).

Each line: Hq/Hkv | page | contiguous ms | paged ms | contiguous / paged, per column.
"""

from __future__ import annotations

import argparse
import os
import sys

import cupy
import numpy as np

import tileattn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_timing import back_to_back_ms, median_event_ms  # noqa: E402
from paged_pools import page_pool  # noqa: E402

REPETITIONS = 15
_SPIN = cupy.RawKernel(r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}""", "spin")


def _spin() -> None:
    _SPIN((1,), (1,), (np.int64(600_000),))  # ~300 us at 1.98 GHz


def flushed_ms(function, how: str) -> float:
    """`how`: "write", "read", "hidden" or "synced" (the module's docstring)."""
    after = {"hidden": _spin, "synced": cupy.cuda.Device().synchronize}.get(how)
    return median_event_ms(function, REPETITIONS, 2, clean_flush=how == "read",
                           after_flush=after)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", default="64")
    args = parser.parse_args()
    batch, n_new, n_keys, dim = 4, 512, 8704, 128
    ways = ("write", "read", "hidden", "synced")
    print("Hq/Hkv | page | " + " | ".join(f"{w}: contiguous, paged, ratio" for w in ways)
          + " | back to back: contiguous, paged, ratio")
    for q_heads, kv_heads in ((16, 16), (32, 8)):
        rng = cupy.random.default_rng(2)
        q = rng.standard_normal((batch, q_heads, n_new, dim), dtype=cupy.float32).astype(
            cupy.float16)
        k = rng.standard_normal((batch, kv_heads, n_keys, dim), dtype=cupy.float32).astype(
            cupy.float16)
        v = rng.standard_normal((batch, kv_heads, n_keys, dim), dtype=cupy.float32).astype(
            cupy.float16)
        seqlens_k = cupy.full(batch, n_keys, dtype=cupy.int32)

        def contiguous():
            return tileattn.forward(q, k, v, causal=True, backend="gpu")

        for page in (int(p) for p in args.pages.split(",")):
            k_pool, table = page_pool(k, [n_keys] * batch, page, np.random.default_rng(3))
            v_pool, _ = page_pool(v, [n_keys] * batch, page, np.random.default_rng(3))

            def paged():
                return tileattn.forward(q, k_pool, v_pool, causal=True, backend="gpu",
                                        block_table=table, seqlens_k=seqlens_k,
                                        check_lengths=False)

            assert float(abs(paged() - contiguous()).max()) == 0.0
            cells = []
            for way in ways:
                c, p = flushed_ms(contiguous, way), flushed_ms(paged, way)
                cells.append(f"{c:.3f} {p:.3f} {c / p:.3f}")
            c, p = back_to_back_ms(contiguous, 30), back_to_back_ms(paged, 30)
            cells.append(f"{c:.3f} {p:.3f} {c / p:.3f}")
            print(f"{q_heads}/{kv_heads} | {page} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
