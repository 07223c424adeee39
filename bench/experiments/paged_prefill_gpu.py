"""Kernel time of a paged prefill against the same keys contiguous, with host lengths and
tables (no device-to-host copy) so that back-to-back calls overlap the host's time with
the kernels': B 4, Hq = Hkv = 16, 512 new rows onto 8192 cached keys, D 128, float16,
causal, pages of 16, 64 and 256 in shuffled order.

    PYTHONPATH=. python3 bench/experiments/paged_prefill_gpu.py
"""

from __future__ import annotations

import cupy
import numpy as np

import tileattn


def back_to_back_ms(function, calls: int = 50) -> float:
    function()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(calls):
        function()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / calls


def main() -> None:
    batch, heads, n_new, n_keys, dim = 4, 16, 512, 8704, 128
    rng = np.random.default_rng(0)
    q = cupy.asarray(rng.standard_normal((batch, heads, n_new, dim)), dtype=cupy.float16)
    k = cupy.asarray(rng.standard_normal((batch, heads, n_keys, dim)), dtype=cupy.float16)
    dense = back_to_back_ms(lambda: tileattn.forward(q, k, k, causal=True, backend="gpu"))
    print(f"contiguous: {dense:.3f} ms")
    for page in (16, 64, 256):
        pages = n_keys // page
        order = rng.permutation(batch * pages)
        table = order.reshape(batch, pages)
        pool = cupy.empty((batch * pages, heads, page, dim), dtype=cupy.float16)
        pool[cupy.asarray(order)] = k.reshape(batch, heads, pages, page, dim).transpose(
            0, 2, 1, 3, 4).reshape(batch * pages, heads, page, dim)
        lengths = {"block_table": table, "seqlens_k": np.full(batch, n_keys),
                   "check_lengths": False}
        padded = back_to_back_ms(lambda: tileattn.forward(
            q, k, k, causal=True, backend="gpu", seqlens_k=np.full(batch, n_keys),
            check_lengths=False))
        paged = back_to_back_ms(lambda: tileattn.forward(q, pool, pool, causal=True,
                                                         backend="gpu", **lengths))
        same = float(cupy.abs(tileattn.forward(q, pool, pool, causal=True, backend="gpu",
                                               **lengths)
                              - tileattn.forward(q, k, k, causal=True, backend="gpu")).max())
        print(f"page {page:4d}: padded (seqlens_k) {padded:.3f} ms, paged {paged:.3f} ms, "
              f"contiguous / paged {dense / paged:.2f}, max |diff| {same:.1e}")


if __name__ == "__main__":
    main()
