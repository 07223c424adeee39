"""Validation, done once at the API boundary (SPEC "Errors").

Every message names the argument, what was expected and what was given. Nothing here
writes to the caller's arrays; reshaping to the backends' 4-D layout makes views where the
strides allow and copies only where they do not.
"""

from __future__ import annotations

import math
import numbers
from functools import lru_cache
from dataclasses import dataclass, field, replace

import numpy as np

from . import arrays
from .backends import REGISTRY
from .dropout import dropout_threshold
from .options import UNLIMITED, AttentionOptions, VarlenLayout, evolve
from .reference import lse_dtype
from .varlen_validation import (check_block_table, check_cu_seqlens_pair, check_packed_slopes,
                                check_page_pools, check_seqlens, varlen_family)


LAYOUTS = ("bhsd", "bshd")


@dataclass
class Layout:
    """How the caller's shapes map onto the backends' ``(B, H, N, D)`` layout."""

    batch_shape: tuple
    single_head: bool  # the caller passed 2-D ``(N, D)`` arrays
    memory: str  # "host" or "cuda"
    library: str  # where the caller's q came from: results go back there
    sequence_first: bool = False  # layout="bshd": the caller's arrays are (*batch, N, H, D)

    def restore(self, array, heads: int, *, is_lse: bool = False):
        """Back from ``(B, H, N, ...)`` to the caller's ``(*batch, H, N, ...)`` (or, for
        ``layout="bshd"``, a ``(*batch, N, H, ...)`` view; lse keeps ``(*batch, H, N)``)
        and library."""
        if self.single_head:
            array = array.reshape(array.shape[2:])
        elif len(self.batch_shape) != 1:  # one batch dimension is the backends' layout
            array = array.reshape(self.batch_shape + (heads,) + array.shape[2:])
        if self.sequence_first and not self.single_head and not is_lse:
            array = array.swapaxes(-3, -2)
        return arrays.from_native(array, self.library)


def check_layout(layout) -> bool:
    """True for ``"bshd"``, the sequence-first layout of flash-attn."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError("layout must be 'bhsd' (batch, heads, seqlen, dim) or 'bshd' "
                         f"(batch, seqlen, heads, dim; flash-attn's), got {layout!r}")
    return layout == "bshd"


def _swap_heads_and_sequence(array):
    """A ``(*batch, N, H, D)`` array as the ``(*batch, H, N, D)`` view the backends read:
    swapaxes only changes strides, so the caller's memory is never copied. 2-D ``(N, D)``
    arrays have no head axis and are the same in both layouts."""
    return array.swapaxes(-3, -2) if array.ndim >= 3 else array


def _describe(shape) -> str:
    return f"shape {tuple(shape)}"


def _check_dtypes(named_arrays: dict) -> np.dtype:
    dtype = None
    for name, array in named_arrays.items():
        if not arrays.is_supported_float(array.dtype):
            raise TypeError(f"{name} must have a floating dtype (float16, bfloat16, float32 or "
                            f"float64), got dtype {array.dtype}")
        if dtype is None:
            dtype = array.dtype
        elif array.dtype != dtype:
            first = next(iter(named_arrays))
            raise TypeError(f"{name}.dtype must equal {first}.dtype ({dtype}), "
                            f"got {array.dtype}")
    return dtype


def _check_memory(named_arrays: dict) -> str:
    memories = {name: arrays.memory_of(a) for name, a in named_arrays.items()}
    kinds = set(memories.values())
    if len(kinds) > 1:
        detail = ", ".join(f"{name} on {memory}" for name, memory in memories.items())
        raise ValueError(f"q, k, v (and do, o, lse) must all be on the same device, got {detail}")
    memory = kinds.pop()
    if memory == "cuda":
        devices = {name: a.device.id for name, a in named_arrays.items()}
        if len(set(devices.values())) > 1:
            raise ValueError(f"arrays must be on one GPU, got devices {devices}")
    return memory


def _check_dims_and_heads(d: int, d_v: int, n_q_heads: int, n_kv_heads: int) -> None:
    """Positive head dims, and query heads a multiple of key/value heads (GQA/MQA)."""
    if d < 1:
        raise ValueError(f"q head dim D must be positive, got D={d}")
    if d_v < 1:
        raise ValueError(f"v head dim Dv must be positive, got Dv={d_v}")
    if n_kv_heads == 0 and n_q_heads > 0 or n_kv_heads > 0 and n_q_heads % n_kv_heads:
        raise ValueError(f"q heads must be a multiple of k/v heads (Hq % Hkv == 0), "
                         f"got Hq={n_q_heads}, Hkv={n_kv_heads}")


def _check_shapes(q, k, v, shapes: dict):
    """Returns ``(batch_shape, Hq, Hkv, Nq, Nk, D, Dv, single_head)``; messages show
    `shapes`, the caller's shapes in the caller's layout."""
    if q.ndim < 2:
        raise ValueError("q must have at least 2 dimensions (N, D), got "
                         f"{_describe(shapes['q'])}")
    for name, array in (("k", k), ("v", v)):
        if array.ndim != q.ndim:
            raise ValueError(f"{name}.ndim must equal q.ndim ({q.ndim}), got {name} "
                             f"{_describe(shapes[name])} and q {_describe(shapes['q'])}")
    single_head = q.ndim == 2
    if single_head:
        q, k, v = q[None], k[None], v[None]
    batch_shape = tuple(q.shape[:-3])
    for name, array in (("k", k), ("v", v)):
        if tuple(array.shape[:-3]) != batch_shape:
            raise ValueError(f"{name} batch dimensions must equal q's {batch_shape}, "
                             f"got {tuple(array.shape[:-3])}")
    n_q_heads, n_q, d = q.shape[-3:]
    n_kv_heads, n_k, d_k = k.shape[-3:]
    if d_k != d:
        raise ValueError(f"k head dim must equal q head dim D={d}, got {d_k} "
                         f"(q {_describe(shapes['q'])}, k {_describe(shapes['k'])})")
    if v.shape[-3] != n_kv_heads:
        raise ValueError(f"v heads must equal k heads Hkv={n_kv_heads}, got {v.shape[-3]}")
    if v.shape[-2] != n_k:
        raise ValueError(f"v sequence length must equal k's Nk={n_k}, got {v.shape[-2]}")
    d_v = v.shape[-1]
    _check_dims_and_heads(d, d_v, n_q_heads, n_kv_heads)
    return batch_shape, n_q_heads, n_kv_heads, n_q, n_k, d, d_v, single_head


def _check_paged_shapes(q, k, v, shapes: dict):
    """`_check_shapes` for paged K/V: ``q (*batch, Hq, Nq, D)`` and page pools
    ``k (num_pages, Hkv, page_size, D)``, ``v (num_pages, Hkv, page_size, Dv)``. Returns
    ``(batch_shape, Hq, Hkv, Nq, D, Dv, num_pages, page_size)``."""
    if q.ndim < 3:
        raise ValueError(f"q must have shape (*batch, Hq, Nq, D) with block_table (paged "
                         f"K/V), got {_describe(shapes['q'])}")
    num_pages, page_size = check_page_pools(k, v)
    n_q_heads, n_q, d = q.shape[-3:]
    n_kv_heads, d_k, d_v = k.shape[1], k.shape[3], v.shape[3]
    if d_k != d:
        raise ValueError(f"k head dim must equal q head dim D={d}, got {d_k} "
                         f"(q {_describe(shapes['q'])}, k {_describe(shapes['k'])})")
    _check_dims_and_heads(d, d_v, n_q_heads, n_kv_heads)
    return tuple(q.shape[:-3]), n_q_heads, n_kv_heads, n_q, d, d_v, num_pages, page_size


def with_lengths(template: Problem, varlen: dict, backward: bool, gpu: int | None,
                 check_lengths: bool):
    """The options of a remembered call on GPU `gpu` (None: on the CPU; `template`,
    validated with lengths of the same signature: CuPy or NumPy arrays, and the same
    `check_lengths`) around this call's `varlen` arrays (tileattn.problem_cache): their
    contents checked as `validate` checks them unless `check_lengths` is False. Nothing
    else that validation derives depends on the lengths' contents."""
    layout = template.options.varlen
    if not check_lengths:
        swapped = _swapped_unchecked_lengths(layout, varlen)
        if swapped is not None:
            return evolve(template.options, varlen=swapped)
    paging = (layout.num_pages, layout.page_size) if layout.family == "paged" else None
    fresh = _check_varlen(varlen_family(varlen, backward=backward), varlen,
                          template.layout.batch_shape, template.n_q, template.n_k,
                          bool(check_lengths), paging, gpu)
    return evolve(template.options, varlen=fresh)


_UNCHECKED_LENGTH_NAMES = ("seqlens_q", "seqlens_k", "block_table")


def _swapped_unchecked_lengths(layout, varlen: dict):
    """`layout` (validated with arrays of this call's signature: types, names, shapes,
    strides, dtypes, device) around this call's arrays, as `_check_varlen` would make it,
    without its checks, which the signature already passed (a decode loop's step: a few
    microseconds of its host time, bench/NOTES-gpu.md v33).
    None where the template holds a host array in place of a device one (lengths on
    another GPU), and for uint64 host arrays (whose values `_check_varlen` checks against
    int64): then the full path."""
    if layout.family == "packed":
        return None
    arrays = {}
    for name in _UNCHECKED_LENGTH_NAMES:
        kept, given = getattr(layout, name), varlen.get(name)
        if (kept is None) != (given is None):
            return None
        if given is None:
            continue
        if isinstance(kept, np.ndarray):
            if type(given) is not np.ndarray or given.dtype == np.uint64:
                return None
            given = given.astype(np.int64)  # a copy, as varlen_validation's host path makes
        elif given.dtype != np.int32 and given.dtype != np.int64:
            given = given.astype(np.int64)  # as varlen_validation's device path does
        arrays[name] = given if given.shape == kept.shape else given.reshape(kept.shape)
    return evolve(layout, **arrays)


def _check_varlen(family, keywords, batch_shape, n_q, n_k, check_lengths, paging,
                  gpu=None):
    """The length keywords of `family` as a `VarlenLayout` (contents checked unless
    ``check_lengths=False``); `paging` is ``(num_pages, page_size)`` for paged K/V. An
    unchecked padded or paged call on GPU `gpu` keeps lengths and tables on that GPU where
    they are (varlen_validation's docstring)."""
    if family == "packed":
        cu_q, cu_k = check_cu_seqlens_pair(keywords["cu_seqlens_q"], keywords["cu_seqlens_k"],
                                           n_q, n_k, check_lengths)
        return VarlenLayout("packed", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            checked=check_lengths)
    seqlens_q = (None if keywords.get("seqlens_q") is None else check_seqlens(
        "seqlens_q", keywords["seqlens_q"], batch_shape, n_q, "Nq", check_lengths, gpu))
    if family == "padded":
        seqlens_k = (None if keywords.get("seqlens_k") is None else check_seqlens(
            "seqlens_k", keywords["seqlens_k"], batch_shape, n_k, "Nk", check_lengths, gpu))
        return VarlenLayout("padded", seqlens_q=seqlens_q, seqlens_k=seqlens_k,
                            checked=check_lengths)
    num_pages, page_size = paging
    seqlens_k = check_seqlens("seqlens_k", keywords["seqlens_k"], batch_shape, None,
                              check_values=check_lengths, keep_device=gpu)
    table = check_block_table(keywords["block_table"], seqlens_k, batch_shape, num_pages,
                              page_size, check_lengths, gpu)
    return VarlenLayout("paged", seqlens_q=seqlens_q, seqlens_k=seqlens_k, block_table=table,
                        page_size=page_size, num_pages=num_pages, checked=check_lengths)


def _to_4d(array, batch: int, single_head: bool):
    if single_head:
        return array[None, None]
    if array.ndim == 4:  # already (B, H, N, D): no reshape (a CuPy reshape costs microseconds)
        return array
    return array.reshape((batch,) + tuple(array.shape[-3:]))


def _lse_view(array, batch: int, single_head: bool):
    return (array if array.ndim == 3 and not single_head
            else _to_4d(array[..., None], batch, single_head)[..., 0])


def backend_views(named: dict, batch: int, single_head: bool) -> dict:
    """The backends' 4-D views of dense arrays in ``(*batch, H, N, D)`` order (lse: 3-D)."""
    return {name: _lse_view(array, batch, single_head) if name == "lse"
            else _to_4d(array, batch, single_head) for name, array in named.items()}


def heads_first(named: dict) -> dict:
    """A "bshd" call's arrays in ``(*batch, H, N, D)`` order; lse is ``(*batch, H, N)`` in
    both layouts, as flash-attn's softmax_lse."""
    return {name: a if name == "lse" else _swap_heads_and_sequence(a)
            for name, a in named.items()}


def output_view(name: str, array, batch: int, single_head: bool, sequence_first: bool):
    """A caller's output buffer in the backends' axis order, and as their 4-D view (lse_out:
    3-D); the latter is a view indeed once the buffer is C-contiguous in either order (its
    leading batch axes then merge without a copy)."""
    if name == "lse_out":
        return array, _lse_view(array, batch, single_head)
    ordered = _swap_heads_and_sequence(array) if sequence_first else array
    return ordered, _to_4d(ordered, batch, single_head)


def _check_int(name, value, *, minimum):
    # type() is: the common case skips the abstract-base-class checks (microseconds a call).
    if type(value) is not int and (isinstance(value, bool)
                                   or not isinstance(value, numbers.Integral)):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_real(name, value):
    if type(value) is not float and (isinstance(value, bool)
                                     or not isinstance(value, numbers.Real)):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    try:
        value = float(value)
    except OverflowError:  # an int beyond float64, such as 10**400
        raise ValueError(f"{name} must be finite, got {value!r}, which overflows float64") \
            from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _compute_dtype(dtype) -> np.dtype:
    """SPEC "Precision": float64 inputs are computed in float64, every other dtype in float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


_LOG2_E = math.log2(math.e)


@lru_cache(maxsize=256)  # the same scale and dtype on every call of a model's layers
def _check_in_compute_dtype(name, value: float, dtype: np.dtype):
    """A nonzero scalar option must stay a normal, finite number in the compute dtype, and so
    must its product with log2(e): the kernels fold log2(e) into the scale, the softcap and
    the ALiBi slopes (their softmax uses exp2), and the GPU compiles with flush-to-zero, so a
    subnormal one acts as 0. A softcap that rounded to 0 was ignored by the CPU forward while
    its backward read a buffer it had not filled."""
    if value == 0:
        return
    compute = _compute_dtype(dtype)
    info = np.finfo(compute)
    largest = float(info.max)  # a Python float: comparing with info.max casts to compute
    with np.errstate(over="ignore", under="ignore"):
        rounded = float(compute.type(value))
    where = f"in {compute.name}, the compute dtype of {np.dtype(dtype).name} inputs"
    if abs(rounded) < info.tiny:
        raise ValueError(f"{name}={value!r} vanishes {where}: it rounds to {rounded!r}, below "
                         f"the smallest normal {compute.name} {float(info.tiny):.6g}")
    if abs(value) * _LOG2_E > largest:
        raise ValueError(f"{name}={value!r} overflows {where}: {name} * log2(e) = "
                         f"{abs(value) * _LOG2_E:.6g}, which the kernels use, exceeds the "
                         f"largest {compute.name} {largest:.6g}")


def _normalise_window(window, causal: bool, n_q: int, n_k: int):
    if window is None:
        left, right = UNLIMITED, UNLIMITED
    else:
        if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
            raise ValueError(f"window must be None or a pair (left, right), got {window!r}")
        sides = []
        for side_name, side in zip(("left", "right"), window):
            if side is None:
                sides.append(UNLIMITED)
                continue
            if isinstance(side, bool) or not isinstance(side, numbers.Integral):
                raise TypeError(f"window {side_name} must be an int or None, got {side!r} "
                                f"({type(side).__name__})")
            # A side reaching past every key is unlimited; this also keeps kernels' int32
            # index arithmetic (i + Nk - Nq - left) from overflowing on huge values.
            sides.append(UNLIMITED if side < 0 or side >= n_q + n_k else int(side))
        left, right = sides
    if causal:
        right = 0
    return left, right


def _check_slopes(slopes: np.ndarray, dtype):
    """Every slope finite and, as `_check_in_compute_dtype` says, 0 or a normal number of
    the compute dtype; checked for all slopes at once (no Python loop per head)."""
    not_finite = ~np.isfinite(slopes)
    if not_finite.any():
        index = tuple(int(i) for i in np.argwhere(not_finite)[0])
        raise ValueError(f"alibi_slopes must be finite, got {slopes[index]} at index {index}")
    compute = _compute_dtype(dtype)
    info = np.finfo(compute)
    with np.errstate(over="ignore", under="ignore"):
        rounded = np.abs(slopes.astype(compute)).astype(np.float64)
    degenerate = (slopes != 0) & ((rounded < info.tiny)
                                  | (np.abs(slopes) * _LOG2_E > float(info.max)))
    if degenerate.any():
        index = tuple(int(i) for i in np.argwhere(degenerate)[0])
        _check_in_compute_dtype(f"alibi_slopes[{', '.join(map(str, index))}]",
                                float(slopes[index]), dtype)


def _normalise_alibi(slopes, batch_shape, n_q_heads, dtype):
    if slopes is None:
        return None
    slopes = np.asarray(arrays.to_host(slopes))
    if slopes.dtype.kind not in "fiu" or slopes.dtype == bool:
        raise TypeError(f"alibi_slopes must be real numbers, got dtype {slopes.dtype}")
    allowed = [(n_q_heads,), tuple(batch_shape) + (n_q_heads,)]
    if slopes.shape not in allowed:
        raise ValueError(f"alibi_slopes must have shape (Hq,) = {allowed[0]} or (*batch, Hq) = "
                         f"{allowed[1]}, got {slopes.shape}")
    batch = math.prod(batch_shape)
    slopes = slopes.astype(np.float64)
    _check_slopes(slopes, dtype)
    if slopes.shape == (n_q_heads,):
        return np.ascontiguousarray(np.broadcast_to(slopes, (batch, n_q_heads)))
    return slopes.reshape(batch, n_q_heads)


def check_seed(seed):
    """`seed` as an int in ``[0, 2**64)``, or None; also used by the torch adapter, which must
    fit the seed into torch's int64 before the API sees it."""
    if seed is None:
        return None
    seed = _check_int("seed", seed, minimum=0)
    if seed >= 2**64:
        raise ValueError(f"seed must be < 2**64, got {seed}")
    return seed


def _normalise_dropout(dropout_p, seed):
    """``(dropout_p, seed)`` as every backend reads them: the effective dropout.

    The dropout hash keeps an entry when its 16 random bits reach ``floor(p * 2**16)``
    (`tileattn.dropout`), so a ``0 < p < 2**-16`` drops nothing. Such a p is off on every
    backend: nothing dropped and no ``1 / (1 - p)`` rescale (the CPU kernels skipped the
    rescale while the golden model applied it). Any larger p drops and rescales by
    ``1 / (1 - p)`` as SPEC says. The seed is 0 whenever dropout is off.
    """
    dropout_p = _check_real("dropout_p", dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0 and seed is None:
        raise ValueError("seed must be an int when dropout_p > 0 (backward needs the same "
                         "seed to drop the same entries), got None")
    seed = check_seed(seed)
    if dropout_threshold(dropout_p) == 0:
        return 0.0, 0
    return dropout_p, seed


def make_options(*, causal, window, scale, softcap, alibi_slopes, dropout_p, seed, block_q,
                 block_k, deterministic, batch_shape, n_q_heads, head_dim, n_q, n_k,
                 dtype) -> AttentionOptions:
    """Check every keyword option and fold them into one `AttentionOptions`; `dtype` is the
    inputs' (scalar options must survive its compute dtype)."""
    check_bool("causal", causal)
    window_left, window_right = _normalise_window(window, bool(causal), n_q, n_k)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else _check_real("scale", scale)
    _check_in_compute_dtype("scale", scale, dtype)
    if softcap is None:
        softcap = 0.0
    else:
        softcap = _check_real("softcap", softcap)
        if softcap < 0:
            raise ValueError(f"softcap must be >= 0 (0 or None disables it), got {softcap}")
        _check_in_compute_dtype("softcap", softcap, dtype)
        compute = _compute_dtype(dtype)
        largest = float(np.finfo(compute).max)
        # The GPU kernels divide by the cap once, as scale / softcap, in the compute dtype.
        if softcap > 0 and abs(scale) / softcap > largest:
            raise ValueError(
                f"softcap={softcap!r} is too small for scale={scale!r} in {compute.name}, the "
                f"compute dtype of {np.dtype(dtype).name} inputs: scale / softcap = "
                f"{abs(scale) / softcap:.6g} exceeds the largest {compute.name} {largest:.6g}")
    dropout_p, seed = _normalise_dropout(dropout_p, seed)
    if block_q is not None:
        block_q = _check_int("block_q", block_q, minimum=1)
    if block_k is not None:
        block_k = _check_int("block_k", block_k, minimum=1)
    check_bool("deterministic", deterministic)
    return AttentionOptions(
        causal=bool(causal), window_left=window_left, window_right=window_right, scale=scale,
        softcap=softcap,
        alibi_slopes=_normalise_alibi(alibi_slopes, batch_shape, n_q_heads, dtype),
        dropout_p=dropout_p, seed=seed, block_q=block_q, block_k=block_k,
        deterministic=bool(deterministic))


@lru_cache(maxsize=1024)
def _extent(shape: tuple, strides: tuple, itemsize: int) -> tuple:
    """``[low, high)`` of the bytes an array of this layout touches, from its pointer (a
    call with out= asks it of five arrays: remembered, it costs a lookup, not two sums)."""
    low = sum(min(0, (n - 1) * s) for n, s in zip(shape, strides))
    high = sum(max(0, (n - 1) * s) for n, s in zip(shape, strides))
    return low, high + itemsize


def _byte_range(array, memory: str) -> tuple:
    """``[low, high)``: the bytes `array` (in `memory`) can touch."""
    pointer = array.data.ptr if memory == "cuda" else array.ctypes.data
    low, high = _extent(array.shape, array.strides, array.itemsize)
    return pointer + low, pointer + high


def _check_outputs(given: dict, expected: dict, to_backend, inputs: dict, memory: str):
    """The caller's output buffers (``out=`` and friends) as the backends' views.

    `given` maps each name to the caller's array or None, `expected` each name to its
    ``(shape, dtype)`` in the caller's layout, `to_backend` gives a buffer in the backends'
    axis order and as their 4-D (3-D for lse) view (a view indeed once the former is
    C-contiguous). A buffer must have exactly that shape and dtype, sit in the inputs'
    memory (and GPU, aligned to two elements there when D is even), be writeable and
    C-contiguous in the caller's layout or in the backends' order (with "bshd" either
    ``(*batch, N, H, D)``, as flash-attn's results, or ``(*batch, H, N, D)`` seen through
    swapaxes), and share no byte with an input or another output: the kernels read
    inputs while they write outputs.
    """
    checked, views = {}, {}
    for name, array in given.items():
        if array is None:
            continue
        _check_not_masked(name, array)
        if (arrays.library_of(array) not in ("numpy", "cupy", "torch")
                and not hasattr(array, "__cuda_array_interface__")):
            # Anything else converts to a new array, which the results would go into.
            raise TypeError(f"{name} must be a NumPy, CuPy or torch array to write the "
                            f"results into, got {type(array).__module__}."
                            f"{type(array).__qualname__}")
        array = arrays.to_native(array)
        shape, dtype = expected[name]
        if tuple(array.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(array.shape)}")
        if array.dtype != dtype:
            raise ValueError(f"{name} must have dtype {dtype}, got {array.dtype}")
        where = arrays.memory_of(array)
        if where != memory:
            raise ValueError(f"{name} must be in the inputs' memory ({memory}), got {where}")
        if memory == "cuda" and array.device.id != next(iter(inputs.values())).device.id:
            raise ValueError(f"{name} must be on the inputs' GPU "
                             f"{next(iter(inputs.values())).device.id}, got {array.device.id}")
        if memory == "host" and not array.flags.writeable:
            raise ValueError(f"{name} must be writeable, got a read-only array")
        ordered, view = to_backend(name, array)
        if not (ordered.flags.c_contiguous or array.flags.c_contiguous):
            order = (" in its own (*batch, N, H, D) order or in (*batch, H, N, D) order"
                     if ordered is not array else "")
            raise ValueError(f"{name} must be C-contiguous{order}, got strides "
                             f"{tuple(array.strides)}")
        checked[name], views[name] = array, view
    check_output_addresses(checked, inputs, memory)
    return views


def other_readers(varlen, alibi_slopes, memory: str) -> dict:
    """The arrays a call reads besides q, k, v (do, o, lse): its lengths, block table and
    ALiBi slopes where given as arrays in the call's memory, which no output buffer may
    overlap either (the kernels read them while they write)."""
    readers = {}
    for name, value in list((varlen or {}).items()) + [("alibi_slopes", alibi_slopes)]:
        if value is None or arrays.library_of(value) not in ("numpy", "cupy", "torch"):
            continue
        native = arrays.to_native(value)
        if arrays.memory_of(native) == memory:
            readers[name] = native
    return readers


def _may_overlap(array, other) -> bool:
    """Whether two host arrays share a byte: NumPy's bounds test, then, where the bounds
    overlap, its exact test (a strided array's gaps may hold the other), bounded in work;
    where that gives up, taken as sharing."""
    if not np.may_share_memory(array, other):
        return False
    try:
        return np.shares_memory(array, other, max_work=1 << 16)
    except _TOO_HARD:
        return True


_TOO_HARD = getattr(getattr(np, "exceptions", np), "TooHardError", Exception)


def check_output_addresses(outputs: dict, inputs: dict, memory: str) -> None:
    """What `_check_outputs` asks of the buffers' addresses, the part that a call with the
    shapes, strides and dtypes of a validated one must still check (`problem_cache`)."""
    if not outputs:
        return
    for name, array in outputs.items():
        # The GPU kernels store rows of an even length as pairs of elements (mma.cuh,
        # store_row_pair), lse one element at a time. New CuPy and XLA buffers are 256-byte
        # aligned; a view at an odd element offset is not.
        if (memory == "cuda" and name != "lse_out" and array.shape[-1] % 2 == 0
                and array.data.ptr % (2 * array.itemsize)):
            raise ValueError(f"{name} must start at an address aligned to two elements "
                             f"({2 * array.itemsize} bytes), got {array.data.ptr:#x}")
    if memory == "host":
        # NumPy compares the arrays' byte bounds in C: ~0.25 us a pair, where reading a
        # pointer from Python (array.ctypes) costs ~1 us an array (a decode step with out=
        # paid 15 us for the ranges below).
        named = [(name, array) for name, array in list(inputs.items()) + list(outputs.items())
                 if array.size]
        for name, array in named:
            if name in outputs:
                for other_name, other in named:
                    if other_name != name and _may_overlap(array, other):
                        raise ValueError(f"{name} must not share memory with {other_name}")
        return
    # Each range once: on the GPU a range reads a few CuPy attributes, and a decode step
    # with out= and lse_out= would otherwise take sixteen of them.
    ranges = {name: _byte_range(array, memory)
              for name, array in list(inputs.items()) + list(outputs.items()) if array.size}
    for name in outputs:
        if name not in ranges:
            continue
        low, high = ranges[name]
        for other_name, (other_low, other_high) in ranges.items():
            if other_name != name and low < other_high and other_low < high:
                raise ValueError(f"{name} must not share memory with {other_name}")


def _native(name: str, array):
    """`arrays.to_native(array)`, its refusal (a torch dtype with no NumPy counterpart)
    naming the argument."""
    try:
        return arrays.to_native(array)
    except TypeError as error:
        raise TypeError(f"{name}: {error}") from None


def _check_not_masked(name: str, array) -> None:
    """A NumPy masked array's mask would be dropped without a word (its data would be read
    as if nothing were masked, or a result written beside its mask): refused."""
    if isinstance(array, np.ma.MaskedArray):
        raise TypeError(f"{name} is a NumPy masked array, whose mask tileattn does not read: "
                        f"pass {name}.data or {name}.filled(value); keys are masked by "
                        "causal, window, seqlens_k or cu_seqlens_k")


def check_bool(name: str, value) -> None:
    """A flag must be a bool (or NumPy's): a truthy ``"no"`` or ``1`` is not taken for True."""
    if value.__class__ is not bool and not isinstance(value, np.bool_):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def check_backend_name(backend) -> str:
    if type(backend) is str and (backend in REGISTRY or backend == "auto"):
        return backend
    names = ("auto",) + tuple(REGISTRY)
    if backend not in names:
        raise ValueError(f"backend must be one of {names}, got {backend!r}")
    return backend


@dataclass
class Problem:
    """Validated inputs in the backends' 4-D layout, plus how to give results back."""

    tensors: dict  # name -> 4-D (or 3-D for lse) array
    layout: Layout
    options: AttentionOptions
    dtype: np.dtype
    n_q_heads: int
    n_kv_heads: int
    n_q: int
    n_k: int
    head_dim: int
    value_dim: int
    outputs: dict = field(default_factory=dict)  # name -> caller's buffer, backends' view

    @property
    def is_empty(self) -> bool:
        batch = self.tensors["q"].shape[0]
        return batch == 0 or self.n_q_heads == 0 or self.n_q == 0 or self.n_k == 0


def validate(q, k, v, *, do=None, o=None, lse=None, layout="bhsd", outputs=None, varlen=None,
             check_lengths=True, **option_kwargs) -> Problem:
    """Check the arrays and options of a forward (``do`` is None) or backward call.

    `outputs` maps the output-buffer arguments (``out``, ``lse_out`` of a forward;
    ``dq_out``, ``dk_out``, ``dv_out`` of a backward) to the caller's arrays or None.
    `varlen` maps the length keywords (``seqlens_q``, ``seqlens_k``, ``cu_seqlens_q``,
    ``cu_seqlens_k``, ``block_table``) to the caller's arrays or None; they become
    ``options.varlen`` (SPEC "Variable-length batches and paged K/V")."""
    sequence_first = check_layout(layout)
    check_bool("check_lengths", check_lengths)
    family = varlen_family(varlen, backward=do is not None) if varlen else None
    library = arrays.library_of(q)
    named = {"q": q, "k": k, "v": v}
    if do is not None:
        named.update(do=do, o=o, lse=lse)
    for name, array in named.items():
        _check_not_masked(name, array)
    slopes_given = option_kwargs.get("alibi_slopes")
    # The caller's memory, for the output buffers' overlap check: an input in another byte
    # order is read from a native copy, but a buffer over its bytes would still overwrite it.
    natives = {name: _native(name, a) for name, a in named.items()}
    named = {name: arrays.to_native_byte_order(a) for name, a in natives.items()}
    shapes = {name: tuple(a.shape) for name, a in named.items()}
    if sequence_first:
        named = heads_first(named)
    memory = _check_memory(named)
    q, k, v = named["q"], named["k"], named["v"]
    dtype = _check_dtypes({name: named[name] for name in ("q", "k", "v")})
    if family == "packed":
        for name in ("q", "k", "v"):
            if named[name].ndim != 3:
                order = "(N_total, H, D)" if sequence_first else "(H, N_total, D)"
                raise ValueError(f"{name} must have shape {order} with cu_seqlens (packed "
                                 f"sequences, no batch axes), got {_describe(shapes[name])}")
    paging = None
    if family == "paged":
        (batch_shape, n_q_heads, n_kv_heads, n_q, d, d_v, *paging) = _check_paged_shapes(
            q, k, v, shapes)
        single_head, n_k = False, 0
    else:
        batch_shape, n_q_heads, n_kv_heads, n_q, n_k, d, d_v, single_head = _check_shapes(
            q, k, v, shapes)
    batch = math.prod(batch_shape)
    varlen_layout = None
    if family is not None:
        varlen_layout = _check_varlen(family, varlen, batch_shape, n_q, n_k,
                                      bool(check_lengths), paging,
                                      q.device.id if memory == "cuda" else None)
        n_k = varlen_layout.key_capacity(n_k)
    if family == "paged":
        tensors = {"q": _to_4d(q, batch, False), "k": k, "v": v}
    else:
        tensors = backend_views({name: named[name] for name in ("q", "k", "v")}, batch,
                                single_head)
    out_shape = (n_q, d_v) if single_head else batch_shape + (
        (n_q, n_q_heads, d_v) if sequence_first else (n_q_heads, n_q, d_v))
    lse_shape = (n_q,) if single_head else batch_shape + (n_q_heads, n_q)
    if do is not None:
        for name, expected in (("do", out_shape), ("o", out_shape), ("lse", lse_shape)):
            if shapes[name] != expected:
                read_as = " (layout='bshd')" if sequence_first and name != "lse" else ""
                raise ValueError(f"{name} must have shape {expected}{read_as}, "
                                 f"got {shapes[name]}")
        _check_dtypes({"q": q, "do": named["do"], "o": named["o"]})
        if not arrays.is_supported_float(named["lse"].dtype):
            raise TypeError(f"lse must have a floating dtype, got {named['lse'].dtype}")
        tensors.update(backend_views({name: named[name] for name in ("do", "o", "lse")},
                                     batch, single_head))
    packed_slopes = None
    if family == "packed":
        packed_slopes = option_kwargs.pop("alibi_slopes", None)
        option_kwargs["alibi_slopes"] = None
    options = make_options(batch_shape=batch_shape, n_q_heads=n_q_heads, head_dim=d, n_q=n_q,
                           n_k=n_k, dtype=dtype, **option_kwargs)
    if family is not None:
        slopes = options.alibi_slopes
        if packed_slopes is not None:
            n_sequences = varlen_layout.n_sequences
            check_packed_slopes(packed_slopes, n_sequences, n_q_heads)
            slopes = _normalise_alibi(packed_slopes, (n_sequences,), n_q_heads, dtype)
        options = replace(options, varlen=varlen_layout, alibi_slopes=slopes)
    output_views = {}
    # only when a buffer is given: small GPU calls are counted in microseconds of host time
    if outputs and any(buffer is not None for buffer in outputs.values()):
        expected = {"out": (out_shape, dtype), "lse_out": (lse_shape, lse_dtype(dtype)),
                    "dq_out": (shapes["q"], dtype), "dk_out": (shapes["k"], dtype),
                    "dv_out": (shapes["v"], dtype)}

        def to_backend(name, array):
            return output_view(name, array, batch, single_head, sequence_first)

        readers = {**natives, **other_readers(varlen, slopes_given, memory)}
        output_views = _check_outputs(outputs, expected, to_backend, readers, memory)
    return Problem(tensors=tensors,
                   layout=Layout(batch_shape, single_head, memory, library, sequence_first),
                   options=options, dtype=dtype, n_q_heads=n_q_heads, n_kv_heads=n_kv_heads,
                   n_q=n_q, n_k=n_k, head_dim=d, value_dim=d_v, outputs=output_views)
