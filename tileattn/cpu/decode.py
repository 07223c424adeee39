"""Launcher of the decode forward (`decode_kernel`): which calls take it, and how many key
splits they get."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import numpy as np

from . import blas, threads
from ..options import BAND, KEYS, ROWS, UNLIMITED
from .blocks import default_blocks
from .tiles import key_span

MAX_QUERY_ROWS = 32
"""Calls with at most this many query rows take the decode path (bench/NOTES-cpu.md,
session 5: `bench/bench_cpu_decode.py`), as many as its plain-loop products serve
(`decode_kernel.MAX_LOOP_ROWS`): MHA Nq 17-32 over 4k-32k keys ran 0.78-0.90x torch on the
forward kernel, whose sgemm packs a whole K and V tile for so few rows, and 0.93-1.25x on
the decode path (2 threads, session 19)."""

TASKS_PER_THREAD = 4
"""Splits are added until there are this many (batch, kv head, split) tasks per thread, as
for the forward's query tiles (`blocks.spread_over_threads`): tasks are claimed on demand,
so a core slowed by other load takes fewer."""

BYTE_COST = 3.0
"""A decode call streams K/V once and does little arithmetic per byte: for the thread count
(`threads.threads_for`, which counts FLOPs) each byte of K/V read weighs as many FLOPs as a
core computes while it streams one (~65 GFLOP/s against ~20 GB/s). By FLOPs alone an MHA
step over 8-67 MB of cache ran on one thread at 0.44-0.52x torch's two (session 14)."""

LOOP_FLOP_COST = 3.0
"""The kernel's plain-loop products (at most `decode_kernel.MAX_LOOP_ROWS` packed rows) run
a call at ~20-25 GFLOP/s a core with its softmax, a third of the ~65 that
`threads.FLOPS_PER_THREAD` assumes, so their FLOPs count three times for the thread count:
a thread still gets about 0.5 ms of work. By FLOPs alone MQA 8/1 over 8192 keys (33 MFLOP,
1.5-2.4 ms) ran on one thread, 0.64x torch on 16 cores (bench/NOTES-cpu.md, session 17)."""

MAX_GROUP_ROWS = 1024
MIN_KEYS_PER_ROW = 8
"""A GQA or MQA forward with more query rows still takes the decode path while a group's
packed rows (group x Nq) stay within MAX_GROUP_ROWS and the keys outnumber the rows by
MIN_KEYS_PER_ROW: each K/V tile is then read once for the whole group, where the forward
kernel reads it once per query head. 2 threads, D = 128, causal, decode path against
forward kernel (bench/NOTES-cpu.md, session 10): 32/8 heads over 8192 keys Nq 17-128
1.17-1.71x faster, Nq 256 (1024 rows) 1.05x, Nq 512 0.97x; MQA 8/1 Nq 17-128 1.09-1.79x,
Nq 256 0.95x; 16/2 Nq 64 over 32k keys 1.53x, B 8 32/8 Nq 32 over 2048 1.45x; but short
square problems 0.77-0.90x (32/8 N 128-256, 8/1 N 128) and 32/8 Nq 256 over 1024 keys
0.96x. MHA (group 1) gains nothing (0.98-1.01x at Nq 17-512) and keeps the forward kernel."""


SHORT_KEYS = 64
"""float32 and float64 calls over at most this many keys take the forward kernel from 4
query rows (MHA) or 16 (GQA, whose decode reads K and V once a group): its tiles finish
such rows sooner than the decode's per-row work. One thread, H8, us decode / forward
(bench/NOTES-cpu.md, session 41): MHA D 64 Nq 16 over 16 / 64 keys 34.7 / 29.4 and 60.4 /
52.2, Nq 32 0.77-0.87x, D 32 0.70-0.92x, D 256 0.81-0.91x, Nq 4 0.86-1.02x, float64
0.81-0.94x; GQA 8/2 Nq 16-32 0.82-0.94x, but Nq 4 over 16 keys 1.10x. Over 128 keys
it varied from 0.80 to 1.09 by head dim and rows, and from 256 the decode won. 16-bit
inputs keep the decode, which reads them as they are (`widens`): the forward kernel's
float32 copy made it 1.03-2.3x slower."""


def takes(n_q: int, n_k: int = 0, group: int = 1, widens: bool = False) -> bool:
    """Whether a forward with `n_q` query rows (the array's, which sizes the decode
    kernel's buffers), at most `n_k` keys a sequence and `group` query heads per kv head
    runs on the decode path; `widens`: with 16-bit K and V read as they are."""
    if n_q <= MAX_QUERY_ROWS:
        return widens or n_k > SHORT_KEYS or n_q < (4 if group == 1 else 16)
    return group > 1 and group * n_q <= MAX_GROUP_ROWS and n_k >= MIN_KEYS_PER_ROW * n_q


def split_count(n_tasks_per_split: int, n_keys: int, block_k: int, n_threads: int) -> int:
    """Key splits for `n_threads`: enough for `TASKS_PER_THREAD` tasks per thread, but no
    split shorter than one key tile (a shorter one would only add merge work)."""
    wanted = -(-TASKS_PER_THREAD * n_threads // n_tasks_per_split)
    return max(1, min(wanted, -(-n_keys // block_k)))


def _key_spans(descriptors, options):
    """Per sequence, how many keys its rows keep between the first and the last kept one
    (`tiles.key_span` over all its rows), vectorised; 0 for a sequence with no rows."""
    rows, keys, bands = (descriptors[:, c] for c in (ROWS, KEYS, BAND))
    start = np.zeros_like(keys)
    stop = keys.copy()
    if options.window_left != UNLIMITED:
        start = np.maximum(start, bands - options.window_left)
    if options.window_right != UNLIMITED:
        stop = np.minimum(stop, rows - 1 + bands + options.window_right + 1)
    return np.where(rows > 0, np.maximum(stop - start, 0), 0)


@dataclass(frozen=True)
class DecodePlan:
    """A decode call's sizing, from its shapes and options alone: `n_workers` threads over
    `n_splits` key splits of `split_size` keys, key tiles of `block_k`, and whether BLAS is
    held at one thread (more packed rows than the kernel's plain-loop products take)."""

    n_workers: int
    n_splits: int
    split_size: int
    block_k: int
    limits_blas: bool


def plan(q_c, k_c, v_c, options, shape, n_splits=None) -> DecodePlan:
    """The sizing of a decode call over prepared arrays (`forward` says what they are)."""
    from .decode_kernel import MAX_LOOP_ROWS

    n_q_heads, n_q, head_dim = q_c.shape[1], q_c.shape[2], q_c.shape[3]
    value_dim = v_c.shape[3]
    n_kv_heads = shape.kv_heads(k_c)
    descriptors = shape.descriptors
    if shape.varlen:
        spans = _key_spans(descriptors, options)
        longest = int(spans.max(initial=0))
        row_keys = float((descriptors[:, ROWS] * spans).sum())
        keys_read = float(spans.sum())
    else:  # every sequence alike: the key span of one, in plain ints
        start, stop = key_span(0, n_q, shape.max_keys, int(descriptors[0, BAND]),
                               options.window_left, options.window_right)
        longest = max(min(stop, shape.max_keys) - max(start, 0), 0)
        row_keys = float(len(descriptors) * n_q * longest)
        keys_read = float(len(descriptors) * longest)
    block_k = options.block_k or default_blocks("forward", head_dim, value_dim,
                                                q_c.itemsize).block_k
    # A named block_k may exceed the keys by far (SPEC: any positive int); the kernel's tile
    # buffers hold block_k keys, and one tile of every key computes the same.
    block_k = min(block_k, max(1, longest))
    packed_rows = n_q_heads // n_kv_heads * n_q
    flops = 2.0 * n_q_heads * row_keys * (head_dim + value_dim)
    if packed_rows <= MAX_LOOP_ROWS:
        flops *= LOOP_FLOP_COST
    kv_bytes = n_kv_heads * keys_read * (head_dim + value_dim) * q_c.itemsize
    n_threads = threads.threads_for(max(flops, BYTE_COST * kv_bytes))
    # Pools stored slots outermost may run a task per sequence for every kv head.
    all_heads = _kernels().all_heads(shape.block_table, shape.slots_outer,
                                     n_q_heads // n_kv_heads, n_q)
    n_tasks_per_split = len(descriptors) * (1 if all_heads else n_kv_heads)
    if n_splits is None:
        n_splits = split_count(n_tasks_per_split, longest, block_k, n_threads)
    # Up to MAX_LOOP_ROWS packed rows the kernel's products are plain loops and call no BLAS:
    # nothing to hold at one thread (asking and setting SciPy's BLAS cost ~8 us a call).
    return DecodePlan(min(n_threads, n_splits * n_tasks_per_split), n_splits,
                      max(1, -(-longest // n_splits)), block_k, packed_rows > MAX_LOOP_ROWS)


# One split's call finishes its rows in the kernel (`decode_kernel.decode_kernel`) and
# passes partial state of no splits: one writeable placeholder per compute dtype, with the
# partials' dimensions, so that the kernel keeps one signature per dtype. Keyed by the dtype
# itself: NumPy computes ``dtype.name`` in Python, ~3 us.
_NO_PARTIALS = {np.dtype(name): (np.zeros((0,) * 5, name), np.zeros((0,) * 4, name),
                                 np.zeros((0,) * 4, name)) for name in ("float32", "float64")}
_NO_LIMIT = contextlib.nullcontext()


@functools.cache
def _kernels():
    """`decode_kernel`, the module, imported at the first call (importing it loads or
    compiles its kernels), then without the ~2 us of an import statement a call."""
    from . import decode_kernel

    return decode_kernel


def forward(q_c, k_c, v_c, options, scalars, lock, shape, n_splits=None, sizing=None,
            widen=0):
    """``(out, lse)`` for prepared (compute-dtype, read-only, contiguous) arrays; or, with
    `widen` (1 float16, 2 bfloat16), k and v as their 16-bit bits (`decode_kernel`).

    `scalars` are the kernels' option arguments (`tileattn.cpu._option_scalars`), `lock`
    the backend's kernel lock, `shape` the call's `tileattn.cpu.Sequences`, `sizing` its
    `DecodePlan` where the caller kept one. `n_splits` (private, for tests) forces the
    split count.
    """
    kernels = _kernels()
    sizing = sizing or plan(q_c, k_c, v_c, options, shape, n_splits)
    batch, n_q_heads, n_q, _ = q_c.shape
    value_dim = v_c.shape[3]
    dtype = q_c.dtype
    n_splits = sizing.n_splits
    rows = (batch, n_q_heads, n_q)
    fill = np.zeros if shape.varlen else np.empty
    if n_splits == 1:
        partials = _NO_PARTIALS[dtype]
        # Rows of no sequence (padding) are not written by the kernel: o 0, lse -inf (SPEC).
        out = fill(rows + (value_dim,), dtype)
        lse = np.full(rows, -np.inf, dtype) if shape.varlen else np.empty(rows, dtype)
    else:
        # Rows of no sequence (padding) get no partial state from the kernel: give them an
        # empty one, which the merge turns into o = 0, lse = -inf (SPEC).
        splits = (n_splits,) + rows
        partials = (fill(splits + (value_dim,), dtype),
                    np.full(splits, -np.inf, dtype) if shape.varlen else np.empty(splits, dtype),
                    fill(splits, dtype))
        out = np.empty(rows + (value_dim,), dtype)
        lse = np.empty(rows, dtype)
    with lock, (blas.single_threaded() if sizing.limits_blas else _NO_LIMIT):
        threads.run(kernels.decode_kernel, sizing.n_workers, q_c, k_c, v_c, *partials, out, lse,
                    shape.descriptors, shape.block_table, shape.page_size,
                    shape.slots_outer, *scalars, sizing.block_k, sizing.split_size, widen)
        if n_splits > 1:
            kernels.merge_kernel(*partials, out, lse)
    return out, lse
