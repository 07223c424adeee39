"""Per-tile pieces shared by the forward and backward kernels: which tiles the mask keeps,
and the score transformations of SPEC steps 2-4 applied to one tile in place.

Scores stay in natural units in both passes. Without softcap and ALiBi only the tiles the
mask cuts pass through here (`mask_tile`); with either option every tile does
(`transform_tile`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .vector_math import FASTMATH, tanh
from .widen import copy_row, copy_rows

UNLIMITED = -1  # tileattn.options.UNLIMITED, repeated so kernels see a compile-time constant


@njit
def key_span(row_start, row_stop, n_k, band_offset, window_left, window_right):
    """Keys ``[start, stop)`` of ``[0, n_k)`` that any of rows ``[row_start, row_stop)`` keeps.

    Row ``i`` keeps key ``j`` when ``-window_left <= j - (i + band_offset) <= window_right``
    (`tileattn.options.keeps`; `band_offset` is `AttentionOptions.band_offset`). The band
    is monotone, so the first row bounds it on the left and the last row on the right.
    Empty spans have start >= stop.
    """
    start, stop = 0, n_k
    if window_left != UNLIMITED:
        start = max(start, row_start + band_offset - window_left)
    if window_right != UNLIMITED:
        stop = min(stop, row_stop - 1 + band_offset + window_right + 1)
    return start, stop


@njit
def row_span(col_start, col_stop, n_q, band_offset, window_left, window_right):
    """Rows ``[start, stop)`` of ``[0, n_q)`` that keep any of keys ``[col_start, col_stop)``."""
    start, stop = 0, n_q
    if window_right != UNLIMITED:
        start = max(start, col_start - band_offset - window_right)
    if window_left != UNLIMITED:
        stop = min(stop, col_stop - 1 - band_offset + window_left + 1)
    return start, stop


@njit
def tile_is_fully_kept(row_start, row_stop, col_start, col_stop, band_offset, window_left,
                       window_right):
    """Whether the mask keeps every (row, key) pair of the tile, so it needs no masking."""
    if window_right != UNLIMITED and col_stop - 1 > row_start + band_offset + window_right:
        return False
    if window_left != UNLIMITED and col_start < row_stop - 1 + band_offset - window_left:
        return False
    return True


@njit
def kept_columns(row, col_start, n_cols, band_offset, window_left, window_right):
    """Tile-relative columns ``[lo, hi)`` that query `row` keeps (clipped); `row` and
    `col_start` index this call's rows and keys."""
    diagonal = row + band_offset - col_start
    lo, hi = 0, n_cols
    if window_left != UNLIMITED:
        lo = min(max(lo, diagonal - window_left), n_cols)
    if window_right != UNLIMITED:
        hi = max(min(hi, diagonal + window_right + 1), 0)
    return lo, max(lo, hi)


@njit(fastmath=FASTMATH)
def mask_tile(scores, row_start, col_start, band_offset, window_left, window_right):
    """Set the masked scores of a boundary tile to -inf (a select, so NaN cannot leak)."""
    n_rows, n_cols = scores.shape
    minus_inf = scores.dtype.type(-np.inf)
    for r in range(n_rows):
        lo, hi = kept_columns(row_start + r, col_start, n_cols, band_offset, window_left,
                              window_right)
        for j in range(lo):
            scores[r, j] = minus_inf
        for j in range(hi, n_cols):
            scores[r, j] = minus_inf


@njit(fastmath=FASTMATH)
def transform_tile(scores, softcap_grad, row_start, col_start, band_offset, softcap, slope,
                   window_left, window_right):
    """SPEC steps 2-4 on a tile of scores, in place.

    `softcap` 0 and `slope` 0 switch those steps off. Unless `softcap_grad` is empty (the
    forward's), a softcap also writes ``d capped / d raw = 1 - tanh^2`` into it (0 where
    masked, so a NaN score there cannot reach the gradient). An empty array rather than a
    flag: a literal flag compiled this function twice.
    """
    n_rows, n_cols = scores.shape
    dtype = scores.dtype.type
    want_softcap_grad = softcap > 0 and softcap_grad.shape[0] > 0
    cap = dtype(softcap)
    inverse_cap = dtype(1.0 / softcap) if softcap > 0 else dtype(0.0)
    alibi_slope = dtype(slope)
    minus_inf = dtype(-np.inf)
    # One plain loop per step, each free of branches and calls, so that each vectorises.
    for r in range(n_rows):
        row = row_start + r
        if cap > 0 and want_softcap_grad:
            for j in range(n_cols):
                capped = tanh(scores[r, j] * inverse_cap)
                scores[r, j] = cap * capped
                softcap_grad[r, j] = dtype(1.0) - capped * capped
        elif cap > 0:
            for j in range(n_cols):
                scores[r, j] = cap * tanh(scores[r, j] * inverse_cap)
        if alibi_slope != 0:
            diagonal = row + band_offset - col_start
            for j in range(n_cols):
                scores[r, j] -= alibi_slope * dtype(abs(diagonal - j))
        lo, hi = kept_columns(row, col_start, n_cols, band_offset, window_left, window_right)
        for j in range(lo):
            scores[r, j] = minus_inf
        for j in range(hi, n_cols):
            scores[r, j] = minus_inf
        if want_softcap_grad:
            for j in range(lo):
                softcap_grad[r, j] = dtype(0.0)
            for j in range(hi, n_cols):
                softcap_grad[r, j] = dtype(0.0)


@njit
def tile_view(buffer, n_rows, n_cols):
    """A C-contiguous ``(n_rows, n_cols)`` view of the front of a flat scratch buffer.

    Numba's ``np.dot`` (BLAS gemm) needs contiguous operands, which a ``[:n_rows, :n_cols]``
    slice of a 2-D buffer is not at the last, ragged tile.
    """
    return buffer[:n_rows * n_cols].reshape((n_rows, n_cols))


@njit
def key_value_rows(keys, values, b, kv_head, start, stop, block_table, page_size,
                   slots_outer, key_buffer, value_buffer):
    """Keys and values ``[start, stop)`` of kv head `kv_head` of batch element `b`, as
    C-contiguous ``(stop - start, D)`` and ``(stop - start, Dv)`` arrays for BLAS.

    Without a block table (``block_table.shape[0] == 0``) `keys` and `values` are
    ``(B, Hkv, N, D)`` and these are views. With one (paged K/V), they are the page pools,
    ``(num_pages, Hkv, page_size, D)``, or ``(num_pages, page_size, Hkv, D)`` when
    `slots_outer` (vLLM's layout, which a caller passes as a transposed view: read as
    stored, without a copy), and `start`, `stop` are logical keys: row ``j`` comes from page
    ``block_table[b, j // page_size]``, slot ``j % page_size``, gathered into the buffers.
    Only the pages of these keys are read. Page ids are clamped into the pool (and table
    columns into the table): with ``check_lengths=False`` nothing checked them, and a bad
    one must give wrong numbers, not a read out of bounds.

    Gathering a tile into scratch (rather than indexing rows inside the score loops) keeps
    the tile products on BLAS; it copies ``block_k x (D + Dv)`` elements per key tile,
    against ``block_q x block_k x (D + Dv)`` multiply-adds of the products. Keys and values
    in one pass: one table lookup per key. This gather is most of what paged K/V adds to
    a cold compile (forward and decode kernels 0.2-0.4 s each, float32, this machine).
    Tried and not kept: an LLVM ``prefetch`` of the page rows 4 keys ahead (pools in
    vLLM's order put each row of one kv head in a new 4 KiB page, which hardware prefetch
    does not follow); paged decode gained about 10% CPU time on a machine at load 50,
    within that machine's noise (docs/varlen.md, "Measured"). The decode kernel reads such
    pools through `decode_kernel._all_heads_tasks` instead, a page row for every kv head.
    """
    if block_table.shape[0] == 0:
        return keys[b, kv_head, start:stop], values[b, kv_head, start:stop]
    if not slots_outer and start % page_size + stop - start <= page_size:
        # The rows of one page, contiguous: read in place, as a contiguous cache is.
        page = page_of(block_table, b, start, page_size, keys.shape[0])
        slot = start % page_size
        return (keys[page, kv_head, slot:slot + stop - start],
                values[page, kv_head, slot:slot + stop - start])
    return gathered_rows(keys, values, b, kv_head, start, stop, block_table, page_size,
                         slots_outer, key_buffer, value_buffer, 0)


@njit(inline="always")
def page_of(block_table, b, key, page_size, n_pages):
    """The pool page that holds logical key `key` of batch element `b`: table columns
    clamped into the table and page ids into the pool's `n_pages`, so that an unchecked
    table gives wrong numbers, never a stray read."""
    page = block_table[b, min(key // page_size, block_table.shape[1] - 1)]
    return min(max(page, 0), n_pages - 1)


@njit
def gathered_rows(keys, values, b, kv_head, start, stop, block_table, page_size, slots_outer,
                  key_buffer, value_buffer, widen):
    """`key_value_rows` of paged K/V: the rows gathered into the buffers, widened from
    16-bit bits where the pools hold them (`widen.copy_row`)."""
    n_rows, head_dim, value_dim = stop - start, keys.shape[3], values.shape[3]
    key_rows = key_buffer[:n_rows * head_dim].reshape((n_rows, head_dim))
    value_rows = value_buffer[:n_rows * value_dim].reshape((n_rows, value_dim))
    j = 0
    while j < n_rows:
        key = start + j
        page = page_of(block_table, b, key, page_size, keys.shape[0])
        slot = key % page_size
        if widen == 0 or slots_outer:
            # Indices chosen outside the copy loops, so each is a plain vectorised copy of
            # one contiguous row (a layout test inside them: paged decode 1.7x the
            # contiguous time), and one indexing path for both layouts.
            outer, inner = (slot, kv_head) if slots_outer else (kv_head, slot)
            copy_row(keys[page, outer, inner], key_rows[j], widen)
            copy_row(values[page, outer, inner], value_rows[j], widen)
            j += 1
            continue
        # 16-bit rows of one kv head that follow one another in a page (those of one table
        # column, so also where unchecked lengths run past the table, whose last column is
        # reused) widen in one loop, as `widen.widen_rows` does a contiguous tile: a call a
        # row cost as much as the widening (bench/NOTES-cpu.md, session 41).
        run = min(page_size - slot, n_rows - j)
        copy_rows(keys[page, kv_head, slot:slot + run], key_rows[j:j + run], widen)
        copy_rows(values[page, kv_head, slot:slot + run], value_rows[j:j + run], widen)
        j += run
    return key_rows, value_rows
