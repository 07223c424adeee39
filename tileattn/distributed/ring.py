"""Ring attention: the forward and backward of one sequence split across the ranks of a
group, exact to rounding against one device.

Forward (ring attention, Liu et al. 2023; the merge is FlashAttention's online softmax
applied to whole blocks): rank ``r`` keeps its queries and, for ``s = 0 .. P-1``, computes
them against the K/V block of rank ``r - s`` while the block of rank ``r - s - 1`` is already
in flight, merging each block's ``(o, lse)`` into float32 accumulators (float64 for float64
inputs) by their log-sum-exp. Each (query segment, key segment) pair is one call of the
backend with its global position (`AttentionOptions.row_offset`/`col_offset`/`alignment`),
so masks, ALiBi and dropout see global rows and keys; a pair that the mask removes wholly
is never called, and the diagonal pair gets the diagonal part of the mask from the backend.

Backward (as ring-flash-attention's): ``dq`` stays local; the ``dk``/``dv`` accumulators of a
block travel around the ring one step behind their K/V, each rank adding its queries' share,
so that after ``P`` shifts every rank holds its own shard's gradients. Each pair's backward
gets the merged ``o`` and ``lse`` of its rows, so its gradients are exactly its share.

Memory per rank: the local shard, the accumulators, and two K/V blocks (the one in hand and
the one arriving), plus in the backward two pairs of ``dk``/``dv`` accumulators.

``trace(event, step)``, where given, is called as the work is enqueued (the benchmark records
a CUDA event at each): ``"forward"``/``"backward"`` when a step's compute is, ``"-wait"`` and
``"-received"`` events around each wait for arriving arrays (the time between them is
communication the compute did not hide; the forward's ``"forward"`` event is its wait's
start), and ``"forward-end"``/``"backward-end"`` after the final casts.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from .. import arrays
from ..api import run_backward, run_forward
from ..options import UNLIMITED, tile_is_masked
from ..reference import lse_dtype
from ..validation import _normalise_window, check_bool, validate
from .layouts import (
    array_module,
    as_bits,
    check_layout,
    contiguous,
    empty_like_shape,
    from_float,
    segments,
    weighted_add,
)


class Pair:
    """One backend call of a ring step: query rows ``q_rows`` of this rank's shard against
    key rows ``k_rows`` of the block in hand, placed at global ``(row_start, col_start)``."""

    __slots__ = ("col_start", "k_rows", "q_rows", "row_start")

    def __init__(self, q_rows, k_rows, row_start, col_start):
        self.q_rows, self.k_rows = q_rows, k_rows
        self.row_start, self.col_start = row_start, col_start


@dataclasses.dataclass
class Ring:
    """What every step of one call needs: the validated local problem, the group's shape,
    and the whole problem's sizes and window."""

    problem: object
    transport: object
    rank: int
    size: int
    layout: str
    n_q_total: int
    n_k_total: int
    window: tuple
    backend: str

    @property
    def accumulate_dtype(self):
        return np.float64 if self.problem.dtype == np.float64 else np.float32

    def positions_matter(self) -> bool:
        """Whether a score depends on its global (row, key): masks, ALiBi and dropout do.
        Without them a step is one call of all local queries against the whole block."""
        options = self.problem.options
        # The whole problem's window: a side reaching past a shard's keys is unlimited in
        # the shard's own validation, yet masks in the whole sequence.
        masked = self.window != (UNLIMITED, UNLIMITED)
        return masked or options.alibi_slopes is not None or options.dropout_p > 0

    def pairs(self, step: int) -> list:
        """The backend calls of `step`, whose block came from rank ``rank - step``."""
        problem = self.problem
        if not self.positions_matter():
            return [Pair(slice(0, problem.n_q), slice(0, problem.n_k), 0, 0)]
        source = (self.rank - step) % self.size
        q_segments = segments(self.layout, self.rank, self.size, problem.n_q)
        k_segments = segments(self.layout, source, self.size, problem.n_k)
        offset_at = self.n_k_total - self.n_q_total  # bottom-right alignment of the whole
        kept = []
        for q_seg in q_segments:
            for k_seg in k_segments:
                band_offset = offset_at + q_seg.global_start - k_seg.global_start
                if tile_is_masked(0, q_seg.length, 0, k_seg.length, band_offset,
                                  self.window[0], self.window[1]):
                    continue
                kept.append(Pair(slice(q_seg.local_start, q_seg.local_start + q_seg.length),
                                 slice(k_seg.local_start, k_seg.local_start + k_seg.length),
                                 q_seg.global_start, k_seg.global_start))
        return kept

    def placed(self, pair: Pair, tensors: dict):
        """The validated problem of one pair: its slices, placed in the whole sequence.
        A group of one computes the whole problem as `tileattn.forward` does, bit for bit."""
        options = self.problem.options if self.size == 1 else dataclasses.replace(
            self.problem.options, row_offset=pair.row_start, col_offset=pair.col_start,
            alignment=self.n_k_total - self.n_q_total, window_left=self.window[0],
            window_right=self.window[1])
        sliced = {}
        for name, array in tensors.items():
            rows = pair.k_rows if name in ("k", "v") else pair.q_rows
            sliced[name] = array[:, :, rows]
        return dataclasses.replace(self.problem, tensors=sliced, options=options,
                                   n_q=pair.q_rows.stop - pair.q_rows.start,
                                   n_k=pair.k_rows.stop - pair.k_rows.start, outputs={})


_CHUNK_ELEMENTS = 1 << 25
"""Elementwise work on the accumulators runs a few heads at a time, so that its float32
temporaries stay near 128 MiB instead of growing with N/P (at N/P = 512k, 32 heads of
Dv = 128 one temporary of the whole would be 8 GiB), and so that CuPy runs the same
elementwise kernels at every N: CuPy gives large arrays variants with 64-bit indexing,
compiled (a few hundred milliseconds each) by the first call that reaches that size."""


def _head_chunks(array):
    """Slices of axis 1 (heads) holding about `_CHUNK_ELEMENTS` elements each."""
    per_head = max(1, array.size // max(1, array.shape[1]))
    step = max(1, _CHUNK_ELEMENTS // per_head)
    return [slice(start, start + step) for start in range(0, array.shape[1], step)]


def merge(o_acc, lse_acc, o_block, lse_block) -> None:
    """Merge a block's ``(o, lse)`` into the accumulators of the same rows, in place, by
    their log-sum-exp; a side with ``lse = -inf`` (no key kept) has weight exactly 0."""
    xp = array_module(o_acc)
    for heads in _head_chunks(o_acc):
        acc, lse_old = o_acc[:, heads], lse_acc[:, heads]
        lse_new = lse_block[:, heads].astype(lse_acc.dtype, copy=False)
        merged = xp.logaddexp(lse_old, lse_new)
        safe = xp.where(merged == -np.inf, 0.0, merged)
        weight_acc = xp.where(lse_old == -np.inf, 0.0, xp.exp(lse_old - safe))
        weight_block = xp.where(lse_new == -np.inf, 0.0, xp.exp(lse_new - safe))
        weighted_add(acc, weight_acc[..., None], weight_block[..., None], o_block[:, heads])
        lse_old[...] = merged


def narrowed(accumulator, dtype):
    """`accumulator` (float32/float64) cast to the input `dtype`, a few heads at a time."""
    out = empty_like_shape(accumulator, accumulator.shape, dtype)
    for heads in _head_chunks(accumulator):
        as_bits(out)[:, heads] = as_bits(from_float(accumulator[:, heads], dtype))
    return out


def add_into(accumulator, block) -> None:
    """``accumulator += block`` (a gradient block in the input dtype), a few heads at a
    time."""
    for heads in _head_chunks(accumulator):
        weighted_add(accumulator[:, heads], 1.0, 1.0, block[:, heads])


# --------------------------------------------------------------------------- agreement


def _option_description(options: dict) -> dict:
    described = {}
    for name, value in options.items():
        if name == "alibi_slopes" and value is not None:
            host = np.ascontiguousarray(np.asarray(arrays.to_host(value)), dtype=np.float64)
            value = f"shape {host.shape}, sha1 {hashlib.sha1(host.tobytes()).hexdigest()[:12]}"
        described[name] = repr(value)
    return described


def _array_description(named: dict) -> dict:
    described = {}
    for name, array in named.items():
        native = arrays.to_native(array)
        described[f"{name}.shape"] = tuple(native.shape)
        described[f"{name}.dtype"] = str(native.dtype)
        described[f"{name}.memory"] = arrays.memory_of(native)
    return described


def agree(group, function: str, named: dict, options: dict, check) -> object:
    """Run `check()` (local validation) on every rank, then one all-gather of what each rank
    was given and whether its check passed; every rank raises the same ValueError when a rank
    failed or the ranks disagree, so no rank is left waiting in the ring. Where every rank
    failed with a TypeError (an option of the wrong type, passed alike everywhere), that is
    what they raise, as `tileattn.forward` does."""
    result, error, description = None, None, {}
    try:
        description = {**_array_description(named), **_option_description(options)}
        result = check()
    except Exception as caught:  # noqa: BLE001 - any rank's failure must reach every rank
        error = f"{type(caught).__name__}: {caught}"
    gathered = group.allgather((description, error))
    failed = [(rank, message) for rank, (_, message) in enumerate(gathered) if message]
    if failed:
        lines = "; ".join(f"rank {rank}: {message}" for rank, message in failed)
        every_type_error = len(failed) == group.size and all(
            message.startswith("TypeError: ") for _, message in failed)
        raise (TypeError if every_type_error else ValueError)(
            f"tileattn.distributed.{function}: rejected on {len(failed)} of {group.size} "
            f"ranks: {lines}")
    first = gathered[0][0]
    for key in first:
        values = [description.get(key) for description, _ in gathered]
        if any(value != values[0] for value in values):
            shown = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values))
            raise ValueError(f"tileattn.distributed.{function}: every rank must pass the same "
                             f"{key}, got {shown}")
    return result


# --------------------------------------------------------------------------- the ring


def _ring(group, problem, layout, window_arg, causal, backend) -> Ring:
    n_q_total, n_k_total = problem.n_q * group.size, problem.n_k * group.size
    like = problem.tensors["q"]
    if group.size == 1:  # zigzag's two chunks of one rank are the whole sequence, in order
        layout = "contiguous"
    return Ring(problem=problem, transport=group.transport(problem.layout.memory, like),
                rank=group.rank, size=group.size, layout=layout, n_q_total=n_q_total,
                n_k_total=n_k_total,
                window=_normalise_window(window_arg, bool(causal), n_q_total, n_k_total),
                backend=backend)


def _check_local_rows(layout, n_q, n_k):
    if layout == "zigzag":
        for name, n in (("q", n_q), ("k", n_k)):
            if n % 2:
                raise ValueError(f"layout='zigzag' needs an even number of local rows "
                                 f"(two chunks of 2P), got {name} with {n} rows")


def ring_forward(group, q, k, v, *, layout, causal, window, backend, options, return_lse,
                 trace=None):
    check_layout(layout)

    def check():
        check_bool("return_lse", return_lse)
        problem = validate(q, k, v, causal=causal, window=window, **options,
                           deterministic=True)
        _check_local_rows(layout, problem.n_q, problem.n_k)
        return problem

    problem = agree(group, "forward", {"q": q, "k": k, "v": v},
                    {"layout": layout, "causal": causal, "window": window,
                     "backend": backend, "return_lse": return_lse, **options}, check)
    ring = _ring(group, problem, layout, window, causal, backend)
    tensors = problem.tensors
    xp = array_module(tensors["q"])
    accumulate = ring.accumulate_dtype
    batch, heads = tensors["q"].shape[:2]
    o_acc = xp.zeros((batch, heads, problem.n_q, problem.value_dim), accumulate)
    lse_acc = xp.full((batch, heads, problem.n_q), -np.inf, accumulate)
    block = [contiguous(tensors["k"]), contiguous(tensors["v"])]
    for step in range(group.size):
        pending = ring.transport.shift(block) if step + 1 < group.size else None
        for pair in ring.pairs(step):
            placed = ring.placed(pair, {"q": tensors["q"], "k": block[0], "v": block[1]})
            o_block, lse_block = run_forward(placed, backend)
            merge(o_acc[:, :, pair.q_rows], lse_acc[:, :, pair.q_rows], o_block, lse_block)
            if pending is not None:
                pending.progress()
        if trace is not None:
            trace("forward", step)
        if pending is not None:
            block = pending.wait()
            if trace is not None:
                trace("forward-received", step)
    o = problem.layout.restore(narrowed(o_acc, problem.dtype), problem.n_q_heads)
    lse = lse_acc.astype(lse_dtype(problem.dtype), copy=False)
    if trace is not None:
        trace("forward-end", group.size)
    if not return_lse:
        return o
    return o, problem.layout.restore(lse, problem.n_q_heads, is_lse=True)


def _traced_wait(pending, trace, step):
    if trace is not None:
        trace("backward-wait", step)
    arrived = pending.wait()
    if trace is not None:
        trace("backward-received", step)
    return arrived


def ring_backward(group, do, q, k, v, o, lse, *, layout, causal, window, backend, options,
                  trace=None):
    check_layout(layout)

    def check():
        problem = validate(q, k, v, do=do, o=o, lse=lse, causal=causal, window=window,
                           **options)
        _check_local_rows(layout, problem.n_q, problem.n_k)
        return problem

    problem = agree(group, "backward",
                    {"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse},
                    {"layout": layout, "causal": causal, "window": window,
                     "backend": backend, **options}, check)
    ring = _ring(group, problem, layout, window, causal, backend)
    tensors = problem.tensors
    xp = array_module(tensors["q"])
    accumulate = ring.accumulate_dtype
    rows = {name: tensors[name] for name in ("q", "do", "o", "lse")}
    dq_acc = xp.zeros(tensors["q"].shape, accumulate)
    block = [contiguous(tensors["k"]), contiguous(tensors["v"])]
    grads = [xp.zeros(tensors["k"].shape, accumulate), xp.zeros(tensors["v"].shape, accumulate)]
    grads_pending = None
    for step in range(group.size):
        pending = ring.transport.shift(block) if step + 1 < group.size else None
        shares = []
        for pair in ring.pairs(step):
            placed = ring.placed(pair, {**rows, "k": block[0], "v": block[1]})
            dq_block, dk_block, dv_block = run_backward(placed, backend)
            add_into(dq_acc[:, :, pair.q_rows], dq_block)
            shares.append((pair.k_rows, dk_block, dv_block))
            for waiting in (pending, grads_pending):
                if waiting is not None:
                    waiting.progress()
        if grads_pending is not None:  # this block's accumulators, one step behind its K/V
            grads = _traced_wait(grads_pending, trace, step)
        for k_rows, dk_block, dv_block in shares:
            add_into(grads[0][:, :, k_rows], dk_block)
            add_into(grads[1][:, :, k_rows], dv_block)
        if trace is not None:
            trace("backward", step)
        if group.size > 1:
            grads_pending = ring.transport.shift(grads)
        if pending is not None:
            block = _traced_wait(pending, trace, step)
    if grads_pending is not None:
        grads = _traced_wait(grads_pending, trace, group.size)
    grads = tuple(problem.layout.restore(narrowed(result, problem.dtype), heads)
                  for result, heads in ((dq_acc, problem.n_q_heads),
                                        (grads[0], problem.n_kv_heads),
                                        (grads[1], problem.n_kv_heads)))
    if trace is not None:
        trace("backward-end", group.size)
    return grads
