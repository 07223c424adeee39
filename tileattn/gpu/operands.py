"""What every launch needs besides its kernel: the arrays as the kernels read them, the
scalar score arguments, the device's limits, and the cache of a problem's launches."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import cupy
import numpy as np

from ..arrays import dtype_name
from ..dropout import dropout_key, dropout_threshold
from ..options import UNLIMITED, AttentionOptions
from .packed_launch import PackedLaunch
from .tiles import Problem

STORAGE = {"float16": "half_storage", "bfloat16": "bfloat16_storage", "float32": "float",
           "float64": "double"}


def accumulation_dtype(dtype) -> np.dtype:
    """float64 for float64 inputs, float32 for every other dtype (also lse's dtype)."""
    return np.dtype(np.float64) if dtype_name(dtype) == "float64" else np.dtype(np.float32)


@lru_cache(maxsize=None)
def compute_capability(device_id: int) -> int:
    return int(cupy.cuda.Device(device_id).compute_capability)


@lru_cache(maxsize=None)
def shared_memory_limit(device_id: int) -> int:
    """The most dynamic shared memory one block of this device may opt in to."""
    return int(cupy.cuda.runtime.getDeviceProperties(device_id)["sharedMemPerBlockOptin"])


@lru_cache(maxsize=None)
def sm_count(device_id: int) -> int:
    """The device's multiprocessors."""
    return int(cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])


def problem_for(device: int, dtype, head_dim: int, value_dim: int, n_k: int,
                options: AttentionOptions, query_heads: int = 0, n_q: int = 0) -> Problem:
    """The `tiles.Problem` of a shape on a device; with the forward's grid (`query_heads` =
    B x Hq heads of `n_q` rows) where rows of the tables go by waves."""
    switches = Switches.of(options)
    return Problem(capability=compute_capability(device),
                   shared_limit=shared_memory_limit(device), dtype=dtype_name(dtype),
                   head_dim=head_dim, value_dim=value_dim, n_k=n_k,
                   score_options=switches.softcap or switches.alibi or switches.dropout,
                   banded=options.is_masked, block_q=options.block_q, block_k=options.block_k,
                   per_row_options=switches.alibi or switches.dropout,
                   dropout=switches.dropout,
                   query_heads=query_heads, n_q=n_q,
                   multiprocessors=sm_count(device) if query_heads else 0)


def problem_of(q, k, v, options: AttentionOptions) -> Problem:
    """The `tiles.Problem` of these arrays on their device (a dense call's: with its Nq,
    which backward rows for few query rows read; not the forward's grid)."""
    return problem_for(q.device.id, q.dtype, q.shape[3], v.shape[3], k.shape[2], options,
                       n_q=q.shape[2])


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class Switches:
    """The options that select code at compile time (an off option costs nothing)."""

    limit_left: bool
    limit_right: bool
    softcap: bool
    alibi: bool
    dropout: bool

    @classmethod
    def of(cls, options: AttentionOptions) -> "Switches":
        return cls(limit_left=options.window_left != UNLIMITED,
                   limit_right=options.window_right != UNLIMITED,
                   softcap=options.softcap > 0, alibi=options.alibi_slopes is not None,
                   dropout=options.dropout_p > 0)

    @property
    def banded(self) -> bool:
        """A window side is limited: the kernels' grids then run tile-major (common.cuh:
        kBandedGrid)."""
        return self.limit_left or self.limit_right

    def defines(self) -> tuple:
        return (("ALIBI", int(self.alibi)), ("DROPOUT", int(self.dropout)),
                ("LIMIT_LEFT", int(self.limit_left)), ("LIMIT_RIGHT", int(self.limit_right)),
                ("SOFTCAP", int(self.softcap)))


def score_arguments(options: AttentionOptions, n_q: int, n_k: int, accum) -> tuple:
    """The run-time score options in the kernels' parameter order (for a variable-length
    call, the band offset is only the global-position shift; sequences.cuh adds the rest).

    Window sides are clamped to ``Nq + Nk + |band offset|``: a wider window keeps the same
    keys, and the clamp keeps the kernels' 64-bit band arithmetic far from overflow. The
    last two are the global positions of row 0 and key 0 for the dropout hash (nonzero for
    a block of a longer sequence, `AttentionOptions.row_offset`).
    """
    accum = np.dtype(accum).type
    if options.varlen is None:
        band_offset = options.band_offset(n_q, n_k)
    else:  # the kernels add each sequence's own bottom-right offset (sequences.cuh)
        band_offset = options.row_offset - options.col_offset
        n_k = options.varlen.key_capacity(n_k)
    reach = n_q + n_k + abs(band_offset)

    def side(value):
        return np.int64(0 if value == UNLIMITED else min(value, reach))

    dropping = options.dropout_p > 0
    return (accum(options.scale), accum(options.softcap if options.softcap > 0 else 1.0),
            np.int64(band_offset), side(options.window_left), side(options.window_right),
            np.uint32(dropout_key(options.seed) if dropping else 0),
            np.uint32(dropout_threshold(options.dropout_p) if dropping else 0),
            accum(1.0 / (1.0 - options.dropout_p)),
            np.uint32(options.row_offset & 0xFFFFFFFF), np.uint32(options.col_offset & 0xFFFFFFFF))


@lru_cache(maxsize=None)
def empty(device_id: int, dtype: str):
    """A zero-length array standing in for an unused pointer argument, one per device and
    dtype."""
    with cupy.cuda.Device(device_id):
        return cupy.empty(0, dtype=dtype)


def alibi_slopes(options: AttentionOptions):
    """The (B, Hq) float64 slopes on the device, or an empty stand-in when ALiBi is off."""
    if options.alibi_slopes is None:
        return empty(cupy.cuda.Device().id, "float64")
    return cupy.asarray(np.ascontiguousarray(options.alibi_slopes, dtype=np.float64))


# --------------------------------------------------------------------------- arrays


def _copy_contiguous(array):
    """A C-contiguous copy; 16-bit arrays are copied as uint16 bits, which works for
    bfloat16 whatever CuPy's own bfloat16 support."""
    if array.dtype.itemsize == 2:
        return array.view(cupy.uint16).copy(order="C").view(array.dtype)
    return array.copy(order="C")


def element_strides(array):
    """``(array, strides in elements)``; copies only if a stride is not a whole element."""
    itemsize = array.itemsize
    if any(stride % itemsize for stride in array.strides):
        array = _copy_contiguous(array)
    return array, tuple(np.int64(stride // itemsize) for stride in array.strides)


def output_strides(o) -> tuple:
    """o's batch, head and row strides in elements, as the kernels take them (they write
    rows of contiguous elements at any of these strides: a "bshd" result in place)."""
    itemsize = o.itemsize
    return tuple(np.int64(stride // itemsize) for stride in o.strides[:3])


def _alignment(value: int) -> int:
    """The largest of 16, 8, 4, 2, 1 that divides `value`."""
    value = abs(int(value))
    for size in (16, 8, 4, 2):
        if value % size == 0:
            return size
    return 1


def row_alignment(array) -> int:
    """The widest copy (bytes, at most 16) that every row of `array` allows: its address,
    its batch, head and row strides and its row's length in bytes all divide by it."""
    alignment = _alignment(array.data.ptr)
    for stride in array.strides[:3]:
        alignment = min(alignment, _alignment(stride))
    return min(alignment, _alignment(array.shape[3] * array.itemsize))


def tensor_core_operands(*arrays):
    """``(arrays, strides, copy_bytes)``: the arrays with contiguous rows (each is read in
    place unless its last axis is strided, which tensor cores cannot take), their element
    strides and the widest copy all of their rows allow."""
    ready = []
    for array in arrays:
        if array.strides[3] != array.itemsize:
            array = _copy_contiguous(array)
        ready.append(element_strides(array))
    copy_bytes = min(row_alignment(array) for array, _ in ready)
    return [a for a, _ in ready], [s for _, s in ready], copy_bytes


class NotReplayable(TypeError):
    """A launch asked to run on device addresses that only CuPy's launch can take."""


def _has_addresses(operands: tuple) -> bool:
    return any(type(operand) is int for operand in operands)


@dataclass
class Launch:
    """One kernel launch but for its array arguments, which come first: the grid, block,
    shared memory and the scalar arguments after the arrays. From its second call on (a
    cached plan) it launches through a `PackedLaunch`, its arguments converted once; a
    one-off launch (a variable-length call builds its own) keeps CuPy's."""

    function: object
    grid: tuple
    block: tuple
    shared: int
    arguments: tuple
    _packed: object = field(default=None, init=False, repr=False, compare=False)
    _calls: int = field(default=0, init=False, repr=False, compare=False)

    def __call__(self, *operands):
        """Launches on `operands`, CuPy arrays or, for a launch that has run before (a
        `tileattn.gpu.replay`), their device addresses as ints."""
        if not self.grid[0]:  # a variable-length call of empty sequences has no tile
            return
        packed = self._packed
        if packed is None and (self._calls or _has_addresses(operands)):
            packed = self._packed = PackedLaunch.build(
                self.function, self.grid, self.block, self.shared, len(operands),
                self.arguments) or False
        self._calls += 1
        if packed and packed.n_arrays == len(operands):
            packed(operands)
        elif _has_addresses(operands):
            raise NotReplayable("a launch whose arguments do not pack takes arrays only")
        else:
            self.function(self.grid, self.block, operands + self.arguments,
                          shared_mem=self.shared)


# --------------------------------------------------------------------------- launch cache

# Launches per problem, so that a repeated call (a training step, a benchmark) skips the
# kernel choice, the compile-cache lookup and the building of ~25 scalar arguments: at
# FlashAttention's N = 1k shapes the host time of a call is 15-30 % of its kernels' time
# (bench/NOTES-gpu.md, v9). Bounded: cleared when full.
_PLANS: dict[tuple, "Plan"] = {}
_PLAN_LIMIT = 256
# Launches over sequence tables built from the lengths' contents (`SequenceContents`): the
# layers of one training step share their lengths, the next step brings new ones, so these
# are kept apart, the oldest dropped first, and never crowd out dense plans.
_SEQUENCE_PLANS: dict[tuple, "Plan"] = {}
_SEQUENCE_PLAN_LIMIT = 32


@dataclass(frozen=True)
class SequenceContents:
    """The host lengths of a variable-length call (`VarlenLayout.contents`), in a plan key
    whose launches hold tables made from them (packed forwards, variable-length
    backwards)."""

    contents: tuple


@dataclass(frozen=True)
class Plan:
    """A problem's launches and the address alignment (bytes) their copies assume."""

    launches: tuple
    alignment: int


def plans_once(layout, forward: bool) -> bool:
    """Whether a call of `layout` plans its launches once per signature, its lengths and
    table filled into device tables at each call (varlen.Sequences): padded and paged
    forwards.
    A host-side plan cost such a call 0.5-0.7 ms of host time (H100 host, B 4 paged
    prefill: bench/NOTES-gpu.md v35), against ~0.1 ms through the tables."""
    return forward and layout.family != "packed"


def plan_key(direction: str, options: AttentionOptions, *arrays) -> tuple | None:
    """What a problem's launches depend on besides the arrays' addresses, or None when they
    are not cached: ALiBi slopes are an array of their own, dropout's seed usually changes
    with every call. A padded or paged forward (`plans_once`) keys by its lengths'
    signature: its tables are buffers of the plan, refilled per call on the current stream,
    so plans are per stream. Other variable-length calls build their tables from the
    lengths, so host lengths key by their contents too (`SequenceContents`, first in the
    key), and device lengths, which such a call must read anyway, are not cached."""
    if options.alibi_slopes is not None or options.dropout_p > 0:
        return None
    first, lengths = (), ()
    layout = options.varlen
    if layout is not None:
        if plans_once(layout, direction == "forward"):
            lengths = (layout.signature(), cupy.cuda.get_current_stream().ptr)
        elif layout.on_device:
            return None
        else:
            first, lengths = (SequenceContents(layout.contents()),), (layout.signature(),)
    return first + (
        direction, options.window_left, options.window_right, options.scale,
        options.softcap, options.block_q, options.block_k, options.deterministic,
        options.row_offset, options.col_offset, options.alignment,
        arrays[0].device.id) + tuple((a.dtype, a.shape, a.strides) for a in arrays) + lengths


def contiguous_strides(shape: tuple, itemsize: int) -> tuple:
    """The byte strides of a C-contiguous array of `shape`."""
    strides, step = [], itemsize
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def strided_out_defines(o) -> tuple:
    """``STRIDED_OUT=1`` for the tensor-core and decode kernels when o is not laid out as a
    contiguous (B, H, N, Dv) array (sequences.cuh says why the switch); axes of one
    element may have any stride."""
    contiguous = contiguous_strides(o.shape, o.itemsize)
    if all(size == 1 or stride == expected
           for size, stride, expected in zip(o.shape, o.strides, contiguous)):
        return ()
    return (("STRIDED_OUT", 1),)


def forward_plan_key(options: AttentionOptions, q, k, v, o_strides: tuple) -> tuple | None:
    """`plan_key` of a forward that writes o at these (byte) strides, which its launches
    take as arguments."""
    key = plan_key("forward", options, q, k, v)
    return None if key is None else key + (tuple(o_strides),)


def remember(key: tuple | None, launches: tuple, alignment: int, *arrays) -> None:
    """Caches `launches` under `key` when the arrays were read in place (so the strides in
    the launches' arguments are the arrays' own)."""
    if key is None or any(a.strides[3] != a.itemsize for a in arrays):
        return
    if isinstance(key[0], SequenceContents):
        if len(_SEQUENCE_PLANS) >= _SEQUENCE_PLAN_LIMIT:
            _SEQUENCE_PLANS.pop(next(iter(_SEQUENCE_PLANS)), None)
        _SEQUENCE_PLANS[key] = Plan(launches, alignment)
        return
    if len(_PLANS) >= _PLAN_LIMIT:
        _PLANS.clear()
    _PLANS[key] = Plan(launches, alignment)


def cached(key: tuple | None, *arrays) -> tuple | None:
    """The launches cached under `key`, if the arrays' addresses allow their copies."""
    if key is None:
        return None
    plan = (_SEQUENCE_PLANS if isinstance(key[0], SequenceContents) else _PLANS).get(key)
    if plan is None or any(a.data.ptr % plan.alignment for a in arrays):
        return None
    return plan.launches
