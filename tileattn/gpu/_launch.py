"""Choosing a kernel configuration for a problem and launching it.

Kernel families (see the headers of the ``.cu`` files):

* ``attention_wgmma_forward.cu`` / ``attention_wgmma_backward.cu``: Hopper (sm_90, compiled
  for sm_90a) tensor-core forward and backward for float16/bfloat16 with
  ``D == Dv in {64, 128}``. The forward runs when the caller names no tile size or one it
  is built with (``block_q in {64, 128, 192}``, ``block_k in {64, 128}``), the backward when
  the caller names none.
* ``attention_mma_forward.cu`` / ``attention_mma_backward.cu``: the same on mma.sync for
  sm_80+ (and on Hopper for tile sizes the wgmma forward lacks, e.g. ``block_k=32``).
* ``attention_tf32_forward.cu``: float32 forward with ``D == Dv in {64, 128}`` on sm_80+
  tensor cores at float32 accuracy (3xTF32), for the tile sizes it is built for
  (``block_q in {64, 128}``, ``block_k in {32, 64}``) when they fit the device's shared
  memory.
* ``attention_backward_delta.cu``: every backward's ``D = rowsum(dO * o)``, launched
  before its dQ and dK/dV kernels.
* ``attention_generic.cu``: CUDA-core forward and backward for every dtype and head dim.
  Compiled for a tile *capacity* that fits shared memory; the caller's ``block_q``/``block_k``
  are honoured exactly up to that capacity (and clipped to it), as run-time values, so
  trying a block size never triggers a compile.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import cupy
import numpy as np

from ..arrays import dtype_name
from ..dropout import dropout_key, dropout_threshold
from ..options import UNLIMITED, AttentionOptions, Blocks
from . import _compile

GENERIC_SOURCE = "attention_generic.cu"
MMA_SOURCE = "attention_mma_forward.cu"
WGMMA_SOURCE = "attention_wgmma_forward.cu"
WGMMA_BACKWARD_SOURCE = "attention_wgmma_backward.cu"
TF32_SOURCE = "attention_tf32_forward.cu"
MMA_BACKWARD_SOURCE = "attention_mma_backward.cu"
DELTA_SOURCE = "attention_backward_delta.cu"
GENERIC_THREADS = 256
# Dynamic shared memory a generic block may use before tiles shrink: 48 KiB keeps two or
# more blocks per SM on every CUDA GPU and needs no opt-in; tiles stop shrinking at 16x16
# (the smallest that splits evenly over 256 threads), which for D = 256 needs the opt-in.
GENERIC_SHARED_TARGET = 48 * 1024
MMA_HEAD_DIMS = (64, 128)
MMA_BLOCK_Q = (64, 128)
MMA_BLOCK_K = (32, 64, 128)
# The fastest tiles of the sweep in bench/NOTES-gpu.md (H100, float16, N = 4096).
MMA_DEFAULT_BLOCKS = {64: Blocks(128, 64), 128: Blocks(128, 128)}


@dataclass(frozen=True)
class WarpLayout:
    """How the forward's warps share a query tile: each owns `rows` (16 or 32) query rows,
    and keeps its Q fragments in registers or re-reads them from shared memory."""

    rows: int
    q_in_registers: bool


# Per head dim, the layout for the default tiles (bench/NOTES-gpu.md, v3 sweep).
MMA_DEFAULT_LAYOUTS = {64: WarpLayout(32, True), 128: WarpLayout(16, True)}


def warp_layout(head_dim: int, blocks: Blocks) -> WarpLayout:
    """The default layout of the head dim when it divides the query tile, else 16 rows."""
    layout = MMA_DEFAULT_LAYOUTS[head_dim]
    return layout if blocks.block_q % layout.rows == 0 else WarpLayout(16, True)


# Tensor-core backward tiles per head dim, (owned rows, streamed rows) of each kernel: the
# dQ kernel owns query rows and streams key tiles, the dK/dV kernel the reverse. 128 owned
# rows = 8 warps; 64 streamed rows keep S and dP at 32 registers each, which with the
# dK/dV accumulators (2 x 64 at D = 128) just fits 255 registers without spilling. The dQ
# tiles are the fastest of bench/sweep_gpu_backward.py (bench/NOTES-gpu.md, v3).
MMA_BACKWARD_TILES = {64: {"dq": (64, 64), "dkdv": (128, 64)},
                      128: {"dq": (128, 128), "dkdv": (128, 64)}}

_STORAGE = {"float16": "half_storage", "bfloat16": "bfloat16_storage", "float32": "float",
            "float64": "double"}


def accumulation_dtype(dtype) -> np.dtype:
    """float64 for float64 inputs, float32 for every other dtype (also lse's dtype)."""
    return np.dtype(np.float64) if dtype_name(dtype) == "float64" else np.dtype(np.float32)


def padded_dim(dim: int) -> int:
    """A head dim rounded up to a power of two >= 16 (the generic kernels' tile width)."""
    return max(16, 1 << (dim - 1).bit_length())


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

    def defines(self) -> tuple:
        return (("ALIBI", int(self.alibi)), ("DROPOUT", int(self.dropout)),
                ("LIMIT_LEFT", int(self.limit_left)), ("LIMIT_RIGHT", int(self.limit_right)),
                ("SOFTCAP", int(self.softcap)))


def score_arguments(options: AttentionOptions, n_q: int, n_k: int, accum) -> tuple:
    """The run-time score options in the kernels' parameter order.

    Window sides are clamped to ``Nq + Nk``: a wider window keeps the same keys, and the
    clamp keeps the kernels' 64-bit band arithmetic far from overflow.
    """
    accum = np.dtype(accum).type
    reach = n_q + n_k

    def side(value):
        return np.int64(0 if value == UNLIMITED else min(value, reach))

    dropping = options.dropout_p > 0
    return (accum(options.scale), accum(options.softcap if options.softcap > 0 else 1.0),
            np.int64(n_k - n_q), side(options.window_left), side(options.window_right),
            np.uint32(dropout_key(options.seed) if dropping else 0),
            np.uint32(dropout_threshold(options.dropout_p) if dropping else 0),
            accum(1.0 / (1.0 - options.dropout_p)))


@lru_cache(maxsize=None)
def _empty(device_id: int, dtype: str):
    """A zero-length array standing in for an unused pointer argument, one per device."""
    with cupy.cuda.Device(device_id):
        return cupy.empty(0, dtype=dtype)


@lru_cache(maxsize=None)
def compute_capability(device_id: int) -> int:
    return int(cupy.cuda.Device(device_id).compute_capability)


@lru_cache(maxsize=None)
def shared_memory_limit(device_id: int) -> int:
    """The most dynamic shared memory one block of this device may opt in to."""
    return int(cupy.cuda.runtime.getDeviceProperties(device_id)["sharedMemPerBlockOptin"])


def alibi_slopes(options: AttentionOptions):
    """The (B, Hq) float64 slopes on the device, or an empty stand-in when ALiBi is off."""
    if options.alibi_slopes is None:
        return _empty(cupy.cuda.Device().id, "float64")
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
    strides = array.strides
    if any(stride % itemsize for stride in strides):
        array = _copy_contiguous(array)
        strides = array.strides
    return array, tuple(np.int64(stride // itemsize) for stride in strides)


@lru_cache(maxsize=256)
def _ready_element_strides(strides: tuple, itemsize: int) -> tuple | None:
    """The element strides of a layout cp.async reads in place (contiguous rows, every row
    start a multiple of 8 elements from an aligned base), else None."""
    if any(stride % itemsize for stride in strides):
        return None
    elements = tuple(np.int64(stride // itemsize) for stride in strides)
    if elements[-1] != 1 or any(s % 8 for s in elements[:-1]):
        return None
    return elements


def _is_ready(array) -> bool:
    """Whether the tensor-core kernels read `array` in place (no copy)."""
    return (_ready_element_strides(array.strides, array.itemsize) is not None
            and array.data.ptr % 16 == 0)


def _tensor_core_layout(array):
    """``(array, strides)`` with contiguous rows starting on 16-byte boundaries, which
    cp.async needs; copies only an array that does not already have that layout."""
    strides = _ready_element_strides(array.strides, array.itemsize)
    if strides is not None and array.data.ptr % 16 == 0:
        return array, strides
    return element_strides(_copy_contiguous(array))


@dataclass(frozen=True)
class Launch:
    """One kernel launch but for its array arguments, which come first: the grid, block,
    shared memory and the scalar arguments after the arrays."""

    function: object
    grid: tuple
    block: tuple
    shared: int
    arguments: tuple

    def __call__(self, *arrays):
        self.function(self.grid, self.block, arrays + self.arguments, shared_mem=self.shared)


# Launches per problem, so that a repeated call (a training step, a benchmark) skips the
# kernel choice, the compile-cache lookup and the building of ~25 scalar arguments: at
# FlashAttention's N = 1k shapes the host time of a call is 15-30 % of its kernels' time
# (bench/NOTES-gpu.md, v9). Bounded: cleared when full.
_PLANS: dict[tuple, tuple] = {}
_PLAN_LIMIT = 256


def _plan_key(direction: str, options: AttentionOptions, *arrays) -> tuple | None:
    """What a problem's launches depend on besides the arrays' addresses, or None when they
    are not cached: ALiBi slopes are an array of their own, and dropout's seed usually
    changes with every call."""
    if options.alibi_slopes is not None or options.dropout_p > 0:
        return None
    return (direction, options.window_left, options.window_right, options.scale,
            options.softcap, options.block_q, options.block_k, options.deterministic,
            arrays[0].device.id) + tuple((a.dtype, a.shape, a.strides) for a in arrays)


def _remember(key: tuple | None, launches: tuple, *arrays) -> None:
    """Caches `launches` under `key` when the arrays were read in place (so the strides in
    the launches' arguments are the arrays' own)."""
    if key is None or not all(_is_ready(a) for a in arrays):
        return
    if len(_PLANS) >= _PLAN_LIMIT:
        _PLANS.clear()
    _PLANS[key] = launches


def _cached(key: tuple | None, *arrays) -> tuple | None:
    """The launches cached under `key`, if the arrays can be read in place."""
    if key is None:
        return None
    launches = _PLANS.get(key)
    if launches is None or any(a.data.ptr % 16 for a in arrays):
        return None
    return launches


# --------------------------------------------------------------------------- generic tiles


def _generic_shared_bytes(accum_size: int, head_pad: int, value_pad: int,
                          block_q: int, block_k: int) -> dict[str, int]:
    """Dynamic shared memory of each generic kernel, mirroring the layouts in
    attention_generic.cu (each kernel checks it got at least this much)."""
    head_pitch, value_pitch, score_pitch = head_pad + 1, value_pad + 1, block_k + 1
    kv = block_k * (head_pitch + value_pitch)
    q_do = block_q * (head_pitch + value_pitch)
    return {
        "attention_forward": accum_size * (block_q * head_pitch + kv + block_q * score_pitch
                                           + 3 * block_q),
        "attention_backward_dkdv": accum_size * (kv + q_do + 2 * block_q * score_pitch
                                                 + 2 * block_q),
        "attention_backward_dq": accum_size * (kv + q_do + block_q * score_pitch
                                               + 2 * block_q),
    }


@dataclass(frozen=True)
class GenericConfig:
    """One compiled configuration of attention_generic.cu."""

    dtype: str
    head_pad: int
    value_pad: int
    capacity: Blocks
    switches: Switches

    @classmethod
    def for_problem(cls, dtype, head_dim: int, value_dim: int,
                    options: AttentionOptions) -> "GenericConfig":
        head_pad, value_pad = padded_dim(head_dim), padded_dim(value_dim)
        accum_size = accumulation_dtype(dtype).itemsize
        block_q = block_k = 64
        while (max(_generic_shared_bytes(accum_size, head_pad, value_pad, block_q,
                                         block_k).values()) > GENERIC_SHARED_TARGET
               and max(block_q, block_k) > 16):
            if block_q >= block_k:
                block_q //= 2
            else:
                block_k //= 2
        return cls(np.dtype(dtype).name, head_pad, value_pad, Blocks(block_q, block_k),
                   Switches.of(options))

    def blocks(self, options: AttentionOptions) -> Blocks:
        """The caller's tile sizes, clipped to this configuration's capacity."""
        wanted = self.capacity.resolve(options.block_q, options.block_k)
        return Blocks(min(wanted.block_q, self.capacity.block_q),
                      min(wanted.block_k, self.capacity.block_k))

    def kernel(self, entry: str):
        accum = accumulation_dtype(self.dtype)
        shared = _generic_shared_bytes(accum.itemsize, self.head_pad, self.value_pad,
                                       self.capacity.block_q, self.capacity.block_k)[entry]
        defines = (("ACCUM", "double" if accum == np.float64 else "float"),
                   ("BLOCK_K", self.capacity.block_k), ("BLOCK_Q", self.capacity.block_q),
                   ("HEAD_DIM_PAD", self.head_pad), ("STORAGE", _STORAGE[self.dtype]),
                   ("THREADS", GENERIC_THREADS),
                   ("VALUE_DIM_PAD", self.value_pad)) + self.switches.defines()
        return _compile.kernel(GENERIC_SOURCE, entry, tuple(sorted(defines)), shared), shared


# --------------------------------------------------------------------------- forward


def tensor_core_blocks(q, v, options: AttentionOptions) -> Blocks | None:
    """The tensor-core kernel's tiles for this problem, or None when it does not apply."""
    head_dim = q.shape[3]
    if dtype_name(q.dtype) not in ("float16", "bfloat16") or head_dim != v.shape[3]:
        return None
    if head_dim not in MMA_HEAD_DIMS or compute_capability(q.device.id) < 80:
        return None
    blocks = MMA_DEFAULT_BLOCKS[head_dim].resolve(options.block_q, options.block_k)
    if blocks.block_q not in MMA_BLOCK_Q or blocks.block_k not in MMA_BLOCK_K:
        return None
    return blocks


def mma_shared_bytes(head_dim: int, blocks: Blocks) -> int:
    """Q tile plus two stages of K and V tiles, rows padded by 8 elements (16 bytes)."""
    return 2 * (blocks.block_q + 4 * blocks.block_k) * (head_dim + 8)


def _launch_tensor_core_forward(function, shared: int, block_q: int, threads: int, q, k, v,
                                o, lse, options: AttentionOptions) -> Launch:
    """Launches a tensor-core forward (one block per `block_q` query rows of a head, the
    arguments every such kernel takes) and returns the launch."""
    batch, n_q_heads, n_q, _ = q.shape
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    (q, q_strides), (k, k_strides), (v, v_strides) = map(_tensor_core_layout, (q, k, v))
    launch = Launch(function, (-(-n_q // block_q) * batch * n_q_heads,), (threads,), shared,
                    (alibi_slopes(options), np.int64(n_q), np.int64(n_k), np.int32(n_q_heads),
                     np.int32(n_q_heads // n_kv_heads), *q_strides[:3], *k_strides[:3],
                     *v_strides[:3], *score_arguments(options, n_q, n_k, np.float32)))
    launch(q, k, v, o, lse)
    return launch


def forward_tensor_core(q, k, v, o, lse, options: AttentionOptions, blocks: Blocks,
                        layout: WarpLayout | None = None):
    """`layout`: by default `warp_layout` of the head dim (the benchmark's sweep passes
    others)."""
    head_dim = q.shape[3]
    layout = layout or warp_layout(head_dim, blocks)
    switches = Switches.of(options)
    defines = (("BLOCK_K", blocks.block_k), ("BLOCK_Q", blocks.block_q),
               ("HEAD_DIM", head_dim), ("IS_BFLOAT16", int(dtype_name(q.dtype) == "bfloat16")),
               ("Q_IN_REGISTERS", int(layout.q_in_registers)), ("WARP_ROWS", layout.rows)
               ) + switches.defines()
    shared = mma_shared_bytes(head_dim, blocks)
    function = _compile.kernel(MMA_SOURCE, "attention_forward_mma", tuple(sorted(defines)),
                               shared)
    return _launch_tensor_core_forward(function, shared, blocks.block_q,
                                       blocks.block_q // layout.rows * 32, q, k, v, o, lse,
                                       options)


@dataclass(frozen=True)
class WgmmaTiles:
    """The Hopper forward's tiles: `block_q` query rows (64 per warpgroup), `block_k` keys
    per step, `stages` K/V buffers in flight, registers capped for `blocks_per_sm` resident
    blocks."""

    block_q: int
    block_k: int
    stages: int
    blocks_per_sm: int = 1

    def shared_bytes(self, head_dim: int) -> int:
        """Q tile and `stages` K and V tiles (16-bit, unpadded: the swizzle avoids bank
        conflicts), plus 1024 bytes to align the tiles to the swizzle's period."""
        return 1024 + 2 * head_dim * (self.block_q + 2 * self.stages * self.block_k)

    def builds(self, head_dim: int) -> bool:
        """Whether the registers allow it: 512 threads per multiprocessor (four warpgroups,
        in one block or two) leave 128 a thread, too few for D = 128's accumulators beside
        128-key scores (NVRTC refuses with C7512: wgmma serialised)."""
        threads_per_sm = self.block_q // 64 * 128 * self.blocks_per_sm
        return threads_per_sm < 512 or head_dim * self.block_k <= 8192


WGMMA_BLOCK_Q = (64, 128, 192, 256)
WGMMA_BLOCK_K = (64, 128)
# The fastest of bench/sweep_gpu_wgmma.py at N = 1k .. 16k (bench/NOTES-gpu.md, v10), for
# scores without softcap, ALiBi or dropout: three warpgroups, 128-key tiles.
WGMMA_DEFAULT_TILES = {64: WgmmaTiles(192, 128, 2), 128: WgmmaTiles(192, 128, 2)}
# Up to this many keys, two blocks of 128 query rows per multiprocessor (registers capped at
# 128): a block's prologue (Q and the first K/V tiles) and epilogue are a larger share of
# a short row of key tiles, and the second block's main loop covers them.
WGMMA_SHORT_TILES = {64: (4096, WgmmaTiles(128, 128, 2, 2)),
                     128: (1024, WgmmaTiles(128, 64, 2, 2))}
# Softcap, ALiBi and dropout add registers per score, which the tiles above pay in spills
# (ptxas, D = 128, 192 x 128: 148 bytes with all three; 192 x 64 x 3: 8): v9's tiles.
WGMMA_SCORE_OPTION_TILES = {64: WgmmaTiles(192, 128, 2), 128: WgmmaTiles(192, 64, 3)}


def wgmma_default_tiles(head_dim: int, n_k: int, options: AttentionOptions) -> WgmmaTiles:
    switches = Switches.of(options)
    if switches.softcap or switches.alibi or switches.dropout:
        return WGMMA_SCORE_OPTION_TILES[head_dim]
    max_keys, short = WGMMA_SHORT_TILES[head_dim]
    return short if n_k <= max_keys else WGMMA_DEFAULT_TILES[head_dim]


def wgmma_tiles(q, k, options: AttentionOptions) -> WgmmaTiles | None:
    """The Hopper forward's tiles when it applies (an sm_90 device, and tile sizes the
    caller named, if any, that it is built for), else None."""
    if compute_capability(q.device.id) != 90:
        return None
    default = wgmma_default_tiles(q.shape[3], k.shape[2], options)
    blocks = Blocks(default.block_q, default.block_k).resolve(options.block_q, options.block_k)
    if (blocks.block_q not in WGMMA_BLOCK_Q or blocks.block_k not in WGMMA_BLOCK_K
            or not WgmmaTiles(blocks.block_q, blocks.block_k, 2).builds(q.shape[3])):
        return None
    if blocks == Blocks(default.block_q, default.block_k):
        return default
    # One block per SM, with the default's stages where they fit the device's shared
    # memory, else fewer (192 x 128 at D = 128 with a score option's three stages needs
    # 241 KiB), else the mma.sync kernel.
    tiles = WgmmaTiles(blocks.block_q, blocks.block_k, default.stages)
    limit = shared_memory_limit(q.device.id)
    while tiles.shared_bytes(q.shape[3]) > limit and tiles.stages > 2:
        tiles = WgmmaTiles(tiles.block_q, tiles.block_k, tiles.stages - 1)
    return tiles if tiles.shared_bytes(q.shape[3]) <= limit else None


def forward_wgmma(q, k, v, o, lse, options: AttentionOptions, tiles: WgmmaTiles):
    head_dim = q.shape[3]
    defines = (("BLOCK_K", tiles.block_k), ("BLOCK_Q", tiles.block_q), ("HEAD_DIM", head_dim),
               ("BLOCKS_PER_SM", tiles.blocks_per_sm),
               ("IS_BFLOAT16", int(dtype_name(q.dtype) == "bfloat16")), ("STAGES", tiles.stages)
               ) + Switches.of(options).defines()
    shared = tiles.shared_bytes(head_dim)
    function = _compile.kernel(WGMMA_SOURCE, "attention_forward_wgmma", tuple(sorted(defines)),
                               shared, arch="90a")
    return _launch_tensor_core_forward(function, shared, tiles.block_q,
                                       tiles.block_q // 64 * 128, q, k, v, o, lse, options)


@dataclass(frozen=True)
class Tf32Tiles:
    """The float32 (3xTF32) forward's tiles: `block_q` query rows in warps of `warp_rows`
    rows each, `block_k` keys per step."""

    block_q: int
    block_k: int
    warp_rows: int

    def shared_bytes(self, head_dim: int) -> int:
        """The Q tile and two stages of K and V tiles, float32; Q and K rows padded by 8
        floats, V rows by 4 (attention_tf32_forward.cu says why)."""
        return 4 * (self.block_q * (head_dim + 8) + 2 * self.block_k * (2 * head_dim + 12))


TF32_BLOCK_Q = (64, 128)
TF32_BLOCK_K = (32, 64)
# The fastest of bench/sweep_gpu_tf32.py (bench/NOTES-gpu.md, v9).
TF32_DEFAULT_TILES = {64: Tf32Tiles(128, 64, 32), 128: Tf32Tiles(128, 64, 16)}


def tf32_tiles(q, v, options: AttentionOptions) -> Tf32Tiles | None:
    """The float32 tensor-core forward's tiles when it applies (float32, D = Dv in
    {64, 128}, sm_80+, tile sizes the caller named, if any, that it is built for, and
    shared memory for them on this device), else None."""
    head_dim = q.shape[3]
    if (dtype_name(q.dtype) != "float32" or head_dim != v.shape[3]
            or head_dim not in MMA_HEAD_DIMS or compute_capability(q.device.id) < 80):
        return None
    default = TF32_DEFAULT_TILES[head_dim]
    blocks = Blocks(default.block_q, default.block_k).resolve(options.block_q, options.block_k)
    if blocks.block_q not in TF32_BLOCK_Q or blocks.block_k not in TF32_BLOCK_K:
        return None
    rows = default.warp_rows if blocks.block_q % default.warp_rows == 0 else 16
    tiles = Tf32Tiles(blocks.block_q, blocks.block_k, rows)
    if tiles.shared_bytes(head_dim) > shared_memory_limit(q.device.id):
        return None
    return tiles


def forward_tf32(q, k, v, o, lse, options: AttentionOptions, tiles: Tf32Tiles):
    head_dim = q.shape[3]
    defines = (("BLOCK_K", tiles.block_k), ("BLOCK_Q", tiles.block_q), ("HEAD_DIM", head_dim),
               ("WARP_ROWS", tiles.warp_rows)) + Switches.of(options).defines()
    shared = tiles.shared_bytes(head_dim)
    function = _compile.kernel(TF32_SOURCE, "attention_forward_tf32", tuple(sorted(defines)),
                               shared)
    return _launch_tensor_core_forward(function, shared, tiles.block_q,
                                       tiles.block_q // tiles.warp_rows * 32, q, k, v, o, lse,
                                       options)


def forward_generic(q, k, v, o, lse, options: AttentionOptions):
    batch, n_q_heads, n_q, head_dim = q.shape
    n_kv_heads, n_k, value_dim = k.shape[1], k.shape[2], v.shape[3]
    config = GenericConfig.for_problem(q.dtype, head_dim, value_dim, options)
    blocks = config.blocks(options)
    function, shared = config.kernel("attention_forward")
    (q, q_strides), (k, k_strides), (v, v_strides) = map(element_strides, (q, k, v))
    n_tiles = -(-n_q // blocks.block_q)
    launch = Launch(function, (n_tiles * batch * n_q_heads,), (GENERIC_THREADS,), shared,
                    (alibi_slopes(options), np.int64(n_q), np.int64(n_k), np.int32(n_q_heads),
                     np.int32(n_q_heads // n_kv_heads), np.int32(head_dim),
                     np.int32(value_dim), np.int32(blocks.block_q), np.int32(blocks.block_k),
                     *q_strides, *k_strides, *v_strides,
                     *score_arguments(options, n_q, n_k, accumulation_dtype(q.dtype))))
    launch(q, k, v, o, lse)
    return launch


def forward(q, k, v, options: AttentionOptions):
    batch, n_q_heads, n_q, _ = q.shape
    o = cupy.empty((batch, n_q_heads, n_q, v.shape[3]), dtype=q.dtype)
    lse = cupy.empty((batch, n_q_heads, n_q), dtype=accumulation_dtype(q.dtype))
    key = _plan_key("forward", options, q, k, v)
    cached = _cached(key, q, k, v)
    if cached is not None:
        cached[0](q, k, v, o, lse)
        return o, lse
    blocks = tensor_core_blocks(q, v, options)
    hopper_tiles = wgmma_tiles(q, k, options) if blocks is not None else None
    float32_tiles = tf32_tiles(q, v, options) if blocks is None else None
    if hopper_tiles is not None:
        launch = forward_wgmma(q, k, v, o, lse, options, hopper_tiles)
    elif blocks is not None:
        launch = forward_tensor_core(q, k, v, o, lse, options, blocks)
    elif float32_tiles is not None:
        launch = forward_tf32(q, k, v, o, lse, options, float32_tiles)
    else:
        launch = forward_generic(q, k, v, o, lse, options)
    _remember(key, (launch,), q, k, v)
    return o, lse


# --------------------------------------------------------------------------- backward


def tensor_core_backward_applies(q, v, options: AttentionOptions) -> bool:
    """The tensor-core backward runs for float16/bfloat16, D = Dv in {64, 128}, sm_80+,
    when the caller names no tile size (its tiles are its own; named sizes select the
    generic kernels, which honour any size)."""
    return (dtype_name(q.dtype) in ("float16", "bfloat16") and q.shape[3] == v.shape[3]
            and q.shape[3] in MMA_HEAD_DIMS and compute_capability(q.device.id) >= 80
            and options.block_q is None and options.block_k is None)


def mma_backward_shared_bytes(entry: str, head_dim: int, owned: int, streamed: int,
                              single_pass: bool = False, element_size: int = 2) -> int:
    """Owned rows of two operands plus two stages of two streamed operands (rows padded by
    8 elements); the dK/dV kernel also stages lse and D per streamed row, and in the single
    pass the dS^T tile (owned x streamed, padded)."""
    tiles = element_size * (2 * owned + 4 * streamed) * (head_dim + 8)
    if entry != "dkdv":
        return tiles
    return tiles + 2 * 2 * 4 * streamed + (2 * owned * (streamed + 8) if single_pass else 0)


# The float32 (3xTF32) backward's tiles: 8 warps (128 owned rows). At D = 128 float32 tiles
# of 128 owned and 64 streamed rows would need 278 KB of shared memory; 32 streamed rows fit,
# and twice the warps of 64 x 64 tiles made the backward 10-15 % faster (bench/NOTES-gpu.md,
# v13).
TF32_BACKWARD_TILES = {64: {"dq": (128, 64), "dkdv": (128, 64)},
                       128: {"dq": (128, 32), "dkdv": (128, 32)}}


def tf32_backward_applies(q, v, options: AttentionOptions) -> bool:
    """The float32 backward on TF32 tensor cores (attention_mma_backward.cu, IS_FLOAT32):
    float32, D = Dv in {64, 128}, sm_80+, no tile size named by the caller, and shared
    memory for its tiles on this device."""
    head_dim = q.shape[3]
    if (dtype_name(q.dtype) != "float32" or head_dim != v.shape[3]
            or head_dim not in MMA_HEAD_DIMS or compute_capability(q.device.id) < 80
            or options.block_q is not None or options.block_k is not None):
        return False
    tiles = TF32_BACKWARD_TILES[head_dim]
    return max(mma_backward_shared_bytes(entry, head_dim, *tiles[entry], element_size=4)
               for entry in ("dq", "dkdv")) <= shared_memory_limit(q.device.id)


def _backward_outputs(q, k, v) -> tuple:
    """dq, dk, dv (uninitialised; every element is written)."""
    return (cupy.empty(q.shape, dtype=q.dtype), cupy.empty(k.shape, dtype=q.dtype),
            cupy.empty(v.shape, dtype=q.dtype))


DELTA_THREADS = 256


def _delta_launch(do, o) -> tuple:
    """``(launch, do, o)``: attention_backward_delta for these arrays (copied only if a
    stride is not a whole element), to be called as ``launch(do, o, delta)``. Contiguous,
    16-byte aligned rows take the kernel that reads 16 bytes a lane."""
    batch, n_heads, n_q, value_dim = o.shape
    (do, do_strides), (o, o_strides) = element_strides(do), element_strides(o)
    accum = accumulation_dtype(o.dtype)
    defines = (("ACCUM", "double" if accum == np.float64 else "float"),
               ("STORAGE", _STORAGE[dtype_name(o.dtype)]))
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
    accumulation dtype (SPEC's D, which every backward below reads), and the launch that
    computed it, for a backward that caches its launches."""
    launch, do, o = _delta_launch(do, o)
    delta = _new_delta(o)
    launch(do, o, delta)
    return delta, launch


def _backward_operands(do, q, k, v, lse, options: AttentionOptions):
    """What both tensor-core backwards launch with: the inputs in the cp.async layout, lse
    as float32, the outputs (dq, dk, dv) and the arguments after the arrays."""
    n_q_heads, n_q = q.shape[1], q.shape[2]
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    (q, q_strides), (k, k_strides), (v, v_strides), (do, do_strides) = map(
        _tensor_core_layout, (q, k, v, do))
    lse = cupy.ascontiguousarray(lse, dtype=cupy.float32)
    outputs = _backward_outputs(q, k, v)
    common = (alibi_slopes(options), np.int64(n_q), np.int64(n_k), np.int32(n_q_heads),
              np.int32(n_q_heads // n_kv_heads), *q_strides[:3], *k_strides[:3],
              *v_strides[:3], *do_strides[:3], *score_arguments(options, n_q, n_k, np.float32))
    return (do, q, k, v, lse), outputs, common


def backward_tensor_core(do, q, k, v, o, lse, options: AttentionOptions, tiles=None,
                         single_pass=None):
    """`tiles`: ``{"dq": (owned, streamed), "dkdv": (owned, streamed)}``, by default
    `MMA_BACKWARD_TILES` (float32: `TF32_BACKWARD_TILES`) of the head dim (the benchmark's
    sweep passes others). float32 runs on TF32 tensor cores at float32 accuracy (3xTF32)
    and always as two kernels.

    `single_pass` (see attention_mma_backward.cu): no dQ kernel; the dK/dV kernel adds dQ
    into a float32 buffer (B * Hq * Nq * D * 4 bytes more memory), in turns when
    ``options.deterministic`` (bitwise reproducible), in arrival order otherwise (dq's last
    bits then depend on scheduling). Without it the dQ kernel recomputes each tile for dQ
    itself (7 tile products instead of 5, deterministic). Default: the single pass only for
    ``deterministic=False``; taking turns cost more than the products it saves
    (bench/NOTES-gpu.md, v5), so the deterministic default is the two-kernel form.
    """
    batch, n_q_heads, n_q, head_dim = q.shape
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    is_float32 = dtype_name(q.dtype) == "float32"
    tiles = tiles or (TF32_BACKWARD_TILES if is_float32 else MMA_BACKWARD_TILES)[head_dim]
    single_pass = not options.deterministic if single_pass is None else single_pass
    single_pass = single_pass and not is_float32  # float32 has no single pass
    ordered = single_pass and options.deterministic
    delta = row_deltas(do, o)[0]
    (do, q, k, v, lse), (dq, dk, dv), common = _backward_operands(do, q, k, v, lse, options)
    dq_sum = cupy.zeros(dq.size if single_pass else 0, dtype=cupy.float32)
    n_q_tiles = -(-n_q // tiles["dkdv"][1])
    dq_turns = cupy.zeros(batch * n_q_heads * n_q_tiles if ordered else 0, dtype=cupy.int32)
    launches = ((("dq", (q, k, v, do, lse, delta, dq), n_q, batch * n_q_heads),)
                if not single_pass else ()) + (
        ("dkdv", (q, k, v, do, lse, delta, dk, dv, dq_sum, dq_turns), n_k,
         batch * n_kv_heads),)
    for entry, arrays, n_rows, heads in launches:
        owned, streamed = tiles[entry]
        defines = (("HEAD_DIM", head_dim),
                   ("IS_BFLOAT16", int(dtype_name(q.dtype) == "bfloat16")),
                   ("IS_FLOAT32", int(is_float32)),
                   ("ORDERED", int(ordered)), ("OWNED_ROWS", owned),
                   ("SINGLE_PASS", int(single_pass)), ("STREAMED_ROWS", streamed)
                   ) + Switches.of(options).defines()
        shared = mma_backward_shared_bytes(entry, head_dim, owned, streamed, single_pass,
                                           q.dtype.itemsize)
        function = _compile.kernel(MMA_BACKWARD_SOURCE, f"attention_backward_{entry}_mma",
                                   tuple(sorted(defines)), shared)
        function((-(-n_rows // owned) * heads,), (owned // 16 * 32,), arrays + common,
                 shared_mem=shared)
    if single_pass:  # `defines` are the dK/dV kernel's: the same module
        convert = _compile.kernel(MMA_BACKWARD_SOURCE, "attention_backward_dq_convert",
                                  tuple(sorted(defines)), 0)
        convert((min(4096, -(-dq.size // 512)),), (256,),
                (dq_sum, dq, np.int64(dq.size), np.float32(options.scale)))
    return dq, dk, dv


@dataclass(frozen=True)
class WgmmaBackwardTiles:
    """The Hopper backward's tiles: per kernel (owned rows, streamed rows), owned rows 64
    per warpgroup, and `stages` buffers of streamed tiles."""

    dq: tuple[int, int]
    dkdv: tuple[int, int]
    stages: int

    def shared_bytes(self, entry: str, head_dim: int, single_pass: bool = False) -> int:
        """Two owned tiles and `stages` of two streamed ones (16-bit, swizzled), 1024 bytes
        of alignment slack; the dK/dV kernel also stages lse and D per streamed row, and in
        the single pass holds the dS^T tile (owned x 64, 1024-byte aligned) and a dQ staging
        block per warpgroup (64 x 64 floats)."""
        owned, streamed = getattr(self, entry)
        tiles = 1024 + 2 * head_dim * (2 * owned + 2 * self.stages * streamed)
        if entry != "dkdv":
            return tiles
        return tiles + 2 * 4 * self.stages * streamed + (
            1024 + 2 * owned * 64 + owned * 64 * 4 if single_pass else 0)


# The fastest of bench/sweep_gpu_backward.py --wgmma (bench/NOTES-gpu.md, v7 and v12).
# Three warpgroups own 192 rows except in the dK/dV kernel at D = 128, where the dK and dV
# accumulators need more registers than 3 x 128 threads leave (it spills). The stage count
# differs with a band (causal or a window): at N = 1k and 2k a third stage made the banded
# D = 64 backward 4-5 % faster and the D = 128 one 8-10 % slower (its dK/dV kernel then
# spills, ptxas: 232 bytes), the unbanded D = 128 one 3-4 % faster (v12).
WGMMA_BACKWARD_TILES = {64: WgmmaBackwardTiles((192, 64), (192, 64), 2),
                        128: WgmmaBackwardTiles((192, 64), (128, 64), 3)}
WGMMA_BANDED_BACKWARD_TILES = {64: WgmmaBackwardTiles((192, 64), (192, 64), 3),
                               128: WgmmaBackwardTiles((192, 64), (128, 64), 2)}


def wgmma_backward_tiles(head_dim: int, options: AttentionOptions) -> WgmmaBackwardTiles:
    """The Hopper backward's default tiles for a head dim, with or without a band."""
    table = WGMMA_BANDED_BACKWARD_TILES if options.is_masked else WGMMA_BACKWARD_TILES
    return table[head_dim]


def wgmma_backward_applies(q, v, options: AttentionOptions) -> bool:
    """The Hopper backward: where the tensor-core backward applies, on an sm_90 device."""
    return (tensor_core_backward_applies(q, v, options)
            and compute_capability(q.device.id) == 90)


def backward_wgmma(do, q, k, v, o, lse, options: AttentionOptions,
                   tiles: WgmmaBackwardTiles | None = None, single_pass: bool = False):
    """`tiles`: by default `wgmma_backward_tiles` (the sweep passes others).

    D = rowsum(do * o) first, then the dQ and the dK/dV kernels, which both read it.
    `single_pass`: no dQ kernel; the dK/dV kernel adds dQ into a float32 buffer
    (B * Hq * Nq rounded up to 64 * D * 4 bytes) by bulk reductions, in arrival order, so
    dq's last bits depend on scheduling. It is slower than the two kernels on the H100
    (its per-tile dS^T store, barriers and staging outweigh the products it saves;
    bench/NOTES-gpu.md, v7, v10 and v11), so both settings of ``deterministic`` run the
    two kernels by default.
    """
    batch, n_q_heads, n_q, head_dim = q.shape
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    # Only the default configuration is cached (the sweep's tiles and the single pass are
    # for measuring).
    key = (_plan_key("backward", options, do, q, k, v, o) if tiles is None and not single_pass
           else None)
    cached = _cached(key, do, q, k, v, o)
    if cached is not None and lse.dtype == cupy.float32 and lse.flags.c_contiguous:
        delta = _new_delta(o)
        dq, dk, dv = _backward_outputs(q, k, v)
        cached[0](do, o, delta)
        cached[1](q, k, v, do, lse, delta, dq)
        cached[2](q, k, v, do, lse, delta, dk, dv, _empty(q.device.id, "float32"))
        return dq, dk, dv
    arrays_in = (do, q, k, v, o)
    tiles = tiles or wgmma_backward_tiles(head_dim, options)
    delta, delta_launch = row_deltas(do, o)
    launches = [delta_launch]
    (do, q, k, v, lse), (dq, dk, dv), common = _backward_operands(do, q, k, v, lse, options)
    # The single pass's dQ buffer: (batch x head, query tile of 64, column block of 64)
    # blocks of 64 x 64 floats, one bulk reduction's destination each.
    dq_sum = (cupy.zeros(batch * n_q_heads * -(-n_q // 64) * 64 * head_dim, dtype=cupy.float32)
              if single_pass else _empty(q.device.id, "float32"))
    for entry, arrays, n_rows, heads in (
            ("dq", (q, k, v, do, lse, delta, dq), n_q, batch * n_q_heads),
            ("dkdv", (q, k, v, do, lse, delta, dk, dv, dq_sum), n_k, batch * n_kv_heads)):
        if single_pass and entry == "dq":
            continue
        owned, streamed = getattr(tiles, entry)
        defines = (("HEAD_DIM", head_dim),
                   ("IS_BFLOAT16", int(dtype_name(q.dtype) == "bfloat16")), ("OWNED_ROWS", owned),
                   ("SINGLE_PASS", int(single_pass)),
                   ("STAGES", tiles.stages), ("STREAMED_ROWS", streamed)
                   ) + Switches.of(options).defines()
        shared = tiles.shared_bytes(entry, head_dim, single_pass)
        function = _compile.kernel(WGMMA_BACKWARD_SOURCE, f"attention_backward_{entry}_wgmma",
                                   tuple(sorted(defines)), shared, arch="90a")
        launches.append(Launch(function, (-(-n_rows // owned) * heads,), (owned // 64 * 128,),
                               shared, common))
        launches[-1](*arrays)
    _remember(key, tuple(launches), *arrays_in)
    if single_pass:  # `defines` are the dK/dV kernel's: the same module
        unblock = _compile.kernel(WGMMA_BACKWARD_SOURCE, "attention_backward_dq_unblock",
                                  tuple(sorted(defines)), 0, arch="90a")
        unblock((min(4096, -(-dq.size // 512)),), (256,),
                (dq_sum, dq, np.int64(n_q), np.int64(dq.size), np.float32(options.scale)))
    return dq, dk, dv


def backward(do, q, k, v, o, lse, options: AttentionOptions):
    if wgmma_backward_applies(q, v, options):
        return backward_wgmma(do, q, k, v, o, lse, options)
    if tensor_core_backward_applies(q, v, options) or tf32_backward_applies(q, v, options):
        return backward_tensor_core(do, q, k, v, o, lse, options)
    batch, n_q_heads, n_q, head_dim = q.shape
    n_kv_heads, n_k, value_dim = k.shape[1], k.shape[2], v.shape[3]
    accum = accumulation_dtype(q.dtype)
    config = GenericConfig.for_problem(q.dtype, head_dim, value_dim, options)
    blocks = config.blocks(options)
    delta = row_deltas(do, o)[0]
    if lse.dtype != accum:
        lse = lse.astype(accum)
    (do, do_strides), (lse, lse_strides) = map(element_strides, (do, lse))
    (q, q_strides), (k, k_strides), (v, v_strides) = map(element_strides, (q, k, v))
    dq, dk, dv = _backward_outputs(q, k, v)
    common = (alibi_slopes(options), np.int64(n_q), np.int64(n_k), np.int32(n_q_heads),
              np.int32(n_q_heads // n_kv_heads), np.int32(head_dim), np.int32(value_dim),
              np.int32(blocks.block_q), np.int32(blocks.block_k), *q_strides, *k_strides,
              *v_strides, *do_strides, *lse_strides,
              *score_arguments(options, n_q, n_k, accum))
    function, shared = config.kernel("attention_backward_dq")
    function((-(-n_q // blocks.block_q) * batch * n_q_heads,), (GENERIC_THREADS,),
             (q, k, v, do, lse, delta, dq) + common, shared_mem=shared)
    function, shared = config.kernel("attention_backward_dkdv")
    function((-(-n_k // blocks.block_k) * batch * n_kv_heads,), (GENERIC_THREADS,),
             (q, k, v, do, lse, delta, dk, dv) + common, shared_mem=shared)
    return dq, dk, dv
