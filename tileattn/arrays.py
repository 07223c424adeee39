"""The caller's arrays: recognising them without importing their libraries, and giving
results back in the library they came from.

Backends see only NumPy (host) or CuPy (GPU) arrays. Arrays from other libraries are
viewed as those without copying, through DLPack: torch tensors, JAX arrays, and anything
else that speaks ``__dlpack__`` or ``__cuda_array_interface__``. A library is recognised by
the module of its array type (einops' habit), so it is touched only when the caller's arrays
already come from it and NumPy users never pay for importing CuPy, torch or JAX.
"""

from __future__ import annotations

import functools
import sys
import warnings

import numpy as np

_FLOAT_KINDS = ("float16", "bfloat16", "float32", "float64")
_DLPACK_CPU, _DLPACK_CUDA = 1, 2


def library_of(array) -> str:
    """``"numpy"``, ``"cupy"``, ``"torch"``, ``"jax"`` or ``"other"`` (by the type's module)."""
    if isinstance(array, np.ndarray):
        return "numpy"
    root = type(array).__module__.split(".")[0]
    if root == "cupy" and "cupy" in sys.modules:
        return "cupy"
    if root == "torch" and "torch" in sys.modules:
        return "torch"
    if root in ("jax", "jaxlib") and "jax" in sys.modules:
        return "jax"
    return "other"


def memory_of(array) -> str:
    """``"cuda"`` for CuPy arrays, ``"host"`` for NumPy arrays (after `to_native`)."""
    return "cuda" if library_of(array) == "cupy" else "host"


# --------------------------------------------------------------------------- into the backends


def bfloat16_dtype():
    """ml_dtypes' bfloat16, the dtype tileattn's NumPy and CuPy arrays use for bfloat16."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _from_dlpack(array, on_cuda: bool):
    if on_cuda:
        import cupy

        return cupy.from_dlpack(array)
    return np.from_dlpack(array)


@functools.cache
def _convertible_torch_dtypes() -> frozenset:
    """The torch dtypes whose tensors convert (bfloat16 through its bits; integers and
    complex numbers for validation to refuse by name): the float8 kinds, say, do not, and
    would fail inside torch without naming anything."""
    import torch

    return frozenset((torch.bfloat16, torch.float16, torch.float32, torch.float64,
                      torch.complex64, torch.complex128, torch.bool, torch.uint8, torch.int8,
                      torch.int16, torch.int32, torch.int64))


def _torch_to_native(tensor):
    import torch

    tensor = tensor.detach()
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"torch tensors must be on the CPU or a CUDA device, got one on "
                         f"{tensor.device}")
    if tensor.is_neg() or tensor.is_conj():  # lazy negation (x.conj().imag) or conjugation:
        tensor = tensor.resolve_neg().resolve_conj()  # neither NumPy nor DLPack reads them
    if tensor.dtype not in _convertible_torch_dtypes():
        raise TypeError(f"a torch tensor of dtype {tensor.dtype} has no NumPy counterpart; "
                        f"tileattn takes float16, bfloat16, float32 and float64")
    on_cuda = tensor.device.type == "cuda"
    bfloat16 = tensor.dtype == torch.bfloat16
    # DLPack consumers do not all know bfloat16: move the bits as int16 and relabel them.
    bits = tensor.view(torch.int16) if bfloat16 else tensor
    # A host tensor's own NumPy view costs a quarter of a DLPack exchange (0.5 us against 2
    # a tensor; a training step hands over nine): the torch adapter's host time.
    host = bits.numpy() if tensor.device.type == "cpu" else _from_dlpack(bits, on_cuda)
    return host.view(bfloat16_dtype()) if bfloat16 else host


def _jax_to_native(array):
    on_cuda = any(device.platform in ("gpu", "cuda") for device in array.devices())
    if on_cuda:
        return _from_dlpack(array, True)
    return np.asarray(array)


def _other_to_native(array):
    if hasattr(array, "__cuda_array_interface__"):
        import cupy

        return cupy.asarray(array)
    if hasattr(array, "__dlpack__") and hasattr(array, "__dlpack_device__"):
        device_type = int(array.__dlpack_device__()[0])
        if device_type in (_DLPACK_CPU, _DLPACK_CUDA):
            return _from_dlpack(array, device_type == _DLPACK_CUDA)
    return np.asarray(array)


def to_native(array):
    """The caller's array as a NumPy or CuPy array, without copying where possible."""
    library = library_of(array)
    if library in ("numpy", "cupy"):
        return array
    if library == "torch":
        return _torch_to_native(array)
    if library == "jax":
        return _jax_to_native(array)
    return _other_to_native(array)


def to_native_byte_order(array):
    """`array` in the machine's byte order, copied once if it is not (``'>f8'`` on x86).

    The API calls this on every input, so that dtypes compare by kind and precision, not by
    byte order, and every backend sees native dtypes: a backend asking ``dtype == float64``
    of a big-endian float64 array got False and computed it in float32. Results come back
    in the native-order version of the input dtype. CuPy, torch and JAX arrays are always
    native, so only host arrays can pay this copy."""
    dtype = array.dtype
    if dtype.isnative:
        return array
    return array.astype(dtype.newbyteorder("="))


def device_view(pointer: int, shape: tuple, dtype, owner, device: int | None = None,
                strides: tuple | None = None):
    """A CuPy array over another library's GPU memory at `pointer` (`strides` in bytes;
    None: dense row-major), kept alive by `owner`. No exchange protocol: DLPack's stream
    handshake cost ~40 us a torch tensor (bench/NOTES-gpu.md, v20) and
    ``__cuda_array_interface__`` may synchronise on the stream it names, so the caller
    orders the work itself by running it on the owner's stream (the adapters do).
    `device` saves the driver call that would otherwise find it."""
    import cupy

    dtype = np.dtype(dtype)
    if strides is None:
        extent = int(np.prod(shape)) * dtype.itemsize
    else:  # the bytes from the lowest to the highest element the strides reach
        extent = dtype.itemsize + sum((n - 1) * abs(stride) for n, stride in zip(shape, strides))
        if any(n == 0 for n in shape):
            extent = 0
    memory = cupy.cuda.UnownedMemory(pointer, extent, owner,
                                     device if device is not None else -1)
    return cupy.ndarray(tuple(shape), dtype, cupy.cuda.MemoryPointer(memory, 0), strides)


# --------------------------------------------------------------------------- back to the caller


def _torch_from_native(array):
    import torch

    bfloat16 = dtype_name(array.dtype) == "bfloat16"
    bits = array.view(np.int16) if bfloat16 else array
    # NumPy results through torch.from_numpy, which costs less than DLPack (see above);
    # read-only arrays keep DLPack's refusal rather than from_numpy's warning.
    if isinstance(bits, np.ndarray) and bits.flags.writeable:
        tensor = torch.from_numpy(bits)
    else:
        tensor = torch.from_dlpack(bits)
    return tensor.view(torch.bfloat16) if bfloat16 else tensor


def _jax_from_native(array):
    import jax.numpy as jnp

    if memory_of(array) == "cuda":
        import jax

        return jax.dlpack.from_dlpack(array)
    return jnp.asarray(array)


def from_native(array, library: str):
    """A NumPy/CuPy result as an array of `library` (the library the caller's q came from)."""
    if library == "torch":
        return _torch_from_native(array)
    if library == "jax":
        return _jax_from_native(array)
    return array


# --------------------------------------------------------------------------- helpers


def to_host(array):
    """A NumPy copy of a CuPy array; NumPy arrays pass through."""
    return array.get() if memory_of(array) == "cuda" else array


def to_device_like(array, like):
    """Move a NumPy result onto the GPU that holds `like` (a CuPy array)."""
    import cupy  # only reached with CuPy arrays, so CuPy is already imported

    with cupy.cuda.Device(like.device.id):
        return cupy.asarray(array)


def is_supported_float(dtype) -> bool:
    """float16, bfloat16 (ml_dtypes), float32, float64."""
    return dtype_name(dtype) in _FLOAT_KINDS


@functools.lru_cache(maxsize=None)
def dtype_name(dtype) -> str:
    """``np.dtype(dtype).name``, memoised: NumPy builds the name anew on every access, which
    was a tenth of a small GPU call's host time (bench/experiments/overhead_gpu.py)."""
    return np.dtype(dtype).name


def full(shape, fill, dtype, memory: str, like=None):
    """An array of `shape` filled with `fill`, in host memory or on `like`'s GPU."""
    if memory == "cuda":
        import cupy

        with cupy.cuda.Device(like.device.id):
            return cupy.full(shape, fill, dtype=dtype)
    return np.full(shape, fill, dtype=dtype)


def empty(shape, dtype, memory: str, like=None):
    """An uninitialised array of `shape`, in host memory or on `like`'s GPU."""
    if memory == "cuda":
        import cupy

        with cupy.cuda.Device(like.device.id):
            return cupy.empty(shape, dtype=dtype)
    return np.empty(shape, dtype=dtype)


_CUPY_STREAMS: dict = {}


def cupy_stream(pointer: int, device: int):
    """Another library's CUDA stream (torch's, XLA's) as a CuPy stream, one object per
    stream: a new wrapper a call costs microseconds, and those libraries keep their streams
    for long (a freed stream's wrapper is only replaced once 64 are held)."""
    import cupy

    stream = _CUPY_STREAMS.get((pointer, device))
    if stream is None:
        with warnings.catch_warnings():  # CuPy 14 deprecates it for Stream.from_external,
            warnings.simplefilter("ignore", DeprecationWarning)  # which CuPy 13 lacks
            stream = cupy.cuda.ExternalStream(pointer, device)
        if len(_CUPY_STREAMS) >= 64:
            _CUPY_STREAMS.clear()
        _CUPY_STREAMS[(pointer, device)] = stream
    return stream
