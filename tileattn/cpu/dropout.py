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

from ..dropout import MIX_MULTIPLIER_1, MIX_MULTIPLIER_2

_MASK32 = np.int64(0xFFFFFFFF)
_MULTIPLIER_1 = np.int64(MIX_MULTIPLIER_1)
_MULTIPLIER_2 = np.int64(MIX_MULTIPLIER_2)


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
    """``fmix32(fmix32(key ^ bh) + row)``, the per-query-row state (absolute `row`)."""
    return fmix32((fmix32(key ^ (bh & _MASK32)) + row) & _MASK32)


@njit
def keeps(state, column, threshold):
    """Whether the score at absolute key `column` of the row with `state` survives dropout."""
    return fmix32((fmix32(state ^ (column & _MASK32)) + state) & _MASK32) >= threshold
