"""The counter-based dropout hash that every backend implements bit-identically.

Specification (all arithmetic on unsigned 32-bit integers, wrapping modulo 2**32)::

    fmix32(x):                       # MurmurHash3's finaliser, a bijection on uint32
        x ^= x >> 16;  x *= 0x85EBCA6B
        x ^= x >> 13;  x *= 0xC2B2AE35
        x ^= x >> 16;  return x

    seed_lo, seed_hi = seed & 0xFFFFFFFF, seed >> 32            # seed in [0, 2**64)
    key       = fmix32(seed_lo ^ fmix32(seed_hi ^ 0x9E3779B9))  # once per call
    row_state = fmix32(fmix32(key ^ bh) + i)                    # once per query row
    bits      = fmix32(fmix32(row_state ^ j) + row_state)       # once per (row, key)
    keep      = bits >= threshold,  threshold = floor(dropout_p * 2**32)

where ``bh = b * Hq + h`` is the flat index of the *query* head over the flattened batch,
``i`` the query row and ``j`` the key column, all absolute (not tile-relative) and
below ``2**32``. A kept probability is multiplied by ``1 / (1 - dropout_p)``.

Why this shape: the per-call and per-row parts hoist out of the inner loop, leaving two
``fmix32`` per score (a dozen integer instructions, cheap next to an ``exp``). Adding
``row_state`` after the first mix breaks the collision ``row_a ^ j_a == row_b ^ j_b`` that
a single xor-then-mix would share between two rows. The keep probability is
``1 - threshold / 2**32``, which is ``1 - dropout_p`` to within ``2**-32``.
"""

from __future__ import annotations

import numpy as np

GOLDEN_RATIO_32 = 0x9E3779B9
MIX_MULTIPLIER_1 = 0x85EBCA6B
MIX_MULTIPLIER_2 = 0xC2B2AE35
_MASK32 = 0xFFFFFFFF


def fmix32(x):
    """MurmurHash3 fmix32 on a uint32 array (or a Python int, returned as a Python int)."""
    if isinstance(x, (int, np.integer)):
        return int(fmix32(np.asarray([int(x) & _MASK32], dtype=np.uint32))[0])
    x = np.asarray(x, dtype=np.uint32)
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(MIX_MULTIPLIER_1)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(MIX_MULTIPLIER_2)
    return x ^ (x >> np.uint32(16))


def dropout_key(seed: int) -> int:
    """The per-call 32-bit key derived from a 64-bit seed."""
    seed_lo, seed_hi = seed & _MASK32, (seed >> 32) & _MASK32
    return fmix32(seed_lo ^ fmix32(seed_hi ^ GOLDEN_RATIO_32))


def dropout_threshold(dropout_p: float) -> int:
    """``floor(dropout_p * 2**32)``: an entry is dropped when its bits fall below this."""
    return min(int(np.floor(dropout_p * 2.0**32)), _MASK32)


def row_states(key: int, bh, rows):
    """Per-row hash state; `bh` and `rows` broadcast against each other."""
    bh = np.asarray(bh, dtype=np.uint64).astype(np.uint32)
    rows = np.asarray(rows, dtype=np.uint64).astype(np.uint32)
    return fmix32(fmix32(np.uint32(key) ^ bh) + rows)


def keep_mask(seed: int, dropout_p: float, bh, rows, cols):
    """Boolean keep mask for query heads `bh`, rows `rows`, key columns `cols` (broadcast).

    Typical use: ``keep_mask(seed, p, bh[:, :, None, None], i[:, None], j[None, :])``.
    """
    state = row_states(dropout_key(seed), bh, rows)
    cols = np.asarray(cols, dtype=np.uint64).astype(np.uint32)
    bits = fmix32(fmix32(state ^ cols) + state)
    return bits >= np.uint32(dropout_threshold(dropout_p))
