"""The backward kernels: FlashAttention-2's Algorithm 2, recomputing each tile of ``P``.

Per tile (rows ``i`` of query head ``h``, keys ``j``), with ``P = 2**(S - lse)`` rebuilt from
the saved ``lse`` and ``D = rowsum(dO * O)`` computed once up front:

    dV_j += P~^T dO_i              (P~ = P * keep / (1 - p), the dropped probabilities)
    dP    = dO_i V_j^T
    dS    = P * (dP * keep / (1 - p) - D_i) * softcap'
    dK_j += scale dS^T Q_i
    dQ_i += scale dS K_j

Two race-free schedules, both deterministic (each output element is summed by one thread in
a fixed order):

* `backward_by_heads`: one task per (batch, kv head) runs every tile of its query heads,
  keys outer and queries inner, so ``dK_j``/``dV_j`` stay in local accumulators and ``dQ`` is
  summed into rows that no other task touches. Five matrix products per tile, the minimum.
  Used when there are enough (batch, kv head) pairs to keep every thread busy.
* `backward_key_tiles` + `backward_query_tiles`: one task per key tile (summing ``dK``,
  ``dV``) and then one per query tile (summing ``dQ``). Both passes recompute ``S`` and
  ``dP``, seven products per tile instead of five, but a single long sequence uses every core.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import dropout
from .tiles import (key_span, mask_tile, row_span, tile_is_fully_kept, tile_view,
                    transform_tile)
from .vector_math import FASTMATH, LOG2_E, exp2


@njit(cache=True, parallel=True, nogil=True, fastmath=FASTMATH)
def row_terms_kernel(do, out, lse, delta, lse_log2):
    """``delta = rowsum(dO * O)`` and ``lse`` in log2 units, +inf for rows with no kept key.

    +inf (not -inf) makes ``2**(s - lse)`` vanish on such rows: their scores are all -inf
    and ``-inf - -inf`` would be NaN.
    """
    batch, n_heads, n_q, value_dim = do.shape
    dtype = delta.dtype.type
    for bh in prange(batch * n_heads):
        b, h = bh // n_heads, bh % n_heads
        for i in range(n_q):
            total = dtype(0.0)
            for d in range(value_dim):
                total += do[b, h, i, d] * out[b, h, i, d]
            delta[b, h, i] = total
            row_lse = lse[b, h, i]
            lse_log2[b, h, i] = np.inf if row_lse == -np.inf else row_lse * dtype(LOG2_E)


@njit(fastmath=FASTMATH)
def _tile_score_gradients(q_scaled, k_tile, v_tile, do_tile, lse_log2, delta, bh, row_start,
                          col_start, n_q, n_k, scale, softcap, slope, window_left,
                          window_right, dropout_key, dropout_threshold, inv_keep, probs,
                          score_grads, softcap_grad):
    """Recompute one tile: `probs` gets ``P~`` (for dV), `score_grads` ``scale * dS``."""
    n_rows, n_cols = probs.shape
    dtype = probs.dtype.type
    natural_units = softcap > 0 or slope != 0
    np.dot(q_scaled, k_tile.T, probs)
    if natural_units:
        transform_tile(probs, softcap_grad, row_start, col_start, n_q, n_k, softcap, slope,
                       window_left, window_right, softcap > 0)
    elif not tile_is_fully_kept(row_start, row_start + n_rows, col_start, col_start + n_cols,
                                n_q, n_k, window_left, window_right):
        mask_tile(probs, row_start, col_start, n_q, n_k, window_left, window_right)
    np.dot(do_tile, v_tile.T, score_grads)
    for r in range(n_rows):
        row_lse, row_delta = lse_log2[r], delta[r]
        for j in range(n_cols):
            probs[r, j] = exp2(probs[r, j] - row_lse)
        if dropout_threshold > 0:
            state = dropout.row_state(dropout_key, bh, row_start + r)
            for j in range(n_cols):
                p = probs[r, j]
                if dropout.keeps(state, col_start + j, dropout_threshold):
                    score_grads[r, j] = p * (score_grads[r, j] * dtype(inv_keep) - row_delta)
                    probs[r, j] = p * dtype(inv_keep)
                else:
                    score_grads[r, j] = -p * row_delta
                    probs[r, j] = dtype(0.0)
        else:
            for j in range(n_cols):
                score_grads[r, j] = probs[r, j] * (score_grads[r, j] - row_delta)
        if softcap > 0:
            for j in range(n_cols):
                score_grads[r, j] *= softcap_grad[r, j]
        for j in range(n_cols):
            score_grads[r, j] *= dtype(scale)


@njit(fastmath=FASTMATH)
def _scale_query_tile(q_tile, q_scaled, scale, natural_units):
    """The query tile times ``scale`` (times log2(e) too unless the transform adds it)."""
    dtype = q_tile.dtype.type
    factor = dtype(scale) if natural_units else dtype(scale * LOG2_E)
    for r in range(q_tile.shape[0]):
        for d in range(q_tile.shape[1]):
            q_scaled[r, d] = q_tile[r, d] * factor


@njit(fastmath=FASTMATH)
def _add_into(target, addend):
    for r in range(addend.shape[0]):
        for d in range(addend.shape[1]):
            target[r, d] += addend[r, d]


@njit(fastmath=FASTMATH)
def _key_tile(q, k, v, do, lse_log2, delta, dq, dk, dv, b, kv_head, col_start, accumulate_dq,
              scale, softcap, alibi_slopes, window_left, window_right, dropout_key,
              dropout_threshold, inv_keep, block_q, block_k, scratch):
    """All tiles of key tile `col_start` over the query heads sharing `kv_head`.

    Writes ``dK``/``dV`` rows of the key tile; with `accumulate_dq` also adds into `dq`.
    """
    (q_scaled, probs_buffer, grads_buffer, softcap_buffer, product_buffer, dk_acc,
     dv_acc) = scratch
    n_q_heads, n_q, head_dim = q.shape[1], q.shape[2], q.shape[3]
    n_k, value_dim = k.shape[2], v.shape[3]
    group = n_q_heads // k.shape[1]
    col_stop = min(col_start + block_k, n_k)
    n_cols = col_stop - col_start
    k_tile = k[b, kv_head, col_start:col_stop]
    v_tile = v[b, kv_head, col_start:col_stop]
    dk_tile = dk_acc[:n_cols]
    dv_tile = dv_acc[:n_cols]
    dk_tile[:] = 0
    dv_tile[:] = 0
    row_lo, row_hi = row_span(col_start, col_stop, n_q, n_k, window_left, window_right)
    first_row = max(row_lo, 0) // block_q * block_q
    for h in range(kv_head * group, (kv_head + 1) * group):
        slope = alibi_slopes[b, h]
        natural_units = softcap > 0 or slope != 0
        for row_start in range(first_row, row_hi, block_q):
            row_stop = min(row_start + block_q, n_q)
            n_rows = row_stop - row_start
            q_tile = q[b, h, row_start:row_stop]
            do_tile = do[b, h, row_start:row_stop]
            _scale_query_tile(q_tile, q_scaled, scale, natural_units)
            probs = tile_view(probs_buffer, n_rows, n_cols)
            grads = tile_view(grads_buffer, n_rows, n_cols)
            softcap_grad = tile_view(softcap_buffer, n_rows, n_cols) if softcap > 0 else grads
            _tile_score_gradients(q_scaled[:n_rows], k_tile, v_tile, do_tile,
                                  lse_log2[b, h, row_start:row_stop],
                                  delta[b, h, row_start:row_stop], b * n_q_heads + h,
                                  row_start, col_start, n_q, n_k, scale, softcap, slope,
                                  window_left, window_right, dropout_key, dropout_threshold,
                                  inv_keep, probs, grads, softcap_grad)
            product = tile_view(product_buffer, n_cols, value_dim)
            np.dot(probs.T, do_tile, product)
            _add_into(dv_tile, product)
            product = tile_view(product_buffer, n_cols, head_dim)
            np.dot(grads.T, q_tile, product)
            _add_into(dk_tile, product)
            if accumulate_dq:
                product = tile_view(product_buffer, n_rows, head_dim)
                np.dot(grads, k_tile, product)
                _add_into(dq[b, h, row_start:row_stop], product)
    dk[b, kv_head, col_start:col_stop] = dk_tile
    dv[b, kv_head, col_start:col_stop] = dv_tile


@njit(fastmath=FASTMATH)
def _query_tile(q, k, v, do, lse_log2, delta, dq, b, h, row_start, scale, softcap,
                alibi_slopes, window_left, window_right, dropout_key, dropout_threshold,
                inv_keep, block_q, block_k, scratch):
    """``dQ`` of one query tile, summed over its key tiles."""
    (q_scaled, probs_buffer, grads_buffer, softcap_buffer, product_buffer, dq_acc,
     _) = scratch
    n_q_heads, n_q, head_dim = q.shape[1], q.shape[2], q.shape[3]
    n_k = k.shape[2]
    kv_head = h // (n_q_heads // k.shape[1])
    row_stop = min(row_start + block_q, n_q)
    n_rows = row_stop - row_start
    q_tile = q[b, h, row_start:row_stop]
    do_tile = do[b, h, row_start:row_stop]
    slope = alibi_slopes[b, h]
    _scale_query_tile(q_tile, q_scaled, scale, softcap > 0 or slope != 0)
    dq_tile = dq_acc[:n_rows]
    dq_tile[:] = 0
    col_lo, col_hi = key_span(row_start, row_stop, n_q, n_k, window_left, window_right)
    for col_start in range(max(col_lo, 0) // block_k * block_k, col_hi, block_k):
        col_stop = min(col_start + block_k, n_k)
        n_cols = col_stop - col_start
        k_tile = k[b, kv_head, col_start:col_stop]
        probs = tile_view(probs_buffer, n_rows, n_cols)
        grads = tile_view(grads_buffer, n_rows, n_cols)
        softcap_grad = tile_view(softcap_buffer, n_rows, n_cols) if softcap > 0 else grads
        _tile_score_gradients(q_scaled[:n_rows], k_tile, v[b, kv_head, col_start:col_stop],
                              do_tile, lse_log2[b, h, row_start:row_stop],
                              delta[b, h, row_start:row_stop], b * n_q_heads + h, row_start,
                              col_start, n_q, n_k, scale, softcap, slope, window_left,
                              window_right, dropout_key, dropout_threshold, inv_keep, probs,
                              grads, softcap_grad)
        product = tile_view(product_buffer, n_rows, head_dim)
        np.dot(grads, k_tile, product)
        _add_into(dq_tile, product)
    dq[b, h, row_start:row_stop] = dq_tile


@njit(fastmath=FASTMATH)
def _scratch(block_q, block_k, head_dim, value_dim, softcap, dtype):
    """One thread's tile buffers (flat where `tile_view` cuts ragged tiles from them)."""
    accumulator_rows = max(block_q, block_k)
    return (np.empty((block_q, head_dim), dtype),
            np.empty(block_q * block_k, dtype),
            np.empty(block_q * block_k, dtype),
            np.empty(block_q * block_k if softcap > 0 else 1, dtype),
            np.empty(accumulator_rows * max(head_dim, value_dim), dtype),
            np.empty((accumulator_rows, head_dim), dtype),
            np.empty((block_k, value_dim), dtype))


@njit(cache=True, parallel=True, nogil=True, fastmath=FASTMATH)
def backward_by_heads(q, k, v, do, lse_log2, delta, dq, dk, dv, scale, softcap, alibi_slopes,
                      window_left, window_right, dropout_key, dropout_threshold, inv_keep,
                      block_q, block_k, n_threads):
    """All gradients, one task per (batch, kv head); `dq` must start zeroed."""
    batch, n_kv_heads, n_k = k.shape[0], k.shape[1], k.shape[2]
    n_tasks = batch * n_kv_heads
    n_workers = min(n_threads, n_tasks)
    for worker in prange(n_workers):
        scratch = _scratch(block_q, block_k, q.shape[3], v.shape[3], softcap, q.dtype)
        for task in range(worker, n_tasks, n_workers):
            b, kv_head = task // n_kv_heads, task % n_kv_heads
            for col_start in range(0, n_k, block_k):
                _key_tile(q, k, v, do, lse_log2, delta, dq, dk, dv, b, kv_head, col_start,
                          True, scale, softcap, alibi_slopes, window_left, window_right,
                          dropout_key, dropout_threshold, inv_keep, block_q, block_k, scratch)


@njit(cache=True, parallel=True, nogil=True, fastmath=FASTMATH)
def backward_key_tiles(q, k, v, do, lse_log2, delta, dk, dv, scale, softcap, alibi_slopes,
                       window_left, window_right, dropout_key, dropout_threshold, inv_keep,
                       block_q, block_k, n_threads):
    """``dK`` and ``dV``, one task per (batch, kv head, key tile), dealt round-robin."""
    batch, n_kv_heads, n_k = k.shape[0], k.shape[1], k.shape[2]
    n_k_tiles = (n_k + block_k - 1) // block_k
    n_tasks = batch * n_kv_heads * n_k_tiles
    n_workers = min(n_threads, n_tasks)
    for worker in prange(n_workers):
        scratch = _scratch(block_q, block_k, q.shape[3], v.shape[3], softcap, q.dtype)
        for task in range(worker, n_tasks, n_workers):
            b = task // (n_kv_heads * n_k_tiles)
            kv_head = task // n_k_tiles % n_kv_heads
            _key_tile(q, k, v, do, lse_log2, delta, dk, dk, dv, b, kv_head,
                      task % n_k_tiles * block_k, False, scale, softcap, alibi_slopes,
                      window_left, window_right, dropout_key, dropout_threshold, inv_keep,
                      block_q, block_k, scratch)


@njit(cache=True, parallel=True, nogil=True, fastmath=FASTMATH)
def backward_query_tiles(q, k, v, do, lse_log2, delta, dq, scale, softcap, alibi_slopes,
                         window_left, window_right, dropout_key, dropout_threshold, inv_keep,
                         block_q, block_k, n_threads):
    """``dQ``, one task per (batch, query head, query tile), dealt round-robin."""
    batch, n_q_heads, n_q = q.shape[0], q.shape[1], q.shape[2]
    n_q_tiles = (n_q + block_q - 1) // block_q
    n_tasks = batch * n_q_heads * n_q_tiles
    n_workers = min(n_threads, n_tasks)
    for worker in prange(n_workers):
        scratch = _scratch(block_q, block_k, q.shape[3], v.shape[3], softcap, q.dtype)
        for task in range(worker, n_tasks, n_workers):
            b = task // (n_q_heads * n_q_tiles)
            h = task // n_q_tiles % n_q_heads
            _query_tile(q, k, v, do, lse_log2, delta, dq, b, h, task % n_q_tiles * block_q,
                        scale, softcap, alibi_slopes, window_left, window_right, dropout_key,
                        dropout_threshold, inv_keep, block_q, block_k, scratch)
