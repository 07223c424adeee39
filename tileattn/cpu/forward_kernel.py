"""The forward kernel: FlashAttention-2's Algorithm 1 over ``block_q x block_k`` tiles.

`tileattn.reference.tiled_forward` is the executable documentation; this is the same loop
with the batch, head and query-tile loops flattened into one task list spread over threads.
Each task owns one query tile of one head: its output rows are written by that task alone,
so there are no races and no reductions across threads. The products run on BLAS, or for
bfloat16 inputs on `bf16_products`' pair products (`forward_kernel`'s `pairs`; P rounded to
bfloat16, as the GPU kernels round it).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..options import BAND, BATCH, INDEX, KEY_BASE, KEYS, ROW_BASE, ROWS
from . import bf16_products, dropout
from .denormals import flush_subnormals, restore_subnormals
from .kept_products import redo_non_finite_rows
from .kernel_cache import flush_if_stale
from .schedule import claim_next
from .tiles import (key_span, key_value_rows, mask_tile, tile_is_fully_kept, tile_view,
                    transform_tile)
from .vector_math import FASTMATH, LOG2_E, exp2_nonpositive, maximum


@njit(fastmath=FASTMATH)
def _softmax_update(scores, row_max, row_sum, rescale):
    """Online softmax over one tile (FlashAttention-2 section 3.1.1), natural-unit scores.

    Turns `scores` into unnormalised probabilities ``exp(s - m_new)`` in place, rescales
    `row_sum` by ``exp(m_old - m_new)`` and adds the tile's row sums; the accumulator's
    factor goes to `rescale`, applied in the same pass that adds ``P V``.

    ``exp(x)`` is ``exp2(x * log2(e))`` with ``x = s - m`` formed first: near the maximum
    that difference is exact, so the scores, the row maximum and hence ``lse`` carry exactly
    the rounding of the scores that the backward recomputes the same way. Folding
    ``log2(e)`` into the query instead (one multiply per score fewer) gave scores whose
    rounding differs from the backward's by an ulp of ``|s|``: float32 dv at |s| ~ 2e4
    came out 1.2-2.4x its tolerance (bench/NOTES-cpu.md, session 4).
    """
    n_rows, n_cols = scores.shape
    dtype = scores.dtype.type
    log2_e = dtype(LOG2_E)
    for r in range(n_rows):
        new_max = row_max[r]
        for j in range(n_cols):
            new_max = maximum(new_max, scores[r, j])
        # A row with nothing kept so far keeps max -inf; subtract 0 then, as exp2(-inf - -inf)
        # would be NaN. Its probabilities are exp2(-inf) = 0. A NaN score makes the max NaN,
        # and with it the whole row, as in the golden model.
        safe_max = dtype(0.0) if new_max == -np.inf else new_max
        rescale[r] = exp2_nonpositive((row_max[r] - safe_max) * log2_e)
        tile_sum = dtype(0.0)
        for j in range(n_cols):
            p = exp2_nonpositive((scores[r, j] - safe_max) * log2_e)
            scores[r, j] = p
            tile_sum += p
        row_sum[r] = row_sum[r] * rescale[r] + tile_sum
        row_max[r] = new_max


@njit(fastmath=FASTMATH)
def _apply_dropout(probs, bh, row_start, col_start, key, threshold, inv_keep):
    """``p * keep / (1 - dropout_p)`` with `tileattn.dropout`'s hash; `row_start` and
    `col_start` are global positions (`AttentionOptions.row_offset` added)."""
    n_rows, n_cols = probs.shape
    dtype = probs.dtype.type
    for r in range(n_rows):
        state = dropout.row_state(key, bh, row_start + r)
        for j in range(n_cols):
            if dropout.keeps(state, col_start + j, threshold):
                probs[r, j] *= dtype(inv_keep)
            else:  # times 0, not 0: a NaN P stays NaN (SPEC step 6)
                probs[r, j] *= dtype(0.0)


@njit(fastmath=FASTMATH)
def _tile(q_scaled, q_tile, k_tile, v_tile, acc, row_max, row_sum, rescale, bh, row_start,
          col_start, band_offset, row_offset, col_offset, scale, softcap, slope, window_left,
          window_right, dropout_key, dropout_threshold, inv_keep, scores_buffer, pv_buffer,
          products):
    """One step of Algorithm 1: the rows of `q_scaled` (`q_tile` unscaled) against one key
    tile; with `products` (`bf16_products.tile_buffers`) on bfloat16's pair products."""
    n_rows, n_cols = q_scaled.shape[0], k_tile.shape[0]
    scores = tile_view(scores_buffer, n_rows, n_cols)
    if products is not None:
        bf16_products.scaled_scores(q_tile, k_tile, scores, scale, *products)
    else:
        np.dot(q_scaled, k_tile.T, scores)
    fully_kept = tile_is_fully_kept(row_start, row_start + n_rows, col_start,
                                    col_start + n_cols, band_offset, window_left, window_right)
    if softcap > 0 or slope != 0:
        transform_tile(scores, scores[:0], row_start, col_start, band_offset, softcap, slope,
                       window_left, window_right)
    elif not fully_kept:
        mask_tile(scores, row_start, col_start, band_offset, window_left, window_right)
    _softmax_update(scores, row_max, row_sum, rescale)
    if dropout_threshold > 0:
        _apply_dropout(scores, bh, row_offset + row_start, col_offset + col_start, dropout_key,
                       dropout_threshold, inv_keep)
    pv = tile_view(pv_buffer, n_rows, v_tile.shape[1])
    if products is not None:
        bf16_products.dot_nn(scores, v_tile, pv, *products)
    else:
        np.dot(scores, v_tile, pv)
    if not fully_kept:
        redo_non_finite_rows(scores, v_tile, pv, row_start, col_start, band_offset,
                             window_left, window_right)
    for r in range(n_rows):
        for d in range(pv.shape[1]):
            acc[r, d] = acc[r, d] * rescale[r] + pv[r, d]


@njit(fastmath=FASTMATH)
def _query_tile(q_tile, k, v, out_rows, lse_rows, b, kv_head, key_base, n_keys, row_start,
                bh, scale, softcap, slope, window_left, window_right, band_offset, row_offset,
                col_offset, dropout_key, dropout_threshold, inv_keep, block_table, page_size,
                slots_outer, block_k, slice_rows, q_scaled, scores_buffer, pv_buffer, acc,
                row_max, row_sum, rescale, key_buffer, value_buffer, products):
    """One query tile of one sequence: rows `row_start` on (sequence positions) against its
    `n_keys` keys, which start at `key_base` of batch element `b` (`tiles.key_value_rows`: or are
    read through the block table). Key tiles past the sequence's keys or outside the mask
    are never loaded."""
    n_rows = q_tile.shape[0]
    dtype = q_tile.dtype.type
    # The same scaled query as the backward's (`backward_kernel._scale_query_tile`), so both
    # passes round every score alike.
    q_factor = dtype(scale)
    for r in range(n_rows):
        for d in range(q_tile.shape[1]):
            q_scaled[r, d] = q_tile[r, d] * q_factor
    acc[:n_rows] = 0
    row_max[:n_rows] = -np.inf
    row_sum[:n_rows] = 0
    row_stop = row_start + n_rows
    col_lo, col_hi = key_span(row_start, row_stop, n_keys, band_offset, window_left,
                              window_right)
    for col_start in range(max(col_lo, 0) // block_k * block_k, col_hi, block_k):
        col_stop = min(col_start + block_k, n_keys)
        k_tile, v_tile = key_value_rows(k, v, b, kv_head, key_base + col_start,
                                        key_base + col_stop, block_table, page_size,
                                        slots_outer, key_buffer, value_buffer)
        if tile_is_fully_kept(row_start, row_stop, col_start, col_stop, band_offset,
                              window_left, window_right):
            _tile(q_scaled[:n_rows], q_tile, k_tile, v_tile, acc, row_max, row_sum, rescale,
                  bh, row_start, col_start, band_offset, row_offset, col_offset, scale,
                  softcap, slope, window_left, window_right, dropout_key, dropout_threshold,
                  inv_keep, scores_buffer, pv_buffer, products)
            continue
        # A tile the mask cuts (the causal diagonal, a window edge) runs in slices of
        # `slice_rows` rows, each against only the keys its rows keep: with 256-row tiles
        # the diagonal would otherwise compute twice the products it keeps.
        for slice_start in range(row_start, row_stop, slice_rows):
            slice_stop = min(slice_start + slice_rows, row_stop)
            keep_lo, keep_hi = key_span(slice_start, slice_stop, n_keys, band_offset,
                                        window_left, window_right)
            cols_lo, cols_hi = max(col_start, keep_lo), min(col_stop, keep_hi)
            if cols_lo >= cols_hi:
                continue
            first, last = slice_start - row_start, slice_stop - row_start
            _tile(q_scaled[first:last], q_tile[first:last],
                  k_tile[cols_lo - col_start:cols_hi - col_start],
                  v_tile[cols_lo - col_start:cols_hi - col_start], acc[first:last],
                  row_max[first:last], row_sum[first:last], rescale[first:last], bh,
                  slice_start, cols_lo, band_offset, row_offset, col_offset, scale, softcap,
                  slope, window_left, window_right, dropout_key, dropout_threshold, inv_keep,
                  scores_buffer, pv_buffer, products)
    for r in range(n_rows):
        total = row_sum[r]
        if total > 0:
            inverse = dtype(1.0) / total
            for d in range(out_rows.shape[1]):
                out_rows[r, d] = acc[r, d] * inverse
            lse_rows[r] = row_max[r] + np.log(total)
        elif total == 0:
            # No kept key (SPEC): output 0, lse -inf.
            out_rows[r, :] = 0
            lse_rows[r] = -np.inf
        else:
            # NaN reached this row (non-finite input): the whole row is NaN, as in the
            # golden model's dense form.
            out_rows[r, :] = np.nan
            lse_rows[r] = np.nan


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def forward_kernel(q, k, v, out, lse, sequences, tiles, block_table, page_size, slots_outer,
                   scale, softcap, alibi_slopes, window_left, window_right, row_offset,
                   col_offset, dropout_key, dropout_threshold, inv_keep, block_q, block_k,
                   slice_rows, pairs, next_task):
    """Fill `out` (B, Hq, Nq, Dv) and `lse` (B, Hq, Nq) from C-contiguous q, k, v: one
    thread's share, run on every thread by `threads.run`.

    `sequences` holds one row per sequence (`tileattn.options.dense_descriptors` /
    `VarlenLayout.descriptors`: batch element, row base and count, key base and count, band
    offset, index), so one call serves a dense batch (one sequence per batch element), a
    padded or packed variable-length batch, or paged K/V (`block_table` non-empty; k and v
    are then page pools, see `tiles.key_value_rows`). Rows of no sequence are not written.
    `alibi_slopes` is (S, Hq), zeros when ALiBi is off; `dropout_threshold` 0 means no
    dropout. `row_offset`, `col_offset` turn a sequence's rows and keys into the global
    positions that the dropout hash sees (`AttentionOptions.row_offset`).
    Tasks (query tile, head) run in the order of `tiles` ((sequence, first row) pairs,
    longest first), each thread claiming the next from `next_task` when it is free
    (`schedule`): causal tile costs grow along the sequence, and round-robin dealing gave
    one of two threads 5/8 of the work at N = 2048.
    """
    n_q_heads, head_dim = q.shape[1], q.shape[3]
    n_kv_heads = k.shape[2] if slots_outer else k.shape[1]
    value_dim = v.shape[3]
    group = n_q_heads // n_kv_heads
    n_tasks = tiles.shape[0] * n_q_heads
    task = claim_next(next_task)
    if task >= n_tasks:
        return
    dtype = q.dtype
    q_scaled = np.empty((block_q, head_dim), dtype)
    scores_buffer = np.empty(block_q * block_k, dtype)
    pv_buffer = np.empty(block_q * value_dim, dtype)
    acc = np.empty((block_q, value_dim), dtype)
    row_max = np.empty(block_q, dtype)
    row_sum = np.empty(block_q, dtype)
    rescale = np.empty(block_q, dtype)
    paged = block_table.shape[0] > 0
    key_buffer = np.empty(block_k * head_dim if paged else 0, dtype)
    value_buffer = np.empty(block_k * value_dim if paged else 0, dtype)
    # `pairs` None: BLAS's products; else bfloat16's pair products (`bf16_products`),
    # whose branches Numba prunes from the BLAS kernels.
    products = None if pairs is None else bf16_products.tile_buffers(block_q, block_k,
                                                                     head_dim, value_dim)
    previous = flush_subnormals()  # the caller's MXCSR, put back below
    while task < n_tasks:
        h = task % n_q_heads
        sequence = tiles[task // n_q_heads, 0]
        row_start = tiles[task // n_q_heads, 1]
        b, index = sequences[sequence, BATCH], sequences[sequence, INDEX]
        row_stop = min(row_start + block_q, sequences[sequence, ROWS])
        first = sequences[sequence, ROW_BASE] + row_start
        last = sequences[sequence, ROW_BASE] + row_stop
        _query_tile(q[b, h, first:last], k, v, out[b, h, first:last], lse[b, h, first:last],
                    b, h // group, sequences[sequence, KEY_BASE], sequences[sequence, KEYS],
                    row_start, index * n_q_heads + h, scale, softcap, alibi_slopes[index, h],
                    window_left, window_right, sequences[sequence, BAND], row_offset,
                    col_offset, dropout_key, dropout_threshold, inv_keep, block_table,
                    page_size, slots_outer, block_k, slice_rows, q_scaled, scores_buffer,
                    pv_buffer, acc, row_max, row_sum, rescale, key_buffer, value_buffer,
                    products)
        task = claim_next(next_task)
    restore_subnormals(previous)


flush_if_stale(forward_kernel)
