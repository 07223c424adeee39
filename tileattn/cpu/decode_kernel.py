"""The decode forward: a few query rows against a long key cache, split over the keys.

With ``Nq`` of 1 to 16 rows the forward kernel has one task per query head, and each
streams the whole of its kv head's K and V from memory: at B = 1 a few heads cannot keep
every core busy, and with GQA every query head of a group reads the same K/V rows again.
Here a task is one (batch, kv head, key split): it runs every query head of the group
against each key tile while the tile is in L2, so each K/V row comes from memory once per
group, and the splits give every core work even at B = 1 with one kv head.

Each split keeps FlashAttention's unnormalised partial state (accumulator, row maximum,
row sum) for its keys; `merge_kernel` then combines the splits exactly, as Flash-Decoding's
split-KV reduction does: with ``m = max_s m_s`` the combined sum is
``sum_s l_s exp(m_s - m)`` and the accumulator ``sum_s acc_s exp(m_s - m)``, which is what
one pass over all keys would have computed, up to rounding.

Every score step is `forward_kernel._tile`, so softcap, ALiBi, masks, dropout (same hash
positions: absolute row and key) and non-finite inputs behave as in the forward kernel.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .forward_kernel import _tile
from .schedule import claim_next
from .vector_math import FASTMATH, maximum


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def decode_kernel(q, k, v, partial_acc, partial_max, partial_sum, scale, softcap,
                  alibi_slopes, window_left, window_right, dropout_key, dropout_threshold,
                  inv_keep, block_k, key_start, key_stop, split_size, next_task):
    """Fill the partial state of every (batch, kv head, split): one thread's share, run on
    every thread by `threads.run`.

    `partial_acc` is (splits, B, Hq, Nq, Dv), `partial_max` and `partial_sum` (splits, B,
    Hq, Nq). Split ``s`` takes keys ``[key_start + s * split_size, ...)`` up to `key_stop`
    (the keys any row keeps); a split with no keys leaves max -inf, sum 0, accumulator 0.
    """
    batch, n_q_heads, n_q, head_dim = q.shape
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    value_dim = v.shape[3]
    group = n_q_heads // n_kv_heads
    n_splits = partial_acc.shape[0]
    n_tasks = n_splits * batch * n_kv_heads
    task = claim_next(next_task)
    if task >= n_tasks:
        return
    dtype = q.dtype
    q_factor = dtype.type(scale)
    q_scaled = np.empty((group * n_q, head_dim), dtype)
    scores_buffer = np.empty(n_q * block_k, dtype)
    pv_buffer = np.empty(n_q * value_dim, dtype)
    rescale = np.empty(n_q, dtype)
    while task < n_tasks:
        split = task % n_splits
        b, kv_head = divmod(task // n_splits, n_kv_heads)
        first_head = kv_head * group
        # The same scaled query as the forward and backward kernels, so all round alike.
        for g in range(group):
            for r in range(n_q):
                for d in range(head_dim):
                    q_scaled[g * n_q + r, d] = q[b, first_head + g, r, d] * q_factor
        acc = partial_acc[split, b]
        row_max = partial_max[split, b]
        row_sum = partial_sum[split, b]
        acc[first_head:first_head + group] = 0
        row_max[first_head:first_head + group] = -np.inf
        row_sum[first_head:first_head + group] = 0
        split_start = key_start + split * split_size
        split_stop = min(split_start + split_size, key_stop)
        for col_start in range(split_start, split_stop, block_k):
            col_stop = min(col_start + block_k, split_stop)
            k_tile = k[b, kv_head, col_start:col_stop]
            v_tile = v[b, kv_head, col_start:col_stop]
            for g in range(group):
                h = first_head + g
                _tile(q_scaled[g * n_q:(g + 1) * n_q], k_tile, v_tile, acc[h], row_max[h],
                      row_sum[h], rescale, b * n_q_heads + h, 0, col_start, n_q, n_k,
                      softcap, alibi_slopes[b, h], window_left, window_right, dropout_key,
                      dropout_threshold, inv_keep, scores_buffer, pv_buffer)
        task = claim_next(next_task)


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def merge_kernel(partial_acc, partial_max, partial_sum, out, lse):
    """Combine the splits' partial state into `out` (B, Hq, Nq, Dv) and `lse` (B, Hq, Nq),
    finishing each row as `forward_kernel._query_tile` does (no kept key: 0 and -inf; NaN
    anywhere: NaN)."""
    n_splits, batch, n_q_heads, n_q, value_dim = partial_acc.shape
    dtype = out.dtype.type
    row = np.empty(value_dim, out.dtype)
    for b in range(batch):
        for h in range(n_q_heads):
            for i in range(n_q):
                row_max = partial_max[0, b, h, i]
                for s in range(1, n_splits):
                    row_max = maximum(row_max, partial_max[s, b, h, i])
                # All splits empty: max -inf, and exp(-inf - 0) = 0 gives total 0.
                safe_max = dtype(0.0) if row_max == -np.inf else row_max
                total = dtype(0.0)
                row[:] = 0
                for s in range(n_splits):
                    weight = np.exp(partial_max[s, b, h, i] - safe_max)
                    total += partial_sum[s, b, h, i] * weight
                    # A split that kept nothing holds exact zeros (its masked terms never
                    # reach the accumulator: `kept_products`), so its 0 weight adds 0; a
                    # NaN in a split's kept values reaches the row, as in one pass.
                    for d in range(value_dim):
                        row[d] += partial_acc[s, b, h, i, d] * weight
                if total > 0:
                    inverse = dtype(1.0) / total
                    for d in range(value_dim):
                        out[b, h, i, d] = row[d] * inverse
                    lse[b, h, i] = row_max + np.log(total)
                elif total == 0:
                    out[b, h, i, :] = 0
                    lse[b, h, i] = -np.inf
                else:
                    out[b, h, i, :] = np.nan
                    lse[b, h, i] = np.nan
