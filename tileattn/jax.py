"""JAX adapter: ``tileattn.jax.attention(q, k, v, ...)`` with a custom VJP.

Optional: importing this module imports JAX (``import tileattn`` never does). It works under
`jax.jit`, `jax.grad` and `jax.vmap`. Options are static: changing them retraces.

Where the computation runs:

- Each pass is a `jax.experimental.buffer_callback`: the callback receives XLA's own
  buffers and writes straight into XLA's output buffers (``out=``). On a GPU it views them
  as CuPy arrays (no copy) and runs tileattn's GPU kernels on XLA's CUDA stream; on the
  CPU it views them as NumPy arrays and runs the CPU backend.
- `jax.pure_callback` (host arrays in, new host arrays out, copied on each side) is the
  fallback: for ``backend="cpu"`` on a GPU, and in a JAX without ``buffer_callback``, with
  a warning on a GPU, where it runs at CPU speed. On the CPU its copies cost 0.6-1.2 ms a
  forward (B1 H8 D64: a decode step 0.93-1.45 against 0.34 ms through buffer_callback, the
  direct call 0.24; N = 2048 28.5-31.2 against 24.6-25.1 ms).

Under `jax.vmap` the callbacks see every array with the vmapped axes in front
(``vmap_method="broadcast_all"``), and tileattn reads leading axes as batch axes, so a
vmapped call is one tileattn call (see `_call`).

Variable-length and paged calls (docs/varlen.md) pass their lengths and block table as
more operands of the callbacks, not as static options: new lengths do not retrace. They
are not differentiable (their cotangents are symbolic zeros).
"""

from __future__ import annotations

import math
import warnings
from functools import cache, lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np

from . import api, arrays, backends
from .reference import lse_dtype
from .problem_cache import validate_call
from .validation import check_backend_name, check_layout
from .varlen_validation import VARLEN_KEYWORDS, varlen_family

try:
    from jax.experimental.buffer_callback import buffer_callback as _buffer_callback
except ImportError:  # JAX releases before buffer_callback (0.7)
    _buffer_callback = None

_DLPACK_CPU = 1  # the DLPack device type of host memory

_OUTPUT_ARGUMENTS = {"forward": ("out", "lse_out"), "backward": ("dq_out", "dk_out", "dv_out")}


def _shapes(q, v, layout):
    """The forward callback's results: o in the caller's layout and lse, ``(*batch, H, N)``
    in both layouts."""
    o_shape = q.shape[:-1] + (v.shape[-1],)
    if layout == "bshd" and q.ndim >= 3:
        lse_shape = q.shape[:-3] + (q.shape[-2], q.shape[-3])
    else:
        lse_shape = q.shape[:-1]
    return (jax.ShapeDtypeStruct(o_shape, q.dtype),
            jax.ShapeDtypeStruct(lse_shape, lse_dtype(q.dtype)))


def _with_head_axis(array, n_vmapped: int):
    """``(*vmapped, N, D)`` as ``(*vmapped, 1, N, D)`` (lse: ``(*vmapped, N)`` as
    ``(*vmapped, 1, N)``): a view of a contiguous array, so outputs are still written in
    place."""
    return array.reshape(array.shape[:n_vmapped] + (1,) + array.shape[n_vmapped:])


def _call(function_name: str, options: dict, base_ndim: int, inputs: list, outputs: list):
    """`tileattn.forward` or `backward` on a callback's arrays (NumPy, or CuPy views of XLA's
    buffers), writing the results into `outputs`. The last ``len(options["length_names"])``
    inputs are the lengths and block table that the call names. Every array is in the
    caller's layout, results too: the GPU kernels write o and the gradients at a "bshd"
    call's strides, so XLA needs no transpose.

    Returns ``(inputs, keywords)`` of the one dense call it made (for `api.replay`), or
    None where it made several or passed lengths.

    Under `jax.vmap` every array carries the same leading vmapped axes before the shape
    it has without vmap (q's has `base_ndim` axes). tileattn reads them as more batch axes,
    so the whole vmapped batch is one call (padded lengths ``(*vmapped, *batch)`` are the
    lengths of that batch), except in three cases:

    - ``(N, D)`` arrays have no head axis, so the vmapped axes would be read as heads; a
      head axis of 1 is inserted and the layout (which means nothing for them) is "bhsd".
    - Dropout's hash counts the flat batch-and-head index, so a folded batch would drop
      other entries than the unbatched call drops for each element; vmap means the loop
      over the elements, so with dropout each element is its own call.
    - Packed sequences (q exactly ``(H, N_total, D)``) and paged K/V (page pools without
      batch axes) have no batch axes to fold vmapped axes into: each element is its own
      call.
    """
    options = dict(options)
    length_names = options.pop("length_names")
    vmapped = inputs[0].shape[:inputs[0].ndim - base_ndim]
    per_element = options["dropout_p"] > 0 or options.get("cu_seqlens") or (
        "block_table" in length_names)
    options.pop("cu_seqlens", None)
    if vmapped and per_element:
        count = math.prod(vmapped)
        flat = [a.reshape((count,) + a.shape[len(vmapped):]) for a in inputs + outputs]
        options = dict(options, length_names=length_names)
        for index in range(count):
            _call(function_name, options, base_ndim, [a[index] for a in flat[:len(inputs)]],
                  [a[index] for a in flat[len(inputs):]])
        return None
    lengths = dict(zip(length_names, inputs[len(inputs) - len(length_names):]))
    inputs = inputs[:len(inputs) - len(length_names)]
    slopes = options["alibi_slopes"]
    if vmapped and slopes is not None and slopes.ndim > 1:  # (*batch, Hq): per element
        options = dict(options, alibi_slopes=np.broadcast_to(slopes, vmapped + slopes.shape))
    if vmapped and base_ndim == 2:
        options = dict(options, layout="bhsd")
        inputs = [_with_head_axis(a, len(vmapped)) for a in inputs]
        outputs = [_with_head_axis(a, len(vmapped)) for a in outputs]
    buffers = dict(zip(_OUTPUT_ARGUMENTS[function_name], outputs))
    if function_name == "forward":
        api.forward(*inputs, return_lse=True, **options, **lengths, **buffers)
    else:
        api.backward(*inputs, **options, **lengths, **buffers)
    return None if lengths else (inputs, dict(options, **buffers))


def _host_callback(function_name, options, base_ndim, result_shapes, *inputs):
    """pure_callback's body: host arrays in, new host arrays out."""
    inputs = [np.asarray(a) for a in inputs]
    vmapped = inputs[0].shape[:inputs[0].ndim - base_ndim]
    outputs = [np.empty(vmapped + s.shape, s.dtype) for s in result_shapes]
    _call(function_name, options, base_ndim, inputs, outputs)
    return tuple(outputs)


def _cupy_view(buffer):
    """An XLA GPU buffer as a CuPy array over the same memory (XLA buffers are dense and
    row-major; `arrays.device_view`): the callback already runs on XLA's stream."""
    return arrays.device_view(buffer.__cuda_array_interface__["data"][0], tuple(buffer.shape),
                              buffer.dtype, buffer)


def _host_view(buffer):
    """An XLA host buffer as a NumPy array over its memory. `np.asarray`, not DLPack: NumPy's
    DLPack has no bfloat16. Results written into a copy would never reach XLA's output, so a
    JAX whose buffers NumPy could only copy is an error, not a silent zero."""
    view = np.asarray(buffer)
    if view.flags.owndata or not view.flags.writeable:
        raise RuntimeError(f"tileattn.jax: NumPy cannot write into this JAX's (jax "
                           f"{jax.__version__}) buffer_callback host buffers in place")
    return view


class _BufferCallback:
    """buffer_callback's body for one traced pass: XLA's buffers, written in place. On a
    GPU they are viewed as CuPy arrays and tileattn runs on XLA's stream; on the CPU
    (where XLA may also lower this, for arrays placed there) they are NumPy arrays.

    XLA compiled the pass for fixed shapes, strides and dtypes, so on a GPU, once a dense
    call has run, later calls replay its launches on the new buffers' addresses
    (`api.replay`): no validation, views or plan lookups, which cost most of a small
    call's host time (bench/NOTES-gpu.md v27)."""

    def __init__(self, function_name: str, options: dict, base_ndim: int):
        self._function_name = function_name
        self._options = options
        self._base_ndim = base_ndim
        self._replay = None  # None: not tried yet; False: this pass does not replay
        self._device = None

    def __call__(self, context, outputs, *inputs):
        if int(inputs[0].__dlpack_device__()[0]) == _DLPACK_CPU:
            _call(self._function_name, self._options, self._base_ndim,
                  [np.asarray(b) for b in inputs], [_host_view(b) for b in outputs])
            return
        # Replayed only on the device it was recorded on: one signature's pass may serve
        # arrays on another GPU (eager calls share it, and so do a jit trace's devices).
        if (self._replay and int(inputs[0].__dlpack_device__()[1]) == self._device.id
                and self._replayed(context, inputs, outputs)):
            return
        import cupy

        inputs, outputs = [_cupy_view(b) for b in inputs], [_cupy_view(b) for b in outputs]
        device = inputs[0].device.id
        # XLA's callback thread may have no CUDA context current, and `Device(device)`
        # only switches devices when the current one differs: make its context current.
        cupy.cuda.runtime.setDevice(device)
        with cupy.cuda.Device(device), arrays.cupy_stream(context.stream, device):
            call = _call(self._function_name, self._options, self._base_ndim, inputs,
                         outputs)
            if self._replay is None:
                self._device = cupy.cuda.Device(device)
                self._replay = call is not None and (
                    api.replay(self._function_name, call[0], **call[1]) or False)

    def _replayed(self, context, inputs, outputs) -> bool:
        from .gpu.operands import NotReplayable

        addresses = [b.__cuda_array_interface__["data"][0] for b in (*inputs, *outputs)]
        with self._device, arrays.cupy_stream(context.stream, self._device.id):
            try:
                return self._replay(*addresses)
            except NotReplayable:
                self._replay = False
                return False


@cache
def _warn_no_buffer_callback():
    warnings.warn(
        "tileattn.jax: this JAX has no jax.experimental.buffer_callback, so attention on the "
        "GPU runs through jax.pure_callback: every array is copied to the host and back and "
        "computed by the CPU backend (CPU speed); JAX >= 0.7 keeps it on the GPU",
        RuntimeWarning, stacklevel=4)


def _use_buffers(backend: str) -> bool:
    """Whether the passes run as buffer_callbacks (XLA's buffers, no copies): wherever JAX
    has them, except ``backend="cpu"`` on a GPU, which needs the host arrays that only the
    pure_callback path hands over."""
    on_gpu = jax.default_backend() == "gpu"
    if _buffer_callback is None:
        if on_gpu:
            _warn_no_buffer_callback()
        return False
    return not (on_gpu and backend == "cpu")


def _run_pass(function_name, frozen_options, length_names, base_ndim, result_shapes,
              *arrays):
    operand_types = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)
    return _pass(function_name, frozen_options, length_names, base_ndim, result_shapes,
                 operand_types)(*arrays)


@lru_cache(maxsize=256)
def _pass(function_name, frozen_options, length_names, base_ndim, result_shapes,
          operand_types):
    """The pass as a function of its operands, one per call signature (the operands'
    shapes and dtypes among it, as a jit trace's): an eager call (no jit) binds the
    callback's primitive with the same callback object as the previous call of that
    signature, so JAX finds its compiled computation instead of compiling anew (a new
    object a call cost ~12-18 ms of XLA compilation each, against ~0.1 ms under jit, which
    reuses the callback of its one trace as this does; `_BufferCallback` replays launches
    for its signature on the GPU). The forward drops the backward's `deterministic`."""
    options = _options_dict(frozen_options)
    if function_name == "forward":
        options.pop("deterministic", None)
    options = dict(options, length_names=length_names,
                   cu_seqlens="cu_seqlens_q" in length_names)

    if _use_buffers(options["backend"]):
        callback = _buffer_callback(_BufferCallback(function_name, options, base_ndim),
                                    result_shapes, vmap_method="broadcast_all")
    else:
        callback = partial(jax.pure_callback, partial(
            _host_callback, function_name, options, base_ndim, result_shapes), result_shapes,
            vmap_method="broadcast_all")

    @jax.custom_jvp
    def run(*operands):
        return tuple(callback(*operands))

    run.defjvp(_no_second_derivative)
    return run


def _no_second_derivative(primals, tangents):
    """A pass differentiated itself: a gradient of a gradient, or a Hessian (the first
    gradient never differentiates the passes: the custom VJP below runs them on values).
    Refused by name, where JAX would say only that callbacks do not support JVP."""
    raise NotImplementedError(
        "tileattn.jax.attention has no second derivative (its passes are not "
        "differentiable): take one gradient, or differentiate the golden model, "
        "tileattn.forward(..., backend='reference') on float64 NumPy arrays")


def _options_dict(frozen):
    options = dict(frozen)
    if options.get("alibi_slopes") is not None:
        options["alibi_slopes"] = np.asarray(options["alibi_slopes"])
    return options


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, lengths, frozen_options):
    return _forward_rule(q, k, v, lengths, frozen_options)[0]


def _forward_rule(q, k, v, lengths, frozen_options):
    # The callbacks' options also say which length operands follow the arrays (their names,
    # in order) and whether the call is packed (see `_call`).
    o, lse = _run_pass("forward", frozen_options, tuple(lengths), q.ndim,
                       _shapes(q, v, dict(frozen_options)["layout"]), q, k, v,
                       *lengths.values())
    return o, (q, k, v, o, lse, lengths)


def _backward_rule(frozen_options, residuals, do):
    q, k, v, o, lse, lengths = residuals
    varlen_family(lengths, backward=True)  # paged K/V: tileattn.backward's ValueError
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v))
    dq, dk, dv = _run_pass("backward", frozen_options, tuple(lengths), q.ndim, shapes,
                           do.astype(o.dtype), q, k, v, o, lse, *lengths.values())
    # Integer lengths have no cotangent space: JAX takes None as their symbolic zero
    # (float0 zeros), under vmap as well.
    return dq, dk, dv, {name: None for name in lengths}


_attention.defvjp(_forward_rule, _backward_rule)


def attention(q, k, v, *, causal=False, window=None, scale=None, softcap=None,
              alibi_slopes=None, dropout_p=0.0, seed=None, block_q=None, block_k=None,
              backend="auto", deterministic=True, layout="bhsd", seqlens_q=None,
              seqlens_k=None, cu_seqlens_q=None, cu_seqlens_k=None, block_table=None,
              check_lengths=True):
    """Differentiable `tileattn.forward` on JAX arrays ``(*batch, H, N, D)``, or
    ``(*batch, N, H, D)`` with ``layout="bshd"`` (flash-attn's layout).

    Same options as `tileattn.forward` (`deterministic` applies to the backward pass);
    returns ``o`` as a JAX array of q's dtype, in q's layout. Under `jax.vmap` the result
    equals the loop over the vmapped axis, dropout included (each element drops what the
    unbatched call drops for the same seed).

    Variable-length batches take the keywords of `tileattn.forward` (docs/varlen.md):
    padded ``seqlens_q``/``seqlens_k`` of shape ``*batch``; packed ``cu_seqlens_q`` and
    ``cu_seqlens_k`` of shape ``(S + 1,)`` with q, k, v ``(H, N_total, D)``; paged K/V with
    ``block_table`` ``(*batch, max_pages)``, ``seqlens_k`` and page pools k, v. They are
    JAX or NumPy integer arrays (or lists), traced operands rather than static options, and
    not differentiable. Paged K/V is forward only: `jax.grad` through it raises
    tileattn.backward's ValueError. Under `jax.vmap` batched lengths of shape
    ``(*vmapped, *batch)`` are the lengths of each element; packed and paged calls run one
    tileattn call per vmapped element. ``check_lengths=True`` checks the contents inside
    the callback, where a bad value's ValueError reaches the caller wrapped in JAX's
    runtime error; combinations of keywords are checked before tracing, and so are a dense
    call's shapes, dtypes and options (a bad one raises `tileattn.forward`'s ValueError or
    TypeError, naming the argument).
    """
    check_layout(layout)  # before tracing: the callbacks' result shapes depend on it
    if check_backend_name(backend) != "auto":
        # Before tracing: inside the callback its BackendUnavailableError would reach the
        # caller wrapped in JAX's runtime error.
        backends.load(backend)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if alibi_slopes is not None:
        alibi_slopes = _static_slopes(alibi_slopes)
    if all(value is None for value in (seqlens_q, seqlens_k, cu_seqlens_q, cu_seqlens_k,
                                       block_table)):
        _check_dense_call(q, k, v, dict(
            causal=causal, window=window, scale=scale, softcap=softcap,
            alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, block_q=block_q,
            block_k=block_k, deterministic=deterministic, layout=layout), backend,
            check_lengths)
    lengths = {name: jnp.asarray(value) for name, value in zip(
        VARLEN_KEYWORDS, (seqlens_q, seqlens_k, cu_seqlens_q, cu_seqlens_k, block_table))
        if value is not None}
    varlen_family(lengths, backward=False)  # a bad combination fails before tracing
    for name, value in lengths.items():
        if not jnp.issubdtype(value.dtype, jnp.integer):
            raise TypeError(f"{name} must have an integer dtype, got dtype {value.dtype}")
    frozen = tuple(sorted(dict(
        causal=causal, window=None if window is None else tuple(window), scale=scale,
        softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed,
        block_q=block_q, block_k=block_k, backend=backend, deterministic=deterministic,
        layout=layout, check_lengths=check_lengths,
    ).items()))
    return _attention(q, k, v, lengths, frozen)


def _check_dense_call(q, k, v, options: dict, backend, check_lengths) -> None:
    """Validate a dense call's shapes, dtypes and options as `tileattn.forward` does, before
    anything is traced, so a bad one raises its ValueError or TypeError naming the argument
    here instead of JAX's runtime error around it from inside the callback. Validation reads
    only shapes, dtypes and option values (and ALiBi's slopes), so zero-stride stand-ins of
    the arrays serve, and the problem cache remembers a signature that passed."""
    check_backend_name(backend)
    stand_ins = [np.broadcast_to(np.zeros((), a.dtype), a.shape) for a in (q, k, v)]
    if options["alibi_slopes"] is not None:
        options = dict(options, alibi_slopes=np.asarray(options["alibi_slopes"]))
    validate_call(*stand_ins, outputs={}, varlen=None, check_lengths=check_lengths,
                  **options)


def _static_slopes(slopes) -> tuple:
    """ALiBi's slopes as nested tuples of floats (options are static: hashable for
    `nondiff_argnums`), or a TypeError naming alibi_slopes for a traced value (under jit or
    vmap) or one that is not an array of numbers."""
    if isinstance(slopes, jax.core.Tracer):
        raise TypeError("alibi_slopes must be concrete (a list, a NumPy array, or a JAX array "
                        "made outside jit and vmap): tileattn's options are static, got a "
                        f"traced value {slopes}")
    try:
        array = np.asarray(slopes, dtype=np.float64)
    except (TypeError, ValueError) as error:  # ragged lists, strings
        raise TypeError(f"alibi_slopes must be an array of numbers: {error}") from None
    return _freeze(array.tolist())


def _freeze(value):
    """Nested lists as nested tuples, so options are hashable for `nondiff_argnums`."""
    return tuple(_freeze(v) for v in value) if isinstance(value, (list, tuple)) else value
