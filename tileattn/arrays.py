"""Recognising the caller's arrays without importing their libraries.

A CuPy array is recognised by its type's module name (einops' habit), so NumPy users never
pay for importing CuPy.
"""

from __future__ import annotations

import sys

import numpy as np

_FLOAT_KINDS = ("float16", "bfloat16", "float32", "float64")


def memory_of(array) -> str:
    """``"cuda"`` for CuPy arrays, ``"host"`` for everything NumPy can read."""
    module = type(array).__module__
    if module.startswith("cupy") and "cupy" in sys.modules:
        return "cuda"
    return "host"


def as_array(array, memory: str):
    """The caller's array as a NumPy or CuPy array, without copying when possible."""
    if memory == "cuda":
        return array
    if isinstance(array, np.ndarray):
        return array
    return np.asarray(array)


def to_host(array):
    """A NumPy copy of a CuPy array (used by the reference backend on CUDA inputs)."""
    return array.get() if memory_of(array) == "cuda" else array


def to_device_like(array, like):
    """Move a NumPy result onto the device of `like` (a CuPy array)."""
    import cupy  # only reached with CuPy arrays, so CuPy is already imported

    with cupy.cuda.Device(like.device.id):
        return cupy.asarray(array)


def is_supported_float(dtype: np.dtype) -> bool:
    """float16, bfloat16 (ml_dtypes), float32, float64."""
    return np.dtype(dtype).name in _FLOAT_KINDS


def empty(shape, dtype, memory: str, like=None, fill=0.0):
    """An array of `shape` filled with `fill`, in the caller's array library."""
    if memory == "cuda":
        import cupy

        with cupy.cuda.Device(like.device.id):
            return cupy.full(shape, fill, dtype=dtype)
    return np.full(shape, fill, dtype=dtype)
