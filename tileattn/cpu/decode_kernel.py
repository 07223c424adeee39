"""The decode forward: a few query rows against a long key cache, split over the keys.

With ``Nq`` of 1 to 32 rows the forward kernel has one task per query head, and each
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

`_group_tile` is `forward_kernel._tile` over a whole group's rows, with the same softmax,
masks, softcap, ALiBi, dropout (same hash positions: global row and key) and handling of
non-finite inputs per head, so every option behaves as in the forward kernel.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from ..options import BAND, BATCH, INDEX, KEY_BASE, KEYS, ROW_BASE, ROWS
from .denormals import flush_subnormals, restore_subnormals
from .forward_kernel import _apply_dropout, _softmax_update
from .kept_products import redo_non_finite_rows
from .kernel_cache import flush_if_stale
from .row_products import LANES, weights_times_values
from .schedule import claim_next
from .tiles import (gathered_rows, key_span, key_value_rows, mask_tile, page_of,
                    tile_is_fully_kept, tile_view, transform_tile)
from .vector_math import FASTMATH, maximum
from .widen import copy_row, widen_rows

MAX_LOOP_ROWS = 32
"""Up to this many rows per group, the two products of a tile are plain loops that read
each K and V row once for all rows, instead of BLAS (whose sgemm packs its operands first,
the likely cost for so few rows; not profiled). 2 threads, B = 1, D = 128, Nk = 32768:
Hq = Hkv = 32, Nq = 8 (causal) 95 -> 79 ms; Hq = 32, Hkv = 8, Nq = 1 21 -> 17 ms
(bench/NOTES-cpu.md, session 5). 16 rows, Nk = 16384: Hq = Hkv = 8, Nq = 16 18.0 -> 13.4 ms,
Hq = 32, Hkv = 8, Nq = 4 17.9 -> 13.3 ms. Since the loops were register-blocked (session
18) they also beat sgemm at 17-32 rows (one Zen 3 core, 512 keys of D = 128, median
GFLOP/s, loops against np.dot: S = Q K^T 51-67 / 28-48, P V 37-62 / 25-43); at 48 rows
they are even and at 64 slower (session 19)."""


@njit(fastmath=FASTMATH)
def _rows_times_keys(rows, keys, out):
    """``out = rows @ keys.T`` as plain loops, each key row read once for all rows.

    Two rows times four keys a pass: eight independent sums over D share two loads of the
    rows and four of the keys. One row times four keys (session 17, 1.2-1.75x one key a
    pass) kept four chains of adds, too few to fill both FMA pipes. 4-16 rows over 512 keys
    of D = 128, one Zen 3 core, best / median GFLOP/s: 51-58 / 43-56 -> 63-68 / 53-60 (four
    rows x two keys alike; four x four and three x four spill AVX2's 16 registers, 32-45;
    bench/NOTES-cpu.md, session 18: `bench/experiments/decode_products_cpu.py`)."""
    n_rows, n_keys, depth = rows.shape[0], keys.shape[0], rows.shape[1]
    n_pairs = n_rows // 2 * 2
    n_fours = n_keys // 4 * 4
    zero = rows.dtype.type(0.0)
    for j in range(0, n_fours, 4):
        for r in range(0, n_pairs, 2):
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = zero
            for d in range(depth):
                x, y = rows[r, d], rows[r + 1, d]
                k0, k1, k2, k3 = keys[j, d], keys[j + 1, d], keys[j + 2, d], keys[j + 3, d]
                a0 += x * k0
                a1 += x * k1
                a2 += x * k2
                a3 += x * k3
                b0 += y * k0
                b1 += y * k1
                b2 += y * k2
                b3 += y * k3
            out[r, j], out[r, j + 1], out[r, j + 2], out[r, j + 3] = a0, a1, a2, a3
            out[r + 1, j], out[r + 1, j + 1], out[r + 1, j + 2], out[r + 1, j + 3] = \
                b0, b1, b2, b3
        for r in range(n_pairs, n_rows):
            a0 = a1 = a2 = a3 = zero
            for d in range(depth):
                x = rows[r, d]
                a0 += x * keys[j, d]
                a1 += x * keys[j + 1, d]
                a2 += x * keys[j + 2, d]
                a3 += x * keys[j + 3, d]
            out[r, j], out[r, j + 1], out[r, j + 2], out[r, j + 3] = a0, a1, a2, a3
    for j in range(n_fours, n_keys):
        for r in range(n_rows):
            total = zero
            for d in range(depth):
                total += rows[r, d] * keys[j, d]
            out[r, j] = total


@njit(fastmath=FASTMATH)
def _weights_times_values(weights, values, out):
    """``out = weights @ values`` as plain loops, each value row read once for all rows.

    Eight keys per pass over an output row: the loop's loads and stores of the output row,
    not the multiply-adds, bound it, and eight keys halve them against four (4-16 rows over
    512 keys of D = 128, one Zen 3 core, best / median GFLOP/s: 43-54 / 36-46 -> 46-60 /
    38-49, a smaller gain than the loads suggest; session 18). Two rows a pass did not
    vectorise (7-12 GFLOP/s): LLVM gives up on a loop that needs more than
    eight run-time checks that its stores miss its loads, and two output rows against four
    value rows need nine; one row against eight value rows needs eight."""
    out[:] = 0
    n_rows, n_keys, width = weights.shape[0], values.shape[0], values.shape[1]
    n_eights = n_keys // 8 * 8
    for j in range(0, n_eights, 8):
        for r in range(n_rows):
            w0, w1, w2, w3 = weights[r, j], weights[r, j + 1], weights[r, j + 2], weights[r, j + 3]
            w4, w5, w6, w7 = (weights[r, j + 4], weights[r, j + 5], weights[r, j + 6],
                              weights[r, j + 7])
            for d in range(width):
                out[r, d] += (w0 * values[j, d] + w1 * values[j + 1, d]
                              + w2 * values[j + 2, d] + w3 * values[j + 3, d]
                              + w4 * values[j + 4, d] + w5 * values[j + 5, d]
                              + w6 * values[j + 6, d] + w7 * values[j + 7, d])
    for j in range(n_eights, n_keys):
        for r in range(n_rows):
            weight = weights[r, j]
            for d in range(width):
                out[r, d] += weight * values[j, d]


def _group_weights_times_values(weights, values, out):
    """``out = weights @ values`` for a group's few rows (at most MAX_LOOP_ROWS): float32
    tiles of contiguous rows at least 64 wide that fill whole vectors (D 64, 80, 96, ...,
    128, 256) in `row_products`' register blocks, others as the plain loops of
    `_weights_times_values`. One Zen 4 core, 1-16 rows over 256 keys, blocks / loops: D 64
    1.3-1.9x, 96-256 1.0-1.5x; D 48 (three blocks of 16 columns, two chains of sums each)
    0.84-0.95x, D 32 level; blocks beside loops for the last columns 0.55-0.75x at D 24 and
    40, level at 72-120."""


@overload(_group_weights_times_values, jit_options={"nogil": True, "fastmath": FASTMATH})
def _group_weights_times_values_typed(weights, values, out):
    if not (weights.dtype == values.dtype == out.dtype == types.float32):
        def loops(weights, values, out):
            _weights_times_values(weights, values, out)
        return loops

    def blocks(weights, values, out):
        width = values.shape[1]
        if width % LANES == 0 and width >= 64 and \
                weights.strides[1] == values.strides[1] == out.strides[1] == 4:
            weights_times_values(weights, values, out)
        else:
            _weights_times_values(weights, values, out)
    return blocks


@njit(fastmath=FASTMATH)
def _group_tile(q_scaled, k_tile, v_tile, acc, row_max, row_sum, rescale, index, first_head,
                n_q_heads, col_start, n_q, softcap, alibi_slopes, window_left, window_right,
                band_offset, row_offset, col_offset, dropout_key, dropout_threshold, inv_keep,
                scores_buffer, pv_buffer):
    """`forward_kernel._tile` for the ``group * n_q`` rows of a GQA group (head-major) of
    sequence `index` (its ALiBi row and dropout heads): one matrix product per key tile for
    the whole group, the masks and options per head."""
    n_rows, n_cols = q_scaled.shape[0], k_tile.shape[0]
    group = n_rows // n_q
    scores = tile_view(scores_buffer, n_rows, n_cols)
    if n_rows <= MAX_LOOP_ROWS:
        _rows_times_keys(q_scaled, k_tile, scores)
    else:
        np.dot(q_scaled, k_tile.T, scores)
    fully_kept = tile_is_fully_kept(0, n_q, col_start, col_start + n_cols, band_offset,
                                    window_left, window_right)
    for g in range(group):
        head_scores = scores[g * n_q:(g + 1) * n_q]
        slope = alibi_slopes[index, first_head + g]
        if softcap > 0 or slope != 0:
            transform_tile(head_scores, head_scores[:0], 0, col_start, band_offset, softcap,
                           slope, window_left, window_right)
        elif not fully_kept:
            mask_tile(head_scores, 0, col_start, band_offset, window_left, window_right)
    _softmax_update(scores, row_max, row_sum, rescale)
    if dropout_threshold > 0:
        for g in range(group):
            _apply_dropout(scores[g * n_q:(g + 1) * n_q], index * n_q_heads + first_head + g,
                           row_offset, col_offset + col_start, dropout_key, dropout_threshold,
                           inv_keep)
    pv = tile_view(pv_buffer, n_rows, v_tile.shape[1])
    if n_rows <= MAX_LOOP_ROWS:
        _group_weights_times_values(scores, v_tile, pv)
    else:
        np.dot(scores, v_tile, pv)
    if not fully_kept:
        for g in range(group):
            redo_non_finite_rows(scores[g * n_q:(g + 1) * n_q], v_tile,
                                 pv[g * n_q:(g + 1) * n_q], 0, col_start, band_offset,
                                 window_left, window_right)
    for r in range(n_rows):
        for d in range(pv.shape[1]):
            acc[r, d] = acc[r, d] * rescale[r] + pv[r, d]


IN_PLACE_PAGE_ROWS = 64
"""Float pools of pages at least this long (a kv head's rows of a page contiguous) are read
in place, a key tile a page at most (`decode_kernel`), instead of gathered into the scratch
a row at a time. One thread, H8 over 8k keys, D 128, Nq 1, float32, ms (this host moves
~15 % between runs): contiguous 2.7-3.3; pages of 256 gathered 4.9-5.4, in place 3.6-3.9;
pages of 64 5.4-5.9 and 5.0-5.4. Shorter tiles cost their per-tile work (16 keys a tile:
2.0x the time of the default tiles over a contiguous cache), so shorter pages keep the
gather (bench/NOTES-cpu.md, session 41)."""


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def decode_kernel(q, k, v, partial_acc, partial_max, partial_sum, out, lse, sequences,
                  block_table, page_size, slots_outer, scale, softcap, alibi_slopes,
                  window_left, window_right, row_offset, col_offset, dropout_key,
                  dropout_threshold, inv_keep, block_k, split_size, widen, next_task):
    """Fill the partial state of every (sequence, kv head, split): one thread's share, run
    on every thread by `threads.run`.

    `sequences` and the paging arguments are those of `forward_kernel.forward_kernel` (a
    dense batch is one sequence per batch element; paged K/V is read through
    `tiles.key_value_rows`). `partial_acc` is (splits, B, Hq, Nq, Dv), `partial_max` and
    `partial_sum` (splits, B, Hq, Nq). Split ``s`` of a sequence takes keys
    ``[start + s * split_size, ...)`` of the keys its rows keep, ``[start, stop)``; a split
    with no keys leaves max -inf, sum 0, accumulator 0. Rows of no sequence are not written.

    A call of one split passes partial state of no splits (shape ``(0, ...)``): each row
    is then finished here into `out` (B, Hq, Nq, Dv) and `lse` (B, Hq, Nq) by the code
    that `merge_kernel` finishes a row with (`_finish_row`), so with the same bits, and
    the call saves the partial arrays and the merge's dispatch (microseconds of a small
    call's host time). Otherwise `out` and `lse` are not written here.

    `widen` (0, or 1 for float16 and 2 for bfloat16 given as their bits: uint16 k and v,
    or page pools): each key tile is widened into the float32 scratch before its products
    (`widen.widen_rows`; paged rows as they are gathered, `widen.copy_row`), so K and V are
    read from memory at two bytes an element and never copied whole.
    """
    kv_heads = k.shape[2] if slots_outer else k.shape[1]
    if all_heads(block_table, slots_outer, q.shape[1] // kv_heads, q.shape[2]):
        _all_heads_tasks(q, k, v, partial_acc, partial_max, partial_sum, out, lse, sequences,
                         block_table, page_size, scale, softcap, alibi_slopes, window_left,
                         window_right, row_offset, col_offset, dropout_key, dropout_threshold,
                         inv_keep, block_k, split_size, widen, next_task)
        return
    n_q_heads, head_dim = q.shape[1], q.shape[3]
    n_kv_heads = k.shape[2] if slots_outer else k.shape[1]
    value_dim = v.shape[3]
    group = n_q_heads // n_kv_heads
    max_rows = group * q.shape[2]
    finishes = partial_acc.shape[0] == 0
    n_splits = 1 if finishes else partial_acc.shape[0]
    n_tasks = n_splits * sequences.shape[0] * n_kv_heads
    task = claim_next(next_task)
    if task >= n_tasks:
        return
    dtype = q.dtype
    q_factor = dtype.type(scale)
    q_scaled_buffer = np.empty((max_rows, head_dim), dtype)
    scores_buffer = np.empty(max_rows * block_k, dtype)
    pv_buffer = np.empty(max_rows * value_dim, dtype)
    acc_buffer = np.empty((max_rows, value_dim), dtype)
    max_buffer = np.empty(max_rows, dtype)
    sum_buffer = np.empty(max_rows, dtype)
    rescale_buffer = np.empty(max_rows, dtype)
    row_buffer = np.empty(value_dim if finishes else 0, dtype)
    gathers = block_table.shape[0] > 0 or widen > 0
    # Pages in the compute dtype, each kv head's rows of a page contiguous, and pages of at
    # least IN_PLACE_PAGE_ROWS: key tiles stop at page ends and are read in place
    # (`tiles.key_value_rows`) instead of gathered into the scratch a row at a time.
    in_place_pages = (block_table.shape[0] > 0 and widen == 0 and slots_outer == 0
                      and page_size >= IN_PLACE_PAGE_ROWS)
    key_buffer = np.empty(block_k * head_dim if gathers else 0, dtype)
    value_buffer = np.empty(block_k * value_dim if gathers else 0, dtype)
    previous = flush_subnormals()  # the caller's MXCSR, put back below
    while task < n_tasks:
        split = task % n_splits
        sequence, kv_head = divmod(task // n_splits, n_kv_heads)
        task = claim_next(next_task)
        b, index = sequences[sequence, BATCH], sequences[sequence, INDEX]
        row_base, n_q = sequences[sequence, ROW_BASE], sequences[sequence, ROWS]
        key_base, n_keys = sequences[sequence, KEY_BASE], sequences[sequence, KEYS]
        band_offset = sequences[sequence, BAND]
        if n_q == 0:
            continue
        n_rows = group * n_q
        q_scaled, acc = q_scaled_buffer[:n_rows], acc_buffer[:n_rows]
        row_max, row_sum = max_buffer[:n_rows], sum_buffer[:n_rows]
        rescale = rescale_buffer[:n_rows]
        first_head = kv_head * group
        _start_group(q, b, first_head, row_base, n_q, q_factor, q_scaled, acc, row_max,
                     row_sum)
        split_start, split_stop = _split_keys(n_q, n_keys, band_offset, window_left,
                                              window_right, split, split_size)
        col_start = split_start
        while col_start < split_stop:
            col_stop = min(col_start + block_k, split_stop)
            if in_place_pages:  # tiles end at page ends, so that they are read in place
                col_stop = min(col_stop, ((key_base + col_start) // page_size + 1)
                               * page_size - key_base)
            k_tile, v_tile = key_value_tiles(k, v, b, kv_head, key_base + col_start,
                                             key_base + col_stop, block_table, page_size,
                                             slots_outer, key_buffer, value_buffer, widen)
            _group_tile(q_scaled, k_tile, v_tile, acc, row_max, row_sum, rescale, index,
                        first_head, n_q_heads, col_start, n_q, softcap, alibi_slopes,
                        window_left, window_right, band_offset, row_offset, col_offset,
                        dropout_key, dropout_threshold, inv_keep, scores_buffer, pv_buffer)
            col_start = col_stop
        _store_group(acc, row_max, row_sum, b, first_head, group, row_base, n_q, split,
                     out, lse, partial_acc, partial_max, partial_sum, row_buffer)
    restore_subnormals(previous)


def key_value_tiles(k, v, b, kv_head, start, stop, block_table, page_size, slots_outer,
                    key_buffer, value_buffer, widen):
    """Keys and values ``[start, stop)`` of one kv head in the compute dtype:
    `tiles.key_value_rows` for K and V of that dtype; for 16-bit bits (uint16 K and V or
    page pools, `widen` 1 float16 or 2 bfloat16) the rows' float32 values in the scratch
    buffers."""


@overload(key_value_tiles, jit_options={"nogil": True})
def _key_value_tiles(k, v, b, kv_head, start, stop, block_table, page_size, slots_outer,
                     key_buffer, value_buffer, widen):
    if k.dtype != types.uint16:
        def as_stored(k, v, b, kv_head, start, stop, block_table, page_size, slots_outer,
                      key_buffer, value_buffer, widen):
            return key_value_rows(k, v, b, kv_head, start, stop, block_table, page_size,
                                  slots_outer, key_buffer, value_buffer)
        return as_stored

    def widened(k, v, b, kv_head, start, stop, block_table, page_size, slots_outer,
                key_buffer, value_buffer, widen):
        if block_table.shape[0] > 0:
            return gathered_rows(k, v, b, kv_head, start, stop, block_table, page_size,
                                 slots_outer, key_buffer, value_buffer, widen)
        n_rows, head_dim, value_dim = stop - start, k.shape[3], v.shape[3]
        widen_rows(k[b, kv_head, start:stop], key_buffer, widen == 2)
        widen_rows(v[b, kv_head, start:stop], value_buffer, widen == 2)
        return (key_buffer[:n_rows * head_dim].reshape((n_rows, head_dim)),
                value_buffer[:n_rows * value_dim].reshape((n_rows, value_dim)))

    return widened


@njit(fastmath=FASTMATH)
def _start_group(q, b, first_head, row_base, n_q, q_factor, q_scaled, acc, row_max, row_sum):
    """A group's packed rows before its keys: the scaled queries of heads `first_head` ..
    (the same scaled query as the forward and backward kernels, so all round alike), and
    an empty softmax state."""
    for g in range(q_scaled.shape[0] // n_q):
        for r in range(n_q):
            for d in range(q_scaled.shape[1]):
                q_scaled[g * n_q + r, d] = q[b, first_head + g, row_base + r, d] * q_factor
    acc[:] = 0
    row_max[:] = -np.inf
    row_sum[:] = 0


@njit
def _split_keys(n_q, n_keys, band_offset, window_left, window_right, split, split_size):
    """``[start, stop)``: split `split`'s keys of the keys a sequence's rows keep."""
    key_lo, key_hi = key_span(0, n_q, n_keys, band_offset, window_left, window_right)
    key_start = max(key_lo, 0)
    key_stop = max(min(key_hi, n_keys), key_start)
    split_start = key_start + split * split_size
    return split_start, min(split_start + split_size, key_stop)


@njit(fastmath=FASTMATH)
def _store_group(acc, row_max, row_sum, b, first_head, group, row_base, n_q, split, out, lse,
                 partial_acc, partial_max, partial_sum, row_buffer):
    """A group's rows after its keys: finished into `out` and `lse` where the call has one
    split (no partial state), else the split's partial state."""
    finishes = partial_acc.shape[0] == 0
    for g in range(group):
        for r in range(n_q):
            row, packed = row_base + r, g * n_q + r
            if finishes:
                lse[b, first_head + g, row] = _finish_row(
                    row_max[packed:packed + 1], row_sum[packed:packed + 1],
                    acc[packed:packed + 1], out[b, first_head + g, row], row_buffer)
                continue
            partial_max[split, b, first_head + g, row] = row_max[packed]
            partial_sum[split, b, first_head + g, row] = row_sum[packed]
            for d in range(acc.shape[1]):
                partial_acc[split, b, first_head + g, row, d] = acc[packed, d]


@njit
def all_heads(block_table, slots_outer, group, n_q):
    """Whether a decode call reads its pages for every kv head at once (`_all_heads_tasks`):
    pools stored slots outermost, and a group's packed rows few enough for the plain-loop
    products, whose tiles are read about as fast as memory delivers them. More rows make a
    tile's products the cost (BLAS), which the all-heads tiles, small enough to hold every
    head, would slow: B1 Hq 32 Hkv 8 Nq 256 D128 over 4096 keys 98 -> 157-169 ms."""
    return block_table.shape[0] > 0 and slots_outer != 0 and group * n_q <= MAX_LOOP_ROWS


ALL_HEADS_TILE_BYTES = 1 << 18
ALL_HEADS_MIN_KEYS = 32
"""The all-heads path's key tiles (`_all_heads_tasks`) hold every kv head's K and V rows of
their keys in ALL_HEADS_TILE_BYTES at most, half of a 512 KiB L2, but no fewer than
ALL_HEADS_MIN_KEYS keys: MHA's 32 heads of D 128 left 8 keys a tile, whose per-tile work
cost (B1 32/32 D128 over 4096 keys, page 16: 0.70-0.75 of contiguous at 8 keys, 0.88-0.94 at
32; 1 MiB tiles for every shape slowed 8/2 D64; bench/NOTES-cpu.md session 28)."""


@njit(fastmath=FASTMATH)
def _all_heads_tasks(q, k, v, partial_acc, partial_max, partial_sum, out, lse, sequences,
                     block_table, page_size, scale, softcap, alibi_slopes, window_left,
                     window_right, row_offset, col_offset, dropout_key, dropout_threshold,
                     inv_keep, block_k, split_size, widen, next_task):
    """`decode_kernel` for page pools stored ``(num_pages, page_size, Hkv, D)`` (vLLM's and
    flash-attn's order): a task is one (sequence, key split) with every kv head. In that
    order one kv head's rows of a page lie ``Hkv * D`` elements apart, a new 4 KiB memory
    page per row for Hkv * D * itemsize >= 4 KiB, which the hardware prefetcher does not
    follow: a task per kv head gathered its tiles at half the bandwidth of a contiguous
    cache (2 threads, B1 Hq 32 Hkv 8 D128 over 16k keys: 14.3 ms against 7.0,
    bench/NOTES-cpu.md session 28). Here each key row of a page is read once for all kv
    heads, contiguously, into one tile per head, and each head's group runs `_group_tile`
    on its own. The key splits then count one task per sequence (`decode.plan`)."""
    n_q_heads, head_dim = q.shape[1], q.shape[3]
    n_kv_heads, value_dim = k.shape[2], v.shape[3]
    group = n_q_heads // n_kv_heads
    max_rows = group * q.shape[2]
    finishes = partial_acc.shape[0] == 0
    n_splits = 1 if finishes else partial_acc.shape[0]
    n_tasks = n_splits * sequences.shape[0]
    task = claim_next(next_task)
    if task >= n_tasks:
        return
    dtype = q.dtype
    q_factor = dtype.type(scale)
    tile_keys = ALL_HEADS_TILE_BYTES // (n_kv_heads * (head_dim + value_dim) * q.itemsize)
    tile_keys = min(block_k, max(ALL_HEADS_MIN_KEYS, tile_keys))
    keys_all = np.empty((n_kv_heads, tile_keys, head_dim), dtype)
    values_all = np.empty((n_kv_heads, tile_keys, value_dim), dtype)
    q_scaled = np.empty((n_kv_heads, max_rows, head_dim), dtype)
    acc = np.empty((n_kv_heads, max_rows, value_dim), dtype)
    row_max = np.empty((n_kv_heads, max_rows), dtype)
    row_sum = np.empty((n_kv_heads, max_rows), dtype)
    rescale = np.empty(max_rows, dtype)
    scores_buffer = np.empty(max_rows * tile_keys, dtype)
    pv_buffer = np.empty(max_rows * value_dim, dtype)
    row_buffer = np.empty(value_dim if finishes else 0, dtype)
    previous = flush_subnormals()  # the caller's MXCSR, put back below
    while task < n_tasks:
        split, sequence = task % n_splits, task // n_splits
        task = claim_next(next_task)
        b, index = sequences[sequence, BATCH], sequences[sequence, INDEX]
        row_base, n_q = sequences[sequence, ROW_BASE], sequences[sequence, ROWS]
        key_base, n_keys = sequences[sequence, KEY_BASE], sequences[sequence, KEYS]
        band_offset = sequences[sequence, BAND]
        if n_q == 0:
            continue
        n_rows = group * n_q
        for h in range(n_kv_heads):
            _start_group(q, b, h * group, row_base, n_q, q_factor, q_scaled[h, :n_rows],
                         acc[h, :n_rows], row_max[h, :n_rows], row_sum[h, :n_rows])
        split_start, split_stop = _split_keys(n_q, n_keys, band_offset, window_left,
                                              window_right, split, split_size)
        for col_start in range(split_start, split_stop, tile_keys):
            n_cols = min(col_start + tile_keys, split_stop) - col_start
            for j in range(n_cols):
                key = key_base + col_start + j
                page = page_of(block_table, b, key, page_size, k.shape[0])
                slot = key % page_size
                for h in range(n_kv_heads):
                    copy_row(k[page, slot, h], keys_all[h, j], widen)
                    copy_row(v[page, slot, h], values_all[h, j], widen)
            for h in range(n_kv_heads):
                _group_tile(q_scaled[h, :n_rows], keys_all[h, :n_cols], values_all[h, :n_cols],
                            acc[h, :n_rows], row_max[h, :n_rows], row_sum[h, :n_rows],
                            rescale[:n_rows], index, h * group, n_q_heads, col_start, n_q,
                            softcap, alibi_slopes, window_left, window_right, band_offset,
                            row_offset, col_offset, dropout_key, dropout_threshold, inv_keep,
                            scores_buffer, pv_buffer)
        for h in range(n_kv_heads):
            _store_group(acc[h, :n_rows], row_max[h, :n_rows], row_sum[h, :n_rows], b,
                         h * group, group, row_base, n_q, split, out, lse, partial_acc,
                         partial_max, partial_sum, row_buffer)
    restore_subnormals(previous)


@njit(fastmath=FASTMATH)
def _finish_row(row_maxima, row_sums, row_accs, out_row, row):
    """One row's output from its splits' partial state (`row_maxima`, `row_sums` of
    (splits,), `row_accs` of (splits, Dv)), written into `out_row`; returns its lse.
    Finishes the row as `forward_kernel._query_tile` does (no kept key: 0 and -inf; NaN
    anywhere: NaN). `row` is scratch of Dv elements."""
    n_splits, value_dim = row_accs.shape
    dtype = out_row.dtype.type
    row_max = row_maxima[0]
    for s in range(1, n_splits):
        row_max = maximum(row_max, row_maxima[s])
    # All splits empty: max -inf, and exp(-inf - 0) = 0 gives total 0.
    safe_max = dtype(0.0) if row_max == -np.inf else row_max
    total = dtype(0.0)
    row[:] = 0
    for s in range(n_splits):
        weight = np.exp(row_maxima[s] - safe_max)
        total += row_sums[s] * weight
        # A split that kept nothing holds exact zeros (its masked terms never reach the
        # accumulator: `kept_products`), so its 0 weight adds 0; a NaN in a split's kept
        # values reaches the row, as in one pass.
        for d in range(value_dim):
            row[d] += row_accs[s, d] * weight
    if total > 0:
        inverse = dtype(1.0) / total
        for d in range(value_dim):
            out_row[d] = row[d] * inverse
        return row_max + np.log(total)
    if total == 0:
        out_row[:] = 0
        return dtype(-np.inf)
    out_row[:] = np.nan
    return dtype(np.nan)


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def merge_kernel(partial_acc, partial_max, partial_sum, out, lse):
    """Combine the splits' partial state into `out` (B, Hq, Nq, Dv) and `lse` (B, Hq, Nq),
    a row at a time (`_finish_row`)."""
    n_splits, batch, n_q_heads, n_q, value_dim = partial_acc.shape
    row = np.empty(value_dim, out.dtype)
    for b in range(batch):
        for h in range(n_q_heads):
            for i in range(n_q):
                lse[b, h, i] = _finish_row(partial_max[:, b, h, i], partial_sum[:, b, h, i],
                                           partial_acc[:, b, h, i], out[b, h, i], row)


flush_if_stale(decode_kernel, merge_kernel)
