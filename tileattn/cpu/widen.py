"""float16 and bfloat16 inputs widened to the kernels' float32, on every thread.

The kernels compute in float32 (SPEC: 16-bit inputs accumulate in float32), so 16-bit q, k,
v (and do, o in the backward) are converted before they run. NumPy converts on one thread,
float16 through a scalar loop and bfloat16 through ml_dtypes' cast: on the 2-core
development host 68 and 29 ms for 33.5 M elements (a decode step's K of 32 heads x 8192 keys
x 128), more than the float32 decode kernel takes for K and V together (bench/NOTES-cpu.md,
session 30). Here the bits are widened by integer operations that LLVM vectorises, over
chunks the threads claim: exactly NumPy's values, NaN payloads and signed zeros included
(float16's subnormals, the one case the shift does not cover, are rewritten in a second,
rarely taken loop).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..arrays import dtype_name
from . import threads
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
    threads.run(_widen_kernel, min(threads.allowed(), n_tasks), source, flat.view(np.uint32),
                flat, name == "bfloat16", CHUNK)
    return out


@njit(nogil=True, cache=True)
def _widen_kernel(bits, out_bits, out, is_bfloat16, chunk, next_task):
    n_tasks = (bits.size + chunk - 1) // chunk
    while True:
        task = claim_next(next_task)
        if task >= n_tasks:
            return
        # Unsigned bounds: a signed index would carry Numba's negative-index wraparound
        # into every access, which keeps LLVM from vectorising the loops (5x slower).
        start = np.uint64(task) * np.uint64(chunk)
        stop = min(np.uint64(bits.size), start + np.uint64(chunk))
        if is_bfloat16:
            for i in range(start, stop):
                out_bits[i] = np.uint32(bits[i]) << np.uint32(16)
        else:
            _widen_half(bits, out_bits, out, start, stop)


@njit(nogil=True, cache=True)
def _widen_half(bits, out_bits, out, start, stop):
    """float16 bits to float32: the exponent rebased from 15 to 127 (all ones kept all ones
    for infinities and NaNs, whose payload shifts along; zeros kept zero), then subnormals,
    which float32 holds as normal numbers, from their mantissa times 2**-24."""
    for i in range(start, stop):
        half = np.uint32(bits[i])
        rest = (half & np.uint32(0x7FFF)) << np.uint32(13)
        exponent = rest & np.uint32(0x0F800000)
        if exponent == np.uint32(0x0F800000):
            rest += np.uint32(224 << 23)
        elif exponent == 0:
            rest = np.uint32(0)  # zeros; subnormals below
        else:
            rest += np.uint32(112 << 23)
        out_bits[i] = rest | ((half & np.uint32(0x8000)) << np.uint32(16))
    for i in range(start, stop):
        half = np.uint32(bits[i])
        if half & np.uint32(0x7C00) == 0 and half & np.uint32(0x3FF) != 0:
            size = np.float32(half & np.uint32(0x3FF)) * np.float32(2.0 ** -24)
            out[i] = -size if half & np.uint32(0x8000) else size
