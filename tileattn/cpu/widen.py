"""float16 and bfloat16 inputs widened to the kernels' float32, on every thread; float16
results narrowed back the same way.

The kernels compute in float32 (SPEC: 16-bit inputs accumulate in float32), so 16-bit q, k,
v (and do, o in the backward) are converted before they run. NumPy converts on one thread,
float16 through a scalar loop and bfloat16 through ml_dtypes' cast: on the 2-core
development host 68 and 29 ms for 33.5 M elements (a decode step's K of 32 heads x 8192 keys
x 128), more than the float32 decode kernel takes for K and V together (bench/NOTES-cpu.md,
session 30). Here the bits are widened by integer operations, over chunks the threads
claim: exactly NumPy's values, NaN payloads and signed zeros included. bfloat16's shift
is a loop LLVM vectorises; float16's rebuild runs 16 lanes a step in LLVM IR
(`half_vectors`), and the elements after the last whole vector in a loop that rewrites
subnormals in a second, rarely taken pass. The decode path does not convert K and V at
all: its kernel widens each key tile as it reads it (`widen_rows`, or row by row from page
pools, `copy_row`).

Results go back the other way: NumPy narrows float32 to float16 through a scalar loop too
(2.4 ms for a forward's o of 8 heads x 1024 rows x 64, an eighth of the forward; a
backward narrows three such arrays), and ml_dtypes' bfloat16 cast runs on one thread
(0.6 ns an element: 20 ms for the dK and dV of 32 heads x 4096 keys x 128), so `narrowed`
rounds both on the threads, each by its library's rule: float16 as NumPy rounds it (half
to even, overflow to infinity, NaN payloads shifted along), bfloat16 as ml_dtypes does
(half to even, every NaN the canonical quiet one of its sign).
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from ..arrays import dtype_name
from . import threads
from .half_vectors import LANES, halves_to_floats
from .schedule import claim_next

MIN_ELEMENTS = 1 << 18
"""Smaller arrays take NumPy's conversion: a pool thread's wake-up costs more than they do."""

CHUNK = 1 << 18
"""Elements a task widens (1 MiB of float32 output)."""

_FLOAT32 = np.dtype(np.float32)


def widened(array: np.ndarray) -> np.ndarray | None:
    """`array` (float16 or bfloat16, any strides) as a new C-contiguous float32 array, or
    None where NumPy's conversion serves (other dtypes, non-native byte order, small)."""
    name = dtype_name(array.dtype)
    if (name not in ("float16", "bfloat16") or not array.dtype.isnative
            or array.size < MIN_ELEMENTS):
        return None
    source = np.ascontiguousarray(array).reshape(-1).view(np.uint16)
    out = np.empty(array.shape, _FLOAT32)
    flat = out.reshape(-1)
    n_tasks = -(-source.size // CHUNK)
    threads.run(_widen_kernel, min(threads.allowed(), n_tasks), source, flat,
                name == "bfloat16", CHUNK)
    return out


def narrowed(array: np.ndarray, dtype) -> np.ndarray:
    """float32 `array` (C-contiguous) as `dtype`: float16 and bfloat16 rounded on the
    threads where the array is large enough, else NumPy's (or ml_dtypes') conversion."""
    name = dtype_name(dtype)
    if (name not in ("float16", "bfloat16") or array.dtype != _FLOAT32 or not dtype.isnative
            or array.size < MIN_ELEMENTS or not array.flags.c_contiguous):
        return array.astype(dtype, copy=False)
    out = np.empty(array.shape, dtype)
    source = array.reshape(-1).view(np.uint32)
    n_tasks = -(-source.size // CHUNK)
    threads.run(_narrow_kernel, min(threads.allowed(), n_tasks), source,
                out.reshape(-1).view(np.uint16), name == "bfloat16", CHUNK)
    return out


@njit(nogil=True, cache=True)
def _narrow_kernel(bits, out, is_bfloat16, chunk, next_task):
    n_tasks = (bits.size + chunk - 1) // chunk
    while True:
        task = claim_next(next_task)
        if task >= n_tasks:
            return
        start = task * chunk
        stop = min(bits.size, start + chunk)
        if is_bfloat16:
            _narrow_bfloat16_chunk(bits[start:stop], out[start:stop])
        else:
            _narrow_chunk(bits[start:stop], out[start:stop])


@njit(nogil=True, inline="always")
def _narrow_bfloat16_chunk(bits, out):
    """float32 bits to bfloat16 bits as ml_dtypes rounds them (half to even; a NaN becomes
    0x7FC0 or 0xFFC0 by its sign), branch-free."""
    for i in range(bits.shape[0]):
        f = bits[i]
        rounded = (f + np.uint32(0x7FFF) + ((f >> np.uint32(16)) & np.uint32(1))) >> \
            np.uint32(16)
        nan = ((f >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0)
        out[i] = np.uint16(nan if f & np.uint32(0x7FFFFFFF) > np.uint32(0x7F800000)
                           else rounded)


@njit(nogil=True, inline="always")
def _narrow_chunk(bits, out):
    """float32 bits to float16 bits, as NumPy's ``npy_floatbits_to_halfbits`` rounds them,
    in straight-line code (every case computed, one selected) that LLVM vectorises. Indexed
    from 0 within the chunk (see `widen_row`)."""
    for i in range(bits.shape[0]):
        f = bits[i]
        sign = (f >> np.uint32(16)) & np.uint32(0x8000)
        magnitude = f & np.uint32(0x7FFFFFFF)
        exponent = f & np.uint32(0x7F800000)
        significand = f & np.uint32(0x007FFFFF)
        # Normal halves: the exponent rebased, the significand rounded half to even (a
        # carry into the exponent is right, up to infinity).
        rounded = significand + np.uint32(0 if significand & np.uint32(0x3FFF) ==
                                          np.uint32(0x1000) else 0x1000)
        normal = ((exponent - np.uint32(0x38000000)) >> np.uint32(13)) + \
            (rounded >> np.uint32(13))
        # Subnormal halves: the significand with its implicit bit, shifted by 1-11 more
        # places, rounded half to even over every bit shifted out.
        shift = min(np.uint32(113) - (exponent >> np.uint32(23)), np.uint32(31))
        small = (significand | np.uint32(0x00800000)) >> shift
        tie = (small & np.uint32(0x3FFF)) == np.uint32(0x1000) and \
            (f & np.uint32(0x7FF)) == np.uint32(0)
        subnormal = (small + np.uint32(0 if tie else 0x1000)) >> np.uint32(13)
        # Infinities, overflows and NaNs (whose payload must stay non-zero).
        payload = np.uint32(0x7C00) + (significand >> np.uint32(13))
        nan = payload + np.uint32(1 if payload == np.uint32(0x7C00) else 0)
        special = nan if magnitude > np.uint32(0x7F800000) else np.uint32(0x7C00)
        if exponent >= np.uint32(0x47800000):
            half = special
        elif exponent > np.uint32(0x38000000):
            half = normal
        elif exponent >= np.uint32(0x33000000):
            half = subnormal
        else:
            half = np.uint32(0)
        out[i] = np.uint16(sign | half)


@njit(nogil=True, cache=True)
def _widen_kernel(bits, out, is_bfloat16, chunk, next_task):
    n_tasks = (bits.size + chunk - 1) // chunk
    while True:
        task = claim_next(next_task)
        if task >= n_tasks:
            return
        start = task * chunk
        stop = min(bits.size, start + chunk)
        widen_row(bits[start:stop], out[start:stop], is_bfloat16)


@njit(nogil=True)
def widen_rows(rows, out, bfloat16):
    """The 16-bit bits `rows` (``(n, width)``, C-contiguous) as float32 into the first
    ``n * width`` elements of `out` (1-D): a key or value tile the decode kernel reads from
    16-bit K and V (`decode_kernel`), which stays in L2. One loop over the whole tile: a
    call a row took 4.2x as long for bfloat16 rows of 128 (512 x 128 bits, one Zen 4 core,
    15.9 against 3.8 us; float16 34.1 against 27.2), more than the tile's two products."""
    size = rows.shape[0] * rows.shape[1]
    widen_row(rows.reshape(size), out[:size], bfloat16)


@njit(nogil=True)
def widen_row(row, out, bfloat16):
    """A row (or a chunk) of 16-bit bits as float32 into `out` (1-D). Indexed from 0
    within the row: an index computed from a row number carries Numba's negative-index
    wraparound into every access, which keeps LLVM from vectorising the loops."""
    out_bits = out.view(np.uint32)
    if bfloat16:
        for d in range(row.shape[0]):
            out_bits[d] = np.uint32(row[d]) << np.uint32(16)
        return
    first = 0
    if row.strides[0] == 2 and out.strides[0] == 4:  # 16 lanes a step (`half_vectors`)
        first = row.shape[0] // LANES * LANES
        halves_to_floats(row, out_bits, first // LANES)
    for d in range(first, row.shape[0]):
        out_bits[d] = _normal_half(np.uint32(row[d]))
    for d in range(first, row.shape[0]):
        half = np.uint32(row[d])
        if half & np.uint32(0x7C00) == 0 and half & np.uint32(0x3FF) != 0:
            out[d] = _subnormal_half(half)


def copy_row(source, target, widen):
    """``target[:] = source`` for a row of K or V gathered from a page: `source` as stored
    in the compute dtype, or as 16-bit bits (uint16; `widen` 1 float16, 2 bfloat16)."""


@overload(copy_row, inline="always")
def _copy_row(source, target, widen):
    if source.dtype == types.uint16:
        def widened(source, target, widen):
            widen_row(source, target, widen == 2)
        return widened

    def copied(source, target, widen):
        for d in range(source.shape[0]):
            target[d] = source[d]
    return copied


def copy_rows(source, target, widen):
    """``target[:] = source`` for rows of K or V that follow one another in a page (both
    2-D and C-contiguous): `source` as stored in the compute dtype (a row at a time), or
    as 16-bit bits (uint16; `widen` 1 float16, 2 bfloat16) widened in one loop over all of
    them, as `widen_rows` widens a tile (`tiles.gathered_rows`)."""


@overload(copy_rows, inline="always")
def _copy_rows(source, target, widen):
    if source.dtype == types.uint16:
        def widened(source, target, widen):
            widen_rows(source, target.reshape(target.shape[0] * target.shape[1]),
                       widen == 2)
        return widened

    def copied(source, target, widen):
        for r in range(source.shape[0]):
            copy_row(source[r], target[r], widen)
    return copied


@njit(inline="always")
def _normal_half(half):
    """float16 bits to float32 bits: the exponent rebased from 15 to 127 (all ones kept all
    ones for infinities and NaNs, whose payload shifts along; zeros kept zero). Subnormals
    come out wrong here: `_subnormal_half`."""
    rest = (half & np.uint32(0x7FFF)) << np.uint32(13)
    exponent = rest & np.uint32(0x0F800000)
    if exponent == np.uint32(0x0F800000):
        rest += np.uint32(224 << 23)
    elif exponent == 0:
        rest = np.uint32(0)
    else:
        rest += np.uint32(112 << 23)
    return rest | ((half & np.uint32(0x8000)) << np.uint32(16))


@njit(inline="always")
def _subnormal_half(half):
    """A float16 subnormal's value (a normal float32): its mantissa times 2**-24."""
    size = np.float32(half & np.uint32(0x3FF)) * np.float32(2.0 ** -24)
    return -size if half & np.uint32(0x8000) else size
