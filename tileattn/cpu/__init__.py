"""The CPU backend: Numba kernels over host (NumPy) arrays. See `tileattn.backends`.

Every kernel is compiled once per compute dtype (float32, or float64 for float64 inputs)
and cached on disk (``cache=True``), so later processes load it instead of compiling. To
keep that to one compilation, the launchers always pass the same argument types: inputs as
read-only C-contiguous arrays of the compute dtype, options as plain Python scalars.
float16 and bfloat16 inputs are converted to float32 (SPEC: they accumulate in float32), on
every thread, and float16 results back (`widen`).

The first use of a dtype compiles for seconds: `compile_notice` says so on stderr, and
`warmup` compiles every kernel ahead of time.

The backward is always deterministic, so ``options.deterministic`` changes nothing here.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
from dataclasses import dataclass

import numba
import numpy as np

from ..dropout import dropout_key, dropout_threshold
from ..options import BAND, KEYS, ROWS, AttentionOptions, Blocks, dense_descriptors
from .. import tile_order
from ..arrays import dtype_name
from . import (bf16_products, blas, compile_notice, decode,  # noqa: F401 (compile_notice listens)
               threads)
from .blocks import BOUNDARY_SLICE_ROWS, cache_sizes, default_blocks, spread_over_threads
from .warmup import warmup  # noqa: F401 (``python -m tileattn warmup``)
from .widen import narrowed, widened

MEMORY = "host"
VARLEN = True  # serves seqlens, cu_seqlens and block_table (`Sequences`)

# Each call already spreads over every core it can use (`threads`), and the BLAS thread
# limit around it is process-wide: serialising calls costs nothing.
_kernel_lock = threading.Lock()


def _new_kernel_lock() -> None:
    """A forked child's lock: the parent's may have been held by a thread inside a call at
    the fork, which the child does not have, so its first call would wait forever."""
    global _kernel_lock
    _kernel_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_kernel_lock)


def availability() -> str | None:
    if importlib.util.find_spec("scipy") is None:
        return ("Numba's np.dot (BLAS gemm, used for every tile) needs SciPy, which is not "
                "installed: pip install 'tileattn[cpu]'")
    return None


def hardware() -> dict[str, str]:
    """For ``python -m tileattn info``: threads and the cache sizes the tiles come from."""
    caches = cache_sizes()
    return {"threads": str(numba.get_num_threads()),
            "L1d per core": f"{caches.l1d // 1024} KiB",
            "L2 per core": f"{caches.l2 // 1024} KiB"}


_FLOAT32, _FLOAT64 = np.dtype(np.float32), np.dtype(np.float64)
_BITS = np.dtype(np.uint16)  # 16-bit K and V read as they are on the decode path


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """float64 for float64, float32 for the others; also lse's dtype (SPEC)."""
    return _FLOAT64 if dtype == _FLOAT64 else _FLOAT32


def _read_only(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A read-only C-contiguous view in `dtype`, copying only when the input is not one
    (16-bit inputs widened to float32 on every thread: `widen`)."""
    wide = widened(array) if dtype == _FLOAT32 and array.itemsize == 2 else None
    view = (np.ascontiguousarray(array, dtype=dtype) if wide is None else wide).view()
    # write=False, passed by position: ~0.25 us, against ~0.5 by keyword and ~0.8 through
    # ``flags.writeable`` (2-core development host; a backward makes six of these).
    view.setflags(False)
    return view


def _blocks(kind: str, q, v, options: AttentionOptions, n_threads: int,
            shape: "Sequences") -> Blocks:
    """The tile sizes, clamped to the longest sequence (a larger tile is one tile anyway).

    Without an override, ``block_q`` shrinks until every thread has work (`blocks.py`).
    """
    head_dim, n_q_heads = q.shape[3], q.shape[1]
    defaults = default_blocks(kind, head_dim, v.shape[3], q.itemsize, options.is_masked)
    block_q = spread_over_threads(defaults.block_q,
                                  lambda size: n_q_heads * shape.query_tasks(size), n_threads)
    blocks = Blocks(block_q, defaults.block_k).resolve(options.block_q, options.block_k)
    return Blocks(max(1, min(blocks.block_q, shape.max_rows)),
                  max(1, min(blocks.block_k, shape.max_keys)))


class Sequences:
    """A call's sequences for the kernels: the descriptors (int64, one row per sequence;
    `tileattn.options.DESCRIPTOR_COLUMNS`), the block table (int64 ``(B, max_pages)``,
    ``(0, 0)`` unless paged) and how the page pools lie. A dense call gets one sequence per
    batch element (`dense_descriptors`), so every call takes the same kernel signature."""

    def __init__(self, q, k, options: AttentionOptions):
        batch, _, n_q, _ = q.shape
        layout = options.varlen
        self.varlen = layout is not None
        self.page_size, self.slots_outer = 0, 0
        self.block_table = _NO_TABLE
        if layout is None:
            n_k = k.shape[2]
            self.descriptors = _dense_descriptors(batch, n_q, n_k,
                                                  options.band_offset(n_q, n_k))
            self.max_rows, self.max_keys = n_q, n_k
        else:
            self.descriptors = layout.descriptors(batch, n_q, k.shape[2])
            if layout.family == "paged":
                self.block_table = np.array(layout.block_table, np.int64)
                self.page_size = layout.page_size
            self.max_rows = int(self.descriptors[:, ROWS].max(initial=0))
            self.max_keys = int(self.descriptors[:, KEYS].max(initial=0))

    def pools(self, k, v, dtype, bits=False):
        """The kernels' read-only C-contiguous views of k and v, in `dtype` or, with `bits`,
        as 16-bit inputs' uint16 bits (`_decode_widening`). For a paged call, pools stored
        ``(num_pages, page_size, Hkv, D)`` (vLLM's order, passed transposed) are read in
        that order without a copy (`tiles.key_value_rows`'s `slots_outer`); both pools are
        read in k's order."""
        def prepared(x):
            return _bits_of(x) if bits else _read_only(x, dtype)

        if self.page_size and k.strides[2] > k.strides[1] and k.shape[1] > 1:
            self.slots_outer = 1
            return tuple(prepared(x.transpose(0, 2, 1, 3)) for x in (k, v))
        return prepared(k), prepared(v)

    def kv_heads(self, k_pool) -> int:
        """Hkv of the kernels' view of k (`pools`: a paged pool may hold slots outermost)."""
        return k_pool.shape[2] if self.slots_outer else k_pool.shape[1]

    def query_tasks(self, block_q: int) -> int:
        """Query tiles over all sequences (per head) for tiles of `block_q` rows."""
        if not self.varlen:
            return len(self.descriptors) * -(-self.max_rows // block_q)
        return int((-(-self.descriptors[:, ROWS] // block_q)).sum())

    def key_tasks(self, block_k: int) -> int:
        """Key tiles over all sequences (per kv head) for tiles of `block_k` keys."""
        if not self.varlen:
            return len(self.descriptors) * -(-self.max_keys // block_k)
        return int((-(-self.descriptors[:, KEYS] // block_k)).sum())

    def pairs(self, options: AttentionOptions) -> int:
        """Kept (row, key) pairs over all sequences, per head."""
        d = self.descriptors
        if not self.varlen:  # every sequence alike: count one
            return len(d) * _dense_pairs(self.max_rows, self.max_keys, int(d[0, BAND]),
                                         options.window_left, options.window_right)
        return tile_order.kept_pairs(d[:, ROWS], d[:, KEYS], d[:, BAND], options.window_left,
                                     options.window_right)

    def tiles(self, block: int, options: AttentionOptions, keys: bool = False):
        """``(sequence, first row)`` pairs of every query tile (or with `keys`, first key of
        every key tile), longest first (`tile_order.tile_list`). A dense batch orders one
        sequence's tiles and deals each to every batch element in turn."""
        d = self.descriptors
        rows, cols, bands = (d[:, KEYS], d[:, ROWS], -d[:, BAND]) if keys else (
            d[:, ROWS], d[:, KEYS], d[:, BAND])
        left, right = ((options.window_right, options.window_left) if keys
                       else (options.window_left, options.window_right))
        if self.varlen or not len(d):
            return tile_order.tile_list(rows, cols, bands, block, left, right)[0]
        return _dense_tiles(len(d), int(rows[0]), int(cols[0]), int(bands[0]), block, left,
                            right)


_NO_TABLE = np.zeros((0, 0), np.int64)


# Dense calls repeat shapes (a decode loop, a training step): their descriptors and tile
# lists are cached, which kept the per-call host time of small calls at main's (the
# NumPy to build them cost 10-15 us a call). The kernels never write them.
@functools.lru_cache(maxsize=256)
def _dense_descriptors(batch: int, n_q: int, n_k: int, band_offset: int) -> np.ndarray:
    return dense_descriptors(batch, n_q, n_k, band_offset)


@functools.lru_cache(maxsize=256)
def _dense_pairs(n_rows, n_cols, band_offset, window_left, window_right) -> int:
    return int(tile_order.kept_pairs_per_row(n_rows, n_cols, band_offset, window_left,
                                           window_right).sum())


@functools.lru_cache(maxsize=256)
def _in_order(n_sequences: int) -> np.ndarray:
    """``(sequence, 0)`` for every sequence in order: the heads schedule of a dense batch."""
    return np.stack([np.arange(n_sequences, dtype=np.int64),
                     np.zeros(n_sequences, np.int64)], axis=1)


# 32 shapes: a tile list holds two int64 per (batch element, tile), 1 MB at B = 64 and
# 1024 tiles, and a loop repeats a few shapes.
@functools.lru_cache(maxsize=32)
def _dense_tiles(batch, n_rows, n_cols, band_offset, block, window_left, window_right):
    """One sequence's tiles longest first, each dealt to every batch element in turn."""
    order = tile_order.longest_first(-(-n_rows // block), block, n_rows, n_cols, band_offset,
                                   window_left, window_right)
    tiles = np.empty((order.size * batch, 2), np.int64)
    tiles[:, 0] = np.tile(np.arange(batch, dtype=np.int64), order.size)
    tiles[:, 1] = np.repeat(order * block, batch)
    return tiles


@functools.lru_cache(maxsize=256)
def _no_slopes(n_sequences: int, n_q_heads: int) -> np.ndarray:
    """Zero ALiBi slopes (read-only, shared by every call of this shape): ALiBi off."""
    return _read_only(np.zeros((n_sequences, n_q_heads)), np.float64)


def _option_scalars(options: AttentionOptions, n_sequences: int, n_q_heads: int):
    """The kernels' option arguments, from `scale` to `inv_keep`. The dropout's position
    offsets are plain ints like the window sides (int64 in the kernels: a placed block's
    sides and offsets are the whole sequence's), so they add no specialisation; band
    offsets are per sequence, in the descriptors."""
    slopes = options.alibi_slopes
    slopes = (_no_slopes(n_sequences, n_q_heads) if slopes is None
              else _read_only(slopes, np.float64))
    key = dropout_key(options.seed) if options.dropout_p > 0 else 0
    threshold = dropout_threshold(options.dropout_p) if options.dropout_p > 0 else 0
    return (float(options.scale), float(options.softcap), slopes,
            int(options.window_left), int(options.window_right), int(options.row_offset),
            int(options.col_offset), int(key), int(threshold), 1.0 / (1.0 - options.dropout_p))


def _flops(q, v, pairs: int) -> float:
    """FLOPs of the forward's two matrix products over `pairs` kept (row, key) pairs per
    head."""
    return 2.0 * q.shape[1] * float(pairs) * (q.shape[3] + v.shape[3])


def _paging(shape: Sequences):
    return shape.block_table, shape.page_size, shape.slots_outer


@dataclass(frozen=True)
class _ForwardPlan:
    """What a forward derives from its shapes and options before any kernel runs: the
    sequences, the kernels' option arguments, the decode path's sizing where it takes the
    call, else the tiled kernel's thread count, tiles and task list."""

    shape: Sequences
    scalars: tuple
    decode: decode.DecodePlan | None = None
    n_workers: int = 1
    blocks: Blocks | None = None
    tiles: np.ndarray | None = None


# Dense forwards per signature: the validated options object (hashed by identity; the
# problem cache hands the same one back for a repeated call), the arrays' shapes, the
# compute dtype and Numba's thread count (the calling thread's: `threads.allowed`). A
# decode step or a small call then skips the planning, ~10 us of Python a call
# (bench/NOTES-cpu.md, session 12). Calls with new options every time (a dropout seed
# per step) only cycle the cache.
_FORWARD_PLANS: dict = {}
_PLAN_LIMIT = 64


def _forward_plan(q_c, k_c, v_c, options: AttentionOptions, shape: Sequences) -> _ForwardPlan:
    n_q_heads, n_q = q_c.shape[1], q_c.shape[2]
    scalars = _option_scalars(options, len(shape.descriptors), n_q_heads)
    if decode.takes(n_q, shape.max_keys, n_q_heads // shape.kv_heads(k_c),
                    k_c.dtype == _BITS):
        return _ForwardPlan(shape, scalars, decode.plan(q_c, k_c, v_c, options, shape))
    n_threads = threads.threads_for(_flops(q_c, v_c, shape.pairs(options)))
    blocks = _blocks("forward", q_c, v_c, options, n_threads, shape)
    tiles = shape.tiles(blocks.block_q, options)
    return _ForwardPlan(shape, scalars, None, min(n_threads, n_q_heads * len(tiles)), blocks,
                        tiles)


@functools.cache
def _kernels(module: str):
    """The kernel module `module` ("forward_kernel", "backward_kernel"), imported at its
    first use (importing it loads or compiles its kernels), then without the ~2 us of an
    import statement a call. Callers read the kernels from it at each call."""
    return importlib.import_module(f"{__name__}.{module}")


# bfloat16's tiled forward and backward multiply on AVX512-BF16 where the CPU has it
# (`bf16_products`: P and dS rounded to bfloat16 as the GPU kernels round them), else on
# float32 BLAS, as every other dtype does.
BF16_PAIR_PRODUCTS = bf16_products.HAS_PAIR_DOT


def _pair_products(dtype):
    """The tiled kernels' `pairs` argument for inputs of `dtype`: 1 for bfloat16's pair
    products, None for BLAS (a kernel specialisation each)."""
    return 1 if BF16_PAIR_PRODUCTS and dtype_name(dtype) == "bfloat16" else None


def _forward(q_c, k_c, v_c, options: AttentionOptions, plan: _ForwardPlan, widen: int = 0,
             pairs=None):
    """Forward over prepared (compute-dtype, read-only, contiguous) arrays; for a decode
    with `widen`, k and v are 16-bit bits (`_decode_widening`); `pairs` as
    `_pair_products` says for the tiled kernel."""
    shape = plan.shape
    if plan.decode is not None:
        return decode.forward(q_c, k_c, v_c, options, plan.scalars, _kernel_lock, shape,
                              sizing=plan.decode, widen=widen)
    batch, n_q_heads, n_q, _ = q_c.shape
    # Rows of no sequence (padding) are never written by the kernel: o 0, lse -inf (SPEC).
    allocate = (np.zeros, lambda shape_, dtype: np.full(shape_, -np.inf, dtype)) \
        if shape.varlen else (np.empty, np.empty)
    out = allocate[0]((batch, n_q_heads, n_q, v_c.shape[3]), q_c.dtype)
    lse = allocate[1]((batch, n_q_heads, n_q), q_c.dtype)
    with _kernel_lock, blas.single_threaded():
        threads.run(_kernels("forward_kernel").forward_kernel, plan.n_workers, q_c, k_c, v_c,
                    out, lse, shape.descriptors, plan.tiles, *_paging(shape), *plan.scalars,
                    plan.blocks.block_q, plan.blocks.block_k, BOUNDARY_SLICE_ROWS, pairs)
    return out, lse


def forward(q, k, v, options: AttentionOptions):
    dtype = _compute_dtype(q.dtype)
    key = ((options, q.shape, k.shape, v.shape, dtype, threads.allowed())
           if options.varlen is None else None)
    plan = _FORWARD_PLANS.get(key) if key is not None else None
    shape = Sequences(q, k, options) if plan is None else plan.shape
    widen = _decode_widening(q, k, v, shape, plan)
    q_c = _read_only(q, dtype)
    k_c, v_c = shape.pools(k, v, dtype, bits=bool(widen))
    if plan is None:
        plan = _forward_plan(q_c, k_c, v_c, options, shape)
        if key is not None:
            if len(_FORWARD_PLANS) >= _PLAN_LIMIT:
                _FORWARD_PLANS.clear()
            _FORWARD_PLANS[key] = plan
    out, lse = _forward(q_c, k_c, v_c, options, plan, widen, _pair_products(q.dtype))
    # lse's dtype (SPEC) is the compute dtype: only o may need converting.
    return narrowed(out, q.dtype), lse


def _decode_widening(q, k, v, shape: Sequences, plan: _ForwardPlan | None) -> int:
    """1 (float16) or 2 (bfloat16) where a forward on the decode path reads 16-bit K and V
    as they are, widening each key tile in the kernel (`decode_kernel`): it streams K and V
    once, and their float32 copy cost more than the whole step (bench/NOTES-cpu.md,
    session 30), of a whole page pool where a call reads a few of its pages. 0 elsewhere:
    the tiled kernels, whose products dwarf the copy, take float32 arrays."""
    name = dtype_name(k.dtype)
    if name not in ("float16", "bfloat16") or v.dtype != k.dtype or not k.dtype.isnative:
        return 0
    takes = (plan.decode is not None if plan is not None else
             decode.takes(q.shape[2], shape.max_keys, q.shape[1] // k.shape[1], True))
    return (1 if name == "float16" else 2) if takes else 0


def _bits_of(array: np.ndarray) -> np.ndarray:
    """A read-only C-contiguous uint16 view of a 16-bit array's bits."""
    view = np.ascontiguousarray(array).view(np.uint16)
    view.setflags(False)
    return view


# The backward's dQ parts (`backward_kernel.KEY_PARTS`: a dQ per key tile) up to this many
# times the bytes of its inputs (q, k, v, dO), so that its extra memory stays O(N) (one
# head of D 64: up to N = 4096, 8 MB); larger calls take the seven-product split schedule.
KEY_PARTS_BUDGET = 2.0
_NO_PARTS = {dtype: np.zeros((0, 0, 0, 0, 0), dtype) for dtype in (_FLOAT32, _FLOAT64)}


def clear_plans() -> None:
    """Forgets the plans of earlier calls (the registry's `clear_plans`)."""
    _FORWARD_PLANS.clear()
    _BACKWARD_PLANS.clear()


def _use_heads_schedule(n_sequences: int, n_kv_heads: int, n_threads: int) -> bool:
    """Whether one task per (sequence, kv head) keeps every thread equally busy (see
    `backward_kernel`); otherwise the split schedule spreads key and query tiles."""
    tasks = n_sequences * n_kv_heads
    return tasks % n_threads == 0 or tasks >= 4 * n_threads


@dataclass(frozen=True)
class _BackwardPlan:
    """What a backward derives from its shapes and options before any kernel runs: the
    sequences, the kernels' option arguments and tiling, and the `backward_kernel` passes
    as ``(schedule, threads, task list)``; with `key_parts`, dQ is summed from `n_parts`
    parts (`backward_kernel.KEY_PARTS`) on `n_threads` threads."""

    shape: Sequences
    scalars: tuple
    tiling: tuple
    runs: tuple
    key_parts: bool
    n_parts: int
    n_threads: int
    dq_zeroed: bool  # the schedule adds into dQ (or leaves padding rows): it starts at 0


# Dense backwards per signature, as `_FORWARD_PLANS` (the same key): a training step's small
# calls skip the planning, ~15 us of Python a call (bench/NOTES-cpu.md, session 26).
_BACKWARD_PLANS: dict = {}


def _backward_plan(q_c, k_c, v_c, do_c, options: AttentionOptions,
                   shape: Sequences) -> _BackwardPlan:
    from .backward_kernel import HEADS, KEY_PARTS, KEY_TILES, QUERY_TILES

    descriptors = shape.descriptors
    n_sequences, n_q_heads, n_kv_heads = len(descriptors), q_c.shape[1], k_c.shape[1]
    # FlashAttention's count: the backward's five products are 2.5x the forward's two. Few
    # query rows over many keys do little arithmetic for the bytes of K and V read and dK
    # and dV written, which count as a decode call's bytes do (`decode.BYTE_COST`).
    moved = 2 * (k_c.nbytes + v_c.nbytes)
    n_threads = threads.threads_for(max(2.5 * _flops(q_c, v_c, shape.pairs(options)),
                                        decode.BYTE_COST * moved))
    blocks = _blocks("backward", q_c, v_c, options, n_threads, shape)
    scalars = _option_scalars(options, n_sequences, n_q_heads)
    heads_schedule = _use_heads_schedule(n_sequences, n_kv_heads, n_threads)
    if not heads_schedule and options.block_k is None:
        # Tasks per key tile: as many as `spread_over_threads` gives query tiles.
        blocks = Blocks(blocks.block_q, spread_over_threads(
            blocks.block_k, lambda size: n_kv_heads * shape.key_tasks(size), n_threads))
    tiling = (blocks.block_q, blocks.block_k, BOUNDARY_SLICE_ROWS)
    n_parts = -(-shape.max_keys // blocks.block_k)
    key_parts = False
    if heads_schedule:
        tiles = _in_order(n_sequences)
        if shape.varlen:  # longest sequences first, so a long one never starts last
            work = descriptors[:, ROWS] * descriptors[:, KEYS]
            tiles = tiles[np.argsort(-work, kind="stable")]
        runs = ((HEADS, min(n_threads, n_sequences * n_kv_heads), tiles),)
        dq_zeroed = True
    elif n_parts * q_c.nbytes <= KEY_PARTS_BUDGET * (q_c.nbytes + k_c.nbytes + v_c.nbytes
                                                       + do_c.nbytes):
        runs = ((KEY_PARTS, n_threads, shape.tiles(blocks.block_k, options, keys=True)),)
        key_parts, dq_zeroed = True, False
    else:
        runs = ((KEY_TILES, n_threads, shape.tiles(blocks.block_k, options, keys=True)),
                (QUERY_TILES, n_threads, shape.tiles(blocks.block_q, options)))
        # Rows of no sequence (padding) are never written by the kernel: 0 (SPEC).
        dq_zeroed = shape.varlen
    return _BackwardPlan(shape, scalars, tiling, runs, key_parts, n_parts, n_threads,
                         dq_zeroed)


def backward(do, q, k, v, o, lse, options: AttentionOptions):
    kernels = _kernels("backward_kernel")
    pairs = _pair_products(q.dtype)
    dtype = _compute_dtype(q.dtype)
    do_c, q_c, k_c, v_c, o_c, lse_c = (_read_only(x, dtype) for x in (do, q, k, v, o, lse))
    key = ((options, q.shape, k.shape, v.shape, dtype, threads.allowed())
           if options.varlen is None else None)
    plan = _BACKWARD_PLANS.get(key) if key is not None else None
    if plan is None:
        plan = _backward_plan(q_c, k_c, v_c, do_c, options, Sequences(q, k, options))
        if key is not None:
            if len(_BACKWARD_PLANS) >= _PLAN_LIMIT:
                _BACKWARD_PLANS.clear()
            _BACKWARD_PLANS[key] = plan
    shape = plan.shape
    rows = q.shape[:3]
    delta = np.empty(rows, dtype)
    safe_lse = np.empty(rows, dtype)
    # Keys and rows of no sequence (padding) are never written by the kernel: 0 (SPEC).
    allocate = np.zeros if shape.varlen else np.empty
    dk = allocate(k.shape, dtype)
    dv = allocate(v.shape, dtype)
    dq = (np.zeros if plan.dq_zeroed else np.empty)(q.shape, dtype)
    dq_parts = (np.zeros((plan.n_parts,) + q.shape, dtype) if plan.key_parts
                else _NO_PARTS[dtype])
    with _kernel_lock, blas.single_threaded():
        kernels.row_terms_kernel(do_c, o_c, lse_c, delta, safe_lse)
        delta.setflags(False)  # write=False (`_read_only`)
        safe_lse.setflags(False)
        for kernel_schedule, n_workers, tiles in plan.runs:
            threads.run(kernels.backward_kernel, n_workers, q_c, k_c, v_c, do_c, safe_lse,
                        delta, dq, dq_parts, dk, dv, shape.descriptors, *plan.scalars,
                        *plan.tiling, kernel_schedule, tiles, pairs)
        if len(dq_parts):
            threads.run(kernels.sum_key_parts, plan.n_threads, dq_parts, dq)
    return narrowed(dq, q.dtype), narrowed(dk, k.dtype), narrowed(dv, v.dtype)


# --------------------------------------------------------------------------- info


def describe(n_k: int, head_dim: int, value_dim: int, dtype,
             options: AttentionOptions | None = None, *, n_q: int | None = None,
             heads: int = 1, kv_heads: int | None = None, batch: int = 1) -> dict[str, str]:
    """For ``python -m tileattn info``: which kernel and schedule each direction of a dense
    call of this shape runs here, as the call's own plans choose them (`_forward_plan`,
    `_backward_plan`)."""
    n_q = n_k if n_q is None else n_q
    forward_plan, backward_plan = _plans(n_q, n_k, head_dim, value_dim, dtype, options,
                                         heads, kv_heads, batch)
    lines = {"forward": _forward_line(forward_plan, n_q, heads, kv_heads or heads),
             "backward": _backward_line(backward_plan)}
    if _pair_products(np.dtype(dtype)) is not None:
        products = "; products in bfloat16 on AVX512-BF16 (cpu/bf16_products.py)"
        lines["backward"] += products
        if forward_plan.decode is None:
            lines["forward"] += products
    return lines


def tile_sizes(n_q: int, n_k: int, head_dim: int, value_dim: int, dtype,
               query_heads: int = 0, options: AttentionOptions | None = None, *,
               kv_heads: int | None = None, batch: int = 1) -> dict[str, Blocks]:
    """The tiles each direction of a dense call of this shape runs here (`query_heads` =
    B x Hq heads, of which `kv_heads` K/V heads a batch element; one head where 0), as its
    plans choose them: the mask, the thread count and the heads all size them. The decode
    path's are all of a kv head's packed query rows against its key tiles."""
    heads = max(1, query_heads // batch)
    forward_plan, backward_plan = _plans(n_q, n_k, head_dim, value_dim, dtype, options,
                                         heads, kv_heads, batch)
    sizing = forward_plan.decode
    forward = (forward_plan.blocks if sizing is None
               else Blocks(n_q, min(sizing.block_k, max(1, n_k))))
    block_q, block_k, _ = backward_plan.tiling
    return {"forward": forward, "backward": Blocks(block_q, block_k)}


class _Counted(Sequences):
    """The `Sequences` of a dense call that `describe` plans without running it: a plan only
    keeps its task lists (or their length), so they are counted, not built, and describing
    a batch of thousands allocates nothing of its size."""

    def __init__(self, q, k, options: AttentionOptions):
        super().__init__(q, k, options)
        self._one = Sequences(q[:1], k[:1], options)  # every sequence of a dense call alike

    def tiles(self, block: int, options: AttentionOptions, keys: bool = False):
        count = len(self._one.tiles(block, options, keys)) * len(self.descriptors)
        return np.broadcast_to(np.zeros(2, np.int64), (count, 2))


def _plans(n_q, n_k, head_dim, value_dim, dtype, options, heads, kv_heads, batch):
    """The forward's and the backward's plans of a dense call of this shape, over stand-in
    arrays of its shapes and compute dtype that hold no memory."""
    options = options or AttentionOptions()
    kv_heads = kv_heads or heads
    compute = _compute_dtype(np.dtype(dtype))

    def stand_in(shape):
        return np.broadcast_to(np.zeros((), compute), shape)

    q, do = stand_in((batch, heads, n_q, head_dim)), stand_in((batch, heads, n_q, value_dim))
    k, v = stand_in((batch, kv_heads, n_k, head_dim)), stand_in((batch, kv_heads, n_k, value_dim))
    shape = _Counted(q, k, options)
    return (_forward_plan(q, k, v, options, shape),
            _backward_plan(q, k, v, do, options, _Counted(q, k, options)))


def _forward_line(plan: "_ForwardPlan", n_q: int, heads: int, kv_heads: int) -> str:
    sizing = plan.decode
    if sizing is None:
        return (f"tiled forward (cpu/forward_kernel.py): a task per (query tile, query head), "
                f"tiles of {plan.blocks.block_q} x {plan.blocks.block_k} on "
                f"{plan.n_workers} thread(s)")
    group = heads // kv_heads
    splits = ("one key split" if sizing.n_splits == 1 else
              f"{sizing.n_splits} key splits of up to {sizing.split_size} keys, merged by "
              f"their log-sum-exp")
    return (f"decode path (cpu/decode_kernel.py): a task per (batch, kv head, key split); "
            f"the {group} query head(s) of a kv head x {n_q} row(s) packed into "
            f"{group * n_q} rows against each K/V tile of {sizing.block_k} keys; {splits}; "
            f"{sizing.n_workers} thread(s)")


def _backward_line(plan: "_BackwardPlan") -> str:
    from .backward_kernel import HEADS, KEY_PARTS

    block_q, block_k, _ = plan.tiling
    schedule = plan.runs[0][0]
    if schedule == HEADS:
        tasks = "a task per (batch element, kv head)"
    elif schedule == KEY_PARTS:
        tasks = (f"a task per key tile, dQ summed from a part per key tile ({plan.n_parts} "
                 f"parts)")
    else:
        tasks = (f"a task per key tile (dK, dV), then one per query tile (dQ): parts of dQ "
                 f"per key tile would take over {KEY_PARTS_BUDGET:g}x the inputs' memory")
    n_threads = max(n_workers for _, n_workers, _ in plan.runs)
    return (f"tiled backward (cpu/backward_kernel.py): {tasks}; tiles of {block_q} queries "
            f"x {block_k} keys on {n_threads} thread(s)")
