"""The CPU backend: Numba kernels over host (NumPy) arrays. See `tileattn.backends`.

Every kernel is compiled once per compute dtype (float32, or float64 for float64 inputs)
and cached on disk (``cache=True``), so later processes load it instead of compiling. To
keep that to one compilation, the launchers always pass the same argument types: inputs as
read-only C-contiguous arrays of the compute dtype, options as plain Python scalars.
float16 and bfloat16 inputs are converted to float32 (SPEC: they accumulate in float32).

The first use of a dtype compiles for seconds: `compile_notice` says so on stderr, and
`warmup` compiles every kernel ahead of time.

The backward is always deterministic, so ``options.deterministic`` changes nothing here.
"""

from __future__ import annotations

import importlib.util
import threading

import numba
import numpy as np

from ..dropout import dropout_key, dropout_threshold
from ..options import AttentionOptions, Blocks
from ..reference import lse_dtype
from . import (blas, compile_notice, decode, schedule,  # noqa: F401 (compile_notice listens)
               threads)
from .blocks import BOUNDARY_SLICE_ROWS, cache_sizes, default_blocks, spread_over_threads
from .warmup import warmup  # noqa: F401 (``python -m tileattn warmup``)

MEMORY = "host"

# Each call already spreads over every core it can use (`threads`), and the BLAS thread
# limit around it is process-wide: serialising calls costs nothing.
_kernel_lock = threading.Lock()


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


def tile_sizes(n_q: int, n_k: int, head_dim: int, value_dim: int, dtype) -> dict[str, Blocks]:
    """The default tiles per pass for one head (more heads may get smaller query tiles:
    `blocks.spread_over_threads`); the forward's are those without a mask (a causal or
    window mask halves its ``block_q``)."""
    itemsize = _compute_dtype(np.dtype(dtype)).itemsize
    tiles = {}
    for kind in ("forward", "backward"):
        blocks = default_blocks(kind, head_dim, value_dim, itemsize, masked=False)
        tiles[kind] = Blocks(min(blocks.block_q, n_q), min(blocks.block_k, n_k))
    return tiles


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _read_only(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A read-only C-contiguous view in `dtype`, copying only when the input is not one."""
    view = np.ascontiguousarray(array, dtype=dtype).view()
    view.flags.writeable = False
    return view


def _blocks(kind: str, q, v, options: AttentionOptions, n_threads: int) -> Blocks:
    """The tile sizes, clamped to the sequence lengths (a larger tile is one tile anyway).

    Without an override, ``block_q`` shrinks until every thread has work (`blocks.py`).
    """
    batch, n_q_heads, n_q, head_dim = q.shape
    defaults = default_blocks(kind, head_dim, v.shape[3], q.itemsize, options.is_masked)
    block_q = spread_over_threads(defaults.block_q,
                                  lambda size: batch * n_q_heads * -(-n_q // size), n_threads)
    blocks = Blocks(block_q, defaults.block_k).resolve(options.block_q, options.block_k)
    return Blocks(min(blocks.block_q, n_q), min(blocks.block_k, v.shape[2]))


def _option_scalars(options: AttentionOptions, batch: int, n_q_heads: int, n_q: int, n_k: int):
    """The kernels' option arguments, from `scale` to `inv_keep`. The band offset and the
    dropout's position offsets are plain ints like the window sides (int64 in the kernels:
    a placed block's sides and offsets are the whole sequence's), so they add no
    specialisation."""
    slopes = options.alibi_slopes
    if slopes is None:
        slopes = np.zeros((batch, n_q_heads))
    key = dropout_key(options.seed) if options.dropout_p > 0 else 0
    threshold = dropout_threshold(options.dropout_p) if options.dropout_p > 0 else 0
    return (float(options.scale), float(options.softcap), _read_only(slopes, np.float64),
            int(options.window_left), int(options.window_right),
            int(options.band_offset(n_q, n_k)), int(options.row_offset),
            int(options.col_offset), int(key), int(threshold), 1.0 / (1.0 - options.dropout_p))


def _forward_flops(q, k, v, options: AttentionOptions) -> float:
    """FLOPs of the forward's two matrix products over the kept (row, key) pairs."""
    batch, n_q_heads, n_q, head_dim = q.shape
    n_k = k.shape[2]
    pairs = schedule.kept_pairs_per_row(n_q, n_k, options.band_offset(n_q, n_k),
                                        options.window_left, options.window_right).sum()
    return 2.0 * batch * n_q_heads * float(pairs) * (head_dim + v.shape[3])


def _query_tile_order(n_q: int, n_k: int, block_q: int, options: AttentionOptions):
    return schedule.longest_first(-(-n_q // block_q), block_q, n_q, n_k,
                                  options.band_offset(n_q, n_k), options.window_left,
                                  options.window_right)


def _forward(q_c, k_c, v_c, options: AttentionOptions):
    """Forward over prepared (compute-dtype, read-only, contiguous) arrays."""
    from .forward_kernel import forward_kernel

    batch, n_q_heads, n_q, _ = q_c.shape
    scalars = _option_scalars(options, batch, n_q_heads, n_q, k_c.shape[2])
    if decode.takes(n_q):
        return decode.forward(q_c, k_c, v_c, options, scalars, _kernel_lock)
    out = np.empty((batch, n_q_heads, n_q, v_c.shape[3]), q_c.dtype)
    lse = np.empty((batch, n_q_heads, n_q), q_c.dtype)
    n_threads = threads.threads_for(_forward_flops(q_c, k_c, v_c, options))
    blocks = _blocks("forward", q_c, v_c, options, n_threads)
    tile_order = _query_tile_order(n_q, k_c.shape[2], blocks.block_q, options)
    with _kernel_lock, blas.single_threaded():
        threads.run(forward_kernel, min(n_threads, batch * n_q_heads * tile_order.size),
                    q_c, k_c, v_c, out, lse, *scalars,
                    blocks.block_q, blocks.block_k, BOUNDARY_SLICE_ROWS, tile_order)
    return out, lse


def forward(q, k, v, options: AttentionOptions):
    dtype = _compute_dtype(q.dtype)
    out, lse = _forward(*(_read_only(x, dtype) for x in (q, k, v)), options)
    return out.astype(q.dtype, copy=False), lse.astype(lse_dtype(q.dtype), copy=False)


_NO_TILE_ORDER = np.zeros(0, np.int64)  # the heads schedule takes every key tile in order


def _use_heads_schedule(batch: int, n_kv_heads: int, n_threads: int) -> bool:
    """Whether one task per (batch, kv head) keeps every thread equally busy (see
    `backward_kernel`); otherwise the split schedule spreads key and query tiles."""
    tasks = batch * n_kv_heads
    return tasks % n_threads == 0 or tasks >= 4 * n_threads


def backward(do, q, k, v, o, lse, options: AttentionOptions):
    from .backward_kernel import (HEADS, KEY_TILES, QUERY_TILES, backward_kernel,
                                  row_terms_kernel)

    dtype = _compute_dtype(q.dtype)
    do_c, q_c, k_c, v_c, o_c, lse_c = (_read_only(x, dtype) for x in (do, q, k, v, o, lse))
    batch, n_q_heads, n_q, _ = q.shape
    n_kv_heads = k.shape[1]
    delta = np.empty((batch, n_q_heads, n_q), dtype)
    safe_lse = np.empty((batch, n_q_heads, n_q), dtype)
    dk = np.empty(k.shape, dtype)
    dv = np.empty(v.shape, dtype)
    # FlashAttention's count: the backward's five products are 2.5x the forward's two.
    n_threads = threads.threads_for(2.5 * _forward_flops(q_c, k_c, v_c, options))
    blocks = _blocks("backward", q_c, v_c, options, n_threads)
    n_k = k.shape[2]
    scalars = _option_scalars(options, batch, n_q_heads, n_q, n_k)
    tiling = (blocks.block_q, blocks.block_k, BOUNDARY_SLICE_ROWS)
    with _kernel_lock, blas.single_threaded():
        row_terms_kernel(do_c, o_c, lse_c, delta, safe_lse)
        delta.flags.writeable = safe_lse.flags.writeable = False
        if _use_heads_schedule(batch, n_kv_heads, n_threads):
            dq = np.zeros(q.shape, dtype)
            runs = [(HEADS, min(n_threads, batch * n_kv_heads), _NO_TILE_ORDER)]
        else:
            dq = np.empty(q.shape, dtype)
            key_order = schedule.longest_first(-(-n_k // blocks.block_k), blocks.block_k, n_k,
                                               n_q, -options.band_offset(n_q, n_k),
                                               options.window_right, options.window_left)
            runs = [(KEY_TILES, n_threads, key_order),
                    (QUERY_TILES, n_threads, _query_tile_order(n_q, n_k, blocks.block_q,
                                                               options))]
        for kernel_schedule, n_workers, tile_order in runs:
            threads.run(backward_kernel, n_workers, q_c, k_c, v_c, do_c, safe_lse, delta, dq,
                        dk, dv, *scalars, *tiling, kernel_schedule, tile_order)
    return (dq.astype(q.dtype, copy=False), dk.astype(k.dtype, copy=False),
            dv.astype(v.dtype, copy=False))
