"""Launching the split-KV decode forward: the decode kernel (attention_decode.cu on CUDA
cores, or attention_decode_mma.cu on tensor cores, by the tiles' type), one block per
(batch, kv head, key range), and, with more than one range, the merge kernel
(attention_decode.cu) that combines the ranges' partial (o, lse) by log-sum-exp, unless the
tensor-core kernel's last block of each group merges them itself
(`tiles.decode_merges_in_kernel`).

The partials and the split counters live in the per-(device, stream) workspace of
`workspace.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import cupy
import numpy as np

from ..options import UNLIMITED, AttentionOptions
from . import _compile
from .operands import (STORAGE, Launch, Switches, accumulation_dtype, alibi_slopes, empty,
                       output_strides, problem_for, score_arguments, sm_count,
                       strided_out_defines, tensor_core_operands)
from .tiles import (DecodeMmaTiles, DecodeShape, DecodeTiles, decode_merges_in_kernel,
                    decode_residency)
from .varlen import dense_arguments
from .workspace import partials, split_counters

DECODE_SOURCE = "attention_decode.cu"
DECODE_MMA_SOURCE = "attention_decode_mma.cu"
MERGE_WARPS = 16  # attention_decode_merge's warps, each taking every MERGE_WARPS-th split
MERGE_COLUMNS = 32  # output columns of one merge block (a lane each)
# Merges of at most MERGE_ROW_SPLITS splits, or of at least MERGE_ROWS_PER_SPLIT rows a split,
# take attention_decode_merge_rows (a warp a row, 8 rows a block), whose blocks are few where
# the rows are many; fewer rows over more splits (one sequence's few rows over hundreds of
# splits) take attention_decode_merge's 16 warps per (row, 32 columns). H200 (NOTES-gpu v55):
# B8 H32/8 Nq8 Nk4k D256 (2048 rows, 2 splits) 183 -> 80 us a step, B64 H8/1 Nq8 Nk32k
# D128 363 -> 262.
MERGE_ROW_SPLITS = 32
MERGE_ROWS_PER_SPLIT = 8
MERGE_ROWS_PER_BLOCK = 8
# cp.async's L2 prefetch size (bytes, 0: none) in the tensor-core decode's K/V copies
# (mma.cuh's L2_PREFETCH): 128 bytes read K/V ~2.5 % faster at D 128 (H200, kernels alone,
# bench/experiments/decode_roofline_gpu.py, NOTES-gpu v54: 4 GiB 1013 -> 987 us, 1 GiB 267
# -> 260), where 64 changed nothing and 256 was up to 3 % slower.
DECODE_L2_PREFETCH = 128
# Paged copies that step to a row's address from the one before it in the same page
# (attention_decode_mma.cu PAIRED_PAGE_ROWS: one shared-memory load a pair of rows at pages
# of 2 x a thread's row step, e.g. 16 at D 128). H200, back to back, dense / paged at page 16
# (bench/experiments/paged_decode_gpu.py --paired-page-rows off on, NOTES-gpu v55): B64
# H32/8 Nk32k D256 bf16 0.83-0.84 -> 0.97-0.98, B8 H32/8 Nq8 Nk32k D128 0.87-0.88 -> 0.90;
# pages of 64 (whole tiles) unchanged.
DECODE_PAIRED_PAGE_ROWS = True


# Bounded: options hash by identity, and a call whose options are validated anew (a new
# dropout seed every step) brings a new object each time.
@lru_cache(maxsize=256)
def band_keys(options: AttentionOptions, n_q: int, n_k: int) -> int:
    """How many keys some query row of [0, n_q) keeps (the kernel's key_tile_range)."""
    low, high = kept_keys(options, n_q, n_k)
    return max(0, high - low)


def kept_keys(options: AttentionOptions, n_q: int, n_k: int) -> tuple[int, int]:
    """Keys ``[low, high)`` of ``[0, n_k)`` that some query row of [0, n_q) keeps (empty
    where low >= high)."""
    offset = options.band_offset(n_q, n_k)
    low, high = 0, n_k
    if options.window_left != UNLIMITED:
        low = max(low, offset - options.window_left)
    if options.window_right != UNLIMITED:
        high = min(high, n_q - 1 + offset + options.window_right + 1)
    return low, high


def decode_shape(q, k, options: AttentionOptions, n_k: int | None = None) -> DecodeShape:
    """The decode table's view of a problem; `n_k` overrides the keys of `k` (the longest
    sequence of a variable-length or paged call)."""
    batch, n_q_heads, n_q, _ = q.shape
    n_kv_heads = k.shape[1]
    n_k = k.shape[2] if n_k is None else n_k
    return DecodeShape(n_q=n_q, group=n_q_heads // n_kv_heads,
                       batch_kv_heads=batch * n_kv_heads, batch_q_heads=batch * n_q_heads,
                       band_keys=band_keys(options, n_q, n_k), sm_count=sm_count(q.device.id))


@dataclass(frozen=True)
class DecodeLaunch:
    """The decode kernel and, with splits it does not merge itself, the merge; called with
    ``(q, k, v, o, lse)`` like a `Launch`, it finds the partials' workspace and the split
    counters itself."""

    decode: Launch
    merge: Launch | None
    partial_size: int  # splits x rows x Dv (0: one split, o written directly)
    lse_size: int  # splits x rows
    accum: np.dtype
    # The tensor-core kernel's split counters: a group's blocks count there when the kernel
    # merges its splits (FUSED_MERGE), else 0; None for the CUDA-core kernel, which has none.
    split_groups: int | None

    def scratch(self) -> tuple:
        """The decode kernel's arguments after ``(q, k, v, o, lse)``: partial o and lse (empty
        stand-ins with one split), then the split counters where the kernel takes them."""
        if self.partial_size:
            arguments = partials(self.partial_size, self.lse_size, self.accum)
        else:
            arguments = (empty(cupy.cuda.runtime.getDevice(), self.accum.name),) * 2
        if self.split_groups is None:
            return arguments
        return arguments + (split_counters(self.split_groups) if self.split_groups
                            else empty(cupy.cuda.runtime.getDevice(), "uint32"),)

    def __call__(self, q, k, v, o, lse):
        scratch = self.scratch()
        self.decode(q, k, v, o, lse, *scratch)
        if self.merge is not None:
            self.merge(scratch[0], scratch[1], o, lse)


def forward_decode(q, k, v, o, lse, options: AttentionOptions,
                   tiles: DecodeTiles | DecodeMmaTiles, sequences=None) -> tuple:
    """Runs the decode forward of `tiles` into o and lse: ``(launch, alignment)``. With
    `sequences` (a padded or paged `varlen.Sequences`), batch element b is sequence b."""
    batch, n_q_heads, n_q, head_dim = q.shape
    n_kv_heads, n_k, value_dim = k.shape[1], k.shape[2], v.shape[3]
    group = n_q_heads // n_kv_heads
    on_tensor_cores = isinstance(tiles, DecodeMmaTiles)
    # More packed rows than a block holds run as row groups, a block each.
    row_groups = tiles.row_groups(group * n_q)
    if group * n_q > tiles.rows * row_groups:
        raise ValueError(f"decode tiles hold rows={tiles.rows} packed rows, the problem has "
                         f"group * Nq = {group * n_q}")
    # K and V are streamed with cp.async in copies as wide as their rows allow; Q's rows,
    # read once per block, take their own width, so their alignment does not narrow the
    # K/V copies.
    (k, v), (k_strides, v_strides), copy_bytes = tensor_core_operands(k, v)
    (q,), (q_strides,), q_copy_bytes = tensor_core_operands(q)
    accum = accumulation_dtype(q.dtype)
    switches = Switches.of(options).defines()
    # The merge is attention_decode.cu's: after the tensor-core kernel it is built with a
    # CUDA-core configuration of the same dims (its tile defines only satisfy that file).
    cuda_core = tiles if not on_tensor_cores else DecodeTiles(16, 32, 2, 128, tiles.splits)
    merge_defines = (("ACCUM", "double" if accum == np.float64 else "float"),
                     ("BLOCK_K", cuda_core.block_k), ("COPY_BYTES", copy_bytes),
                     ("HEAD_DIM", head_dim), ("MERGE_WARPS", MERGE_WARPS),
                     ("ROWS", cuda_core.rows),
                     ("STAGES", cuda_core.stages), ("STORAGE", STORAGE[np.dtype(q.dtype).name]),
                     ("THREADS", cuda_core.threads), ("VALUE_DIM", value_dim)) + switches
    defines = merge_defines
    fused_merge = on_tensor_cores and decode_merges_in_kernel(tiles, group * n_q, value_dim,
                                                              head_dim)
    if on_tensor_cores:
        residency = decode_residency(problem_for(q.device.id, q.dtype, head_dim, value_dim, n_k,
                                                 options), tiles)
        defines = (("COPY_BYTES", copy_bytes), ("FUSED_MERGE", int(fused_merge)),
                   ("HEAD_DIM", head_dim),
                   ("IS_BFLOAT16", int(np.dtype(q.dtype).name == "bfloat16")),
                   ("MIN_BLOCKS", residency), ("Q_COPY_BYTES", q_copy_bytes),
                   ("ROW_TILES", tiles.row_tiles),
                   ("ROW_WARPS", tiles.row_warps),
                   ("STAGES", tiles.stages), ("VALUE_DIM", value_dim),
                   ("WARP_KEYS", tiles.warp_keys), ("WARPS", tiles.warps)) + switches
        if DECODE_L2_PREFETCH:
            defines += (("L2_PREFETCH", DECODE_L2_PREFETCH),)
        if DECODE_PAIRED_PAGE_ROWS and sequences is not None:
            defines += (("PAIRED_PAGE_ROWS", 1),)
    defines += strided_out_defines(o)
    if sequences is not None:
        defines += sequences.defines()
        tables = sequences.arguments(None)[0]
    else:
        tables = dense_arguments(q.device.id)
    defines = tuple(sorted(defines))
    n_rows = batch * n_q_heads * n_q
    splits = tiles.splits
    if on_tensor_cores:
        shared = tiles.shared_bytes(head_dim, value_dim)
        function = _compile.kernel(DECODE_MMA_SOURCE, "attention_decode_mma", defines, shared)
    else:
        shared = tiles.shared_bytes(q.itemsize, accum.itemsize, head_dim, value_dim)
        function = _compile.kernel(DECODE_SOURCE, "attention_decode", defines, shared)
    decode = Launch(function, (batch * n_kv_heads * row_groups * splits,), (tiles.threads,),
                    shared,
                    (alibi_slopes(options), np.int64(n_q), np.int64(n_k), np.int32(n_q_heads),
                     np.int32(group), np.int32(splits), *q_strides[:3], *k_strides[:3],
                     *v_strides[:3], *output_strides(o), *score_arguments(options, n_q, n_k, accum),
                     *tables))
    merge = None
    if splits > 1 and not fused_merge:
        by_rows = splits <= MERGE_ROW_SPLITS or n_rows >= MERGE_ROWS_PER_SPLIT * splits
        merge_function = _compile.kernel(
            DECODE_SOURCE, "attention_decode_merge_rows" if by_rows else "attention_decode_merge",
            tuple(sorted(merge_defines)))
        grid = ((-(-n_rows // MERGE_ROWS_PER_BLOCK),) if by_rows
                else (n_rows, -(-value_dim // MERGE_COLUMNS)))
        merge = Launch(merge_function, grid,
                       (32 * (MERGE_ROWS_PER_BLOCK if by_rows else MERGE_WARPS),), 0,
                       (np.int64(n_rows), np.int32(splits), np.int32(n_q_heads),
                        np.int64(n_q), *output_strides(o)))
    split_groups = (batch * n_kv_heads * row_groups if fused_merge else 0) if on_tensor_cores \
        else None
    partial_rows = splits * n_rows if splits > 1 else 0
    launch = DecodeLaunch(decode, merge, partial_rows * value_dim, partial_rows, accum,
                          split_groups)
    launch(q, k, v, o, lse)
    return launch, copy_bytes
