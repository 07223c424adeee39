"""Launcher of the decode forward (`decode_kernel`): which calls take it, and how many key
splits they get."""

from __future__ import annotations

import numpy as np

from . import blas, threads
from .blocks import default_blocks
from .tiles import key_span

MAX_QUERY_ROWS = 16
"""Calls with at most this many query rows take the decode path (bench/NOTES-cpu.md,
session 5: `bench/bench_cpu_decode.py`)."""

TASKS_PER_THREAD = 4
"""Splits are added until there are this many (batch, kv head, split) tasks per thread, as
for the forward's query tiles (`blocks.spread_over_threads`): tasks are claimed on demand,
so a core slowed by other load takes fewer."""


def takes(n_q: int) -> bool:
    """Whether a forward with `n_q` query rows runs on the decode path."""
    return n_q <= MAX_QUERY_ROWS


def split_count(n_tasks_per_split: int, n_keys: int, block_k: int, n_threads: int) -> int:
    """Key splits for `n_threads`: enough for `TASKS_PER_THREAD` tasks per thread, but no
    split shorter than one key tile (a shorter one would only add merge work)."""
    wanted = -(-TASKS_PER_THREAD * n_threads // n_tasks_per_split)
    return max(1, min(wanted, -(-n_keys // block_k)))


def forward(q_c, k_c, v_c, options, scalars, lock, n_splits=None):
    """``(out, lse)`` for prepared (compute-dtype, read-only, contiguous) arrays.

    `scalars` are the kernels' option arguments (`tileattn.cpu._option_scalars`), `lock`
    the backend's kernel lock. `n_splits` (private, for tests) forces the split count.
    """
    from .decode_kernel import decode_kernel, merge_kernel

    batch, n_q_heads, n_q, head_dim = q_c.shape
    n_kv_heads, n_k, value_dim = k_c.shape[1], k_c.shape[2], v_c.shape[3]
    key_lo, key_hi = key_span(0, n_q, n_k, options.band_offset(n_q, n_k), options.window_left,
                              options.window_right)
    key_start, key_stop = max(key_lo, 0), max(min(key_hi, n_k), max(key_lo, 0))
    block_k = options.block_k or default_blocks("forward", head_dim, value_dim,
                                                q_c.itemsize).block_k
    flops = 2.0 * batch * n_q_heads * n_q * (key_stop - key_start) * (head_dim + value_dim)
    n_threads = threads.threads_for(flops)
    if n_splits is None:
        n_splits = split_count(batch * n_kv_heads, key_stop - key_start, block_k, n_threads)
    split_size = max(1, -(-(key_stop - key_start) // n_splits))
    dtype = q_c.dtype
    partial_acc = np.empty((n_splits, batch, n_q_heads, n_q, value_dim), dtype)
    partial_max = np.empty((n_splits, batch, n_q_heads, n_q), dtype)
    partial_sum = np.empty((n_splits, batch, n_q_heads, n_q), dtype)
    out = np.empty((batch, n_q_heads, n_q, value_dim), dtype)
    lse = np.empty((batch, n_q_heads, n_q), dtype)
    with lock, blas.single_threaded():
        threads.run(decode_kernel, min(n_threads, n_splits * batch * n_kv_heads), q_c, k_c,
                    v_c, partial_acc, partial_max, partial_sum, *scalars, block_k, key_start,
                    key_stop, split_size)
        merge_kernel(partial_acc, partial_max, partial_sum, out, lse)
    return out, lse
