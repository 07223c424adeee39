"""Which rows of the sequence axis each rank holds ("contiguous" or "zigzag"), and the
array helpers the ring needs for NumPy and CuPy alike (CuPy is never imported here: it is
taken from `sys.modules` when the arrays are CuPy's).

A rank's rows are a list of `Segment`s: ``length`` rows that sit at ``local_start`` of the
rank's shard and at ``global_start`` of the whole sequence.

* ``"contiguous"``: rank ``r`` of ``P`` holds rows ``[r N/P, (r+1) N/P)``, one segment.
* ``"zigzag"``: the axis is cut into ``2P`` chunks and rank ``r`` holds chunks ``r`` and
  ``2P-1-r``, in that order. With a causal mask each rank then has as many kept (row, key)
  pairs as every other (the load balance of Megatron's context parallelism and
  ring-flash-attention's zigzag ring).
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import numpy as np

LAYOUTS = ("contiguous", "zigzag")


class Segment(NamedTuple):
    local_start: int
    global_start: int
    length: int


def check_layout(layout) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be 'contiguous' or 'zigzag', got {layout!r}")
    return layout


def pieces(layout: str, size: int) -> int:
    """How many equal chunks the sequence axis is cut into."""
    return 2 * size if layout == "zigzag" else size


def check_divisible(n_total: int, layout: str, size: int, name: str = "x") -> int:
    """Rows per rank; a ValueError naming the layout when `n_total` does not divide."""
    chunks = pieces(layout, size)
    if n_total % chunks:
        what = f"2P = {chunks}" if layout == "zigzag" else f"P = {chunks}"
        raise ValueError(f"layout={layout!r} with P = {size} ranks needs {name}'s sequence "
                         f"length divisible by {what}, got {n_total}")
    return n_total // size


def segments(layout: str, rank: int, size: int, n_local: int) -> list:
    """The segments of `rank`'s shard of `n_local` rows."""
    if layout == "contiguous":
        return [Segment(0, rank * n_local, n_local)]
    half = n_local // 2
    return [Segment(0, rank * half, half), Segment(half, (2 * size - 1 - rank) * half, half)]


# --------------------------------------------------------------------------- array helpers


def array_module(array):
    """NumPy, or CuPy for CuPy arrays (taken from `sys.modules`, never imported here)."""
    return np if isinstance(array, np.ndarray) else sys.modules["cupy"]


def _is_bfloat16(dtype) -> bool:
    return np.dtype(dtype).name == "bfloat16"


def as_bits(array):
    """16-bit arrays as uint16 bits: CuPy copies, slices and concatenates those whatever
    its own bfloat16 support."""
    return array.view(np.uint16) if array.dtype.itemsize == 2 else array


def contiguous(array):
    """A C-contiguous array (the array itself when it already is)."""
    xp = array_module(array)
    if array.flags.c_contiguous:
        return array
    return xp.ascontiguousarray(as_bits(array)).view(array.dtype)


def take_rows(array, rows: list, axis: int):
    """The concatenation of ``array[..., start:start + length, ...]`` (on `axis`) over
    ``rows = [(start, length), ...]``, C-contiguous."""
    xp = array_module(array)
    axis = axis % array.ndim
    parts = []
    for start, length in rows:
        index = (slice(None),) * axis + (slice(start, start + length),)
        parts.append(as_bits(array[index]))
    return xp.ascontiguousarray(xp.concatenate(parts, axis=axis)).view(array.dtype)


def put_rows(target, source, target_start: int, source_start: int, length: int, axis: int):
    """``target[..., target_start:+length, ...] = source[..., source_start:+length, ...]``."""
    axis = axis % target.ndim
    head = (slice(None),) * axis
    as_bits(target)[head + (slice(target_start, target_start + length),)] = \
        as_bits(source)[head + (slice(source_start, source_start + length),)]


def bfloat16_bits_to_float32(xp, bits):
    """float32 values of bfloat16 `bits` (uint16): a bfloat16 is the top half of a float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


# CuPy elementwise kernels for the ring's accumulations and its final cast to bfloat16, each
# one pass over memory (CuPy's own expressions take one kernel and one temporary per
# operator). Built on first use from `sys.modules["cupy"]`.
_CUPY_KERNELS = {
    # acc = acc * w_acc + w_block * block, with the block widened to the accumulator's type
    "weighted_add": ("A w_acc, A w_block, T block", "A acc",
                     "acc = acc * w_acc + w_block * static_cast<A>(block)"),
    "weighted_add_bfloat16": ("A w_acc, A w_block, uint16 block", "A acc",
                              "acc = acc * w_acc + w_block * "
                              "static_cast<A>(__uint_as_float(((unsigned int)block) << 16))"),
    # round to nearest even by the bits; NaN stays a (quiet) NaN
    "narrow_bfloat16": ("float32 x", "uint16 y",
                        "unsigned int b = __float_as_uint(x); "
                        "y = isnan(x) ? (unsigned short)0x7FC0 "
                        ": (unsigned short)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16)"),
}
_built = {}


def _cupy_kernel(name):
    if name not in _built:
        params_in, params_out, operation = _CUPY_KERNELS[name]
        _built[name] = sys.modules["cupy"].ElementwiseKernel(
            params_in, params_out, operation, f"tileattn_ring_{name}")
    return _built[name]


def weighted_add(accumulator, weight_accumulator, weight_block, block) -> None:
    """``accumulator = accumulator * weight_accumulator + weight_block * block`` in place (the
    weights broadcast against the accumulator; `block` in the input dtype)."""
    xp = array_module(accumulator)
    if xp is np:
        if not (np.isscalar(weight_accumulator) and weight_accumulator == 1):
            accumulator *= weight_accumulator
        widened = block.astype(accumulator.dtype, copy=False)
        accumulator += widened if np.isscalar(weight_block) and weight_block == 1 else \
            weight_block * widened
        return
    kind = accumulator.dtype.type
    weights = [kind(weight) if np.isscalar(weight) else weight.astype(kind, copy=False)
               for weight in (weight_accumulator, weight_block)]
    if _is_bfloat16(block.dtype):
        _cupy_kernel("weighted_add_bfloat16")(*weights, block.view(np.uint16), accumulator)
    else:
        _cupy_kernel("weighted_add")(*weights, block, accumulator)


def to_float(array, dtype):
    """`array` converted to the float32/float64 `dtype`; bfloat16 CuPy arrays by their bits
    (CuPy's own bfloat16 arithmetic is not relied on)."""
    xp = array_module(array)
    if xp is not np and _is_bfloat16(array.dtype):
        widened = bfloat16_bits_to_float32(xp, array.view(np.uint16))
        return widened.astype(dtype, copy=False)
    return array.astype(dtype, copy=False)


def from_float(array, dtype):
    """A float32/float64 array cast to `dtype`, rounding to nearest even; bfloat16 CuPy
    arrays by their bits."""
    xp = array_module(array)
    if xp is not np and _is_bfloat16(dtype):
        return _cupy_kernel("narrow_bfloat16")(array.astype(np.float32, copy=False)).view(dtype)
    return array.astype(dtype)


def empty_like_shape(like, shape, dtype):
    xp = array_module(like)
    if xp is np:
        return np.empty(shape, dtype=dtype)
    return xp.empty(shape, dtype=np.uint16 if np.dtype(dtype).itemsize == 2 and
                    _is_bfloat16(dtype) else dtype).view(dtype)
