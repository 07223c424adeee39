"""A kernel launch whose argument buffer is built once: the driver's parameter array, with
the scalars in place and a slot per array pointer, so that a repeated launch writes a few
pointers and makes one ``cuLaunchKernel`` call.

CuPy's own launch converts every argument on every call, ~0.4 us each: 23 us for the ~40
arguments of a tileattn kernel against 7 us for two on the H100's host
(bench/experiments/overhead_breakdown_gpu.py, bench/NOTES-gpu.md v20), which was most of a
decode step's launch time.
"""

from __future__ import annotations

import ctypes
import threading

import cupy
import numpy as np
from cupy.cuda import driver

# cuLaunchKernel's answer on a thread where no CUDA context is current: a new thread (the
# caller's worker, torch's autograd engine, XLA's callback) until some runtime call there
# makes the device's primary context current. CuPy's pooled allocations make none.
_INVALID_CONTEXT = 201

_SCALARS = {np.dtype(np.int64): ctypes.c_int64, np.dtype(np.int32): ctypes.c_int32,
            np.dtype(np.uint32): ctypes.c_uint32, np.dtype(np.float32): ctypes.c_float,
            np.dtype(np.float64): ctypes.c_double}


def _argument(value):
    """A ctypes value for a kernel argument: a CuPy array's address or a NumPy scalar; None
    for anything else (the caller then keeps CuPy's launch)."""
    if isinstance(value, cupy.ndarray):
        return ctypes.c_uint64(value.data.ptr)
    scalar = _SCALARS.get(getattr(value, "dtype", None))
    return None if scalar is None or np.ndim(value) else scalar(value)


class PackedLaunch:
    """`function` (a CuPy kernel) on `grid` x `block` with `shared` bytes, `n_arrays` array
    arguments given per call followed by the fixed `arguments` (which the caller keeps
    alive: their arrays' addresses are stored here). `build` returns None where an argument
    is of a kind this does not pack."""

    def __init__(self, function_pointer: int, grid: tuple, block: tuple, shared: int,
                 n_arrays: int, fixed: list):
        self._device = cupy.cuda.runtime.getDevice()
        self._function = function_pointer
        self._grid = tuple(grid) + (1,) * (3 - len(grid))
        self._block = tuple(block) + (1,) * (3 - len(block))
        self._shared = shared
        self._slots = [ctypes.c_uint64(0) for _ in range(n_arrays)]
        self._fixed = fixed
        values = self._slots + fixed
        self._parameters = (ctypes.c_void_p * len(values))(
            *(ctypes.addressof(value) for value in values))
        self._pointer = ctypes.addressof(self._parameters)
        # Two threads launching the same plan (a forward on one, on another the autograd
        # engine's backward of the same shapes) must not interleave their pointers.
        self._lock = threading.Lock()

    @classmethod
    def build(cls, function, grid: tuple, block: tuple, shared: int, n_arrays: int,
              arguments: tuple) -> "PackedLaunch | None":
        fixed = [_argument(value) for value in arguments]
        # A RawKernel's Function for the current device (CuPy loads it at its first launch).
        pointer = getattr(getattr(function, "kernel", None), "ptr", None)
        if pointer is None or any(value is None for value in fixed):
            return None
        return cls(pointer, grid, block, shared, n_arrays, fixed)

    @property
    def n_arrays(self) -> int:
        return len(self._slots)

    def __call__(self, operands) -> None:
        """Launches on `operands`: CuPy arrays or device addresses (ints), on the current
        stream."""
        stream = cupy.cuda.get_current_stream().ptr
        with self._lock:
            for slot, operand in zip(self._slots, operands):
                slot.value = operand if type(operand) is int else operand.data.ptr
            try:
                self._launch(stream)
            except driver.CUDADriverError as error:
                if getattr(error, "status", None) != _INVALID_CONTEXT:
                    raise
                cupy.cuda.runtime.setDevice(self._device)  # makes its primary context current
                self._launch(stream)

    def _launch(self, stream: int) -> None:
        driver.launchKernel(self._function, *self._grid, *self._block, self._shared, stream,
                            self._pointer, 0)
