"""Launching the backward: ``D = rowsum(dO * o)`` first (attention_backward_delta.cu), then
the family that `tiles.choose_backward` picked, each launcher only reading its row."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import cupy
import numpy as np

from ..arrays import dtype_name
from ..options import AttentionOptions
from . import _compile
from .launch_decode import decode_shape
from .launch_forward import GENERIC_THREADS, GenericConfig
from .operands import (STORAGE, Launch, Switches, accumulation_dtype, alibi_slopes, cached,
                       contiguous_strides, element_strides, empty, output_strides, plan_key,
                       problem_for, problem_of, remember, score_arguments,
                       shared_memory_limit, sm_count, strided_out_defines,
                       tensor_core_operands)
from .tiles import (Choice, MmaBackwardTiles, WgmmaBackwardTiles, Widths, backward_group_splits,
                    choose_backward, dq_key_splits, runs_single_pass,
                    takes_single_pass)
from .varlen import Sequences, leaves_padding, tile_grid
from .workspace import workspace

WGMMA_SOURCE = "attention_wgmma_backward.cu"
MMA_SOURCE = "attention_mma_backward.cu"
DELTA_SOURCE = "attention_backward_delta.cu"
DELTA_THREADS = 256
# The redo of flagged key blocks walks the dK/dV kernels' flags over this many blocks an SM
# (attention_backward_dkdv_redo): with finite keys each reads a few flags and returns.
REDO_BLOCKS_PER_SM = 4
GROUP_SUM_SOURCE = "group_sum.cu"


def _outputs(q, k, v, given=(None, None, None), zeroed: bool = False) -> tuple:
    """dq, dk, dv: the caller's buffers where given (validated: shape and dtype; rows of
    contiguous elements at any batch, head and row strides, which the kernels take), else
    new contiguous ones; uninitialised, every element is written, unless `zeroed` (a
    variable-length call, whose padding rows and keys no kernel writes: their gradients
    are 0)."""
    outputs = tuple(cupy.empty(like.shape, dtype=q.dtype) if buffer is None else buffer
                    for like, buffer in zip((q, k, v), given))
    if zeroed:
        for output in outputs:
            output.fill(0)
    return outputs


def _writes_strided(given) -> bool:
    """Whether a given gradient buffer is not a contiguous (B, H, N, D) array (a "bshd"
    gradient, written in the caller's order): the kernels then compile STRIDED_OUT."""
    return any(buffer is not None and strided_out_defines(buffer) for buffer in given)


def gradient_strides(q, k, v, given) -> tuple:
    """The byte strides of the gradients that `_outputs` returns, for the plan cache's key:
    the launches take them as arguments."""
    return tuple(contiguous_strides(like.shape, like.itemsize) if buffer is None
                 else buffer.strides for like, buffer in zip((q, k, v), given))


# --------------------------------------------------------------------------- D


def _delta_launch(do, o) -> tuple:
    """``(launch, do, o)``: attention_backward_delta for these arrays (copied only if a
    stride is not a whole element), to be called as ``launch(do, o, delta)``. Contiguous,
    16-byte aligned rows take the kernel that reads 16 bytes a lane."""
    batch, n_heads, n_q, value_dim = o.shape
    (do, do_strides), (o, o_strides) = element_strides(do), element_strides(o)
    accum = accumulation_dtype(o.dtype)
    defines = (("ACCUM", "double" if accum == np.float64 else "float"),
               ("STORAGE", STORAGE[dtype_name(o.dtype)]))
    n_rows = batch * n_heads * n_q
    shape = (np.int64(n_rows), np.int32(n_heads), np.int64(n_q), np.int32(value_dim))
    per_vector = 16 // o.dtype.itemsize
    if (value_dim % per_vector == 0
            and all(strides[3] == 1 and all(s % per_vector == 0 for s in strides[:3])
                    and array.data.ptr % 16 == 0
                    for array, strides in ((do, do_strides), (o, o_strides)))):
        row_lanes = min(32, 1 << (value_dim // per_vector - 1).bit_length())
        function = _compile.kernel(DELTA_SOURCE, "attention_backward_delta_vectors", defines)
        blocks = max(1, min(-(-n_rows * row_lanes // DELTA_THREADS), 16384))
        launch = Launch(function, (blocks,), (DELTA_THREADS,), 0,
                        shape + (np.int32(row_lanes),) + do_strides[:3] + o_strides[:3])
    else:
        function = _compile.kernel(DELTA_SOURCE, "attention_backward_delta", defines)
        blocks = max(1, min(-(-n_rows // (DELTA_THREADS // 32)), 16384))  # then grid-stride
        launch = Launch(function, (blocks,), (DELTA_THREADS,), 0,
                        shape + do_strides + o_strides)
    return launch, do, o


def _new_delta(o):
    """D's buffer: one value per query row, in the accumulation dtype."""
    return cupy.empty(o.shape[0] * o.shape[1] * o.shape[2], dtype=accumulation_dtype(o.dtype))


def row_deltas(do, o) -> tuple:
    """``(delta, launch)``: ``D = rowsum(do * o)`` per query row, flat ``(B * Hq * Nq,)``,
    accumulation dtype (SPEC's D, which every backward below reads), and its launch."""
    launch, do, o = _delta_launch(do, o)
    delta = _new_delta(o)
    launch(do, o, delta)
    return delta, launch


# --------------------------------------------------------------------------- tensor cores


def _operands(do, q, k, v, lse, options: AttentionOptions, given=(None, None, None),
              sequences: Sequences | None = None):
    """What the tensor-core backwards launch with: the inputs read in place, lse in the
    accumulation dtype (float32; float64 for float64), the outputs (dq, dk, dv; zeroed for a
    variable-length call), the arguments after the arrays but for the tables, and the copy
    width."""
    n_q_heads, n_q = q.shape[1], q.shape[2]
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    (q, k, v, do), (q_strides, k_strides, v_strides, do_strides), copy_bytes = (
        tensor_core_operands(q, k, v, do))
    accum = accumulation_dtype(q.dtype)
    lse = cupy.ascontiguousarray(lse, dtype=accum)
    outputs = _outputs(q, k, v, given, zeroed=leaves_padding(options.varlen))
    common = (alibi_slopes(options), np.int64(n_q), np.int64(n_k), np.int32(n_q_heads),
              np.int32(n_q_heads // n_kv_heads), *q_strides[:3], *k_strides[:3],
              *v_strides[:3], *do_strides[:3], *score_arguments(options, n_q, n_k, accum))
    return (do, q, k, v, lse), outputs, common, copy_bytes


def _dkdv_parts(split: bool) -> tuple:
    """The DKDV_PART values of the dK/dV launches: both at once, or dV and dK apart."""
    return (1, 2) if split else (0,)


def _has_query_tail(n_q: int, streamed: int, sequences: Sequences | None) -> bool:
    """Whether a dK/dV kernel streaming `streamed` query rows a tile meets tiles that end
    past a sequence's last query (their rows past it are zero rows)."""
    return sequences is not None or n_q % streamed != 0


def _key_flags(redo: Launch | None, key_blocks: int):
    """The dK/dV kernels' flag per block (each of their `key_blocks` blocks writes its own),
    or an empty stand-in when they flag nothing (no `redo`)."""
    if redo is None:
        return empty(cupy.cuda.Device().id, "int32")
    return cupy.empty(key_blocks, dtype=cupy.int32)


def _key_grid(q, k, v, do, lse, dk, dv, options: AttentionOptions, owned: int,
              flagging: bool, tile_major: bool, sequences: Sequences | None) -> tuple:
    """``(grid, tables, redo, flags)`` of the dK/dV kernels (`owned` keys a block, blocks
    in the order `tile_major` says): their grid and table arguments, and where they flag
    non-finite keys (`flagging`) the redo launch (`_key_redo`, writing dk and dv at their
    strides) and the flags' buffer."""
    batch, n_kv_heads, n_k = q.shape[0], k.shape[1], k.shape[2]
    grid, tables = tile_grid(n_kv_heads, n_k, owned, batch, sequences, keys=True)
    redo = (_key_redo(q, k, v, do, lse, dk, dv, options, owned, tile_major, grid, tables,
                      sequences) if flagging else None)
    return grid, tables, redo, _key_flags(redo, grid)


def _key_redo(q, k, v, do, lse, dk, dv, options: AttentionOptions, owned: int,
              tile_major: bool, grid: int, tables: tuple,
              sequences: Sequences | None) -> Launch:
    """attention_generic.cu's attention_backward_dkdv_redo over a 16-bit dK/dV kernel's grid
    (`owned` keys a block, its block order, its table arguments): dk and dv again, on CUDA
    cores from the real queries only, for the blocks that flagged inf or NaN in their K or
    V rows (FLAG_NON_FINITE_KEYS). Called as ``launch(q, k, v, do, lse, delta, dk, dv,
    flags)`` with the arrays the tensor-core kernels read."""
    batch, n_q_heads, n_q, head_dim = q.shape
    n_kv_heads, n_k, value_dim = k.shape[1], k.shape[2], v.shape[3]
    config = GenericConfig.for_problem(q.dtype, head_dim, value_dim, options, "backward")
    blocks = config.blocks(options)
    function, shared = config.kernel("attention_backward_dkdv_redo",
                                     sequences.defines() if sequences is not None else ())
    strides = [s for array in (q, k, v, do, lse) for s in element_strides(array)[1]]
    arguments = (alibi_slopes(options), np.int64(n_q), np.int64(n_k), np.int32(n_q_heads),
                 np.int32(n_q_heads // n_kv_heads), np.int32(head_dim), np.int32(value_dim),
                 np.int32(blocks.block_q), np.int32(blocks.block_k))
    return Launch(function, (min(grid, REDO_BLOCKS_PER_SM * sm_count(q.device.id)),),
                  (GENERIC_THREADS,), shared,
                  arguments + tuple(strides)
                  + score_arguments(options, n_q, n_k, np.float32) + tables
                  + output_strides(dk) + output_strides(dv)
                  + (np.int32(owned), np.int32(tile_major), np.int32(grid)))


def _group_sum_launch(out, splits: int, part: str | None = None) -> Launch:
    """group_sum.cu adding `splits` contiguous parts per head of `out` (B, H, N, D) into
    it, at out's strides; the parts' type is `part` (float32 for dQ's key shares) or out's."""
    batch, heads, n, width = out.shape
    accum = accumulation_dtype(out.dtype)
    defines = (("ACCUM", "double" if accum == np.float64 else "float"),
               ("STORAGE", STORAGE[dtype_name(out.dtype)])) + strided_out_defines(out)
    if part is not None:
        defines += (("PART", part),)
    function = _compile.kernel(GROUP_SUM_SOURCE, "group_sum", tuple(sorted(defines)))
    total = out.size
    return Launch(function, (max(1, min(-(-total // 256), 8192)),), (256,), 0,
                  (np.int64(n * width), np.int64(total), np.int32(splits), np.int32(heads),
                   np.int32(width), *output_strides(out)))


class GroupSums:
    """dK and dV of GQA groups cut over `splits` blocks (the dK/dV kernels' GROUP_SPLITS):
    the kernels write partial gradients of Hkv * splits heads into contiguous buffers from
    `buffers`, and the call adds each group's partials into dk and dv (group_sum.cu), at
    their strides."""

    def __init__(self, k, v, dk, dv, splits: int):
        batch, n_kv_heads, n_k = k.shape[:3]
        self.splits = splits
        self.dtype = k.dtype
        self.shapes = [(batch, n_kv_heads * splits, n_k, array.shape[3]) for array in (k, v)]
        self.launches = [_group_sum_launch(out, splits) for out in (dk, dv)]

    def buffers(self) -> tuple:
        return tuple(cupy.empty(shape, dtype=self.dtype) for shape in self.shapes)

    def part_bytes(self) -> tuple:
        """The bytes of each of `buffers`, which the kernels read only through its address."""
        return tuple(math.prod(shape) * self.dtype.itemsize for shape in self.shapes)

    def __call__(self, parts, dk, dv) -> None:
        for launch, part, out in zip(self.launches, parts, (dk, dv)):
            launch(part, out)


def _group_split(q, k, v, dk, dv, key_grid: int, key_tables: tuple, owned: int,
                 splittable: bool) -> tuple:
    """``(group size a dK/dV block takes, GroupSums or None, the dK/dV kernels' outputs, their
    grid, their tables)`` for a dense backward whose dK/dV kernels own `owned` keys a block
    on `key_grid` blocks; `splittable` is False where the kernels flag keys for a redo, run
    the single pass or walk sequence tables (they are not cut)."""
    group = q.shape[1] // k.shape[1]
    splits = backward_group_splits(key_grid, group, sm_count(q.device.id)) if splittable else 1
    if splits == 1:
        return group, None, (dk, dv), key_grid, key_tables
    sums = GroupSums(k, v, dk, dv, splits)
    grid, tables = tile_grid(k.shape[1] * splits, k.shape[2], owned, q.shape[0], None,
                             keys=True)
    return group // splits, sums, sums.buffers(), grid, tables


@dataclass(frozen=True)
class SplitDq:
    """A dQ kernel over (query tiles, key shares) (SPLIT_KEYS, `tiles.dq_key_splits`): each
    share's part (float32; float64's in doubles) into the split workspace, then group_sum.cu
    adds the parts into dq in a fixed order. Called as the dQ kernel's launch is."""

    kernel: Launch
    add: Launch
    size: int  # shares x dq's elements
    part: np.dtype = np.dtype(np.float32)

    def __call__(self, q, k, v, do, lse, delta, dq):
        parts = workspace(self.size, self.part)
        self.kernel(q, k, v, do, lse, delta, parts)
        self.add(parts, dq)


def _dq_splits(q, k, options: AttentionOptions, tiles, sequences: Sequences | None,
               single_pass: bool, forced: int | None) -> int:
    """Key shares of the dQ kernel: `forced` (tests, sweeps) or `tiles.dq_key_splits`; 1 for
    variable-length calls (tile tables) and the single pass (no dQ kernel)."""
    if sequences is not None or single_pass:
        return 1
    return forced or dq_key_splits(tiles, decode_shape(q, k, options))


def _dq_launch(function, grid: int, threads: int, shared: int, arguments: tuple, dq,
               splits: int):
    """The dQ kernel's launch, over `splits` key shares summed by `SplitDq` into dq (at its
    strides) where > 1."""
    if splits == 1:
        return Launch(function, (grid,), (threads,), shared, arguments)
    # parts [head][share][n][d], float32 (common.cuh: SplitOutput; float64's in doubles)
    part = accumulation_dtype(dq.dtype)
    return SplitDq(Launch(function, (grid, splits), (threads,), shared, arguments),
                   _group_sum_launch(dq, splits, part=STORAGE[dtype_name(part)]),
                   splits * dq.size, part)


@dataclass(frozen=True)
class BackwardPlan:
    """A tensor-core backward's launches, kept in the plan cache: D, dQ (a `SplitDq` where
    the keys are cut into shares), the dK/dV kernels, the redo of blocks that flagged
    non-finite keys and the GQA group sums (None where absent). Called with the arrays, or
    with their device addresses (`tileattn.gpu.replay`), and the `scratch` of the call."""

    delta: Launch
    dq: Launch | SplitDq
    dkdv: tuple
    redo: Launch | None
    sums: GroupSums | None
    n_rows: int  # D's length: B x Hq x Nq
    key_blocks: int  # the dK/dV kernels' blocks: a flag each where there is a redo

    def scratch(self, allocate) -> tuple:
        """D, the dK/dV kernels' flags and the group sums' partial dK and dV (or None), as
        the device addresses ``allocate(bytes)`` gives: memory for one call, or for every
        call of a replay on one stream (calls on a stream run in order)."""
        flags = (empty(cupy.cuda.runtime.getDevice(), "int32").data.ptr if self.redo is None
                 else allocate(4 * self.key_blocks))
        parts = (None if self.sums is None
                 else tuple(allocate(size) for size in self.sums.part_bytes()))
        return allocate(4 * self.n_rows), flags, parts

    def __call__(self, do, q, k, v, o, lse, dq, dk, dv, scratch: tuple) -> None:
        delta, flags, parts = scratch
        self.delta(do, o, delta)
        self.dq(q, k, v, do, lse, delta, dq)
        unused = empty(cupy.cuda.runtime.getDevice(), "float32")
        for launch in self.dkdv:
            launch(q, k, v, do, lse, delta, *((dk, dv) if parts is None else parts), unused,
                   flags)
        if self.sums is not None:
            self.sums(parts, dk, dv)
        if self.redo is not None:
            self.redo(q, k, v, do, lse, delta, dk, dv, flags)


def new_bytes(held: list, size: int) -> int:
    """The address of `size` new bytes of CuPy's pool on the current stream, the array kept
    in `held` (a `BackwardPlan.scratch` allocator)."""
    held.append(cupy.empty(size, dtype=cupy.uint8))
    return held[-1].data.ptr


def _split_defines(entry: str, sums: GroupSums | None, dq_splits: int, dq, dk, dv) -> tuple:
    """A tensor-core dQ or dK/dV kernel's defines for its outputs: the GQA group cut
    (GROUP_SPLITS) or the keys' shares (SPLIT_KEYS), whose contiguous parts a group sum
    adds into the gradients, else STRIDED_OUT where a gradient it writes is strided."""
    if entry == "dkdv":
        if sums is not None:
            return (("GROUP_SPLITS", sums.splits),)
        return strided_out_defines(dk) or strided_out_defines(dv)
    return (("SPLIT_KEYS", 1),) if dq_splits > 1 else strided_out_defines(dq)


def _strides_of(*outputs) -> tuple:
    """The kernels' last arguments: the batch, head and row strides of each output."""
    return tuple(stride for out in outputs for stride in output_strides(out))


def _with_group(common: tuple, group: int) -> tuple:
    """`_operands`' arguments with the group size the dK/dV kernels take."""
    return common[:4] + (np.int32(group),) + common[5:]


def backward_wgmma(do, q, k, v, o, lse, options: AttentionOptions, tiles: WgmmaBackwardTiles,
                   single_pass: bool = False, given=(None, None, None),
                   sequences: Sequences | None = None, dq_splits: int | None = None,
                   planned: bool = False):
    """D = rowsum(do * o) first, then the dQ and the dK/dV kernels, which both read it.

    `single_pass` (measured, not the default): no dQ kernel; the dK/dV kernel adds dQ into
    a float32 buffer (B * Hq * Nq rounded up to 64 * D * 4 bytes) by bulk reductions, in
    arrival order, so dq's last bits depend on scheduling. It is slower than the two kernels
    on the H100 (bench/NOTES-gpu.md, v7, v10 and v11), so both settings of
    ``deterministic`` run the two kernels by default. A variable-length call (`sequences`)
    and strided gradients (a "bshd" call's) run the two kernels.
    """
    single_pass = single_pass and sequences is None and not _writes_strided(given)
    batch, n_q_heads, n_q, head_dim = q.shape
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    # The plan cache's key is the problem, not the tiles: only the table's own choice
    # (`planned`) is taken from and left in it, never tiles or dQ shares that tests and
    # sweeps force on a problem the cache may hold with others.
    cacheable = planned and not single_pass and dq_splits is None
    key = backward_plan_key(do, q, k, v, o, options, given) if cacheable else None
    arrays_in = (do, q, k, v, o)
    delta, delta_launch = row_deltas(do, o)
    launches = [delta_launch]
    (do, q, k, v, lse), (dq, dk, dv), common, copy_bytes = _operands(do, q, k, v, lse, options,
                                                                     given, sequences)
    widths = Widths.padded(head_dim, v.shape[3], 16)
    # The single pass's dQ buffer: (batch x head, query tile of 64, column block of 64)
    # blocks of 64 x 64 floats, one bulk reduction's destination each.
    dq_sum = (cupy.zeros(batch * n_q_heads * -(-n_q // 64) * 64 * head_dim, dtype=cupy.float32)
              if single_pass else empty(q.device.id, "float32"))
    flagging = _has_query_tail(n_q, tiles.dkdv[1], sequences)
    key_grid, key_tables, redo, flags = _key_grid(q, k, v, do, lse, dk, dv, options,
                                                  tiles.dkdv[0], flagging,
                                                  Switches.of(options).banded, sequences)
    group, sums, parts, key_grid, key_tables = _group_split(
        q, k, v, dk, dv, key_grid, key_tables, tiles.dkdv[0],
        not (flagging or single_pass or sequences))
    dq_splits = _dq_splits(q, k, options, tiles, sequences, single_pass, dq_splits)
    kernels = ([] if single_pass else [("dq", 0, (q, k, v, do, lse, delta, dq), n_q,
                                        n_q_heads)])
    kernels += [("dkdv", part, (q, k, v, do, lse, delta, *parts, dq_sum, flags), n_k,
                 n_kv_heads) for part in _dkdv_parts(tiles.split)]
    for entry, part, arrays, n_rows, heads in kernels:
        owned, streamed = getattr(tiles, entry)
        defines = (("COPY_BYTES", copy_bytes), ("DKDV_PART", part), ("HEAD_DIM", head_dim),
                   ("IS_BFLOAT16", int(dtype_name(q.dtype) == "bfloat16")),
                   ("OWNED_ROWS", owned), ("SINGLE_PASS", int(single_pass)),
                   ("STAGES", tiles.stages), ("STREAMED_ROWS", streamed),
                   ("VALUE_DIM", v.shape[3])) + Switches.of(options).defines()
        if sequences is not None:
            defines += (("VARLEN", 1),)
        if entry == "dkdv" and flagging:
            defines += (("FLAG_NON_FINITE_KEYS", 1),)
        defines += _split_defines(entry, sums, dq_splits, dq, dk, dv)
        shared = tiles.shared_bytes(entry, widths, single_pass, part)
        function = _compile.kernel(WGMMA_SOURCE, f"attention_backward_{entry}_wgmma",
                                   tuple(sorted(defines)), shared, arch="90a")
        grid, tables = ((key_grid, key_tables) if entry == "dkdv" else
                        tile_grid(heads, n_rows, owned, batch, sequences))
        arguments = (_with_group(common, group) + tables + _strides_of(*parts) if entry == "dkdv"
                     else common + tables + output_strides(dq))
        if entry == "dq":
            launches.append(_dq_launch(function, grid, owned // 64 * 128, shared, arguments,
                                       dq, dq_splits))
        else:
            launches.append(Launch(function, (grid,), (owned // 64 * 128,), shared,
                                   arguments))
        launches[-1](*arrays)
    if sums is not None:
        sums(parts, dk, dv)
    if redo is not None:
        redo(q, k, v, do, lse, delta, dk, dv, flags)
    if key is not None:
        remember(key, (BackwardPlan(launches[0], launches[1], tuple(launches[2:]), redo,
                                    sums, delta.size, flags.size),), copy_bytes, *arrays_in)
    if single_pass:  # `defines` are the dK/dV kernel's: the same module
        unblock = _compile.kernel(WGMMA_SOURCE, "attention_backward_dq_unblock",
                                  tuple(sorted(defines)), 0, arch="90a")
        unblock((min(4096, -(-dq.size // 512)),), (256,),
                (dq_sum, dq, np.int64(n_q), np.int64(dq.size), np.float32(options.scale)))
    return dq, dk, dv


def backward_mma(do, q, k, v, o, lse, options: AttentionOptions, tiles: MmaBackwardTiles,
                 single_pass: bool | None = None, given=(None, None, None),
                 sequences: Sequences | None = None, dq_splits: int | None = None,
                 dq_parts: bool = False):
    """The mma.sync backward (float32 on 3xTF32 with the same kernels, IS_FLOAT32; float64
    on sm_90's FP64 tensor cores, IS_FLOAT64: the two kernels, never the single pass).

    `single_pass` (attention_mma_backward.cu): no dQ kernel; the dK/dV kernel adds dQ into
    a float32 buffer (B * Hq * Nq * D * 4 bytes more memory), in turns when
    ``options.deterministic`` (bitwise reproducible), in arrival order otherwise. Without
    it the dQ kernel recomputes each tile for dQ itself (7 tile products instead of 5,
    deterministic). Default: the single pass where it serves the problem (16-bit: D = Dv
    a multiple of 16; float32: D a multiple of 8; dK and dV in one kernel, its dS tile
    within the shared memory; "bshd" gradients are written in place, dq by
    attention_backward_dq_convert_strided), in float32 for both settings, in 16-bit for
    ``deterministic=False`` only (`tiles.runs_single_pass`: turns cost more than the
    products they save in 16-bit, bench/NOTES-gpu.md v5, not in float32, v42); and not
    where a GQA grid of few dK/dV blocks would leave SMs idle (`tiles.takes_single_pass`:
    the two kernels cut its groups instead). `dq_parts` (with the single pass; a sweep's or
    test's choice until it is measured against the table's rows for few query rows): each
    key block stores its dQ shares into a slot of its own (B * Hq * key blocks * Nq * D * 4
    bytes), summed in the key blocks' order by the convert: reproducible without turns.
    """
    batch, n_q_heads, n_q, head_dim = q.shape
    n_kv_heads, n_k, value_dim = k.shape[1], k.shape[2], v.shape[3]
    is_float32 = dtype_name(q.dtype) == "float32"
    is_float64 = dtype_name(q.dtype) == "float64"
    widths = Widths.padded(head_dim, value_dim, 8 if is_float32 or is_float64 else 16)
    can_single = tiles.single_pass_fits(head_dim, value_dim, q.dtype.itemsize,
                                        shared_memory_limit(q.device.id))
    if single_pass is None:
        # A GQA group over too few dK/dV blocks cuts its heads over blocks (_group_split),
        # which the single pass cannot: where its own grid would leave SMs idle, the two
        # kernels keep them busy.
        key_blocks = batch * n_kv_heads * -(-n_k // tiles.dkdv[0])
        single_pass = runs_single_pass(dtype_name(q.dtype), options.deterministic) and \
            takes_single_pass(key_blocks, n_q_heads // n_kv_heads, sm_count(q.device.id))
    single_pass = single_pass and can_single and sequences is None and not is_float64
    dq_parts = dq_parts and single_pass
    ordered = single_pass and options.deterministic and not dq_parts
    delta = row_deltas(do, o)[0]
    (do, q, k, v, lse), (dq, dk, dv), common, copy_bytes = _operands(do, q, k, v, lse, options,
                                                                     given, sequences)
    # DQ_PARTS: a slot per key block of each head, zeros where a band skips the block.
    dq_slots = -(-n_k // tiles.dkdv[0]) if dq_parts else 1
    dq_sum = cupy.zeros(dq.size * dq_slots if single_pass else 0, dtype=cupy.float32)
    n_q_tiles = -(-n_q // tiles.dkdv[1])
    # ORDERED: the blocks' ticket, then a turn counter per (batch x head, query tile).
    dq_turns = cupy.zeros(1 + batch * n_q_heads * n_q_tiles if ordered else 0,
                          dtype=cupy.int32)
    # float32 and float64 zero the tail's probabilities instead (QUERY_TAIL below), at no
    # cost there.
    flagging = (not (is_float32 or is_float64)
                and _has_query_tail(n_q, tiles.dkdv[1], sequences))
    key_grid, key_tables, redo, flags = _key_grid(q, k, v, do, lse, dk, dv, options,
                                                  tiles.dkdv[0], flagging,
                                                  Switches.of(options).banded or ordered,
                                                  sequences)
    group, sums, parts, key_grid, key_tables = _group_split(
        q, k, v, dk, dv, key_grid, key_tables, tiles.dkdv[0],
        not (flagging or single_pass or sequences))
    dq_splits = _dq_splits(q, k, options, tiles, sequences, single_pass, dq_splits)
    kernels = ([] if single_pass else [("dq", 0, (q, k, v, do, lse, delta, dq), n_q,
                                        n_q_heads)])
    kernels += [("dkdv", part, (q, k, v, do, lse, delta, *parts, dq_sum, dq_turns, flags),
                 n_k, n_kv_heads) for part in _dkdv_parts(tiles.split)]
    for entry, part, arrays, n_rows, heads in kernels:
        owned, streamed = getattr(tiles, entry)
        defines = (("COPY_BYTES", copy_bytes), ("DKDV_PART", part), ("HEAD_DIM", head_dim),
                   ("IS_BFLOAT16", int(dtype_name(q.dtype) == "bfloat16")),
                   ("IS_FLOAT32", int(is_float32)), ("IS_FLOAT64", int(is_float64)),
                   ("ORDERED", int(ordered)),
                   ("OWNED_ROWS", owned), ("SINGLE_PASS", int(single_pass)),
                   ("STREAMED_ROWS", streamed), ("VALUE_DIM", value_dim)
                   ) + Switches.of(options).defines()
        if sequences is not None:
            defines += (("VARLEN", 1),)
        if dq_parts:
            defines += (("DQ_PARTS", 1),)
        if (entry == "dkdv" and (is_float32 or is_float64)
                and _has_query_tail(n_q, streamed, sequences)):
            defines += (("QUERY_TAIL", 1),)  # backward_scores.cuh: transposed_probabilities
        if entry == "dkdv" and flagging:
            defines += (("FLAG_NON_FINITE_KEYS", 1),)
        if entry in tiles.paired:
            defines += (("PAIRED_WARPS", 1),)
        defines += _split_defines(entry, sums, dq_splits, dq, dk, dv)
        shared = tiles.shared_bytes(entry, widths, q.dtype.itemsize, single_pass, part)
        function = _compile.kernel(MMA_SOURCE, f"attention_backward_{entry}_mma",
                                   tuple(sorted(defines)), shared)
        grid, tables = ((key_grid, key_tables) if entry == "dkdv" else
                        tile_grid(heads, n_rows, owned, batch, sequences))
        arguments = (_with_group(common, group) + tables + _strides_of(*parts) if entry == "dkdv"
                     else common + tables + output_strides(dq))
        if grid and entry == "dq":
            _dq_launch(function, grid, tiles.threads(entry), shared, arguments, dq,
                       dq_splits)(*arrays)
        elif grid:
            function((grid,), (tiles.threads(entry),), arrays + arguments, shared_mem=shared)
    if sums is not None:
        sums(parts, dk, dv)
    if redo is not None:
        redo(q, k, v, do, lse, delta, dk, dv, flags)
    if single_pass:  # `defines` are the dK/dV kernel's: the same module
        strided = bool(strided_out_defines(dq))
        convert = _compile.kernel(
            MMA_SOURCE, "attention_backward_dq_convert" + ("_strided" if strided else ""),
            tuple(sorted(defines)), 0)
        arguments = (dq_sum, dq, np.int64(dq.size), np.float32(options.scale),
                     np.int32(dq_slots), np.int64(n_q * head_dim))
        if strided:  # a "bshd" dq, written in the caller's order
            arguments += (np.int32(n_q_heads), np.int64(n_q), np.int32(head_dim),
                          *output_strides(dq))
        convert((min(4096, -(-dq.size // 512)),), (256,), arguments)
    return dq, dk, dv


# --------------------------------------------------------------------------- generic


def backward_generic(do, q, k, v, o, lse, options: AttentionOptions, given=(None, None, None),
                     sequences: Sequences | None = None):
    batch, n_q_heads, n_q, head_dim = q.shape
    n_kv_heads, n_k, value_dim = k.shape[1], k.shape[2], v.shape[3]
    accum = accumulation_dtype(q.dtype)
    config = GenericConfig.for_problem(q.dtype, head_dim, value_dim, options, "backward")
    blocks = config.blocks(options)
    delta = row_deltas(do, o)[0]
    if lse.dtype != accum:
        lse = lse.astype(accum)
    (do, do_strides), (lse, lse_strides) = map(element_strides, (do, lse))
    (q, q_strides), (k, k_strides), (v, v_strides) = map(element_strides, (q, k, v))
    dq, dk, dv = _outputs(q, k, v, given, zeroed=leaves_padding(options.varlen))
    common = (alibi_slopes(options), np.int64(n_q), np.int64(n_k), np.int32(n_q_heads),
              np.int32(n_q_heads // n_kv_heads), np.int32(head_dim), np.int32(value_dim),
              np.int32(blocks.block_q), np.int32(blocks.block_k), *q_strides, *k_strides,
              *v_strides, *do_strides, *lse_strides,
              *score_arguments(options, n_q, n_k, accum))
    extra = sequences.defines() if sequences is not None else ()
    function, shared = config.kernel("attention_backward_dq", extra)
    grid, tables = tile_grid(n_q_heads, n_q, blocks.block_q, batch, sequences)
    if grid:
        function((grid,), (GENERIC_THREADS,),
                 (q, k, v, do, lse, delta, dq) + common + tables + output_strides(dq),
                 shared_mem=shared)
    function, shared = config.kernel("attention_backward_dkdv", extra)
    grid, tables = tile_grid(n_kv_heads, n_k, blocks.block_k, batch, sequences, keys=True)
    if grid:
        function((grid,), (GENERIC_THREADS,),
                 (q, k, v, do, lse, delta, dk, dv) + common + tables + _strides_of(dk, dv),
                 shared_mem=shared)
    return dq, dk, dv


# --------------------------------------------------------------------------- dispatch


def run(choice: Choice, do, q, k, v, o, lse, options: AttentionOptions,
        given=(None, None, None), sequences: Sequences | None = None, planned: bool = False):
    """``(dq, dk, dv)`` with the family and tiles of `choice` (the sweeps pass their own;
    its `key_splits` above 1 forces the dQ kernel's key shares), written into the `given`
    buffers where there are some. `planned`: `choice` is the tile table's for the problem,
    so its launches may be cached under the problem (`backward_wgmma`)."""
    forced = choice.key_splits if choice.key_splits > 1 else None
    if choice.family == "wgmma":
        return backward_wgmma(do, q, k, v, o, lse, options, choice.tiles, given=given,
                              sequences=sequences, dq_splits=forced, planned=planned)
    if choice.family in ("mma", "tf32", "f64"):
        return backward_mma(do, q, k, v, o, lse, options, choice.tiles, given=given,
                            sequences=sequences, dq_splits=forced)
    return backward_generic(do, q, k, v, o, lse, options, given, sequences)


def backward_plan_key(do, q, k, v, o, options: AttentionOptions, given) -> tuple | None:
    """The plan cache's key of a backward: the problem and the gradients' strides (the
    launches take them as arguments)."""
    key = plan_key("backward", options, do, q, k, v, o)
    return None if key is None else key + gradient_strides(q, k, v, given)


def _replayed(do, q, k, v, o, lse, options: AttentionOptions, given) -> tuple | None:
    """``(dq, dk, dv)`` by the launches an earlier call of this problem left in the plan
    cache (the tile table's own choice: `backward_wgmma` with `planned`), or None."""
    if lse.dtype != cupy.float32 or not lse.flags.c_contiguous:
        return None
    launches = cached(backward_plan_key(do, q, k, v, o, options, given), do, q, k, v, o)
    if launches is None:
        return None
    plan = launches[0]
    dq, dk, dv = _outputs(q, k, v, given, zeroed=leaves_padding(options.varlen))
    held = []  # the scratch's arrays, alive until the kernels are queued
    plan(do, q, k, v, o, lse, dq, dk, dv, plan.scratch(partial(new_bytes, held)))
    return dq, dk, dv


def backward(do, q, k, v, o, lse, options: AttentionOptions, given=(None, None, None)):
    """``(dq, dk, dv)``, written into the `given` buffers (any batch, head and row strides:
    a "bshd" gradient in the caller's order) where there are some. A problem whose
    launches are cached (dense, or variable-length with host lengths: the layers of a
    training step repeat them) runs them without choosing or planning again."""
    replayed = _replayed(do, q, k, v, o, lse, options, given)
    if replayed is not None:
        return replayed
    if options.varlen is not None:
        sequences = Sequences(q, k, options)
        problem = problem_for(q.device.id, q.dtype, q.shape[3], v.shape[3],
                              max(1, sequences.max_keys), options)
        return run(choose_backward(problem), do, q, k, v, o, lse, options, given, sequences,
                   planned=True)
    return run(choose_backward(problem_of(q, k, v, options)), do, q, k, v, o, lse, options,
               given, planned=True)
