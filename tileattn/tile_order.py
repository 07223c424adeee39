"""The order of a call's tiles, longest first, for the CPU and GPU launchers.

A causal or windowed tile's cost grows with the keys its rows keep, and sequences of a
variable-length call differ in length: running the tiles with the most kept (row, key) pairs
first lets the short ones fill in at the end instead of one long tile starting last
(bench/NOTES-cpu.md, v5). The CPU takes tiles in that order (`tile_list`); the GPU keeps
each sequence's tiles together, the costliest sequences first (`tile_list_by_estimate`),
so that blocks resident at once share K and V in L2. Plain NumPy, run by the host before a
launch.
"""

from __future__ import annotations

import numpy as np

from .options import UNLIMITED


def kept_pairs_per_row(n_rows, n_cols, band_offset, window_left, window_right):
    """How many keys each of `n_rows` query rows keeps (int64 array; the band of
    `tileattn.options.keeps`, `band_offset` from `AttentionOptions.band_offset`)."""
    diagonal = np.arange(n_rows, dtype=np.int64) + band_offset
    lo = np.zeros(n_rows, np.int64)
    hi = np.full(n_rows, n_cols, np.int64)
    if window_left != UNLIMITED:
        lo = np.maximum(diagonal - window_left, 0)
    if window_right != UNLIMITED:
        hi = np.minimum(diagonal + window_right + 1, n_cols)
    return np.maximum(hi - lo, 0)


def longest_first(n_tiles, block, n_rows, n_cols, band_offset, window_left, window_right):
    """Query-tile indices (int64), the most kept (row, key) pairs first (stable).

    For key tiles, swap the roles: ``longest_first(n_k_tiles, block_k, n_k, n_q,
    -band_offset, window_right, window_left)`` (key ``j`` is kept by rows
    ``j - band_offset - window_right`` to ``j - band_offset + window_left``, the same band
    transposed). NumPy, in the launcher: the order is the kernels' input, and compiling
    Numba's argsort cost a second.
    """
    cost = tile_costs(n_tiles, block, n_rows, n_cols, band_offset, window_left, window_right)
    return np.argsort(-cost, kind="stable").astype(np.int64)


def tile_costs(n_tiles, block, n_rows, n_cols, band_offset, window_left, window_right):
    """Kept (row, key) pairs of each tile of `block` rows, plus a fixed 1 per tile: the
    fixed cost keeps empty and tiny tiles last."""
    pairs = kept_pairs_per_row(n_rows, n_cols, band_offset, window_left, window_right)
    starts = np.arange(n_tiles, dtype=np.int64) * block
    return np.add.reduceat(pairs, starts) + 1 if n_tiles else np.zeros(0, np.int64)


def _pairs_of_every_row(rows, cols, bands, window_left, window_right):
    """Kept keys of every row of every sequence, the sequences' rows one after another
    (int64, ``sum(rows)``), and each sequence's first row in that order: one pass of NumPy
    over all rows, however many sequences (a Python loop over 32 sequences' shapes cost
    ~0.5 ms a call)."""
    rows = np.asarray(rows, np.int64)
    first_rows = np.cumsum(rows) - rows
    sequence = np.repeat(np.arange(len(rows), dtype=np.int64), rows)
    diagonal = (np.arange(sequence.size, dtype=np.int64) - first_rows[sequence]
                + np.asarray(bands, np.int64)[sequence])
    n_cols = np.asarray(cols, np.int64)[sequence]
    lo = 0 if window_left == UNLIMITED else np.maximum(diagonal - window_left, 0)
    hi = n_cols if window_right == UNLIMITED else np.minimum(diagonal + window_right + 1,
                                                             n_cols)
    return np.maximum(hi - lo, 0), first_rows


def kept_pairs(rows, cols, bands, window_left, window_right) -> int:
    """Kept (row, key) pairs over every sequence (one head)."""
    return int(_pairs_of_every_row(rows, cols, bands, window_left, window_right)[0].sum())


def tile_list(rows, cols, bands, block, window_left, window_right):
    """The tiles of every sequence as ``(sequence, first row)`` pairs (int64, ``(T, 2)``),
    the most kept (row, key) pairs first (stable), and their total kept pairs.

    `rows`, `cols`, `bands` are per-sequence counts and band offsets (columns of the
    descriptors, `tileattn.options.DESCRIPTOR_COLUMNS`); for key tiles pass keys as
    `rows` and the band transposed, as `longest_first` says. A tile's cost is its kept
    pairs plus 1 (`tile_costs`).
    """
    pairs, first_rows = _pairs_of_every_row(rows, cols, bands, window_left, window_right)
    n_tiles = -(-np.asarray(rows, np.int64) // block)
    sequence = np.repeat(np.arange(len(n_tiles), dtype=np.int64), n_tiles)
    tile = np.arange(sequence.size, dtype=np.int64) - np.repeat(np.cumsum(n_tiles) - n_tiles,
                                                                  n_tiles)
    cost = (np.add.reduceat(pairs, first_rows[sequence] + tile * block) + 1 if sequence.size
            else np.zeros(0, np.int64))
    order = np.argsort(-cost, kind="stable")
    return np.stack([sequence[order], tile[order] * block], axis=1), int(pairs.sum())


def tile_list_by_estimate(rows, cols, bands, block, window_left, window_right):
    """`tile_list`'s tiles in the GPU launcher's order: sequence by sequence, the sequence
    with the most estimated pairs first, and within a sequence its costliest tile first.
    A tile's estimate is the keys its middle row keeps times its rows, in time proportional
    to the tiles rather than the rows (a packed batch of 140k rows in ~50 us where
    `tile_list` takes ~1 ms); the kept keys per row are linear between the band's clips, so
    the estimate is exact for tiles that no clip crosses.

    Why by sequence: blocks resident together then hold tiles of one sequence, whose heads'
    K and V they read from L2 once between them, as a dense call's neighbouring tiles do.
    Ordered by cost alone, a causal batch's neighbours were tiles at the same row of
    different sequences, each reading its own K and V from memory (H100, 32 sequences of
    128-8192 tokens: 0.82 of the dense sequence's rate by cost alone, bench/NOTES-gpu.md
    v35); the shortest sequences still come last, filling the tail."""
    rows = np.asarray(rows, np.int64)
    n_tiles = -(-rows // block)
    sequence = np.repeat(np.arange(len(rows), dtype=np.int64), n_tiles)
    first = (np.arange(sequence.size, dtype=np.int64)
             - np.repeat(np.cumsum(n_tiles) - n_tiles, n_tiles)) * block
    height = np.minimum(block, rows[sequence] - first)
    middle = first + (height - 1) / 2
    diagonal = middle + np.asarray(bands, np.int64)[sequence]
    n_cols = np.asarray(cols, np.int64)[sequence]
    low = np.zeros(sequence.size) if window_left == UNLIMITED else np.maximum(
        diagonal - window_left, 0)
    high = n_cols if window_right == UNLIMITED else np.minimum(diagonal + window_right + 1,
                                                               n_cols)
    cost = np.maximum(high - low, 0) * height + 1
    sequence_cost = np.bincount(sequence, weights=cost, minlength=len(rows))
    rank = np.empty(len(rows))
    rank[np.argsort(-sequence_cost, kind="stable")] = np.arange(len(rows))
    # One stable sort of a composite key, half of np.lexsort's host time: the sequence's
    # rank, then the tile's cost, descending (exact in float64: costs are halves, and
    # rank x span stays far below 2^53).
    key = rank[sequence] * (cost.max(initial=0.0) + 1.0) - cost
    order = np.argsort(key, kind="stable")
    tiles = np.empty((sequence.size, 2), np.int64)
    tiles[:, 0], tiles[:, 1] = sequence[order], first[order]
    return tiles
