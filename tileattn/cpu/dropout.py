"""The dropout hash of `tileattn.dropout`, bit-identical, as Numba functions for the kernels.

Everything runs in int64 on values kept below ``2**32``: Numba promotes mixed uint32/int64
arithmetic to float64, and int64 keeps the typing simple. A product of two such values may
wrap past ``2**63``, but two's complement keeps its low 32 bits right, and masking with
``_MASK32`` after every multiplication gives exactly uint32 wrapping arithmetic. Shifts only
ever see non-negative values, so they are logical shifts.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..dropout import GOLDEN_RATIO_32, MIX_MULTIPLIER_1, MIX_MULTIPLIER_2

_MASK32 = np.int64(0xFFFFFFFF)
_MULTIPLIER_1 = np.int64(MIX_MULTIPLIER_1)
_MULTIPLIER_2 = np.int64(MIX_MULTIPLIER_2)
_GOLDEN_RATIO = np.int64(GOLDEN_RATIO_32)


@njit
def fmix32(x):
    """MurmurHash3's finaliser on an int64 holding a uint32 value."""
    x ^= x >> 16
    x = (x * _MULTIPLIER_1) & _MASK32
    x ^= x >> 13
    x = (x * _MULTIPLIER_2) & _MASK32
    return x ^ (x >> 16)


@njit
def row_state(key, bh, row):
    """The per-query-row state of absolute `row`: its row pair's base, bit 0 its half."""
    row &= _MASK32
    base = fmix32((fmix32(key ^ (bh & _MASK32)) + (row & ~np.int64(8))) & _MASK32)
    return (base & ~np.int64(1)) | ((row >> 3) & 1)


@njit
def keeps(state, column, threshold):
    """Whether the score at absolute key `column` of the row with `state` survives dropout:
    the row's 16 bits of its row pair's hash (the high half for the upper row) reach
    `threshold`."""
    base = state & ~np.int64(1)
    bits = fmix32((((base ^ (column & _MASK32)) * _GOLDEN_RATIO) + base) & _MASK32)
    return (bits >> 16 if state & 1 else bits & 0xFFFF) >= threshold
