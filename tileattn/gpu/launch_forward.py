"""Launching the forward: the family and tiles come from `choose` (`tiles.choose_decode` for
few query rows against many keys, else `tiles.choose_forward`); each launcher here only
turns its row into compile-time defines, a grid and arguments."""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from ..arrays import dtype_name
from ..options import UNLIMITED, AttentionOptions, Blocks, evolve
from . import _compile
from .launch_decode import decode_shape, forward_decode, kept_keys
from .operands import (STORAGE, Launch, Switches, accumulation_dtype, alibi_slopes, cached,
                       element_strides, forward_plan_key, output_strides, problem_for, remember,
                       score_arguments, shared_memory_limit, sm_count, strided_out_defines,
                       tensor_core_operands)
from . import tiles as tile_tables
from .tiles import (FOLD_MAX_QUERY_ROWS, MAX_TENSOR_CORE_DIM, Choice, F64Tiles, MmaTiles,
                    Tf32Tiles, Tf32WgmmaTiles, WgmmaTiles, Widths, choose_decode, choose_forward,
                    cuts_key_shares, fold_value_slices, folded_choice, folds_decode_rows,
                    folds_group_rows, forward_resident_blocks, key_shares, with_key_splits,
                    within_pages)
from .varlen import Sequences, tile_grid
from .workspace import partials

WGMMA_SOURCE = "attention_wgmma_forward.cu"
MMA_SOURCE = "attention_mma_forward.cu"
TF32_SOURCE = "attention_tf32_forward.cu"
TF32_WGMMA_SOURCE = "attention_tf32_wgmma_forward.cu"
GENERIC_SOURCE = "attention_generic.cu"
SPLIT_MERGE_SOURCE = "split_keys_merge.cu"
SPLIT_MERGE_THREADS = 256  # split_keys_merge's __launch_bounds__
SPLIT_MERGE_COLUMNS = 4  # columns of a row a merge thread takes (kColumns)
GENERIC_THREADS = 256
# The generic kernels' tile capacities, a list per direction, the first whose kernels fit
# the device's shared memory (the count beside it: blocks an SM that must fit) taken. Their
# products read both operands from shared memory for one multiply-add each, so bigger tiles
# cut the loads per FMA; float64, B x N = 16k, H200 (bench/experiments/generic_tiles_gpu.py,
# NOTES-gpu v52), ms forward / backward against one capacity for all sized to 48 KiB (16 x
# 16 in float64 from D 64): D 64 114.6 / 301.6 -> 71.9 (64 x 32) / 197.0 (32 x 32, two an
# SM; 32 x 64, one, 220.4); D 128 106.5 / 316.9 -> 77.2 / 240.3 (32 x 64); D 256 116.8 /
# 636.9 -> 92.0 (32 x 32) / 326.1 (16 x 32). 16 x 16 is the smallest that splits evenly
# over 256 threads; where even it does not fit, `GenericConfig.kernel` refuses the shape.
GENERIC_CAPACITIES = {
    "forward": ((Blocks(64, 32), 1), (Blocks(32, 32), 1), (Blocks(16, 32), 1),
                (Blocks(16, 16), 1)),
    "backward": ((Blocks(32, 32), 2), (Blocks(32, 64), 1), (Blocks(32, 32), 1),
                 (Blocks(16, 32), 1), (Blocks(16, 16), 1)),
}
GENERIC_ENTRIES = {"forward": ("attention_forward",),
                   "backward": ("attention_backward_dq", "attention_backward_dkdv",
                                "attention_backward_dkdv_redo")}


def _dims_defines(q, v, copy_bytes: int) -> tuple:
    return (("COPY_BYTES", copy_bytes), ("HEAD_DIM", q.shape[3]), ("VALUE_DIM", v.shape[3]))


@dataclass(frozen=True)
class SplitKeysLaunch:
    """A split-KV forward (`tiles.forward_key_splits`): the kernel over (query tiles, key
    shares) into the workspace's partials (float32; float64 for float64), then
    split_keys_merge.cu into o and lse.
    `unwritten_rows`: a variable-length call, whose kernels skip rows of no sequence; their
    lse partials start as -inf, so the merge writes o = 0 and lse = -inf there."""

    forward: Launch
    merge: Launch
    partial_size: int  # shares x rows x Dv
    lse_size: int  # shares x rows
    unwritten_rows: bool = False
    partial_dtype: type = np.float32

    def __call__(self, q, k, v, o, lse):
        partial_o, partial_lse = partials(self.partial_size, self.lse_size, self.partial_dtype)
        if self.unwritten_rows:
            partial_lse.fill(-np.inf)
        self.forward(q, k, v, partial_o, partial_lse)
        self.merge(partial_o, partial_lse, o, lse)


def _merge_launch(o, n_q: int, splits: int) -> Launch:
    """split_keys_merge.cu over the rows of o (heads of `n_q`): a thread per
    SPLIT_MERGE_COLUMNS columns."""
    batch, n_q_heads, _, value_dim = o.shape
    n_rows = batch * n_q_heads * n_q
    defines = (("PARTIAL", "double" if accumulation_dtype(o.dtype) == np.float64 else "float"),
               ("STORAGE", STORAGE[dtype_name(o.dtype)]), ("VALUE_DIM", value_dim))
    function = _compile.kernel(SPLIT_MERGE_SOURCE, "split_keys_merge", defines)
    threads = n_rows * -(-value_dim // SPLIT_MERGE_COLUMNS)
    return Launch(function, (-(-threads // SPLIT_MERGE_THREADS),), (SPLIT_MERGE_THREADS,), 0,
                  (np.int64(n_rows), np.int64(n_q), np.int32(splits), np.int32(n_q_heads),
                   *output_strides(o)))


def _launch_tensor_core(function, shared: int, block_q: int, threads: int, q, k, v, o, lse,
                        strides, options: AttentionOptions, grid: tuple, splits: int,
                        sequences: Sequences | None):
    """Launches a tensor-core forward over `grid` (``(blocks, table arguments)``: a block
    per `block_q` query rows of a head, `splits` key shares each) with the arguments every
    such kernel takes, and returns the launch."""
    batch, n_q_heads, n_q, _ = q.shape
    n_kv_heads, n_k, value_dim = k.shape[1], k.shape[2], v.shape[3]
    q_strides, k_strides, v_strides = strides
    blocks, tables = grid
    launch = Launch(function, (blocks, splits) if splits > 1 else (blocks,), (threads,), shared,
                    (alibi_slopes(options), np.int64(n_q), np.int64(n_k), np.int32(n_q_heads),
                     np.int32(n_q_heads // n_kv_heads), *q_strides[:3], *k_strides[:3],
                     *v_strides[:3], *output_strides(o),
                     *score_arguments(options, n_q, n_k, accumulation_dtype(q.dtype)),
                     *tables))
    if splits > 1:
        n_rows = batch * n_q_heads * n_q
        launch = SplitKeysLaunch(launch, _merge_launch(o, n_q, splits),
                                 splits * n_rows * value_dim, splits * n_rows,
                                 unwritten_rows=sequences is not None,
                                 partial_dtype=accumulation_dtype(q.dtype).type)
    launch(q, k, v, o, lse)
    return launch


def _forward_on_tensor_cores(source: str, entry: str, family_defines: tuple, step: int,
                             arch: str | None, q, k, v, o, lse, options: AttentionOptions,
                             tiles, sequences: Sequences | None, splits) -> tuple:
    """A tensor-core forward of `tiles` (widths padded to `step`), the arrays read in place
    with the widest copies their rows allow, the keys cut into `splits` shares (or as many
    as ``splits(blocks)`` says for the grid's blocks): ``(launch, copy bytes)``."""
    (q, k, v), strides, copy_bytes = tensor_core_operands(q, k, v)
    grid = tile_grid(q.shape[1], q.shape[2], tiles.block_q, q.shape[0], sequences)
    if callable(splits):
        splits = splits(grid[0])
    if copy_bytes < 16 and ("OVERLAP", 1) in family_defines:
        # Rows copied in narrower pieces (misaligned or odd-strided inputs) take more
        # registers, and the overlapped 64x128 tiles then spill (ptxas, D 128: 4-40 bytes),
        # which a kernel whose accumulators wgmma writes in flight must not: the same tiles
        # run on the plain schedule.
        family_defines = tuple(define for define in family_defines if define[0] != "OVERLAP")
    defines = (family_defines + _dims_defines(q, v, copy_bytes) + Switches.of(options).defines()
               + strided_out_defines(o))
    if sequences is not None:
        defines += sequences.defines()
    if splits > 1:
        defines += (("SPLIT_KEYS", 1),)
    shared = tiles.shared_bytes(Widths.padded(q.shape[3], v.shape[3], step))
    function = _compile.kernel(source, entry, tuple(sorted(defines)), shared, arch=arch)
    return _launch_tensor_core(function, shared, tiles.block_q, tiles.threads, q, k, v, o, lse,
                               strides, options, grid, splits, sequences), copy_bytes


def forward_wgmma(q, k, v, o, lse, options: AttentionOptions, tiles: WgmmaTiles,
                  sequences: Sequences | None = None, splits: int = 1) -> tuple:
    defines = (("BLOCK_K", tiles.block_k), ("BLOCK_Q", tiles.block_q),
               ("BLOCKS_PER_SM", tiles.blocks_per_sm),
               ("IS_BFLOAT16", int(dtype_name(q.dtype) == "bfloat16")), ("STAGES", tiles.stages))
    if sequences is not None and sequences.pages_hold_tiles(tiles.block_k):
        defines += (("PAGES_HOLD_TILES", 1),)  # a key tile's copies from one table entry
    if tiles.overlap:
        defines += (("OVERLAP", 1),)
    return _forward_on_tensor_cores(WGMMA_SOURCE, "attention_forward_wgmma", defines, 16, "90a",
                                    q, k, v, o, lse, options, tiles, sequences, splits)


def forward_mma(q, k, v, o, lse, options: AttentionOptions, tiles: MmaTiles,
                sequences: Sequences | None = None, splits: int = 1) -> tuple:
    defines = (("BLOCK_K", tiles.block_k), ("BLOCK_Q", tiles.block_q),
               ("IS_BFLOAT16", int(dtype_name(q.dtype) == "bfloat16")),
               ("Q_IN_REGISTERS", int(tiles.q_in_registers)), ("WARP_ROWS", tiles.warp_rows))
    return _forward_on_tensor_cores(MMA_SOURCE, "attention_forward_mma", defines, 16, None,
                                    q, k, v, o, lse, options, tiles, sequences, splits)


def forward_tf32(q, k, v, o, lse, options: AttentionOptions, tiles: Tf32Tiles | Tf32WgmmaTiles,
                 sequences: Sequences | None = None, splits: int = 1) -> tuple:
    if isinstance(tiles, Tf32WgmmaTiles):
        return _forward_on_tensor_cores(
            TF32_WGMMA_SOURCE, "attention_forward_tf32_wgmma",
            (("BLOCK_K", tiles.block_k), ("BLOCK_Q", tiles.block_q)), 8, "90a",
            q, k, v, o, lse, options, tiles, sequences, splits)
    defines = (("BLOCK_K", tiles.block_k), ("BLOCK_Q", tiles.block_q),
               ("WARP_ROWS", tiles.warp_rows))
    return _forward_on_tensor_cores(TF32_SOURCE, "attention_forward_tf32", defines, 8, None,
                                    q, k, v, o, lse, options, tiles, sequences, splits)


def forward_f64(q, k, v, o, lse, options: AttentionOptions, tiles: F64Tiles,
                sequences: Sequences | None = None, splits: int = 1) -> tuple:
    """float64 on sm_90's FP64 tensor cores: the 3xTF32 forward's source with one double
    product in place of three (IS_FLOAT64); key shares merge double partials."""
    defines = (("BLOCK_K", tiles.block_k), ("BLOCK_Q", tiles.block_q), ("IS_FLOAT64", 1),
               ("WARP_ROWS", tiles.warp_rows))
    return _forward_on_tensor_cores(TF32_SOURCE, "attention_forward_f64", defines, 8, None,
                                    q, k, v, o, lse, options, tiles, sequences, splits)


# --------------------------------------------------------------------------- generic


def padded_dim(dim: int) -> int:
    """The generic kernels' tile width for a head dim: a power of two >= 16 up to the block's
    threads (a thread keeps one column), a multiple of the threads above (a thread keeps
    several columns of every row)."""
    if dim > GENERIC_THREADS:
        return -(-dim // GENERIC_THREADS) * GENERIC_THREADS
    return max(16, 1 << (dim - 1).bit_length())


def _generic_shared_bytes(accum_size: int, head_pad: int, value_pad: int,
                          block_q: int, block_k: int) -> dict[str, int]:
    """Dynamic shared memory of each generic kernel, mirroring the layouts in
    attention_generic.cu (each kernel checks it got at least this much)."""
    head_pitch, value_pitch, score_pitch = head_pad + 1, value_pad + 1, block_k + 1
    kv = block_k * (head_pitch + value_pitch)
    q_do = block_q * (head_pitch + value_pitch)
    dkdv = accum_size * (kv + q_do + 2 * block_q * score_pitch + 2 * block_q)
    return {
        "attention_forward": accum_size * (block_q * head_pitch + kv + block_q * score_pitch
                                           + 3 * block_q),
        "attention_backward_dkdv": dkdv,
        "attention_backward_dkdv_redo": dkdv,
        "attention_backward_dq": accum_size * (kv + q_do + block_q * score_pitch
                                               + 2 * block_q),
    }


@dataclass(frozen=True)
class GenericConfig:
    """One compiled configuration of attention_generic.cu for one direction: its tile
    *capacity* is the first of `GENERIC_CAPACITIES` that fits; the caller's tile sizes run
    up to it as run-time values."""

    dtype: str
    head_pad: int
    value_pad: int
    capacity: Blocks
    switches: Switches

    @classmethod
    def for_problem(cls, dtype, head_dim: int, value_dim: int, options: AttentionOptions,
                    direction: str, shared_limit: int | None = None) -> "GenericConfig":
        """The configuration of one direction's kernels ("forward" or "backward") on a
        device offering `shared_limit` bytes a block (the current device's by default)."""
        head_pad, value_pad = padded_dim(head_dim), padded_dim(value_dim)
        accum_size = accumulation_dtype(dtype).itemsize
        if shared_limit is None:
            shared_limit = shared_memory_limit(cupy.cuda.Device().id)
        capacities = GENERIC_CAPACITIES[direction]
        for capacity, per_sm in capacities:
            shared = _generic_shared_bytes(accum_size, head_pad, value_pad, capacity.block_q,
                                          capacity.block_k)
            if max(shared[entry] for entry in GENERIC_ENTRIES[direction]) * per_sm \
                    <= shared_limit:
                break
        return cls(np.dtype(dtype).name, head_pad, value_pad, capacity, Switches.of(options))

    def blocks(self, options: AttentionOptions) -> Blocks:
        """The caller's tile sizes, clipped to this configuration's capacity."""
        wanted = self.capacity.resolve(options.block_q, options.block_k)
        return Blocks(min(wanted.block_q, self.capacity.block_q),
                      min(wanted.block_k, self.capacity.block_k))

    def kernel(self, entry: str, extra_defines: tuple = ()):
        accum = accumulation_dtype(self.dtype)
        shared = _generic_shared_bytes(accum.itemsize, self.head_pad, self.value_pad,
                                       self.capacity.block_q, self.capacity.block_k)[entry]
        limit = shared_memory_limit(cupy.cuda.Device().id)
        if shared > limit:
            raise ValueError(
                f"head dims {self.head_pad}/{self.value_pad} (padded) in {self.dtype} need "
                f"{shared // 1024} KiB of shared memory a block for {entry} on the GPU's "
                f"CUDA-core kernels; this device offers {limit // 1024} KiB: use a smaller "
                f"head dim, a 16-bit or float32 dtype, or backend='cpu'")
        defines = (("ACCUM", "double" if accum == np.float64 else "float"),
                   ("BLOCK_K", self.capacity.block_k), ("BLOCK_Q", self.capacity.block_q),
                   ("HEAD_DIM_PAD", self.head_pad), ("STORAGE", STORAGE[self.dtype]),
                   ("THREADS", GENERIC_THREADS),
                   ("VALUE_DIM_PAD", self.value_pad)) + self.switches.defines() + extra_defines
        return _compile.kernel(GENERIC_SOURCE, entry, tuple(sorted(defines)), shared), shared


def forward_generic(q, k, v, o, lse, options: AttentionOptions, tiles=None,
                    sequences: Sequences | None = None) -> tuple:
    batch, n_q_heads, n_q, head_dim = q.shape
    n_kv_heads, n_k, value_dim = k.shape[1], k.shape[2], v.shape[3]
    config = GenericConfig.for_problem(q.dtype, head_dim, value_dim, options, "forward")
    blocks = config.blocks(options)
    function, shared = config.kernel(
        "attention_forward", sequences.defines() if sequences is not None else ())
    (q, q_strides), (k, k_strides), (v, v_strides) = map(element_strides, (q, k, v))
    grid, tables = tile_grid(n_q_heads, n_q, blocks.block_q, batch, sequences)
    launch = Launch(function, (grid,), (GENERIC_THREADS,), shared,
                    (alibi_slopes(options), np.int64(n_q), np.int64(n_k), np.int32(n_q_heads),
                     np.int32(n_q_heads // n_kv_heads), np.int32(head_dim),
                     np.int32(value_dim), np.int32(blocks.block_q), np.int32(blocks.block_k),
                     *q_strides, *k_strides, *v_strides, *output_strides(o),
                     *score_arguments(options, n_q, n_k, accumulation_dtype(q.dtype)), *tables))
    launch(q, k, v, o, lse)
    return launch, 1


# --------------------------------------------------------------------------- dispatch

# Each launcher returns ``(launch, alignment)``: the launch, to be cached, and the address
# alignment (bytes) its copies assume.
_LAUNCHERS = {"wgmma": forward_wgmma, "mma": forward_mma, "tf32": forward_tf32,
              "f64": forward_f64, "generic": forward_generic, "decode": forward_decode}


def choose(q, k, v, options: AttentionOptions, sequences: Sequences | None = None) -> Choice:
    """The forward's family and tiles: decode where `tiles.choose_decode` takes the problem
    (few packed query rows, many keys), else the prefill table's choice. A variable-length
    call is chosen for by its longest sequence; packed sequences never decode (the decode
    kernel's blocks are batch elements)."""
    n_k = k.shape[2] if sequences is None else max(1, sequences.max_keys)
    # A dense grid is known here (rows that go by waves); a tile table's is not.
    grid = (q.shape[0] * q.shape[1], q.shape[2]) if sequences is None else (0, 0)
    problem = problem_for(q.device.id, q.dtype, q.shape[3], v.shape[3], n_k, options, *grid)
    if sequences is not None and sequences.packed:
        return choose_forward(problem)
    shape = decode_shape(q, k, options, n_k)
    decode = choose_decode(problem, shape)
    if decode is not None:
        return decode
    if sequences is not None or problem.named_blocks:
        return choose_forward(problem)
    return with_key_splits(choose_forward(problem), shape)


def _run(choice: Choice, q, k, v, o, lse, options: AttentionOptions,
         sequences: Sequences | None = None, splits=None) -> tuple:
    """Runs `choice`'s launcher (with `splits` key shares, or a rule giving them for the
    grid's blocks, in place of the choice's): ``(launch, alignment)``."""
    splits = choice.key_splits if splits is None else splits
    extra = {} if splits == 1 else {"splits": splits}
    return _LAUNCHERS[choice.family](q, k, v, o, lse, options, choice.tiles, sequences, **extra)


def _varlen_shares(choice: Choice, q, options: AttentionOptions, sequences: Sequences):
    """The key shares of a variable-length forward, as a rule of its tile table's blocks
    (`tiles.key_shares`, as for a dense grid, the longest sequence's keys and window
    bounding a share's), or 1 where the family does not split or tile sizes are named."""
    if (not cuts_key_shares(choice.family) or options.block_q is not None
            or options.block_k is not None):
        return 1
    keys = sequences.max_keys
    if options.window_left != UNLIMITED and options.window_right != UNLIMITED:
        keys = min(keys, sequences.max_rows + options.window_left + options.window_right)
    resident = forward_resident_blocks(choice.tiles, sm_count(q.device.id))
    return lambda blocks: key_shares(blocks, resident, keys, choice.tiles.block_k)


def _outputs(q, v, out=None, lse_out=None):
    """o and lse: the caller's buffers where given (validated: shape, dtype, rows contiguous
    at any strides, two-element aligned), else new ones; uninitialised, every element is
    written."""
    batch, n_q_heads, n_q, _ = q.shape
    return (cupy.empty((batch, n_q_heads, n_q, v.shape[3]), dtype=q.dtype) if out is None
            else out,
            cupy.empty((batch, n_q_heads, n_q), dtype=accumulation_dtype(q.dtype))
            if lse_out is None else lse_out)


def launch(choice: Choice, q, k, v, o, lse, options: AttentionOptions):
    """Runs the family and tiles of `choice` into o and lse and returns the launch, which
    repeats the call on arrays of the same shapes, strides and alignment (benchmarks)."""
    return _run(choice, q, k, v, o, lse, options)[0]


def run(choice: Choice, q, k, v, options: AttentionOptions):
    """``(o, lse)`` with the family and tiles of `choice` (tests and sweeps name theirs)."""
    o, lse = _outputs(q, v)
    launch(choice, q, k, v, o, lse, options)
    return o, lse


def forward(q, k, v, options: AttentionOptions, out=None, lse_out=None):
    if options.varlen is not None:
        return _forward_varlen(q, k, v, options, out, lse_out)
    o, lse = _outputs(q, v, out, lse_out)
    if may_fold(q, k, v, options) and _forward_folded_rows(q, k, v, o, lse, options):
        return o, lse
    key = forward_plan_key(options, q, k, v, o.strides)
    launches = cached(key, q, k, v)
    if launches is not None:
        launches[0](q, k, v, o, lse)
        return o, lse
    choice = choose(q, k, v, options)
    launch, alignment = _run(choice, q, k, v, o, lse, options)
    remember(key, (launch,), alignment, q, k, v)
    return o, lse


def folds_group(dtype, head_dim: int, value_dim: int, n_q: int, group: int,
                options: AttentionOptions) -> bool:
    """`tiles.folds_group_rows` for a forward with these options."""
    return folds_group_rows(dtype_name(dtype), head_dim, value_dim, n_q, group,
                            options.alibi_slopes is not None or options.dropout_p > 0,
                            options.block_q is not None or options.block_k is not None)


def may_fold(q, k, v, options: AttentionOptions) -> bool:
    """Whether a dense forward of these shapes is a GQA decode that folds its group into
    query rows: a wide one (`tiles.folds_group_rows`) or one of many packed rows at the
    tensor-core head dims (`folds_decode`), where the fold still has to take it
    (`fold_choice`)."""
    n_q, head_dim, value_dim = q.shape[2], q.shape[3], v.shape[3]
    if max(head_dim, value_dim) <= MAX_TENSOR_CORE_DIM:
        return tile_tables.FOLD_DECODE_ENABLED and folds_decode(q, k, v, options)
    return (n_q <= FOLD_MAX_QUERY_ROWS
            and folds_group(q.dtype, head_dim, value_dim, n_q, q.shape[1] // k.shape[1],
                            options))


def folds_decode(q, k, v, options: AttentionOptions) -> bool:
    """`tiles.folds_decode_rows` for a forward with these arrays and options."""
    masked = options.causal or options.window_left != UNLIMITED \
        or options.window_right != UNLIMITED
    return folds_decode_rows(dtype_name(q.dtype), q.shape[3], v.shape[3], q.shape[2],
                             q.shape[1] // k.shape[1], masked,
                             options.alibi_slopes is not None or options.dropout_p > 0,
                             options.block_q is not None or options.block_k is not None)


def fold_rows(options: AttentionOptions, n_q: int, n_k: int) -> list:
    """A folded forward's query rows, each ``(options, low, high)``: the row alone, its band
    where it was (a one-row call aligned at its offset), and the keys [low, high) it keeps
    (none where low >= high)."""
    if n_q == 1:
        rows = [options]
    else:
        offset = options.band_offset(n_q, n_k)
        rows = [evolve(options, alignment=offset + row, row_offset=0, col_offset=0)
                for row in range(n_q)]
    return [(alone, *kept_keys(alone, 1, n_k)) for alone in rows]


def fold_choice(q, k, value_dim: int, options: AttentionOptions, decodes: bool):
    """`tiles.folded_choice` for a folded decode: `q` its (B, Hkv, group, D) query rows, `k`
    the keys its row keeps, values `value_dim` wide run in column slices
    (`tiles.fold_value_slices`, the first the widest), `options` unmasked; `decodes`: the
    unfolded call takes the decode kernel."""
    widest = fold_value_slices(value_dim)[0][1]
    problem = problem_for(q.device.id, q.dtype, q.shape[3], widest, k.shape[2], options,
                          q.shape[0] * q.shape[1], q.shape[2])
    return folded_choice(problem, decode_shape(q, k, options), decodes)


def unmasked(options: AttentionOptions) -> AttentionOptions:
    """A folded decode's options: its keys already cut to the row's, no mask or offsets."""
    return evolve(options, causal=False, window_left=UNLIMITED, window_right=UNLIMITED,
                  row_offset=0, col_offset=0, alignment=None)


def _forward_folded_rows(q, k, v, o, lse, options: AttentionOptions) -> bool:
    """Runs a wide GQA decode (`tiles.folds_group_rows`) folded (`_fold_group`), one fold
    per query row, each over the keys its row keeps; False where it does not fold (a row
    that keeps no key, or a fold `_forward_folded` declines), the plain path then writing
    every row."""
    n_q, n_k = q.shape[2], k.shape[2]
    unfolded = (q, k, v, options)
    if n_q > 1 and max(q.shape[3], v.shape[3]) <= MAX_TENSOR_CORE_DIM:
        # Every row keeps every key (`folds_decode_rows`): all of them in one fold.
        folded = _fold_every_row(q, k, v, o, lse, options)
        return folded is not None and _forward_folded(*folded, unfolded=unfolded)
    rows = fold_rows(options, n_q, n_k)
    if n_q == 1:
        folded = _fold_group(q, k, v, o, lse, *rows[0])
        return folded is not None and _forward_folded(*folded, unfolded=unfolded)
    # The kernels write lse as a contiguous (B, H, N) array: each query row's go to a row
    # of their own, copied into lse once every row has run.
    rows_lse = cupy.empty((n_q,) + lse.shape[:2], dtype=lse.dtype)
    folds = []
    for row, (alone, low, high) in enumerate(rows):
        one = slice(row, row + 1)
        folded = _fold_group(q[:, :, one], k, v, o[:, :, one], rows_lse[row][..., None],
                             alone, low, high)
        if folded is None:
            return False
        folds.append(folded)
    if not all(_forward_folded(*folded, unfolded=unfolded) for folded in folds):
        return False
    lse[...] = rows_lse.transpose(1, 2, 0)
    return True


def _fold_group(q, k, v, o, lse, options: AttentionOptions, low: int, high: int):
    """``(q, k, v, o, lse, options)`` of a one-row wide GQA decode folded into query rows:
    each K/V head's group of query heads as `group` rows of one head, K and V cut to the
    keys [low, high) the row keeps (`fold_rows`), no mask; views of the same memory, so the
    kernels write the caller's o and lse. None where the row keeps no key."""
    batch, n_q_heads, _, head_dim = q.shape
    n_kv_heads, value_dim = k.shape[1], v.shape[3]
    group = n_q_heads // n_kv_heads
    if low >= high:
        return None

    from cupy.lib.stride_tricks import as_strided

    def rows_of_heads(array, shape):  # (B, Hq, 1, ...) -> (B, Hkv, group, ...)
        strides = array.strides
        return as_strided(array, shape, (strides[0], group * strides[1], strides[1])
                          + strides[3:])

    return (rows_of_heads(q, (batch, n_kv_heads, group, head_dim)), k[:, :, low:high],
            v[:, :, low:high], rows_of_heads(o, (batch, n_kv_heads, group, value_dim)),
            rows_of_heads(lse, (batch, n_kv_heads, group)), unmasked(options))


def _fold_every_row(q, k, v, o, lse, options: AttentionOptions):
    """``(q, k, v, o, lse, options)`` of an unmasked GQA decode folded into query rows: each
    K/V head's group x Nq rows as the rows of one head, (B, Hkv, group * Nq, ...) views of
    the same memory; None where an array's heads do not hold their rows one after another
    (a "bshd" call's), which such a view needs."""
    batch, n_q_heads, n_q, head_dim = q.shape
    n_kv_heads, value_dim = k.shape[1], v.shape[3]
    group = n_q_heads // n_kv_heads
    if any(array.strides[1] != n_q * array.strides[2] for array in (q, o, lse)):
        return None

    from cupy.lib.stride_tricks import as_strided

    def rows_of_heads(array, shape):  # (B, Hq, Nq, ...) -> (B, Hkv, group * Nq, ...)
        strides = array.strides
        return as_strided(array, shape, (strides[0], group * strides[1], strides[2])
                          + strides[3:])

    return (rows_of_heads(q, (batch, n_kv_heads, group * n_q, head_dim)), k, v,
            rows_of_heads(o, (batch, n_kv_heads, group * n_q, value_dim)),
            rows_of_heads(lse, (batch, n_kv_heads, group * n_q)), unmasked(options))


def _forward_folded(q, k, v, o, lse, options: AttentionOptions, unfolded: tuple) -> bool:
    """Runs a folded decode on the prefill (`tiles.folded_choice`), a launch per column slice
    of V and O (`tiles.fold_value_slices`); False, having run nothing, where it does not
    fold (the decision is cached like a plan). `unfolded`:
    ``(q, k, v, options)`` of the call as given, whose own choice the fold must beat."""
    key = forward_plan_key(options, q, k, v, o.strides)
    key = None if key is None else ("folded group",) + key
    slices = fold_value_slices(v.shape[3])
    launches = cached(key, q, k, v)
    if launches is not None:
        if launches[0] is None:
            return False
        for launch, (start, stop) in zip(launches, slices):
            launch(q, k, _columns(v, start, stop), _columns(o, start, stop), lse)
        return True
    choice = fold_choice(q, k, v.shape[3], options, choose(*unfolded).family == "decode")
    if choice is None:
        remember(key, (None,), 1, q, k, v)
        return False
    launches, alignments = zip(*(_run(choice, q, k, _columns(v, start, stop),
                                      _columns(o, start, stop), lse, options)
                                 for start, stop in slices))
    remember(key, launches, max(alignments), q, k, v)
    return True


def _columns(array, start: int, stop: int):
    """Columns [start, stop) of the last axis: a view, or the array itself where that is all
    of them (a CuPy view costs microseconds of a decode step's host time)."""
    return array if start == 0 and stop == array.shape[-1] else array[..., start:stop]


def _forward_varlen(q, k, v, options: AttentionOptions, out=None, lse_out=None):
    """A variable-length or paged forward: one launch over the tile table (or, for few
    query rows a batch element, the decode kernel over the batch). Rows of no sequence are
    never written by the query-tile kernels, so there o and lse start as 0 and -inf (SPEC).
    A padded or paged call (`Sequences.dense_grid`, lengths from the host or the device) is
    planned once per signature: a repeated one fills its tables (`DeviceTables.fill`) and
    launches. A packed call is planned once per lengths (`operands.SequenceContents`): the
    layers of a training step repeat them."""
    o, lse = _outputs(q, v, out, lse_out)
    key = forward_plan_key(options, q, k, v, o.strides)
    plan = cached(key, q, k, v)
    if plan is not None:
        tables, launch, fills = plan
        if fills:
            o.fill(0)
            lse.fill(-np.inf)
        if tables is not None:
            tables.fill(options.varlen)
        launch(q, k, v, o, lse)
        return o, lse
    sequences = Sequences(q, k, options, forward=True)
    choice = choose(q, k, v, options, sequences)
    if sequences.paged:
        # Named tiles stay; score options spill in tiles.WGMMA_PAGED (ptxas: 172-180 bytes).
        switches = Switches.of(options)
        keep_rows = (options.block_q is not None or options.block_k is not None
                     or switches.softcap or switches.alibi or switches.dropout)
        choice = within_pages(choice, sequences.page_size, max(q.shape[3], v.shape[3]),
                              keep_rows)
    fills = choice.family != "decode" and not sequences.forward_covers_every_row
    if fills:  # (a split launch's merge writes every row anyway)
        o.fill(0)
        lse.fill(-np.inf)
    launch, alignment = _run(choice, q, k, v, o, lse, options, sequences,
                             _varlen_shares(choice, q, options, sequences))
    remember(key, (sequences.device_tables if sequences.dense_grid else None, launch, fills),
             alignment, q, k, v)
    return o, lse


