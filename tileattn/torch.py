"""PyTorch adapter: ``tileattn.torch.attention(q, k, v, ...)`` is differentiable and compiles.

Optional: importing this module imports torch (``import tileattn`` never does). The passes
are the custom operators ``torch.ops.tileattn.forward`` (returns ``(o, lse)``) and
``torch.ops.tileattn.backward`` (returns ``(dq, dk, dv)``), registered with
`torch.library.custom_op` together with their output shapes (`register_fake`) and their
autograd formula (`register_autograd`), so ``torch.compile(fullgraph=True)`` traces
`attention` as one node per pass instead of breaking the graph at the DLPack hand-off.

Variable-length and paged calls (``seqlens_q``, ``seqlens_k``, ``cu_seqlens_q``,
``cu_seqlens_k``, ``block_table``, ``check_lengths``; docs/varlen.md) pass their integer
arrays as optional tensor arguments of both operators; they get no gradient.

Tensors are handed to tileattn without copying (CPU tensors as NumPy views, CUDA tensors as
CuPy views of their memory, results back through ``__cuda_array_interface__``); CPU tensors
run on the CPU backend and CUDA tensors on the GPU backend (``backend="auto"``), on torch's
current CUDA stream. The backward recomputes score tiles from the saved log-sum-exp, so only
``o`` and ``lse`` are kept between the passes.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional, Tuple

import numpy as np
import torch
from torch.autograd import forward_ad
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import api, arrays
from .validation import check_bool, check_seed

_INT64_SPAN = 2**64


def _seed_argument(seed):
    """A seed in ``[0, 2**64)`` as torch.library's int64: the upper half travels as negative
    numbers (two's complement); `_seed_from_argument` undoes it. Checked first, so a bad
    seed gets tileattn's error rather than an overflow in the dispatcher."""
    seed = check_seed(seed)
    if seed is None:
        return None
    return seed - _INT64_SPAN if seed >= _INT64_SPAN // 2 else seed


def _seed_from_argument(seed):
    return None if seed is None else seed % _INT64_SPAN


def _window_argument(window):
    """torch.library has no list of optional ints; a negative side means unlimited, as None
    does (SPEC), so None sides travel as -1. Anything but a pair gets `tileattn.forward`'s
    error here, before it would meet the conversion."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window must be None or a pair (left, right), got {window!r}")
    return [-1 if side is None else side for side in window]


def _slopes_argument(alibi_slopes):
    """Slopes given as a tensor, a NumPy array or a (nested) list, as the op's tensor of
    float64. Complex and bool slopes get `tileattn.forward`'s TypeError here, before the
    cast would drop their imaginary part or take True for 1.0; slopes that would be
    differentiated get an error too (tileattn has no gradient for them, and torch would
    read the missing one as zero)."""
    if alibi_slopes is None:
        return None
    if torch.compiler.is_compiling():  # no NumPy in the traced graph
        return torch.as_tensor(alibi_slopes, dtype=torch.float64)
    if not isinstance(alibi_slopes, torch.Tensor) and hasattr(alibi_slopes,
                                                             "__cuda_array_interface__"):
        alibi_slopes = torch.as_tensor(alibi_slopes)  # CuPy, Numba: on their device
    if isinstance(alibi_slopes, torch.Tensor):
        if alibi_slopes.requires_grad and torch.is_grad_enabled() or _tracks_grad(alibi_slopes):
            raise ValueError("alibi_slopes get no gradient from tileattn: pass "
                             "alibi_slopes.detach()")
        kind = ("c" if alibi_slopes.is_complex()
                else "b" if alibi_slopes.dtype == torch.bool else "f")
        dtype = alibi_slopes.dtype
    else:
        array = _as_array("alibi_slopes", alibi_slopes)
        kind, dtype = array.dtype.kind, array.dtype
        alibi_slopes = array
    if kind not in "fiu":
        raise TypeError(f"alibi_slopes must be real numbers, got dtype {dtype}")
    return torch.as_tensor(alibi_slopes, dtype=torch.float64)


def _lengths_argument(name, values):
    """Lengths or a block table given as a tensor, a NumPy array or a list, as the op's
    tensor. The dtype is kept, so a float array still gets tileattn's TypeError."""
    if values is None or isinstance(values, torch.Tensor):
        return values
    if torch.compiler.is_compiling():  # no NumPy in the traced graph
        return torch.as_tensor(values)
    if hasattr(values, "__cuda_array_interface__"):
        return torch.as_tensor(values)  # CuPy, Numba: on their device
    array = _as_array(name, values)
    if array.dtype.kind not in "biuf":
        raise TypeError(f"{name} must be integers, got dtype {array.dtype}")
    return torch.as_tensor(array)


def _as_array(name, values):
    """A list or NumPy array as NumPy's array, or a TypeError naming the argument."""
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as error:  # ragged lists
        raise TypeError(f"{name} must be an array of numbers: {error}") from None
    if array.dtype.kind in "OSUV":
        raise TypeError(f"{name} must be an array of numbers, got {values!r}")
    return array


_FLOAT_DTYPES = {torch.float16: np.float16, torch.float32: np.float32,
                 torch.float64: np.float64, torch.bfloat16: np.int16}


def _to_cupy(tensor):
    """A CUDA tensor of a float dtype as a CuPy view of its memory (`arrays.device_view`: no
    DLPack handshake, ~8 us against ~40 a tensor on the H100's host); bfloat16 as
    ml_dtypes' bfloat16. Other tensors pass as they are, for tileattn to convert or refuse.
    Called on torch's stream (`_on_torch_stream`), which orders the kernels after the
    tensors' producers."""
    if tensor.device.type != "cuda" or tensor.dtype not in _FLOAT_DTYPES:
        return tensor
    tensor = tensor.detach()
    size = tensor.element_size()
    view = arrays.device_view(tensor.data_ptr(), tuple(tensor.shape), _FLOAT_DTYPES[tensor.dtype],
                              tensor, tensor.device.index,
                              tuple(stride * size for stride in tensor.stride()))
    return view.view(arrays.bfloat16_dtype()) if tensor.dtype == torch.bfloat16 else view


def _to_torch(array):
    """A CuPy result as a tensor over the same memory (``__cuda_array_interface__``, strides
    kept); the tensor holds the array. Same stream as the kernels that wrote it."""
    bfloat16 = arrays.dtype_name(array.dtype) == "bfloat16"
    tensor = torch.as_tensor(array.view(np.int16) if bfloat16 else array,
                             device=f"cuda:{array.device.id}")
    return tensor.view(torch.bfloat16) if bfloat16 else tensor


def _call_on_device(function, tensors, **keywords):
    """`function` (`api.forward` or `api.backward`) on `tensors`, on torch's stream; CUDA
    tensors cross as CuPy views and the results come back as tensors."""
    with _on_torch_stream(tensors[0]):
        if tensors[0].device.type != "cuda":
            return function(*tensors, **keywords)
        results = function(*map(_to_cupy, tensors), **keywords)
        return tuple(_to_torch(result) for result in results)


@contextlib.contextmanager
def _on_torch_stream(tensor):
    """Run tileattn's CuPy kernels on torch's current stream of `tensor`'s GPU, so they are
    ordered with the caller's torch work without a synchronisation (DLPack then sees the
    same stream on both sides). Host tensors need nothing."""
    if tensor.device.type != "cuda":
        yield
        return
    import cupy

    device = tensor.device.index
    with cupy.cuda.Device(device), arrays.cupy_stream(_current_stream(tensor.device), device):
        yield


def _options(causal, window, scale, softcap, alibi_slopes, dropout_p, seed, block_q, block_k,
             backend, layout, seqlens_q, seqlens_k, cu_seqlens_q, cu_seqlens_k, block_table,
             check_lengths):
    """The op's arguments as `tileattn.forward`/`backward` keywords."""
    if alibi_slopes is not None:  # validation reads slopes on the host
        alibi_slopes = alibi_slopes.detach().cpu()
    return dict(causal=causal, window=window, scale=scale, softcap=softcap,
                alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                seed=_seed_from_argument(seed), block_q=block_q, block_k=block_k,
                backend=backend, layout=layout, seqlens_q=seqlens_q, seqlens_k=seqlens_k,
                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                block_table=block_table, check_lengths=check_lengths)


@torch.library.custom_op("tileattn::forward", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                window: Optional[List[int]], scale: Optional[float], softcap: Optional[float],
                alibi_slopes: Optional[torch.Tensor], dropout_p: float, seed: Optional[int],
                block_q: Optional[int], block_k: Optional[int], backend: str, layout: str,
                deterministic: bool, seqlens_q: Optional[torch.Tensor] = None,
                seqlens_k: Optional[torch.Tensor] = None,
                cu_seqlens_q: Optional[torch.Tensor] = None,
                cu_seqlens_k: Optional[torch.Tensor] = None,
                block_table: Optional[torch.Tensor] = None,
                check_lengths: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    return _run_forward(q, k, v, causal, window, scale, softcap, alibi_slopes, dropout_p,
                        seed, block_q, block_k, backend, layout, deterministic, seqlens_q,
                        seqlens_k, cu_seqlens_q, cu_seqlens_k, block_table, check_lengths)


def _run_forward(q, k, v, causal, window, scale, softcap, alibi_slopes, dropout_p, seed,
                 block_q, block_k, backend, layout, deterministic, seqlens_q, seqlens_k,
                 cu_seqlens_q, cu_seqlens_k, block_table, check_lengths):
    """The forward op's body, for the op and for eager calls (`_EagerAttention`)."""
    # `deterministic` is unused here: it is an argument so that the autograd formula,
    # which sees only the forward's inputs, can hand it to the backward op.
    arguments = (causal, window, scale, softcap, alibi_slopes, dropout_p, seed, block_q,
                 block_k, backend, layout, deterministic, seqlens_q, seqlens_k, cu_seqlens_q,
                 cu_seqlens_k, block_table, check_lengths)
    if q.device.type == "cuda" and _replayable(arguments):
        results = _by_replay("forward", (q, k, v), arguments,
                             lambda: _forward_results(q, v, layout, backend))
        if results is not None:
            return results
    options = _options(causal, window, scale, softcap, alibi_slopes, dropout_p, seed,
                       block_q, block_k, backend, layout, seqlens_q, seqlens_k,
                       cu_seqlens_q, cu_seqlens_k, block_table, check_lengths)
    return _call_on_device(api.forward, (q, k, v), return_lse=True, **options)


def _layout_strided(like, shape, dtype, layout, written_in_place: bool = False):
    """An empty tensor of `shape` with the strides tileattn's results have: contiguous, or
    with "bshd" a ``swapaxes(-3, -2)`` view of a contiguous "bhsd" buffer, except where the
    kernels write the result in the caller's layout (`written_in_place`: o and the
    gradients on a GPU)."""
    if layout == "bshd" and len(shape) >= 3 and not written_in_place:
        swapped = list(shape)
        swapped[-3], swapped[-2] = swapped[-2], swapped[-3]
        return like.new_empty(swapped, dtype=dtype).transpose(-3, -2)
    return like.new_empty(shape, dtype=dtype)


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _in_place(tensor, backend) -> bool:
    """Whether the GPU kernels write this call's results in the caller's layout (a "bshd"
    result C-contiguous, as flash-attn's): CUDA tensors, any backend but the reference."""
    return tensor.device.type == "cuda" and backend != "reference"


def _forward_results(q, v, layout, backend):
    """New (o, lse) laid out as tileattn's results are. Variable-length results have the
    dense shapes: padded and paged o is q's shape with v's head dim (a page pool's last
    axis is Dv too), packed o is (Hq, N_total, Dv)."""
    o = _layout_strided(q, (*q.shape[:-1], v.shape[-1]), q.dtype, layout,
                        written_in_place=_in_place(q, backend))
    lse_shape = list(q.shape[:-1])  # (*batch, H, N) in both layouts
    if layout == "bshd" and q.dim() >= 3:
        lse_shape[-2], lse_shape[-1] = lse_shape[-1], lse_shape[-2]
    return o, q.new_empty(lse_shape, dtype=_lse_dtype(q.dtype))


@_forward_op.register_fake
def _(q, k, v, causal, window, scale, softcap, alibi_slopes, dropout_p, seed, block_q,
      block_k, backend, layout, deterministic, seqlens_q=None, seqlens_k=None,
      cu_seqlens_q=None, cu_seqlens_k=None, block_table=None, check_lengths=True):
    return _forward_results(q, v, layout, backend)


@torch.library.custom_op("tileattn::backward", mutates_args=())
def _backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, lse: torch.Tensor, causal: bool,
                 window: Optional[List[int]], scale: Optional[float],
                 softcap: Optional[float], alibi_slopes: Optional[torch.Tensor],
                 dropout_p: float, seed: Optional[int], block_q: Optional[int],
                 block_k: Optional[int], backend: str, layout: str,
                 deterministic: bool, seqlens_q: Optional[torch.Tensor] = None,
                 seqlens_k: Optional[torch.Tensor] = None,
                 cu_seqlens_q: Optional[torch.Tensor] = None,
                 cu_seqlens_k: Optional[torch.Tensor] = None,
                 block_table: Optional[torch.Tensor] = None,
                 check_lengths: bool = True
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _run_backward(do, q, k, v, o, lse, causal, window, scale, softcap, alibi_slopes,
                         dropout_p, seed, block_q, block_k, backend, layout, deterministic,
                         seqlens_q, seqlens_k, cu_seqlens_q, cu_seqlens_k, block_table,
                         check_lengths)


def _run_backward(do, q, k, v, o, lse, causal, window, scale, softcap, alibi_slopes,
                  dropout_p, seed, block_q, block_k, backend, layout, deterministic,
                  seqlens_q, seqlens_k, cu_seqlens_q, cu_seqlens_k, block_table,
                  check_lengths):
    """The backward op's body, for the op and for eager calls (`_EagerAttention`)."""
    arguments = (causal, window, scale, softcap, alibi_slopes, dropout_p, seed, block_q,
                 block_k, backend, layout, deterministic, seqlens_q, seqlens_k, cu_seqlens_q,
                 cu_seqlens_k, block_table, check_lengths)
    if q.device.type == "cuda" and _replayable(arguments):
        results = _by_replay("backward", (do, q, k, v, o, lse), arguments,
                             lambda: _backward_results(q, k, v, layout, backend))
        if results is not None:
            return results
    # block_table is in the schema so that tileattn.backward itself refuses it (paged K/V
    # is forward only) with its own ValueError, in eager and compiled code alike.
    options = _options(causal, window, scale, softcap, alibi_slopes, dropout_p, seed,
                       block_q, block_k, backend, layout, seqlens_q, seqlens_k,
                       cu_seqlens_q, cu_seqlens_k, block_table, check_lengths)
    return _call_on_device(api.backward, (do, q, k, v, o, lse), deterministic=deterministic,
                           **options)


def _backward_results(q, k, v, layout, backend):
    """New (dq, dk, dv) laid out as tileattn's results are."""
    return tuple(_layout_strided(x, x.shape, q.dtype, layout,
                                 written_in_place=_in_place(q, backend)) for x in (q, k, v))


@_backward_op.register_fake
def _(do, q, k, v, o, lse, causal, window, scale, softcap, alibi_slopes, dropout_p, seed,
      block_q, block_k, backend, layout, deterministic, seqlens_q=None, seqlens_k=None,
      cu_seqlens_q=None, cu_seqlens_k=None, block_table=None, check_lengths=True):
    return _backward_results(q, k, v, layout, backend)


# --------------------------------------------------------------------------- replays

# A dense CUDA pass whose signature (the arguments; the tensors' shapes, strides and dtypes;
# the device) ran before is replayed (`api.replay`), one replay per torch stream: its
# launches write into new tensors, skipping validation, CuPy views and plan lookups, most
# of a small call's host time (bench/NOTES-gpu.md v27). A signature's first call takes the
# full path, which keeps its plan. A backward replay's scratch comes from torch's
# allocator, which knows CUDA graph capture, and lives with the replay.
# Values: (replay, its scratch tensors), or False for a signature whose plan is not kept.
_REPLAYS: dict = {}
_SEEN: dict = {}  # signatures that ran, without the stream
_REPLAY_LIMIT = 256


def _replayable(arguments) -> bool:
    """No ALiBi, dropout or lengths: the calls whose plans tileattn keeps."""
    alibi_slopes, dropout_p, lengths = arguments[4], arguments[5], arguments[12:17]
    return alibi_slopes is None and not dropout_p and all(x is None for x in lengths)


def _current_stream(device) -> int:
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # 0.3 us against 5
    return raw(device.index) if raw is not None else (
        torch.cuda.current_stream(device).cuda_stream)


def _remember(table: dict, key, value) -> None:
    if len(table) >= _REPLAY_LIMIT:
        table.clear()
    table[key] = value


def _by_replay(name: str, tensors: tuple, arguments: tuple, new_results):
    """Pass `name` on `tensors` run by a replay into the tensors ``new_results()`` makes,
    which it returns; None where no replay ran (nothing did)."""
    device = tensors[0].device
    window = arguments[1]
    signature = (name, arguments[:1] + (window if window is None else tuple(window),)
                 + arguments[2:], tuple((t.shape, t.stride(), t.dtype) for t in tensors),
                 device.index)
    stream = _current_stream(device)
    entry = _REPLAYS.get((signature, stream))
    if entry is False:
        return None
    if entry is None and signature not in _SEEN:
        _remember(_SEEN, signature, True)
        return None
    results = new_results()
    import cupy

    with cupy.cuda.Device(device.index), arrays.cupy_stream(stream, device.index):
        if entry is None:  # seen before (on this stream or another: a graph's capture)
            entry = _new_replay(name, tensors, arguments, results) or False
            _remember(_REPLAYS, (signature, stream), entry)
            if not entry:
                return None
        return results if entry[0](*(t.data_ptr() for t in tensors + results)) else None


def _new_replay(name: str, tensors: tuple, arguments: tuple, results: tuple):
    """``(replay, scratch)`` for pass `name` once tileattn keeps its plan, else None."""
    keywords = _options(*arguments[:11], *arguments[12:])
    if name == "backward":
        keywords["deterministic"] = arguments[11]
    outputs = dict(zip(("out", "lse_out") if name == "forward" else ("dq_out", "dk_out",
                                                                     "dv_out"),
                       map(_to_cupy, results)))
    scratch = []

    def allocate(size: int) -> int:
        scratch.append(torch.empty(size, dtype=torch.uint8, device=tensors[0].device))
        return scratch[-1].data_ptr()
    replay = api.replay(name, tuple(map(_to_cupy, tensors)), allocate=allocate,
                        **keywords, **outputs)
    return None if replay is None else (replay, scratch)


_OPTION_NAMES = ("causal", "window", "scale", "softcap", "alibi_slopes", "dropout_p", "seed",
                 "block_q", "block_k", "backend", "layout", "deterministic")
_LENGTH_NAMES = ("seqlens_q", "seqlens_k", "cu_seqlens_q", "cu_seqlens_k", "block_table")


def _setup_context(ctx, inputs, output):
    q, k, v, *rest = inputs
    # The schema's defaults are filled in here, so `rest` always holds every argument.
    options, lengths = rest[:len(_OPTION_NAMES)], rest[len(_OPTION_NAMES):-1]
    o, lse = output
    # Lengths and tables are tensors (or None), kept as saved tensors like q, k and v.
    ctx.save_for_backward(q, k, v, o, lse, *lengths)
    ctx.options = dict(zip(_OPTION_NAMES, options), check_lengths=rest[-1])


def _gradients(ctx, do, backward):
    """``(dq, dk, dv)`` and no gradient for the options, nor for the integer lengths and
    tables, through `backward` (the op, or its body in eager calls)."""
    q, k, v, o, lse, *lengths = ctx.saved_tensors
    dq, dk, dv = backward(do.to(o.dtype), q, k, v, o, lse, **ctx.options,
                          **dict(zip(_LENGTH_NAMES, lengths)))
    return (dq, dk, dv) + (None,) * (len(_OPTION_NAMES) + len(_LENGTH_NAMES) + 1)


def _backward_formula(ctx, do, dlse):
    # lse is returned for the backward pass, not as a differentiable output: `attention`
    # hands out only `o`, so `dlse` is zero and not part of the gradient.
    return _gradients(ctx, do, torch.ops.tileattn.backward)


_forward_op.register_autograd(_backward_formula, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The same passes as the ops, for calls outside torch.compile: a custom op's dispatch
    costs ~40 us a pass, and its autograd wrapper ~140 us more (CPU, tiny problem: 297 us a
    call against 118 us for `tileattn.forward` on the same tensors, 136 us through this).
    torch.compile traces the ops (`attention`).

    The forward takes no ctx and `setup_context` saves what the backward needs, the form
    torch.func asks of a Function: grad, vjp, jacrev and vmap (by `vmap`, a loop over the
    batched axis) run through it. lse is an output so that `setup_context` sees it; it is
    not differentiable."""

    @staticmethod
    def forward(q, k, v, *arguments):
        return _run_forward(q, k, v, *arguments)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output)
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, do, dlse):
        legacy_batched = getattr(torch._C._functorch, "is_legacy_batchedtensor", None)
        if legacy_batched is not None and legacy_batched(do):
            raise NotImplementedError(
                "tileattn.torch.attention: batched gradients through torch's legacy vmap "
                "(is_grads_batched=True, autograd.functional.jacobian(vectorize=True)) are "
                "not served; torch.func.vmap over torch.func.vjp is")
        # Under create_graph=True (grad mode on here, as torch.func.grad runs backwards) a
        # Function whose own backward refuses a second derivative by name, as the op does
        # in compiled code, instead of a silent zero.
        backward = _EagerBackward.call if torch.is_grad_enabled() else _run_backward
        return _gradients(ctx, do, backward)

    @staticmethod
    def vmap(info, in_dims, *inputs):
        return _looped(_EagerAttention, info, in_dims, inputs)


class _EagerBackward(torch.autograd.Function):
    """The backward pass as a Function with no derivative of its own: a second derivative
    (create_graph=True, torch.func.grad of a gradient) raises instead of reading zero."""

    @staticmethod
    def call(do, q, k, v, o, lse, **options):
        names = _OPTION_NAMES + ("check_lengths",) + _LENGTH_NAMES
        return _EagerBackward.apply(do, q, k, v, o, lse, *(options[n] for n in names))

    @staticmethod
    def forward(do, q, k, v, o, lse, *arguments):
        options, check_lengths = arguments[:len(_OPTION_NAMES)], arguments[len(_OPTION_NAMES)]
        lengths = arguments[len(_OPTION_NAMES) + 1:]
        return _run_backward(do, q, k, v, o, lse, *options, *lengths, check_lengths)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("tileattn.backward has no derivative: tileattn.torch.attention "
                           "serves first derivatives only")

    @staticmethod
    def vmap(info, in_dims, *inputs):
        return _looped(_EagerBackward, info, in_dims, inputs)


def _looped(function, info, in_dims, inputs):
    """torch.func.vmap's rule for `function`: one call per element of the batched axis
    (each call already runs every batch and head of its own tensors in one pass). Only
    tensors can be batched (q, k, v, do, o, lse, the slopes and the lengths); the options
    are Python values. Calls go through `function.apply`, so transforms below vmap (grad
    inside vmap) still see them."""
    batched = [(position, value.movedim(dim, 0))
               for position, (value, dim) in enumerate(zip(inputs, in_dims))
               if isinstance(dim, int)]  # None, or Nones mirroring a list option
    results = []
    for index in range(max(info.batch_size, 1)):
        call = list(inputs)
        for position, value in batched:
            # An empty axis: one call on zeros of an element's shape gives the results'
            # shapes, of which none is kept.
            call[position] = value[index] if info.batch_size else value.new_zeros(
                value.shape[1:])
        results.append(function.apply(*call))
    stacked = tuple(torch.stack(parts)[:info.batch_size] for parts in zip(*results))
    return stacked, (0,) * len(stacked)


def attention(q, k, v, *, causal=False, window=None, scale=None, softcap=None,
              alibi_slopes=None, dropout_p=0.0, seed=None, block_q=None, block_k=None,
              backend="auto", deterministic=True, layout="bhsd", seqlens_q=None,
              seqlens_k=None, cu_seqlens_q=None, cu_seqlens_k=None, block_table=None,
              check_lengths=True):
    """Differentiable `tileattn.forward` on torch tensors ``(*batch, H, N, D)``, or
    ``(*batch, N, H, D)`` with ``layout="bshd"`` (flash-attn's ``flash_attn_func`` layout).

    Variable-length batches take the keywords of `tileattn.forward` (docs/varlen.md):
    padded ``seqlens_q``/``seqlens_k`` of shape ``*batch``; packed ``cu_seqlens_q`` and
    ``cu_seqlens_k`` of shape ``(S + 1,)`` with q, k, v ``(H, N_total, D)`` (or
    ``(N_total, H, D)`` with "bshd", as ``flash_attn_varlen_func`` takes them); paged K/V
    with ``block_table`` ``(*batch, max_pages)``, ``seqlens_k`` and k, v page pools
    ``(num_pages, Hkv, page_size, D)`` (``(num_pages, page_size, Hkv, D)`` with "bshd").
    They are integer tensors, NumPy arrays or lists and get no gradient. Paged K/V is
    forward only: a backward through it raises tileattn.backward's ValueError.

    Same options as `tileattn.forward` (`alibi_slopes` as a tensor, a NumPy array or a
    list); `deterministic` applies to the backward pass. Returns ``o``, a tensor of q's dtype
    on q's device, in q's layout; with "bshd" it and the gradients are C-contiguous in that
    layout on a GPU (the kernels write them so, as flash-attn's), and strided views of
    "bhsd" buffers on the CPU (``.contiguous()`` packs them). Works under
    ``torch.compile(fullgraph=True)``: each pass is one `torch.ops.tileattn` operator.
    An option of a type the operator's schema does not take (``scale="a"``) gets torch's
    RuntimeError, which names the argument; values are checked by `tileattn.forward`.
    Outside torch.compile the same passes run through a `torch.autograd.Function` instead
    of the dispatcher (`_EagerAttention`, ~160 us less host time a training step), where a
    mistyped option gets `tileattn.forward`'s own error; a call with no gradient to take
    (under ``torch.no_grad()``, or no input requiring one) runs the forward alone.
    torch.func's grad, vjp, jacrev and vmap run through that Function too; a second
    derivative raises a RuntimeError naming tileattn.backward.
    """
    for name, array in (("q", q), ("k", k), ("v", v)):
        if not isinstance(array, torch.Tensor):
            raise TypeError(f"tileattn.torch.attention: {name} must be a torch.Tensor, got "
                            f"{type(array).__module__}.{type(array).__qualname__} (NumPy "
                            f"arrays go to tileattn.forward, or through torch.from_numpy)")
    # The forward never reads `deterministic`: checked here, or a bad one would surface
    # only when the backward runs. Compiled code leaves it to the op's schema (bool), so
    # that the graph holds no NumPy type test.
    if not torch.compiler.is_compiling():
        check_bool("deterministic", deterministic)
    arguments = (causal, _window_argument(window), scale, softcap,
                 _slopes_argument(alibi_slopes), dropout_p, _seed_argument(seed), block_q,
                 block_k, backend, layout, deterministic,
                 _lengths_argument("seqlens_q", seqlens_q),
                 _lengths_argument("seqlens_k", seqlens_k),
                 _lengths_argument("cu_seqlens_q", cu_seqlens_q),
                 _lengths_argument("cu_seqlens_k", cu_seqlens_k),
                 _lengths_argument("block_table", block_table),
                 check_lengths)
    if torch.compiler.is_compiling():
        return torch.ops.tileattn.forward(q, k, v, *arguments)[0]
    if _in_functorch_transform(q, k, v, *arguments) or _has_tangents(q, k, v):
        # torch.func (under make_fx too, as torch.func.linearize traces): the Function,
        # whose rules serve vmap, grad and vjp and refuse forward mode by torch's error.
        return _EagerAttention.apply(q, k, v, *arguments)[0]
    if _dispatch_mode_active():
        # Traced by make_fx: the op, whose fake implementation gives the shapes.
        return torch.ops.tileattn.forward(q, k, v, *arguments)[0]
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                         or v.requires_grad)):
        # Inference: no graph to record, so not even the Function's (~20 us a call).
        return _run_forward(q, k, v, *arguments)[0]
    return _EagerAttention.apply(q, k, v, *arguments)[0]


def _in_functorch_transform(*values) -> bool:
    """Whether torch.func (vmap, grad, vjp, ...) wraps any tensor among `values` (q, k, v,
    slopes or lengths): its gradients do not show in `requires_grad`, and its tensors need
    `_EagerAttention`'s rules."""
    wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return wrapped is not None and any(wrapped(value) for value in values
                                       if isinstance(value, torch.Tensor))


def _tracks_grad(tensor) -> bool:
    """Whether torch.func.grad (or vjp, jacrev) differentiates `tensor`."""
    tracking = getattr(torch._C._functorch, "is_gradtrackingtensor", None)
    return tracking is not None and tracking(tensor)


def _has_tangents(*tensors) -> bool:
    """Whether forward-mode AD (torch.autograd.forward_ad, torch.func.linearize) carries a
    tangent on any of `tensors`: the Function then refuses it by torch's jvp error, where
    the forward alone would drop the tangent without a word."""
    if getattr(forward_ad, "_current_level", -1) < 0:
        return False
    return any(forward_ad.unpack_dual(tensor).tangent is not None for tensor in tensors)


def _dispatch_mode_active() -> bool:
    """Whether a Python dispatch mode (make_fx's proxy or fake tensors) is tracing: the
    kernels cannot read its tensors, the op's fake implementation serves it."""
    return _get_current_dispatch_mode() is not None
