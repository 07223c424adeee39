"""The backward kernels: FlashAttention-2's Algorithm 2, recomputing each tile of ``P``.

Per tile (rows ``i`` of query head ``h``, keys ``j``), with ``P = 2**(S - lse)`` rebuilt from
the saved ``lse`` and ``D = rowsum(dO * O)`` computed once up front:

    dV_j += P~^T dO_i              (P~ = P * keep / (1 - p), the dropped probabilities)
    dP    = dO_i V_j^T
    dS    = P * (dP * keep / (1 - p) - D_i) * softcap'
    dK_j += scale dS^T Q_i
    dQ_i += scale dS K_j

Two race-free schedules of `backward_kernel`, both deterministic (each output element is
summed by one thread in a fixed order):

* `HEADS`: one task per (sequence, kv head) runs every tile of its query heads, keys outer and
  queries inner, so ``dK_j``/``dV_j`` stay in local accumulators and ``dQ`` is summed into
  rows that no other task touches. Five matrix products per tile, the minimum. Used when
  there are enough (batch, kv head) pairs to keep every thread busy.
* `KEY_PARTS` then `sum_key_parts`: one task per key tile sums its ``dK``, ``dV`` and
  adds its share of ``dQ`` into a zeroed copy of ``dQ`` of its own (one per key tile), which
  a second pass sums in key-tile order. Five products, and a single long sequence uses
  every core; the parts cost a ``dQ`` of memory per key tile. Its sums are `HEADS`'s, bit
  for bit: each row of ``dQ`` gets one product per key tile, added from 0 in key-tile order
  either way.
* `KEY_TILES` then `QUERY_TILES`: one task per key tile (summing ``dK``, ``dV``) and then
  one per query tile (summing ``dQ``). Both passes recompute ``S`` and ``dP``, seven
  products per tile instead of five, where the parts would not fit their memory budget.

The products run on BLAS (``np.dot``), or for bfloat16 inputs on `bf16_products`' pair
products (`backward_kernel`'s `pairs`: P and dS rounded to bfloat16, as the GPU kernels
round them; S from the unscaled Q, scaled after, as Q times the scale is no bfloat16
value).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..options import BAND, BATCH, INDEX, KEY_BASE, KEYS, ROW_BASE, ROWS
from . import bf16_products, dropout
from .denormals import flush_subnormals, restore_subnormals
from .kept_products import redo_non_finite_columns, redo_non_finite_rows
from .kernel_cache import flush_if_stale
from .schedule import claim_next
from .tiles import (key_span, mask_tile, row_span, tile_is_fully_kept, tile_view,
                    transform_tile)
from .vector_math import FASTMATH, LOG2_E, exp2_nonpositive


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def row_terms_kernel(do, out, lse, delta, safe_lse):
    """``delta = rowsum(dO * O)`` from the given O (SPEC), and ``lse`` with +inf for rows
    with no kept key. One thread: a pass over dO and O, under 1% of the backward.

    +inf (not -inf) makes ``exp(s - lse)`` vanish on such rows: their scores are all -inf
    and ``-inf - -inf`` would be NaN.
    """
    batch, n_heads, n_q, value_dim = do.shape
    dtype = delta.dtype.type
    for bh in range(batch * n_heads):
        b, h = bh // n_heads, bh % n_heads
        for i in range(n_q):
            total = dtype(0.0)
            for d in range(value_dim):
                total += do[b, h, i, d] * out[b, h, i, d]
            delta[b, h, i] = total
            row_lse = lse[b, h, i]
            safe_lse[b, h, i] = np.inf if row_lse == -np.inf else row_lse


@njit(fastmath=FASTMATH)
def _tile_score_gradients(q_scaled, q_tile, k_tile, v_tile, do_tile, safe_lse, delta, bh,
                          row_start, col_start, band_offset, row_offset, col_offset, scale,
                          softcap, slope, window_left, window_right, dropout_key,
                          dropout_threshold, inv_keep, probs, score_grads, softcap_grad,
                          products):
    """Recompute one tile: `probs` gets ``P~`` (for dV), `score_grads` ``scale * dS``.

    ``P = exp(S - lse)`` with the caller's lse, never renormalised over this call's keys:
    a placed block (`AttentionOptions.row_offset`) holds only some of each row's keys."""
    n_rows, n_cols = probs.shape
    dtype = probs.dtype.type
    _recompute_scores(q_scaled, q_tile, k_tile, probs, softcap_grad, row_start, col_start,
                      band_offset, scale, softcap, slope, window_left, window_right, products)
    if products is not None:
        bf16_products.dot_nt(do_tile, v_tile, score_grads, *products)
    else:
        np.dot(do_tile, v_tile.T, score_grads)
    if dropout_threshold > 0 or softcap > 0:
        _general_score_gradients(probs, score_grads, softcap_grad, safe_lse, delta, bh,
                                 row_offset + row_start, col_offset + col_start, scale,
                                 softcap, dropout_key, dropout_threshold, inv_keep)
        return
    # The common case in one vectorised pass: P = exp(S - lse), scale * P * (dP - D).
    for r in range(n_rows):
        row_lse, row_delta = safe_lse[r], delta[r]
        for j in range(n_cols):
            p = _probability(probs[r, j], row_lse, dtype(0.0), dtype(LOG2_E))
            probs[r, j] = p
            score_grads[r, j] = p * (score_grads[r, j] - row_delta) * dtype(scale)


@njit(fastmath=FASTMATH)
def _recompute_scores(q_scaled, q_tile, k_tile, scores, softcap_grad, row_start, col_start,
                      band_offset, scale, softcap, slope, window_left, window_right,
                      products):
    """``S`` of one tile in natural units, SPEC steps 2-4 applied (`softcap_grad` gets
    ``1 - tanh^2`` when there is a softcap)."""
    n_rows, n_cols = scores.shape
    if products is not None:
        bf16_products.scaled_scores(q_tile, k_tile, scores, scale, *products)
    else:
        np.dot(q_scaled, k_tile.T, scores)
    if softcap > 0 or slope != 0:
        transform_tile(scores, softcap_grad, row_start, col_start, band_offset, softcap,
                       slope, window_left, window_right)
    elif not tile_is_fully_kept(row_start, row_start + n_rows, col_start, col_start + n_cols,
                                band_offset, window_left, window_right):
        mask_tile(scores, row_start, col_start, band_offset, window_left, window_right)


@njit(fastmath=FASTMATH)
def _probability(score, row_lse, zero, log2_e):
    """``exp(S - lse)``. ``S - lse <= 0`` up to rounding; clamping at `zero` (keeping NaN)
    makes a wrong `lse` from the caller give bounded probabilities instead of an overflow.
    `zero` and `log2_e` come in the tile's dtype, so float32 stays float32.

    The difference is taken in natural units and only then scaled to log2 units: near the
    row maximum ``S`` and ``lse`` are close, so it is exact, whereas rounding ``S * log2(e)``
    first costs half an ulp of ``|S|`` per score (5e-4 at scores near 1e4 in float32), a
    different error on every key of a row, which ``dS = P (dP - D)`` then no longer sums
    to zero over (test_large_float32_scores_do_not_overflow)."""
    x = score - row_lse
    return exp2_nonpositive((zero if x > zero else x) * log2_e)


@njit(fastmath=FASTMATH)
def _general_score_gradients(probs, score_grads, softcap_grad, safe_lse, delta, bh, row_start,
                             col_start, scale, softcap, dropout_key, dropout_threshold,
                             inv_keep):
    """The same with dropout and/or softcap (``dS`` times ``1 - tanh^2``); `row_start` and
    `col_start` are the global positions the dropout hash sees."""
    n_rows, n_cols = probs.shape
    dtype = probs.dtype.type
    for r in range(n_rows):
        row_lse, row_delta = safe_lse[r], delta[r]
        state = dropout.row_state(dropout_key, bh, row_start + r)
        for j in range(n_cols):
            p = _probability(probs[r, j], row_lse, dtype(0.0), dtype(LOG2_E))
            dp = score_grads[r, j]
            if dropout_threshold > 0:
                if dropout.keeps(state, col_start + j, dropout_threshold):
                    dp *= dtype(inv_keep)
                    probs[r, j] = p * dtype(inv_keep)
                else:  # times 0, not 0: a NaN P or dP stays NaN (SPEC step 6)
                    dp *= dtype(0.0)
                    probs[r, j] = p * dtype(0.0)
            else:
                probs[r, j] = p
            grad = p * (dp - row_delta) * dtype(scale)
            if softcap > 0:
                grad *= softcap_grad[r, j]
            score_grads[r, j] = grad


@njit(fastmath=FASTMATH)
def _scale_query_tile(q_tile, q_scaled, scale):
    """The query tile times ``scale``: scores in natural units (see `_probability`)."""
    dtype = q_tile.dtype.type
    factor = dtype(scale)
    for r in range(q_tile.shape[0]):
        for d in range(q_tile.shape[1]):
            q_scaled[r, d] = q_tile[r, d] * factor


@njit(fastmath=FASTMATH)
def _add_into(target, addend):
    for r in range(addend.shape[0]):
        for d in range(addend.shape[1]):
            target[r, d] += addend[r, d]


@njit(fastmath=FASTMATH)
def _copy_into(target, source):
    """``target[:] = source`` for equal shapes. A loop, because Numba's array assignment
    compiles its shape-mismatch error message, 2.3 s of every cold start (session 4)."""
    for r in range(source.shape[0]):
        for d in range(source.shape[1]):
            target[r, d] = source[r, d]


@njit(fastmath=FASTMATH)
def _tile(q_scaled, q_rows, do_rows, k_cols, v_cols, lse_rows, delta_rows, dk_cols, dv_cols,
          dq_rows, want_key_grads, want_query_grads, bh, row_start, col_start, band_offset,
          row_offset, col_offset, scale, softcap, slope, window_left, window_right, dropout_key,
          dropout_threshold, inv_keep, scratch, products):
    """One tile: recompute it, then add its share into the requested accumulators
    (`products`: `bf16_products.tile_buffers` for bfloat16's pair products, or None for
    BLAS)."""
    _, probs_buffer, grads_buffer, softcap_buffer, product_buffer, _, _ = scratch
    n_rows, n_cols = q_rows.shape[0], k_cols.shape[0]
    head_dim, value_dim = q_rows.shape[1], v_cols.shape[1]
    probs = tile_view(probs_buffer, n_rows, n_cols)
    grads = tile_view(grads_buffer, n_rows, n_cols)
    softcap_grad = tile_view(softcap_buffer, n_rows, n_cols) if softcap > 0 else grads
    _tile_score_gradients(q_scaled, q_rows, k_cols, v_cols, do_rows, lse_rows, delta_rows, bh,
                          row_start, col_start, band_offset, row_offset, col_offset, scale,
                          softcap, slope, window_left, window_right, dropout_key,
                          dropout_threshold, inv_keep, probs, grads, softcap_grad, products)
    # A tile the mask cuts multiplies masked entries (0, or NaN on a NaN row) too; see
    # `kept_products` for why redoing the non-finite rows of each product is exact.
    fully_kept = tile_is_fully_kept(row_start, row_start + n_rows, col_start,
                                    col_start + n_cols, band_offset, window_left, window_right)
    if want_key_grads:
        product = tile_view(product_buffer, n_cols, value_dim)
        if products is not None:
            bf16_products.dot_tn(probs, do_rows, product, *products)
        else:
            np.dot(probs.T, do_rows, product)
        if not fully_kept:
            redo_non_finite_columns(probs, do_rows, product, row_start, col_start,
                                    band_offset, window_left, window_right)
        _add_into(dv_cols, product)
        product = tile_view(product_buffer, n_cols, head_dim)
        if products is not None:
            bf16_products.dot_tn(grads, q_rows, product, *products)
        else:
            np.dot(grads.T, q_rows, product)
        if not fully_kept:
            redo_non_finite_columns(grads, q_rows, product, row_start, col_start,
                                    band_offset, window_left, window_right)
        _add_into(dk_cols, product)
    if want_query_grads:
        product = tile_view(product_buffer, n_rows, head_dim)
        if products is not None:
            bf16_products.dot_nn(grads, k_cols, product, *products)
        else:
            np.dot(grads, k_cols, product)
        if not fully_kept:
            redo_non_finite_rows(grads, k_cols, product, row_start, col_start, band_offset,
                                 window_left, window_right)
        _add_into(dq_rows, product)


@njit(fastmath=FASTMATH)
def _tile_or_slices(q, k, v, do, safe_lse, delta, b, h, kv_head, row_base, key_base, n_keys,
                    bh, row_start, row_stop, col_start, col_stop, q_scaled, dk_tile, dv_tile,
                    dq_tile, want_key_grads, want_query_grads, scale, softcap, slope,
                    window_left, window_right, band_offset, row_offset, col_offset,
                    dropout_key, dropout_threshold, inv_keep, slice_rows, scratch, products):
    """Tile rows ``[row_start, row_stop)`` x keys ``[col_start, col_stop)`` of one sequence
    (positions within it; its rows start at `row_base` and its `n_keys` keys at `key_base`
    of batch element `b`); `dk_tile`, `dv_tile` start at `col_start`, `dq_tile` and
    `q_scaled` at `row_start`.

    A tile the mask cuts runs in slices of `slice_rows` rows, each against only the keys
    it keeps, as in the forward kernel.
    """
    fully_kept = tile_is_fully_kept(row_start, row_stop, col_start, col_stop, band_offset,
                                    window_left, window_right)
    step = row_stop - row_start if fully_kept else slice_rows
    for slice_start in range(row_start, row_stop, step):
        slice_stop = min(slice_start + step, row_stop)
        keep_lo, keep_hi = key_span(slice_start, slice_stop, n_keys, band_offset, window_left,
                                    window_right)
        cols_lo, cols_hi = max(col_start, keep_lo), min(col_stop, keep_hi)
        if cols_lo >= cols_hi:
            continue
        first, last = slice_start - row_start, slice_stop - row_start
        rows_lo, rows_hi = row_base + slice_start, row_base + slice_stop
        _tile(q_scaled[first:last], q[b, h, rows_lo:rows_hi], do[b, h, rows_lo:rows_hi],
              k[b, kv_head, key_base + cols_lo:key_base + cols_hi],
              v[b, kv_head, key_base + cols_lo:key_base + cols_hi],
              safe_lse[b, h, rows_lo:rows_hi], delta[b, h, rows_lo:rows_hi],
              dk_tile[cols_lo - col_start:cols_hi - col_start],
              dv_tile[cols_lo - col_start:cols_hi - col_start], dq_tile[first:last],
              want_key_grads, want_query_grads, bh, slice_start, cols_lo, band_offset,
              row_offset, col_offset, scale, softcap, slope, window_left, window_right,
              dropout_key, dropout_threshold, inv_keep, scratch, products)


@njit(fastmath=FASTMATH)
def _key_tile(q, k, v, do, safe_lse, delta, dq, dk, dv, sequences, sequence, kv_head,
              col_start, want_key_grads, want_query_grads, scale, softcap, alibi_slopes,
              window_left, window_right, row_offset, col_offset, dropout_key,
              dropout_threshold, inv_keep, block_q, block_k, slice_rows, scratch, products):
    """All tiles of key tile `col_start` of one sequence (a row of `sequences`, see
    `forward_kernel.forward_kernel`) over the query heads sharing `kv_head`.

    Writes ``dK``/``dV`` rows of the key tile (`want_key_grads` is true here); with
    `want_query_grads` also adds into `dq`.
    """
    q_scaled, dk_acc, dv_acc = scratch[0], scratch[5], scratch[6]
    n_q_heads = q.shape[1]
    group = n_q_heads // k.shape[1]
    b, index = sequences[sequence, BATCH], sequences[sequence, INDEX]
    row_base, n_rows = sequences[sequence, ROW_BASE], sequences[sequence, ROWS]
    key_base, n_keys = sequences[sequence, KEY_BASE], sequences[sequence, KEYS]
    band_offset = sequences[sequence, BAND]
    col_stop = min(col_start + block_k, n_keys)
    dk_tile = dk_acc[:col_stop - col_start]
    dv_tile = dv_acc[:col_stop - col_start]
    dk_tile[:] = 0
    dv_tile[:] = 0
    row_lo, row_hi = row_span(col_start, col_stop, n_rows, band_offset, window_left,
                              window_right)
    for h in range(kv_head * group, (kv_head + 1) * group):
        slope = alibi_slopes[index, h]
        for row_start in range(max(row_lo, 0) // block_q * block_q, row_hi, block_q):
            row_stop = min(row_start + block_q, n_rows)
            _scale_query_tile(q[b, h, row_base + row_start:row_base + row_stop], q_scaled,
                              scale)
            _tile_or_slices(q, k, v, do, safe_lse, delta, b, h, kv_head, row_base, key_base,
                            n_keys, index * n_q_heads + h, row_start, row_stop, col_start,
                            col_stop, q_scaled, dk_tile, dv_tile,
                            dq[b, h, row_base + row_start:row_base + row_stop],
                            want_key_grads, want_query_grads, scale, softcap, slope,
                            window_left, window_right, band_offset, row_offset, col_offset,
                            dropout_key, dropout_threshold, inv_keep, slice_rows, scratch,
                            products)
    _copy_into(dk[b, kv_head, key_base + col_start:key_base + col_stop], dk_tile)
    _copy_into(dv[b, kv_head, key_base + col_start:key_base + col_stop], dv_tile)


@njit(fastmath=FASTMATH)
def _query_tile(q, k, v, do, safe_lse, delta, dq, sequences, sequence, h, row_start,
                want_key_grads, want_query_grads, scale, softcap, alibi_slopes, window_left,
                window_right, row_offset, col_offset, dropout_key, dropout_threshold,
                inv_keep, block_q, block_k, slice_rows, scratch, products):
    """``dQ`` of one query tile of one sequence, summed over its key tiles
    (`want_query_grads` is true and `want_key_grads` false here)."""
    q_scaled, dq_acc, unused_key_grads = scratch[0], scratch[5], scratch[6]
    n_q_heads = q.shape[1]
    kv_head = h // (n_q_heads // k.shape[1])
    b, index = sequences[sequence, BATCH], sequences[sequence, INDEX]
    row_base, n_rows = sequences[sequence, ROW_BASE], sequences[sequence, ROWS]
    key_base, n_keys = sequences[sequence, KEY_BASE], sequences[sequence, KEYS]
    band_offset = sequences[sequence, BAND]
    row_stop = min(row_start + block_q, n_rows)
    slope = alibi_slopes[index, h]
    _scale_query_tile(q[b, h, row_base + row_start:row_base + row_stop], q_scaled, scale)
    dq_tile = dq_acc[:row_stop - row_start]
    dq_tile[:] = 0
    col_lo, col_hi = key_span(row_start, row_stop, n_keys, band_offset, window_left,
                              window_right)
    for col_start in range(max(col_lo, 0) // block_k * block_k, col_hi, block_k):
        col_stop = min(col_start + block_k, n_keys)
        _tile_or_slices(q, k, v, do, safe_lse, delta, b, h, kv_head, row_base, key_base,
                        n_keys, index * n_q_heads + h, row_start, row_stop, col_start,
                        col_stop, q_scaled, unused_key_grads, unused_key_grads, dq_tile,
                        want_key_grads, want_query_grads, scale, softcap, slope, window_left,
                        window_right, band_offset, row_offset, col_offset, dropout_key,
                        dropout_threshold, inv_keep, slice_rows, scratch, products)
    _copy_into(dq[b, h, row_base + row_start:row_base + row_stop], dq_tile)


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


HEADS, KEY_TILES, QUERY_TILES, KEY_PARTS = 0, 1, 2, 3
"""The schedules of `backward_kernel` (see the module docstring)."""


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def backward_kernel(q, k, v, do, safe_lse, delta, dq, dq_parts, dk, dv, sequences, scale,
                    softcap, alibi_slopes, window_left, window_right, row_offset, col_offset,
                    dropout_key, dropout_threshold, inv_keep, block_q, block_k, slice_rows,
                    schedule, tiles, pairs, next_task):
    """One thread's share of one schedule, run on every thread by `threads.run`; each
    thread claims the next task from `next_task` when it is free (`schedule` module).

    `sequences` describes the call's sequences as for `forward_kernel` (a dense batch: one
    per batch element); `tiles` lists ``(sequence, first row or key)`` pairs.

    * `HEADS`: every gradient, one task per (sequence, kv head), the sequences in the order
      of `tiles`; `dq` must start zeroed. Claiming lets a core slowed by other work, or
      given a long sequence, run fewer of them.
    * `KEY_TILES`: ``dK`` and ``dV``, one task per (key tile, kv head) in `tiles`, longest
      first (causal key tiles shrink along the sequence).
    * `KEY_PARTS`: the same tasks, each also adding its key tile's share of ``dQ`` into
      ``dq_parts[key tile]`` (zeroed; `sum_key_parts` then sums them into `dq`).
    * `QUERY_TILES`: ``dQ``, one task per (query tile, query head) in `tiles`.

    Keys and rows of no sequence (padding) are not written: the launcher zeroes them.
    One kernel for the three (the flags below are run-time values, so every helper compiles
    once): three kernels took 11.6 s to compile, this one 6.0 s (bench/NOTES-cpu.md,
    session 4).
    """
    n_q_heads, n_kv_heads = q.shape[1], k.shape[1]
    want_key_grads = schedule != QUERY_TILES
    want_query_grads = schedule != KEY_TILES
    heads = n_q_heads if schedule == QUERY_TILES else n_kv_heads
    n_tasks = tiles.shape[0] * heads
    task = claim_next(next_task)
    if task >= n_tasks:
        return
    scratch = _scratch(block_q, block_k, q.shape[3], v.shape[3], softcap, q.dtype)
    # `pairs` None: BLAS's products; else bfloat16's pair products. Numba prunes the
    # branches on an argument's None, so the BLAS kernels compile no pair products.
    products = None if pairs is None else bf16_products.tile_buffers(block_q, block_k,
                                                                     q.shape[3], v.shape[3])
    previous = flush_subnormals()  # the caller's MXCSR, put back below
    while task < n_tasks:
        sequence, start = tiles[task // heads, 0], tiles[task // heads, 1]
        head = task % heads
        if schedule == QUERY_TILES:
            _query_tile(q, k, v, do, safe_lse, delta, dq, sequences, sequence, head, start,
                        want_key_grads, want_query_grads, scale, softcap, alibi_slopes,
                        window_left, window_right, row_offset, col_offset, dropout_key,
                        dropout_threshold, inv_keep, block_q, block_k, slice_rows, scratch,
                        products)
        else:
            if schedule == HEADS:
                first_tile = 0
                last_tile = (sequences[sequence, KEYS] + block_k - 1) // block_k
            else:
                first_tile = start // block_k
                last_tile = first_tile + 1
            for tile in range(first_tile, last_tile):
                query_grads = dq_parts[tile] if schedule == KEY_PARTS else dq
                _key_tile(q, k, v, do, safe_lse, delta, query_grads, dk, dv, sequences, sequence,
                          head, tile * block_k, want_key_grads, want_query_grads, scale,
                          softcap, alibi_slopes, window_left, window_right, row_offset,
                          col_offset, dropout_key, dropout_threshold, inv_keep, block_q,
                          block_k, slice_rows, scratch, products)
        task = claim_next(next_task)
    restore_subnormals(previous)


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def sum_key_parts(dq_parts, dq, next_task):
    """``dq = sum of dq_parts`` over the key tiles, in their order, from 0 (as `HEADS`
    adds them into a zeroed ``dQ``): one task per (batch, head) row block of 64 rows."""
    n_parts, batch, n_heads, n_q, head_dim = dq_parts.shape
    blocks = (n_q + 63) // 64
    n_tasks = batch * n_heads * blocks
    task = claim_next(next_task)
    while task < n_tasks:
        bh, block = task // blocks, task % blocks
        b, h = bh // n_heads, bh % n_heads
        for i in range(block * 64, min(block * 64 + 64, n_q)):
            row = dq[b, h, i]
            row[:] = 0
            for part in range(n_parts):
                addend = dq_parts[part, b, h, i]
                for d in range(head_dim):
                    row[d] += addend[d]
        task = claim_next(next_task)


flush_if_stale(row_terms_kernel, backward_kernel, sum_key_parts)
