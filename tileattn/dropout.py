"""The counter-based dropout hash that every backend implements bit-identically.

Specification (all arithmetic on unsigned 32-bit integers, wrapping modulo 2**32)::

    fmix32(x):                       # MurmurHash3's finaliser, a bijection on uint32
        x ^= x >> 16;  x *= 0x85EBCA6B
        x ^= x >> 13;  x *= 0xC2B2AE35
        x ^= x >> 16;  return x

    seed_lo, seed_hi = seed & 0xFFFFFFFF, seed >> 32            # seed in [0, 2**64)
    key       = fmix32(seed_lo ^ fmix32(seed_hi ^ 0x9E3779B9))  # once per call
    base      = fmix32(fmix32(key ^ bh) + (i & ~8)) & ~1        # once per pair of rows
    row_state = base | ((i >> 3) & 1)                           # i, i ^ 8 share the base
    bits      = fmix32((base ^ j) * 0x9E3779B9 + base)          # once per (row pair, key)
    random    = bits >> 16  if row_state & 1  else  bits & 0xFFFF   # 16 bits per (i, j)
    keep      = random >= threshold,  threshold = floor(dropout_p * 2**16)

where ``bh = b * Hq + h`` is the flat index of the *query* head over the flattened batch,
``i`` the query row and ``j`` the key column, all absolute (not tile-relative) and
below ``2**32``. A kept probability is multiplied by ``1 / (1 - dropout_p)``.

Why this shape: the per-call and per-row parts hoist out of the inner loop. The inner
part is what costs: a GPU forward has a handful of integer instructions a score to spare
beside its tensor-core products. A thread of the tensor-core kernels holds rows i and
i + 8 of a 16-row tile (the forward and dQ: per key; the dK/dV kernel: queries i and i + 8
against each of its keys), so one ``fmix32`` serves both rows, 16 random bits each.
Mixing ``(base ^ j) * 0x9E3779B9 + base`` rather than ``base + j * constant`` keeps two
row pairs from sharing one pattern shifted by a few keys (with a plain sum, pairs whose
bases differ by a multiple of the constant would). The keep probability is
``1 - threshold / 2**16``, which is ``1 - dropout_p`` to within ``2**-16``; a
``dropout_p`` below ``2**-16`` drops nothing, and every backend treats it as 0.
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
    with np.errstate(over="ignore"):  # uint32 products wrap by design (0-d arrays warn)
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(MIX_MULTIPLIER_1)
        x = x ^ (x >> np.uint32(13))
        x = x * np.uint32(MIX_MULTIPLIER_2)
        return x ^ (x >> np.uint32(16))


def dropout_key(seed: int) -> int:
    """The per-call 32-bit key derived from a 64-bit seed."""
    seed_lo, seed_hi = seed & _MASK32, (seed >> 32) & _MASK32
    return fmix32(seed_lo ^ fmix32(seed_hi ^ GOLDEN_RATIO_32))


RANDOM_BITS = 16  # random bits a (row, key) entry gets from its pair's hash


def dropout_threshold(dropout_p: float) -> int:
    """``floor(dropout_p * 2**16)``: an entry is dropped when its 16 random bits fall below
    this."""
    return min(int(np.floor(dropout_p * 2.0**RANDOM_BITS)), 2**RANDOM_BITS - 1)


def row_states(key: int, bh, rows):
    """Per-row hash state (the row pair's base, bit 0 the row's half); `bh` and `rows`
    broadcast against each other."""
    bh = np.asarray(bh, dtype=np.uint64).astype(np.uint32)
    rows = np.asarray(rows, dtype=np.uint64).astype(np.uint32)
    with np.errstate(over="ignore"):
        base = fmix32(fmix32(np.uint32(key) ^ bh) + (rows & ~np.uint32(8))) & ~np.uint32(1)
    return base | ((rows >> np.uint32(3)) & np.uint32(1))


def keep_mask(seed: int, dropout_p: float, bh, rows, cols):
    """Boolean keep mask for query heads `bh`, rows `rows`, key columns `cols` (broadcast).

    Typical use: ``keep_mask(seed, p, bh[:, :, None, None], i[:, None], j[None, :])``.
    """
    state = row_states(dropout_key(seed), bh, rows)
    cols = np.asarray(cols, dtype=np.uint64).astype(np.uint32)
    return random_bits(state, cols) >= np.uint32(dropout_threshold(dropout_p))


def random_bits(state, cols):
    """The 16 random bits of each (row, key): `state` the rows' states, `cols` the keys."""
    state, cols = np.asarray(state, dtype=np.uint32), np.asarray(cols, dtype=np.uint32)
    base = state & ~np.uint32(1)
    with np.errstate(over="ignore"):
        bits = fmix32((base ^ cols) * np.uint32(GOLDEN_RATIO_32) + base)
    return np.where(state & np.uint32(1), bits >> np.uint32(16), bits & np.uint32(0xFFFF))
