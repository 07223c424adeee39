"""JAX adapter: ``tileattn.jax.attention(q, k, v, ...)`` with a custom VJP.

Optional: importing this module imports JAX (``import tileattn`` never does). It works under
`jax.jit`, `jax.grad` and `jax.vmap`. Options are static: changing them retraces.

Where the computation runs:

- On the CPU each pass is a `jax.pure_callback`: the callback receives host (NumPy) arrays
  and runs tileattn's CPU backend.
- On a GPU each pass is a `jax.experimental.buffer_callback`: the callback receives XLA's
  device buffers and XLA's CUDA stream, views the buffers as CuPy arrays (no copy) and
  runs tileattn's GPU kernels on that stream, writing straight into XLA's output buffers
  (``out=``). A JAX without ``buffer_callback`` falls back to the host path, with a
  warning: on a GPU that copies every array to the host and back and runs at CPU speed.

Under `jax.vmap` the callbacks see every array with the vmapped axes in front
(``vmap_method="broadcast_all"``), and tileattn reads leading axes as batch axes, so a
vmapped call is one tileattn call (see `_call`).
"""

from __future__ import annotations

import math
import warnings
from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np

from . import api
from .reference import lse_dtype
from .validation import check_layout

try:
    from jax.experimental.buffer_callback import buffer_callback as _buffer_callback
except ImportError:  # JAX releases before buffer_callback (0.7)
    _buffer_callback = None

_DLPACK_CPU = 1  # the DLPack device type of host memory

_OUTPUT_ARGUMENTS = {"forward": ("out", "lse_out"), "backward": ("dq_out", "dk_out", "dv_out")}


def _shapes(q, v, layout):
    o_shape = q.shape[:-1] + (v.shape[-1],)
    lse_shape = q.shape[:-1]
    if layout == "bshd" and q.ndim >= 3:  # lse is (*batch, H, N) in both layouts
        lse_shape = lse_shape[:-2] + (lse_shape[-1], lse_shape[-2])
    return (jax.ShapeDtypeStruct(o_shape, q.dtype),
            jax.ShapeDtypeStruct(lse_shape, lse_dtype(q.dtype)))


def _with_head_axis(array, n_vmapped: int):
    """``(*vmapped, N, D)`` as ``(*vmapped, 1, N, D)`` (lse: ``(*vmapped, N)`` as
    ``(*vmapped, 1, N)``): a view of a contiguous array, so outputs are still written in
    place."""
    return array.reshape(array.shape[:n_vmapped] + (1,) + array.shape[n_vmapped:])


def _call(function_name: str, options: dict, base_ndim: int, inputs: list, outputs: list):
    """`tileattn.forward` or `backward` on a callback's arrays (NumPy, or CuPy views of XLA's
    buffers), writing the results into `outputs`.

    Under `jax.vmap` every array carries the same leading vmapped axes before the shape
    it has without vmap (q's has `base_ndim` axes). tileattn reads them as more batch axes,
    so the whole vmapped batch is one call, except in two cases:

    - ``(N, D)`` arrays have no head axis, so the vmapped axes would be read as heads; a
      head axis of 1 is inserted and the layout (which means nothing for them) is "bhsd".
    - Dropout's hash counts the flat batch-and-head index, so a folded batch would drop
      other entries than the unbatched call drops for each element; vmap means the loop
      over the elements, so with dropout each element is its own call.
    """
    vmapped = inputs[0].shape[:inputs[0].ndim - base_ndim]
    if vmapped and options["dropout_p"] > 0:
        count = math.prod(vmapped)
        flat = [a.reshape((count,) + a.shape[len(vmapped):]) for a in inputs + outputs]
        for index in range(count):
            _call(function_name, options, base_ndim, [a[index] for a in flat[:len(inputs)]],
                  [a[index] for a in flat[len(inputs):]])
        return
    slopes = options["alibi_slopes"]
    if vmapped and slopes is not None and slopes.ndim > 1:  # (*batch, Hq): per element
        options = dict(options, alibi_slopes=np.broadcast_to(slopes, vmapped + slopes.shape))
    if vmapped and base_ndim == 2:
        options = dict(options, layout="bhsd")
        inputs = [_with_head_axis(a, len(vmapped)) for a in inputs]
        outputs = [_with_head_axis(a, len(vmapped)) for a in outputs]
    names = _OUTPUT_ARGUMENTS[function_name]
    # XLA's buffers are row-major in the caller's layout; with "bshd" the kernels write
    # (*batch, H, N, D) rows instead, so those results are copied in (lse is (*batch, H, N)
    # in both layouts and always written in place).
    in_place = options["layout"] == "bhsd" or inputs[0].ndim == 2
    buffers = {name: output for name, output in zip(names, outputs)
               if in_place or name == "lse_out"}
    if function_name == "forward":
        results = api.forward(*inputs, return_lse=True, **options, **buffers)
    else:
        results = api.backward(*inputs, **options, **buffers)
    for name, output, result in zip(names, outputs, results):
        if name not in buffers:
            output[...] = result


def _host_callback(function_name, options, base_ndim, result_shapes, *inputs):
    """pure_callback's body: host arrays in, new host arrays out."""
    inputs = [np.asarray(a) for a in inputs]
    vmapped = inputs[0].shape[:inputs[0].ndim - base_ndim]
    outputs = [np.empty(vmapped + s.shape, s.dtype) for s in result_shapes]
    _call(function_name, options, base_ndim, inputs, outputs)
    return tuple(outputs)


def _cupy_view(buffer):
    """An XLA GPU buffer as a CuPy array over the same memory (XLA buffers are dense and
    row-major). The raw pointer, not ``cupy.asarray``: the latter may synchronise on the
    stream the interface names, and the callback already runs on XLA's stream."""
    import cupy

    dtype = np.dtype(buffer.dtype)
    pointer = buffer.__cuda_array_interface__["data"][0]
    memory = cupy.cuda.UnownedMemory(pointer, math.prod(buffer.shape) * dtype.itemsize, buffer)
    return cupy.ndarray(tuple(buffer.shape), dtype, cupy.cuda.MemoryPointer(memory, 0))


def _buffer_callback_body(function_name, options, base_ndim, context, outputs, *inputs):
    """buffer_callback's body: XLA's buffers, written in place. On a GPU they are viewed as
    CuPy arrays and tileattn runs on XLA's stream; on the CPU (where XLA may also lower
    this, for arrays placed there) they are NumPy arrays."""
    if int(inputs[0].__dlpack_device__()[0]) == _DLPACK_CPU:
        _call(function_name, options, base_ndim, [np.asarray(b) for b in inputs],
              [np.asarray(b) for b in outputs])
        return
    import cupy

    inputs, outputs = [_cupy_view(b) for b in inputs], [_cupy_view(b) for b in outputs]
    device = inputs[0].device.id
    with cupy.cuda.Device(device), cupy.cuda.ExternalStream(context.stream, device):
        _call(function_name, options, base_ndim, inputs, outputs)


@cache
def _warn_no_buffer_callback():
    warnings.warn(
        "tileattn.jax: this JAX has no jax.experimental.buffer_callback, so attention on the "
        "GPU runs through jax.pure_callback: every array is copied to the host and back and "
        "computed by the CPU backend (CPU speed); JAX >= 0.7 keeps it on the GPU",
        RuntimeWarning, stacklevel=4)


def _use_device_buffers() -> bool:
    """Whether the passes run as buffer_callbacks: on a GPU, when JAX has them."""
    if jax.default_backend() != "gpu":
        return False
    if _buffer_callback is None:
        _warn_no_buffer_callback()
        return False
    return True


def _run_pass(function_name, options, base_ndim, result_shapes, *arrays):
    # backend="cpu" asks for host arrays, which only the pure_callback path hands over
    if options["backend"] != "cpu" and _use_device_buffers():
        run = _buffer_callback(
            partial(_buffer_callback_body, function_name, options, base_ndim), result_shapes,
            vmap_method="broadcast_all")
        return tuple(run(*arrays))
    return jax.pure_callback(
        partial(_host_callback, function_name, options, base_ndim, result_shapes),
        result_shapes, *arrays, vmap_method="broadcast_all")


def _options_dict(frozen):
    options = dict(frozen)
    if options.get("alibi_slopes") is not None:
        options["alibi_slopes"] = np.asarray(options["alibi_slopes"])
    return options


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, frozen_options):
    return _forward_rule(q, k, v, frozen_options)[0]


def _forward_rule(q, k, v, frozen_options):
    forward_options = {key: value for key, value in _options_dict(frozen_options).items()
                       if key != "deterministic"}
    o, lse = _run_pass("forward", forward_options, q.ndim,
                       _shapes(q, v, forward_options["layout"]), q, k, v)
    return o, (q, k, v, o, lse)


def _backward_rule(frozen_options, residuals, do):
    q, k, v, o, lse = residuals
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v))
    return _run_pass("backward", _options_dict(frozen_options), q.ndim, shapes,
                     do.astype(o.dtype), q, k, v, o, lse)


_attention.defvjp(_forward_rule, _backward_rule)


def attention(q, k, v, *, causal=False, window=None, scale=None, softcap=None,
              alibi_slopes=None, dropout_p=0.0, seed=None, block_q=None, block_k=None,
              backend="auto", deterministic=True, layout="bhsd"):
    """Differentiable `tileattn.forward` on JAX arrays ``(*batch, H, N, D)``, or
    ``(*batch, N, H, D)`` with ``layout="bshd"`` (flash-attn's layout).

    Same options as `tileattn.forward` (`deterministic` applies to the backward pass);
    returns ``o`` as a JAX array of q's dtype, in q's layout. Under `jax.vmap` the result
    equals the loop over the vmapped axis, dropout included (each element drops what the
    unbatched call drops for the same seed).
    """
    check_layout(layout)  # before tracing: the callbacks' result shapes depend on it
    if alibi_slopes is not None:
        alibi_slopes = _freeze(np.asarray(alibi_slopes, dtype=np.float64).tolist())
    frozen = tuple(sorted(dict(
        causal=causal, window=None if window is None else tuple(window), scale=scale,
        softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed,
        block_q=block_q, block_k=block_k, backend=backend, deterministic=deterministic,
        layout=layout,
    ).items()))
    return _attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), frozen)


def _freeze(value):
    """Nested lists as nested tuples, so options are hashable for `nondiff_argnums`."""
    return tuple(_freeze(v) for v in value) if isinstance(value, (list, tuple)) else value
