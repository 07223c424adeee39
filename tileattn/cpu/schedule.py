"""How the parallel kernels share tasks among threads: longest task first, claimed on demand.

A causal query tile's cost grows with its row index (tile ``i`` of ``n`` computes about
``i + 1/2`` key tiles). Dealt round-robin to two threads, every odd tile went to the second
thread, which so did ``n/2`` key tiles more per head than the first: at N = 2048 with
512-row tiles, 5 against 3, and the first thread idled a quarter of the call
(bench/NOTES-cpu.md, v5). Ordering the tasks longest first and letting each thread claim the
next one when it is free (an atomic counter) ends both threads within one short task of each
other, whatever the mask, and also when the machine's other load slows one core.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .tiles import UNLIMITED


@intrinsic
def claim_next(typingctx, counter):
    """Atomically ``counter[0] += 1``; returns the value before (a task index to run).

    Numba has no atomics; this is LLVM's ``atomicrmw add`` on the array's first element, so
    every task goes to exactly one thread however the threads interleave.
    """
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", array.data, ir.Constant(ir.IntType(64), 1),
                                  "monotonic")

    return types.int64(counter), codegen


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


def tile_list(rows, cols, bands, block, window_left, window_right):
    """The tiles of every sequence as ``(sequence, first row)`` pairs (int64, ``(T, 2)``),
    the most kept (row, key) pairs first (stable), and their total kept pairs.

    `rows`, `cols`, `bands` are per-sequence counts and band offsets (columns of the
    descriptors, `tileattn.options.DESCRIPTOR_COLUMNS`); for key tiles pass keys as
    `rows` and the band transposed, as `longest_first` says. Sequences of equal shape
    share one cost computation: a dense batch costs what one sequence does.
    """
    shapes, inverse = np.unique(np.stack([rows, cols, bands], axis=1), axis=0,
                                return_inverse=True)
    inverse = inverse.reshape(-1)
    costs = [tile_costs(-(-int(n) // block), block, int(n), int(m), int(band), window_left,
                        window_right) for n, m, band in shapes]
    n_tiles = -(-np.asarray(rows, np.int64) // block)
    sequence = np.repeat(np.arange(len(rows), dtype=np.int64), n_tiles)
    tile = np.arange(sequence.size, dtype=np.int64) - np.repeat(np.cumsum(n_tiles) - n_tiles,
                                                                  n_tiles)
    cost = (np.concatenate([costs[u] for u in inverse]) if sequence.size
            else np.zeros(0, np.int64))
    order = np.argsort(-cost, kind="stable")
    pairs = int(cost.sum() - cost.size)
    return np.stack([sequence[order], tile[order] * block], axis=1), pairs
