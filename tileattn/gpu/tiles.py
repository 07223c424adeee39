"""Which kernel family runs a problem, and with which tiles: one table per family.

Families (the ``.cu`` files' headers say how each works):

* ``wgmma``: Hopper (sm_90) tensor cores, float16/bfloat16 (attention_wgmma_forward.cu,
  attention_wgmma_backward.cu);
* ``mma``: mma.sync tensor cores on sm_80 and later, float16/bfloat16
  (attention_mma_forward.cu, attention_mma_backward.cu);
* ``tf32``: float32 at float32 accuracy on TF32 tensor cores, sm_80 and later
  (attention_tf32_forward.cu, attention_mma_backward.cu with IS_FLOAT32; on Hopper the
  forward's `Tf32WgmmaTiles` rows run attention_tf32_wgmma_forward.cu);
* ``f64``: float64 on sm_90's FP64 tensor cores, D and Dv up to 128 (the forward:
  attention_tf32_forward.cu with IS_FLOAT64; the backward, attention_mma_backward.cu with
  IS_FLOAT64);
* ``generic``: CUDA cores, every dtype and head dim (attention_generic.cu): float64
  above 128 and before sm_90, head dims beyond the tensor-core rows (above 576 for
  the 16-bit forward, 384 for the rest), GPUs before sm_80, and tile sizes the caller
  names that no tensor-core configuration is built for;
* ``decode`` (forward only): a few query rows per K/V head against many keys:
  split-KV with GQA packing, on tensor cores for 16-bit inputs (attention_decode_mma.cu,
  `DecodeMmaTiles`) and on CUDA cores for every dtype and option (attention_decode.cu,
  `DecodeTiles`); chosen before the others by `choose_decode` from the problem's
  `DecodeShape`.

Each tensor-core table is a list of rows, the first that matches a problem wins. A row
matches on the padded head dims (`Widths`: D and Dv rounded up to the tensor cores' K
step), on the number of keys and on the score options; its note says which sweep chose
it (bench/NOTES-gpu.md has the sweeps; bench/experiments/sweep_gpu_tiles.py runs them).
A row whose tiles do not fit the device's shared memory is passed over. A new head dim
needs no code: every width is a template instantiation of the same kernels, and the rows
cover them by ranges (wgmma and the tensor-core decode to 256, mma.sync and 3xTF32 wider).

`choose_forward` and `choose_backward` are the one place a family is chosen; `describe`
says what they chose and why, for ``python -m tileattn info``. Nothing here imports CuPy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

MAX_TENSOR_CORE_DIM = 256  # the wgmma and tensor-core decode kernels' widest head dim
# Above 256 the mma.sync and 3xTF32 kernels still serve, Q read from shared memory, through
# the rows of widths above 256 below; above MAX_WIDE_DIM (or where no such row fits) the
# generic kernels run (documented in the README).
MAX_WIDE_DIM = 576


@dataclass(frozen=True)
class Problem:
    """What the choice depends on: the device's compute capability (90 for sm_90), its
    shared memory per block, the dtype's name, D and Dv, Nk, the score options that cost
    registers (softcap, ALiBi, dropout), whether a band (causal or window) masks tiles, and
    the tile sizes the caller named, if any."""

    capability: int
    shared_limit: int
    dtype: str
    head_dim: int
    value_dim: int
    n_k: int
    score_options: bool = False
    banded: bool = False
    per_row_options: bool = False  # ALiBi or dropout (a slope or hash state per query head)
    dropout: bool = False  # the tensor-core decode has none (decode_on_tensor_cores)
    block_q: int | None = None
    block_k: int | None = None
    # The forward's grid: B x Hq query heads of Nq rows on `multiprocessors` SMs (0: not
    # known, as for the backward and variable-length calls; rows on waves then never match).
    # A dense backward knows its Nq alone (rows for few queries over many keys).
    query_heads: int = 0
    n_q: int = 0
    multiprocessors: int = 0

    @property
    def named_blocks(self) -> bool:
        return self.block_q is not None or self.block_k is not None

    def waves(self, block_q: int, blocks_per_sm: int) -> float | None:
        """How many waves of resident blocks a forward grid of `block_q`-row tiles takes,
        or None where the grid is not known."""
        if not (self.query_heads and self.n_q and self.multiprocessors):
            return None
        blocks = self.query_heads * -(-self.n_q // block_q)
        return blocks / (self.multiprocessors * blocks_per_sm)


def padded(dim: int, step: int) -> int:
    """A head dim rounded up to the tensor cores' K step (the kernels' padded_width)."""
    return -(-dim // step) * step


@dataclass(frozen=True)
class Widths:
    """D and Dv padded to the K step of a family: 16 for 16-bit inputs, 8 for TF32."""

    head: int
    value: int

    @classmethod
    def of(cls, problem: Problem, step: int) -> "Widths":
        return cls.padded(problem.head_dim, problem.value_dim, step)

    @classmethod
    def padded(cls, head_dim: int, value_dim: int, step: int) -> "Widths":
        return cls(padded(head_dim, step), padded(value_dim, step))

    @property
    def widest(self) -> int:
        return max(self.head, self.value)


@dataclass(frozen=True)
class When:
    """A row's condition: padded widths up to `max_width` (both D and Dv) and above
    `min_width` (the wider of them), where given up to `max_sum` for D + Dv, and of one
    padded width where `same_widths`; at most
    `max_keys` keys; at most `max_queries` query rows (a known Nq: the dense backward's); a
    forward grid of fewer than `max_waves` waves of `wave_tiles`
    (block_q, blocks per SM) blocks; score options and a band as given (None: either)."""

    max_width: int
    max_sum: int = 2 * MAX_TENSOR_CORE_DIM
    max_keys: int | None = None
    score_options: bool | None = None
    banded: bool | None = None
    min_width: int = 0
    max_waves: float | None = None
    wave_tiles: tuple[int, int] = (192, 1)
    same_widths: bool = False
    max_queries: int | None = None

    def matches(self, problem: Problem, widths: Widths) -> bool:
        waves = problem.waves(*self.wave_tiles) if self.max_waves is not None else None
        return (self.min_width < widths.widest <= self.max_width
                and widths.head + widths.value <= self.max_sum
                and (not self.same_widths or widths.head == widths.value)
                and (self.max_keys is None or problem.n_k <= self.max_keys)
                and (self.max_queries is None or 0 < problem.n_q <= self.max_queries)
                and (self.max_waves is None or (waves is not None and waves < self.max_waves))
                and (self.score_options is None or self.score_options == problem.score_options)
                and (self.banded is None or self.banded == problem.banded))


# --------------------------------------------------------------------------- configurations


@dataclass(frozen=True)
class WgmmaTiles:
    """The Hopper forward: `block_q` query rows (64 per warpgroup), `block_k` keys per step,
    `stages` K/V buffers in flight, registers capped for `blocks_per_sm` resident blocks;
    `overlap`: each tile's softmax runs while the previous tile's P V does (OVERLAP in
    attention_wgmma_forward.cu; three stages at least)."""

    block_q: int
    block_k: int
    stages: int
    blocks_per_sm: int = 1
    overlap: bool = False

    @property
    def threads(self) -> int:
        return self.block_q // 64 * 128

    def shared_bytes(self, widths: Widths) -> int:
        """Q tile and `stages` K and V tiles (16-bit, swizzled, unpadded rows), plus 1024
        bytes to align the tiles to the swizzle's period."""
        return 1024 + 2 * (self.block_q * widths.head
                           + self.stages * self.block_k * (widths.head + widths.value))


@dataclass(frozen=True)
class WgmmaBackwardTiles:
    """The Hopper backward: per kernel (owned rows, streamed rows), owned rows 64 per
    warpgroup, `stages` buffers of streamed tiles; `split` runs dK and dV as two kernels
    (DKDV_PART) where both accumulators would not fit the registers."""

    dq: tuple[int, int]
    dkdv: tuple[int, int]
    stages: int
    split: bool = False

    def shared_bytes(self, entry: str, widths: Widths, single_pass: bool = False,
                     part: int = 0) -> int:
        """Owned and `stages` streamed tiles (16-bit, swizzled), 1024 bytes of alignment
        slack; the dK/dV kernel also stages lse and D per streamed row, holds no V tile in
        its dV-only part, and in the single pass the dS^T tile (owned x 64, 1024-byte
        aligned) and a dQ staging block per warpgroup (64 x 64 floats)."""
        owned, streamed = getattr(self, entry)
        stream = 2 * self.stages * streamed * (widths.head + widths.value)
        if entry != "dkdv":
            return 1024 + 2 * owned * (widths.head + widths.value) + stream
        owned_bytes = 2 * owned * (widths.head + (widths.value if part != 1 else 0))
        return 1024 + owned_bytes + stream + 2 * 4 * self.stages * streamed + (
            1024 + 2 * owned * 64 + owned * 64 * 4 if single_pass else 0)


@dataclass(frozen=True)
class MmaTiles:
    """The mma.sync forward: `block_q` query rows in warps of `warp_rows` (16 or 32) rows
    each, Q fragments in registers or re-read from shared memory, `block_k` keys per step."""

    block_q: int
    block_k: int
    warp_rows: int = 16
    q_in_registers: bool = True

    @property
    def threads(self) -> int:
        return self.block_q // self.warp_rows * 32

    def shared_bytes(self, widths: Widths) -> int:
        """Q tile plus two stages of K and V tiles, rows padded by 8 elements (16 bytes)."""
        return 2 * ((self.block_q + 2 * self.block_k) * (widths.head + 8)
                    + 2 * self.block_k * (widths.value + 8))


@dataclass(frozen=True)
class Tf32Tiles:
    """The float32 (3xTF32) forward: `block_q` query rows in warps of `warp_rows` rows each,
    `block_k` keys per step."""

    block_q: int
    block_k: int
    warp_rows: int

    @property
    def threads(self) -> int:
        return self.block_q // self.warp_rows * 32

    def shared_bytes(self, widths: Widths) -> int:
        """The Q tile and two stages of K and V tiles, float32; Q and K rows padded by 8
        floats, V rows by 4 (attention_tf32_forward.cu says why)."""
        return 4 * ((self.block_q + 2 * self.block_k) * (widths.head + 8)
                    + 2 * self.block_k * (widths.value + 4))


@dataclass(frozen=True)
class F64Tiles:
    """The float64 forward on sm_90's FP64 tensor cores (attention_tf32_forward.cu built
    with IS_FLOAT64): `block_q` query rows in warps of `warp_rows` rows each, `block_k` keys
    per step."""

    block_q: int
    block_k: int
    warp_rows: int = 16

    @property
    def threads(self) -> int:
        return self.block_q // self.warp_rows * 32

    def shared_bytes(self, widths: Widths) -> int:
        """The Q tile and two stages of K and V tiles, float64; Q and K rows padded to a
        multiple of 16 doubles plus 8, V rows by 2 (attention_tf32_forward.cu says why)."""
        return 8 * ((self.block_q + 2 * self.block_k) * (padded(widths.head, 16) + 8)
                    + 2 * self.block_k * (widths.value + 2))


@dataclass(frozen=True)
class Tf32WgmmaTiles:
    """The Hopper float32 (3xTF32 on wgmma) forward: `block_q` query rows (64 per
    warpgroup), `block_k` keys per step."""

    block_q: int
    block_k: int

    @property
    def threads(self) -> int:
        return self.block_q // 64 * 128

    def shared_bytes(self, widths: Widths) -> int:
        """Q's big and small tiles, K's, V^T's (Dv padded to 16: wgmma's N), each swizzled
        and starting on a 1024-byte period, one raw K and V tile, float32; 1024 bytes of
        alignment slack (attention_tf32_wgmma_forward.cu)."""
        value = padded(widths.value, 16)
        split_tiles = (padded(4 * self.block_q * widths.head, 1024)
                       + padded(4 * self.block_k * widths.head, 1024)
                       + padded(4 * value * self.block_k, 1024))
        return 1024 + 2 * split_tiles + 4 * self.block_k * (widths.head + value)


@dataclass(frozen=True)
class MmaBackwardTiles:
    """The mma.sync / 3xTF32 backward: per kernel (owned rows, streamed rows), 16 owned rows
    per warp; `split` as in `WgmmaBackwardTiles`; `paired`: the kernels ("dq", "dkdv")
    whose 16 owned rows are a pair of warps' (attention_mma_backward.cu, PAIRED_WARPS: dV
    and dK of the same keys; dQ's columns in two halves)."""

    dq: tuple[int, int]
    dkdv: tuple[int, int]
    split: bool = False
    paired: tuple[str, ...] = ()

    def threads(self, entry: str) -> int:
        owned = getattr(self, entry)[0]
        return owned // 16 * 32 * (2 if entry in self.paired else 1)

    def shared_bytes(self, entry: str, widths: Widths, element_size: int,
                     single_pass: bool = False, part: int = 0) -> int:
        """Owned tiles plus two stages of streamed ones, rows padded by 8 elements (4 in
        float64); the dK/dV kernel also stages lse and D per streamed row (floats, doubles
        in float64; no V tile in its dV-only part), in the single pass the dS tile (owned x
        streamed, padded); a kernel of warp pairs also the score tile they hand over (owned
        x streamed floats)."""
        owned, streamed = getattr(self, entry)
        pad = 4 if element_size == 8 else 8
        head_pitch, value_pitch = widths.head + pad, widths.value + pad
        stream = 2 * streamed * (head_pitch + value_pitch)
        handed = 4 * owned * streamed if entry in self.paired else 0
        if entry != "dkdv":
            return element_size * (owned * (head_pitch + value_pitch) + stream) + handed
        owned_elements = owned * (head_pitch + (value_pitch if part != 1 else 0))
        ds_tile = (0 if not single_pass else 4 * streamed * (owned + 8) if element_size == 4
                   else 2 * owned * (streamed + 8))
        row_terms = 2 * 2 * max(4, element_size) * streamed
        return element_size * (owned_elements + stream) + row_terms + ds_tile + handed

    @property
    def serves_single_pass(self) -> bool:
        """Whether the dK/dV kernel can add dQ itself (attention_mma_backward.cu, SINGLE_PASS):
        dK and dV in one kernel, whose warps split a query tile's dQ share into whole row
        slabs."""
        warps, slabs = self.threads("dkdv") // 32, self.dkdv[1] // 16
        return not self.split and warps % slabs == 0

    def single_pass_fits(self, head_dim: int, value_dim: int, element_size: int,
                         shared_limit: int) -> bool:
        """Whether these tiles run a dense problem's single pass (``deterministic=False``):
        16-bit D = Dv a multiple of 16, float32 D a multiple of 8 (the dQ sums' columns
        unpadded), `serves_single_pass`, and the dS tile within `shared_limit` (less the
        static shared memory of the pass in turns: its blocks' ticket)."""
        is_float32 = element_size == 4
        widths = Widths.padded(head_dim, value_dim, 8 if is_float32 else 16)
        return ((head_dim % 8 == 0 if is_float32 else
                 head_dim == value_dim and head_dim % 16 == 0)
                and self.serves_single_pass
                and self.shared_bytes("dkdv", widths, element_size, True)
                <= shared_limit - ORDERED_STATIC_BYTES)


ORDERED_STATIC_BYTES = 16
"""Static shared memory of the single pass in turns (backward_single_pass.cuh:
ordered_block_index's ticket, rounded up), beside its dynamic tiles."""


# --------------------------------------------------------------------------- tables


@dataclass(frozen=True)
class Row:
    """One row of a family's table: when it applies, its tiles, and why they won."""

    when: When
    tiles: object
    note: str


# Hopper forward. D = 64, 80, 96, 112 and 128 are bench/experiments/sweep_gpu_tiles.py's
# (v10-v13b, v28: FlashAttention's shapes, N = 1k-16k); the other widths start from the
# registers ptxas reports per width (bench/NOTES-gpu.md, v14) until the sweep measures them.
WGMMA_FORWARD = [
    Row(When(64, max_keys=64, score_options=False), WgmmaTiles(64, 64, 2, 4),
        "v49: D<=64 over <=64 keys, one-warpgroup blocks, four an SM (H200 N64 16k tokens, "
        "kernels alone, full/causal: 0.107/0.110 ms vs 0.209/0.225 for 128x128 tiles)"),
    Row(When(96, max_keys=64, score_options=False), WgmmaTiles(64, 64, 2, 2),
        "v49: D=65-96 over <=64 keys, one-warpgroup blocks (H200 N64 full, kernels alone, "
        "D=80/96: 0.123/0.112 ms vs 0.152/0.122 for 128x64x3/2; four an SM 0.114/0.108, but "
        "ptxas spills 24-140 bytes there under a band or variable lengths)"),
    Row(When(64, max_keys=128, score_options=False, banded=True), WgmmaTiles(64, 64, 2, 4),
        "v49: banded D<=64 over <=128 keys (H200 B128 H32 N128 causal, kernels alone: 0.122 "
        "ms vs 0.136; full 0.128 vs 0.123, so not there)"),
    Row(When(64), WgmmaTiles(128, 128, 2, 2),
        "v28: D<=64, two blocks per SM at every N (FA shapes N=16k: 386/374 TFLOP/s vs "
        "353/329 for 192x128, full/causal; v14: 270/266 vs 212/197 at D<=32); v29: with "
        "score options too (N=4k, full/causal: dropout 236/219 vs 204/182, ALiBi 212/196 vs "
        "189/161, softcap 179/181 vs 176/158)"),
    Row(When(128, score_options=True), WgmmaTiles(128, 64, 2, 2),
        "v29: score options at D<=128, two blocks per SM (D=128 N=4k, full/causal TFLOP/s: "
        "dropout 311/296 vs 293/257 for 192x64x3, ALiBi 318/288 vs 277/244, softcap "
        "288/265 vs 266/234)"),
    Row(When(128, min_width=96, max_keys=64), WgmmaTiles(64, 64, 3),
        "v49: D=97-128 over <=64 keys, one-warpgroup blocks (H200 B256 H16 N64 full, kernels "
        "alone, D=128: 0.103 ms vs 0.116 for 128x64x2/2, 0.106 four an SM; at N=128 "
        "128x64x2/2 stays, 0.122 vs 0.132)"),
    Row(When(96, max_keys=1024), WgmmaTiles(128, 64, 3, 2),
        "v14: N<=1k at D=96, a third stage: 362/227 TFLOP/s vs 356/216"),
    Row(When(112, max_keys=1024), WgmmaTiles(192, 64, 3),
        "v14: N<=1k at D=112, three warpgroups: 266 TFLOP/s vs 238 (two 128x64 blocks)"),
    Row(When(128, max_keys=1024), WgmmaTiles(128, 64, 2, 2),
        "v10: N<=1k at D=128, two blocks per SM"),
    Row(When(80, min_width=64), WgmmaTiles(256, 64, 2),
        "v28: D=65-80, four warpgroups (D=80 N=4k/16k: 354/377 TFLOP/s vs 317/351 for "
        "192x128, causal 292/339 vs 274/322)"),
    Row(When(112, min_width=96, banded=False), WgmmaTiles(256, 64, 2),
        "v28: D=97-112 without a band, four warpgroups (D=112 N=4k/16k: 404/414 TFLOP/s vs "
        "376/390 for 192x128; causal and D=96 keep 192x128)"),
    Row(When(128, min_width=112, banded=True), WgmmaTiles(128, 64, 2, 2),
        "v28: banded D=128, two blocks per SM (FA shapes causal N=4k/16k: 387/454 TFLOP/s "
        "vs 358/409 for 192x128, 311/427 for 256x64)"),
    Row(When(128, min_width=112, max_waves=8), WgmmaTiles(128, 64, 2, 2),
        "v23: D=128 grids under 8 waves of 192-row blocks: 10-40 % faster (B=1, prefill)"),
    Row(When(128, min_width=112), WgmmaTiles(256, 64, 2),
        "v28: D=128, four warpgroups (FA shapes N=4k/16k: 469/491 TFLOP/s vs 416/433 for "
        "192x128, 457/470 for two 128x64 blocks)"),
    Row(When(128), WgmmaTiles(192, 128, 2), "v10: D=128 N=2k-16k, three warpgroups"),
    Row(When(192), WgmmaTiles(128, 64, 3),
        "v14: D<=192, two warpgroups; O's 96 registers leave no room for 128-key scores"),
    Row(When(256), WgmmaTiles(128, 64, 2),
        "v14: D<=256, two warpgroups, 236 registers (ptxas); two stages fill 193 KiB"),
]

# Hopper backward. D <= 64: the v45 sweep (H200) at D 32 and 64; D <= 128: the v7/v12
# sweeps, D 128 re-timed in v45 (v12's sweep ran through the plan cache, which then held one
# tiling per problem), D 80-112 in v46. Wider: the v46 sweep at D 160, 192, 256 and 192/128
# (N = 4k); D + Dv <= 256 beyond 128 is not yet timed against other tilings.
WGMMA_BACKWARD = [
    Row(When(32, banded=True), WgmmaBackwardTiles((128, 64), (192, 64), 3),
        "v45: banded D<=32, 128-row dQ blocks (H200 fwd+bwd N=1k/4k/16k: 129.9/183.0/204.4 "
        "TFLOP/s vs 112.6/169.4/195.5 for 192-row)"),
    Row(When(32), WgmmaBackwardTiles((128, 64), (192, 64), 2),
        "v45: D<=32, 128-row dQ blocks (H200 fwd+bwd N=1k/4k/16k: 203.6/235.1/238.9 TFLOP/s "
        "vs 183.1/221.0/231.0 for 192-row)"),
    Row(When(64, max_keys=512), WgmmaBackwardTiles((64, 64), (64, 64), 2),
        "v49: D<=64 over <=512 keys, one warpgroup a block (H200 fwd+bwd kernels alone, "
        "N=64/128/512 full: 0.568/0.499/1.017 ms vs 0.688/0.555/1.047 for 64x64-128x64)"),
    Row(When(64, banded=True, max_keys=1024), WgmmaBackwardTiles((64, 64), (64, 64), 2),
        "v45: banded D<=64 over <=1k keys, one warpgroup a block (H200 D=64 N=1k fwd+bwd: "
        "172.7 TFLOP/s vs 158.4 for 192x64x3; at N=4k 220.6 vs 236.7)"),
    Row(When(64, max_keys=1024), WgmmaBackwardTiles((64, 64), (128, 64), 2),
        "v45: D<=64 over <=1k keys (H200 D=64 N=1k fwd+bwd: 263.9 TFLOP/s vs 247.0 for "
        "192x64x2; at N=4k 288.7 vs 291.5)"),
    Row(When(64, banded=True), WgmmaBackwardTiles((192, 64), (192, 64), 3),
        "v12: banded D=64, a third stage +4-5 %"),
    Row(When(64), WgmmaBackwardTiles((192, 64), (192, 64), 2), "v7: D=64"),
    Row(When(112, banded=False), WgmmaBackwardTiles((192, 64), (128, 64), 2),
        "v46: unbanded D=65-112, two stages (H200 fwd+bwd N=1k/4k/16k: D=80 "
        "257.0/301.4/316.6 TFLOP/s vs 256.9/287.4/320.1 for three, D=112 "
        "254.1/324.0/341.4 vs 251.8/317.5/333.9)"),
    Row(When(128, min_width=112, max_keys=512), WgmmaBackwardTiles((64, 64), (64, 64), 2),
        "v49: D=128 over <=512 keys (H200 fwd+bwd kernels alone, N=64/128/512 full "
        "0.457/0.459/0.955 ms vs 0.521/0.473/0.990 for the rows below, causal "
        "0.518/0.522/0.776 vs 0.567/0.563/0.869)"),
    Row(When(128, min_width=112, max_queries=32), WgmmaBackwardTiles((64, 64), (64, 64), 2),
        "v48: D=128, <=32 query rows (H200 fwd+bwd over 32k keys, Nq=1/32 full 1.525/1.548 ms "
        "vs 1.611/1.630 for 192x64-128x64x3, causal 1.246/1.247 vs 1.355/1.349)"),
    Row(When(128, min_width=112, max_queries=128), WgmmaBackwardTiles((128, 64), (64, 64), 2),
        "v48: D=128, <=128 query rows (H200 fwd+bwd over 32k keys, Nq=100/128 full "
        "1.633/1.604 ms vs 1.677/1.645 for 192x64-128x64x3, causal 1.385/1.345 vs "
        "1.432/1.424)"),
    Row(When(128, banded=True), WgmmaBackwardTiles((192, 64), (128, 64), 2),
        "v12: banded D=128, a third stage spills the dK/dV kernel (v45, H200 N=4k causal: "
        "310.9 TFLOP/s fwd+bwd, best of 8 tilings 311.9)"),
    Row(When(128), WgmmaBackwardTiles((192, 64), (128, 64), 3),
        "v12: D=128, three stages (v45, H200 N=4k: 384.0 TFLOP/s fwd+bwd, best of 8 "
        "tilings 387.0)"),
    Row(When(192, max_sum=256), WgmmaBackwardTiles((128, 64), (128, 64), 2),
        "v14: D+Dv<=256 beyond 128, one dK/dV kernel"),
    Row(When(192), WgmmaBackwardTiles((128, 64), (128, 32), 2),
        "v46: D<=192, one dK/dV kernel over 32 streamed rows (H200 N=4k fwd+bwd, full/causal: "
        "D=160 320.1/258.0 TFLOP/s vs 291.7/234.1 split in two kernels, D=192 332.3/267.7 vs "
        "327.0/260.7, 192/128 325.0 vs 309.1)"),
    Row(When(192), WgmmaBackwardTiles((128, 64), (128, 64), 2, split=True),
        "v14: D<=192, dK and dV in two kernels (ptxas: 222-236 registers each)"),
    Row(When(256), WgmmaBackwardTiles((128, 32), (128, 32), 2, split=True),
        "v14: D<=256, 32 streamed rows fit 193 KiB of shared memory"),
]

# Widths above this run the backward (and the float32 forward) on the generic kernels:
# at 576/512 the mma.sync dK/dV and dQ kernels spill 1-5 KB a thread (ptxas, NOTES-gpu v25).
WIDE_BACKWARD_DIM = 384

# mma.sync forward (sm_80+; on Hopper for named tile sizes the wgmma kernel lacks). D = 64 and
# 128: the v3 sweep. Wider: Q re-read from shared memory, which frees the registers O needs.
MMA_FORWARD = [
    Row(When(64), MmaTiles(128, 64, 32, True), "v3: D=64, 32-row warps, +12-30 %"),
    Row(When(128), MmaTiles(128, 128, 16, True), "v3: D=128"),
    Row(When(128), MmaTiles(128, 64, 16, True),
        "v14: D=128 where 128x128 tiles exceed shared memory (sm_80: 163 KiB)"),
    Row(When(256), MmaTiles(64, 64, 16, False), "v14: D<=256, Q from shared memory"),
    Row(When(256), MmaTiles(64, 32, 16, False), "v14: D<=256 in sm_80's 163 KiB"),
    Row(When(MAX_WIDE_DIM, max_sum=2 * MAX_WIDE_DIM, min_width=256), MmaTiles(64, 32, 16, False),
        "v25: widths above 256, Q from shared memory (ptxas, every option: 250 registers "
        "at 320/320, 1.3 KB of spills at 512/512)"),
]

MMA_BACKWARD = [
    Row(When(64), MmaBackwardTiles((64, 64), (128, 64)), "v3: D=64"),
    Row(When(128), MmaBackwardTiles((128, 128), (128, 64)), "v3: D=128"),
    Row(When(128), MmaBackwardTiles((64, 64), (64, 64)),
        "v14: D=128 where v3's tiles exceed shared memory"),
    Row(When(256, max_sum=256), MmaBackwardTiles((64, 64), (64, 64)), "v14: D+Dv<=256"),
    Row(When(256), MmaBackwardTiles((64, 32), (64, 32), split=True),
        "v14: D+Dv>256, dK and dV in two kernels"),
    Row(When(256), MmaBackwardTiles((32, 32), (32, 32), split=True),
        "v14: D+Dv>256 in sm_80's 163 KiB"),
    Row(When(WIDE_BACKWARD_DIM, max_sum=2 * WIDE_BACKWARD_DIM, min_width=256),
        MmaBackwardTiles((32, 32), (32, 32), split=True),
        "v25: widths 257-384 (ptxas at 320/320: 255 registers, 8-24 bytes of spills)"),
]

# float32 on 3xTF32 (sm_80+): v9 (forward) and v13 (backward) sweeps at D = 64 and 128.
TF32_FORWARD = [
    Row(When(64, max_keys=128), Tf32Tiles(64, 32, 32),
        "v51: D<=64 over <=128 keys (H200 B256 H32 N64 causal: 0.333 ms vs 0.570 for 128x64)"),
    Row(When(64), Tf32Tiles(128, 64, 32), "v9: D=64"),
    Row(When(128), Tf32Tiles(128, 64, 16), "v9: D=128"),
    Row(When(192), Tf32Tiles(128, 32, 16),
        "v14: D<=192, 8 warps: 42-54 TFLOP/s at D=192 vs 25-39 (64x32)"),
    Row(When(256), Tf32Tiles(128, 16, 16),
        "v38: D<=256, 8 warps over 16-key steps in 198 KiB (H200 D=256 N=4k: 33.2/31.3 "
        "TFLOP/s vs 24.1/23.2 for 64x32, causal second; D=192 keeps 128x32: 39.5 vs 34.9)"),
    Row(When(256), Tf32Tiles(32, 16, 16), "v14: D<=256 in sm_80's 163 KiB"),
    Row(When(WIDE_BACKWARD_DIM, max_sum=2 * WIDE_BACKWARD_DIM, min_width=256),
        Tf32Tiles(32, 16, 16), "v25: widths 257-384 (ptxas at 320/320: 32 bytes of spills)"),
]

# float64 on sm_90's FP64 tensor cores (mma.sync.m16n8k8.f64), D and Dv up to 128: O in
# doubles takes Dv / 2 registers a row tile. Eight warps of 16 rows share each K/V tile, in
# the longest key steps whose two stages fit beside the Q tile: H200, B4 N4k hidden 2048
# (bench/experiments/sweep_gpu_tiles.py --family f64, NOTES-gpu v52), TFLOP/s full /
# causal against torch's math backend (cuBLAS on the same tensor cores) at ~20.
F64_FORWARD = [
    Row(When(64), F64Tiles(128, 64),
        "v52: D<=64, 64-key steps in 215 KiB (D=64: 32.8/32.4 vs 30.0/29.3 for 128x32, "
        "26.6/24.8 for 128x16; D=32: 24.4/23.8 vs 22.3/21.4)"),
    Row(When(128), F64Tiles(128, 32),
        "v52: D<=128 where 32-key steps fit (D=96, Dv=64: 31.6/31.9 vs 28.3/28.3 for "
        "128x16)"),
    Row(When(128), F64Tiles(128, 16),
        "v52: D<=128, 16-key steps in 207 KiB at D=128 (33.2/32.9 vs 24.2/23.1 for 64x32, "
        "20.0/20.0 for 32x16)"),
]

# float64's backward on sm_90's FP64 tensor cores (attention_mma_backward.cu with IS_FLOAT64):
# its two kernels only. Rows by shared memory and ptxas (every option: 60-100 bytes of
# spills).
F64_BACKWARD = [
    Row(When(64), MmaBackwardTiles((64, 32), (64, 32)),
        "D<=64: dQ and dK/dV of 64 rows over 32-row tiles (140 KiB)"),
    Row(When(128), MmaBackwardTiles((64, 16), (64, 16), split=True),
        "D<=128: 16-row tiles, dK and dV apart (their double accumulators, 203 KiB)"),
]

# float32 on Hopper: 3xTF32 on wgmma up to D = Dv = 160 (H200, B4 N4k hidden 2048, ms
# against the mma.sync rows, full / causal: D 64 8.00 / 4.40 vs 10.60 / 5.77, D 128 8.43 /
# 4.51 vs 13.53 / 6.67). Wider, the split Q tiles leave room for one warpgroup, and above
# 176 only for 16-key steps, whose score products wait on shared memory: D 192 and 256 on
# 64 x 16 tiles 0.85 / 1.02x the mma.sync rows, which keep them (NOTES-gpu v44).
TF32_WGMMA_FORWARD = [
    Row(When(64, max_keys=128), Tf32WgmmaTiles(64, 32),
        "v51: D<=64 over <=128 keys, one warpgroup (H200 B256 H32 causal, N64 / N128: "
        "0.350 / 0.407 ms vs 0.584 / 0.447 for 128x64)"),
    Row(When(64), Tf32WgmmaTiles(128, 64), "v44: D<=64, 64-key steps in 161 KiB (128x32: "
        "9.71/5.43 ms vs 8.05/4.40)"),
    Row(When(128), Tf32WgmmaTiles(128, 32), "v44: D<=128, 32-key steps in 225 KiB (128x16: "
        "11.14/5.90 ms vs 8.37/4.50; 64x32 12.51/7.11)"),
    Row(When(160), Tf32WgmmaTiles(64, 32), "v44: D<=160, one warpgroup (D=160: 12.75/7.02 ms "
        "vs 16.19/9.24 for 64x16, mma.sync 13.41/8.39)"),
    Row(When(192, max_sum=320), Tf32WgmmaTiles(64, 32),
        "v44: D+Dv<=320 (MLA's 192/128: 11.19/6.24 ms vs mma.sync 12.17/7.03)"),
]

TF32_BACKWARD = [
    Row(When(64, max_keys=128), MmaBackwardTiles((64, 32), (64, 32)),
        "v51: D<=64 over <=128 keys (H200 B256 H32 causal, N64 / N128: 1.27 / 1.58 ms vs "
        "2.37 / 2.29 for 128x64; 32x32 1.24 / 1.68)"),
    Row(When(128, min_width=64, max_keys=128), MmaBackwardTiles((64, 16), (64, 16)),
        "v51: D<=128 over <=128 keys (H200 B128 H16 N128 causal: 1.59 ms vs 2.59 for 128x32; "
        "64x32 2.81)"),
    Row(When(64), MmaBackwardTiles((128, 64), (128, 64)), "v13: D=64, 8 warps"),
    Row(When(128), MmaBackwardTiles((128, 32), (128, 32)),
        "v13: D=128, 32 streamed rows fit 278 KB of tiles into 227 KiB"),
    Row(When(192, max_sum=256), MmaBackwardTiles((64, 32), (64, 32)), "v14: D+Dv<=256"),
    Row(When(160), MmaBackwardTiles((128, 16), (128, 16)),
        "v30: D<=160, 8 warps of 16 streamed rows, dK and dV in one kernel (D=160 N=4k: "
        "28.6/25.7 TFLOP/s fwd+bwd vs 21.6/20.0 for the D<=192 row, causal second)"),
    Row(When(192, same_widths=True),
        MmaBackwardTiles((64, 32), (64, 16), paired=("dq", "dkdv")),
        "v39: D=Dv<=192, both kernels on warp pairs (H200 D=192 N=4k: 26.2/22.8 TFLOP/s "
        "fwd+bwd vs 21.6/16.6 dK, dV apart; dK/dV pairs alone 25.1/22.4; 64x16 dQ pairs "
        "24.5/23.4, causal second)"),
    Row(When(192), MmaBackwardTiles((64, 16), (64, 16), paired=("dq", "dkdv")),
        "v44: D!=Dv<=192 on warp pairs (H200 192/128 B4 N4k backward 47.96/24.36 ms vs "
        "67.05/35.30 dK, dV apart; causal second)"),
    Row(When(192), MmaBackwardTiles((64, 32), (64, 32), split=True), "v14: D<=192"),
    Row(When(256, same_widths=True),
        MmaBackwardTiles((64, 16), (64, 16), paired=("dq", "dkdv")),
        "v39: D=Dv<=256, both kernels on warp pairs (H200 D=256 N=4k: 23.5/22.2 TFLOP/s "
        "fwd+bwd vs 17.2/16.5 dK, dV apart; dK/dV pairs alone 22.2/20.9, causal second)"),
    Row(When(256), MmaBackwardTiles((64, 16), (64, 16), split=True),
        "v14: D<=256, 16 streamed rows: 24 TFLOP/s fwd+bwd vs 14 (32x32)"),
    Row(When(256), MmaBackwardTiles((16, 16), (16, 16), split=True),
        "v14: D<=256 in sm_80's 163 KiB"),
    Row(When(WIDE_BACKWARD_DIM, max_sum=2 * WIDE_BACKWARD_DIM, min_width=256),
        MmaBackwardTiles((32, 16), (32, 16), split=True),
        "v25: widths 257-384 (ptxas at 320/320: 255 registers, 8-32 bytes of spills)"),
]

# Tile sizes a caller may name that a tensor-core forward is built for.
WGMMA_BLOCK_Q = (64, 128, 192, 256)
WGMMA_BLOCK_K = (64, 128)
MMA_BLOCK_Q = (64, 128)
MMA_BLOCK_K = (32, 64, 128)
TF32_BLOCK_Q = (64, 128)
TF32_BLOCK_K = (32, 64)

# The key-tile heights each query-tile family is built and tested for.
BUILT_BLOCK_K = {"wgmma": WGMMA_BLOCK_K, "mma": MMA_BLOCK_K, "tf32": TF32_BLOCK_K}


# Hopper's paged tiles, D and Dv <= 128, where the table's key tiles span pages:
# bench/experiments/paged_prefill_gpu.py --tiles (B 4, H 16, 512 rows onto 8704 keys, D 128,
# causal; NOTES-gpu v23, v28, v34): 256 x 64 ran 0.400 ms at pages of 16 and 64, against
# 0.419-0.428 for two 128 x 64 blocks an SM and 0.541-0.555 for 192 x 128.
WGMMA_PAGED = WgmmaTiles(256, 64, 2)


def pages_hold_tiles(page: int, rows: int) -> bool:
    """Whether every tile of `rows` keys (a power of two, tiles at multiples of it) lies in
    one page of `page` keys at a fixed slot: pages of a power of two of at least `rows`
    (the Hopper forward's PAGES_HOLD_TILES copies)."""
    return page >= rows and page & (page - 1) == 0


def within_pages(choice: Choice, page: int, width: int, keep_rows: bool) -> Choice:
    """For paged K/V (pages of `page` keys), key tiles no taller than a page where the family
    is built for such a height, so that each tile lies in one page and costs one block-table
    lookup (sequences.cuh, PagedRows::for_tile) instead of one per row, a dependent load
    before each row's copy. Smaller pages keep the table's tiles (a lookup per row). On
    Hopper, pages of a power of two that hold the table's key tiles keep them: its forward
    copies such a tile as a contiguous one (PAGES_HOLD_TILES; H100, B4 512 rows onto 8704
    keys D128 causal, pages of 64: two 128 x 64 blocks an SM 0.364 ms against 0.360 for 256
    x 64 at H 16/16, 0.727 against 0.745 at 32/8, NOTES-gpu v35). Other pages: head dims
    (`width`: the larger of D and Dv) of 65-128 take `WGMMA_PAGED`, whose copies read each
    row's page a tile ahead (sequences.cuh, PagedCopyRows), unless `keep_rows` (named tiles,
    score options); up to 64 the table's tiles stay at every page size (H100, D 64, same
    problem: two 128 x 128 blocks an SM 0.244 / 0.245 ms at pages of 16 / 64 against 0.284 /
    0.265 for `WGMMA_PAGED` and 0.267 / 0.246 for 128 x 64 key tiles held in pages;
    contiguous 0.203)."""
    if choice.family not in BUILT_BLOCK_K:
        return choice
    spans = not (choice.tiles.block_k <= page and page % choice.tiles.block_k == 0)
    if (choice.family == "wgmma" and 64 < width <= 128 and not keep_rows
            and not pages_hold_tiles(page, choice.tiles.block_k)):
        return replace(choice, tiles=WGMMA_PAGED)
    if choice.family == "wgmma" and width <= 64:
        return choice
    if not spans:
        return choice
    fitting = [b for b in BUILT_BLOCK_K[choice.family] if b <= page and page % b == 0]
    if not fitting:
        return choice
    return replace(choice, tiles=replace(choice.tiles, block_k=max(fitting)))


# --------------------------------------------------------------------------- the choice


@dataclass(frozen=True)
class Choice:
    """A family, its configuration (None for the generic kernels, which size their own
    tiles) and why: the row's note, or the reason a tensor-core family does not apply.
    `key_splits` > 1: a tensor-core forward cuts each query tile's keys into that many
    shares, blocks of their own, merged by log-sum-exp (`forward_key_splits`); for a
    backward the dQ kernel's shares (`dq_key_splits` chooses them where this is 1)."""

    family: str
    tiles: object = None
    note: str = ""
    key_splits: int = 1


def _tensor_core_dims(problem: Problem) -> str | None:
    """Why no tensor-core family serves these head dims, or None."""
    if max(problem.head_dim, problem.value_dim) > MAX_WIDE_DIM:
        return f"head dim above {MAX_WIDE_DIM}"
    return None


def _first_fitting(table, problem: Problem, widths: Widths, fits) -> Row | None:
    for row in table:
        if row.when.matches(problem, widths) and fits(row.tiles):
            return row
    return None


def _generic(reason: str) -> Choice:
    return Choice("generic", None, reason)


def _no_row_note(what: str, table, widths: Widths) -> str:
    """Why no row of `table` serves `widths`: none covers them (the rows end below), or
    every row that does outgrows the device's shared memory."""
    covered = max(row.when.max_width for row in table)
    if widths.widest > covered:
        return (f"no {what} rows cover head dims above {covered}: these pad to "
                f"{widths.head}/{widths.value}")
    return f"no {what} tiles fit this device's shared memory"


def wgmma_named_tiles(problem: Problem, default: WgmmaTiles) -> WgmmaTiles | None:
    """The Hopper forward with the caller's tile sizes where it is built for them: one block
    per SM, the default's stages where they fit shared memory, else fewer."""
    block_q = problem.block_q or default.block_q
    block_k = problem.block_k or default.block_k
    if block_q not in WGMMA_BLOCK_Q or block_k not in WGMMA_BLOCK_K:
        return None
    widths = Widths.of(problem, 16)
    # 512 threads per SM leave 128 registers a thread: too few for wide accumulators beside
    # 128-key scores (NVRTC refuses with C7512: wgmma serialised).
    if block_q >= 256 and widths.widest * block_k > 8192:
        return None
    if (block_q, block_k) == (default.block_q, default.block_k):
        return default
    tiles = WgmmaTiles(block_q, block_k, default.stages)
    while tiles.shared_bytes(widths) > problem.shared_limit and tiles.stages > 2:
        tiles = WgmmaTiles(block_q, block_k, tiles.stages - 1)
    return tiles if tiles.shared_bytes(widths) <= problem.shared_limit else None


def _with_named_blocks(family: str, row: Row, problem: Problem, widths: Widths, block_qs,
                       block_ks, build) -> Choice:
    """The row's tiles, or the caller's tile sizes where the family is built for them (with
    the row's warp layout where it divides the query tile): ``build(block_q, block_k,
    warp_rows)`` makes the tiles."""
    if not problem.named_blocks:
        return Choice(family, row.tiles, row.note)
    block_q = problem.block_q or row.tiles.block_q
    block_k = problem.block_k or row.tiles.block_k
    if block_q not in block_qs or block_k not in block_ks:
        return _generic(f"no {family} forward is built for block_q={block_q}, "
                        f"block_k={block_k}")
    warp_rows = row.tiles.warp_rows if block_q % row.tiles.warp_rows == 0 else 16
    tiles = build(block_q, block_k, warp_rows)
    if tiles.shared_bytes(widths) > problem.shared_limit:
        return _generic("the named tiles exceed this device's shared memory")
    return Choice(family, tiles, "tile sizes named by the caller")


@lru_cache(maxsize=1024)
def choose_forward(problem: Problem) -> Choice:
    """The forward's family and tiles for `problem`."""
    reason = _tensor_core_dims(problem)
    if reason is not None:
        return _generic(reason)
    if problem.dtype in ("float16", "bfloat16"):
        if problem.capability < 80:
            return _generic("tensor-core kernels need sm_80 or later")
        widths = Widths.of(problem, 16)
        if problem.capability == 90:
            row = _first_fitting(WGMMA_FORWARD, problem, widths,
                                 lambda t: t.shared_bytes(widths) <= problem.shared_limit)
            if row is not None:
                if not problem.named_blocks:
                    return Choice("wgmma", row.tiles, row.note)
                named = wgmma_named_tiles(problem, row.tiles)
                if named is not None:
                    return Choice("wgmma", named, "tile sizes named by the caller")
        row = _first_fitting(MMA_FORWARD, problem, widths,
                             lambda t: t.shared_bytes(widths) <= problem.shared_limit)
        if row is None:
            return _generic(_no_row_note("mma.sync", MMA_FORWARD, widths))
        return _with_named_blocks(
            "mma", row, problem, widths, MMA_BLOCK_Q, MMA_BLOCK_K,
            lambda block_q, block_k, rows: MmaTiles(block_q, block_k, rows,
                                                    row.tiles.q_in_registers))
    if problem.dtype == "float32":
        if problem.capability < 80:
            return _generic("TF32 tensor cores need sm_80 or later")
        widths = Widths.of(problem, 8)
        if problem.capability == 90 and not problem.named_blocks:
            row = _first_fitting(TF32_WGMMA_FORWARD, problem, widths,
                                 lambda t: t.shared_bytes(widths) <= problem.shared_limit)
            if row is not None:
                return Choice("tf32", row.tiles, row.note)
        row = _first_fitting(TF32_FORWARD, problem, widths,
                             lambda t: t.shared_bytes(widths) <= problem.shared_limit)
        if row is None:
            return _generic(_no_row_note("3xTF32", TF32_FORWARD, widths))
        return _with_named_blocks("tf32", row, problem, widths, TF32_BLOCK_Q, TF32_BLOCK_K,
                                  Tf32Tiles)
    if problem.dtype == "float64" and problem.capability >= 90 and not problem.named_blocks:
        widths = Widths.of(problem, 8)
        row = _first_fitting(F64_FORWARD, problem, widths,
                             lambda t: t.shared_bytes(widths) <= problem.shared_limit)
        if row is not None:
            return Choice("f64", row.tiles, row.note)
        return _generic(_no_row_note("float64 tensor-core", F64_FORWARD, widths))
    if problem.dtype == "float64" and problem.capability >= 80:
        return _generic("float64 on CUDA cores: FP64 tensor cores' m16n8k8 needs sm_90"
                        if not problem.named_blocks else
                        "tile sizes named by the caller (the generic kernels honour any)")
    return _generic(f"{problem.dtype} runs on CUDA cores")


def backward_fits(tiles, widths: Widths, limit: int, element_size: int = 2) -> bool:
    """Whether every kernel of a backward tiling fits `limit` bytes of shared memory: the dQ
    and the dK/dV kernel, the latter in both parts where dK and dV run apart."""
    parts = (1, 2) if tiles.split else (0,)
    if isinstance(tiles, WgmmaBackwardTiles):
        sizes = (tiles.shared_bytes(entry, widths, part=part)
                 for entry in ("dq", "dkdv") for part in parts)
    else:
        sizes = (tiles.shared_bytes(entry, widths, element_size, part=part)
                 for entry in ("dq", "dkdv") for part in parts)
    return all(size <= limit for size in sizes)


# A problem's choice is looked up on every call that misses the launch cache (every
# backward): memoised per Problem, a frozen value.
@lru_cache(maxsize=1024)
def choose_backward(problem: Problem) -> Choice:
    """The backward's family and tiles for `problem`. Tile sizes named by the caller select
    the generic kernels, which honour any size."""
    reason = _tensor_core_dims(problem)
    if reason is not None:
        return _generic(reason)
    if problem.named_blocks:
        return _generic("tile sizes named by the caller (the generic kernels honour any)")
    if problem.dtype in ("float16", "bfloat16"):
        if problem.capability < 80:
            return _generic("tensor-core kernels need sm_80 or later")
        widths = Widths.of(problem, 16)
        if problem.capability == 90:
            row = _first_fitting(WGMMA_BACKWARD, problem, widths,
                                 lambda t: backward_fits(t, widths, problem.shared_limit))
            if row is not None:
                return Choice("wgmma", row.tiles, row.note)
        table, element_size, family = MMA_BACKWARD, 2, "mma"
    elif problem.dtype == "float32":
        if problem.capability < 80:
            return _generic("TF32 tensor cores need sm_80 or later")
        widths = Widths.of(problem, 8)
        table, element_size, family = TF32_BACKWARD, 4, "tf32"
    elif problem.dtype == "float64" and problem.capability >= 80:
        if problem.capability < 90:
            return _generic("float64 on CUDA cores: FP64 tensor cores' m16n8k8 needs sm_90")
        widths = Widths.of(problem, 8)
        table, element_size, family = F64_BACKWARD, 8, "f64"
    else:
        return _generic(f"{problem.dtype} runs on CUDA cores")
    row = _first_fitting(table, problem, widths, lambda t: backward_fits(
        t, widths, problem.shared_limit, element_size))
    if row is None:
        return _generic(_no_row_note(f"{family} backward", table, widths))
    return Choice(family, row.tiles, row.note)


def describe(problem: Problem) -> dict[str, str]:
    """One line per direction: the family, its tiles and the row's note; for any grid (the
    shape's own: `describe_with_decode`)."""
    lines = {direction: _choice_line(choice) for direction, choice in
             (("forward", choose_forward(problem)), ("backward", choose_backward(problem)))}
    if _single_pass_fits(problem):
        lines["backward"] += (f"; {_single_pass_clause(problem.dtype)}, unless a GQA grid too "
                              "small for it cuts its groups over blocks")
    return lines


def _choice_line(choice: Choice) -> str:
    tiles = "" if choice.tiles is None else f" {choice.tiles}"
    return f"{choice.family}{tiles} ({choice.note})"


def _single_pass_fits(problem: Problem) -> bool:
    """Whether the backward's tiles serve the single pass (`MmaBackwardTiles`; never
    float64's, whose dQ sum would be float32), as launch_backward.backward_mma asks."""
    tiles = choose_backward(problem).tiles
    return (problem.dtype != "float64" and isinstance(tiles, MmaBackwardTiles)
            and tiles.single_pass_fits(problem.head_dim, problem.value_dim,
                                       4 if problem.dtype == "float32" else 2,
                                       problem.shared_limit))


def _single_pass_clause(dtype: str) -> str:
    if runs_single_pass(dtype, True):
        return ("one kernel, dQ added in turns (SINGLE_PASS, ORDERED), with "
                "deterministic=False in arrival order")
    return "deterministic=False: one kernel, dQ added by atomics (SINGLE_PASS)"


def _dense_key_blocks(problem: Problem, shape: DecodeShape) -> int:
    """The dK/dV kernels' blocks of a dense backward: B x Hkv x key tiles."""
    owned = choose_backward(problem).tiles.dkdv[0]
    return shape.batch_kv_heads * -(-problem.n_k // owned)


def _flags_query_tail(problem: Problem, shape: DecodeShape) -> bool:
    """Whether the 16-bit dK/dV kernels meet a query tail and flag non-finite keys for a
    redo (FLAG_NON_FINITE_KEYS), which keeps GQA groups whole; float32 and float64 zero
    the tail (launch_backward.backward_mma)."""
    streamed = choose_backward(problem).tiles.dkdv[1]
    return problem.dtype in ("float16", "bfloat16") and shape.n_q % streamed != 0


# --------------------------------------------------------------------------- GQA backward
# A dK/dV block owns a key tile of one K/V head and walks every query head of its group, so
# its grid is B x Hkv x key tiles whatever the group: MQA at B = 4, N = 4096 is 128 blocks
# on 132 SMs, each walking 16 heads (forward + backward 0.42x cuDNN's, sweep_cliffs_gpu.py,
# NOTES-gpu v25). Below this many waves of one block an SM, the group's query heads are cut
# over blocks (GROUP_SPLITS), whose partial dK and dV a small kernel adds up.
BACKWARD_GROUP_WAVES = 2


def backward_group_splits(key_blocks: int, group: int, sm_count: int) -> int:
    """Into how many blocks each GQA group's query heads are cut for dK/dV: the fewest
    splits, dividing the group, that give BACKWARD_GROUP_WAVES waves; 1 where the grid has
    them already or there is no group."""
    target = BACKWARD_GROUP_WAVES * sm_count
    if group == 1 or key_blocks >= target:
        return 1
    # The fewest splits that reach the target lie between `needed` and the target; above
    # it every divisor does, so the smallest divisor above the target (or the group) wins.
    # Both searches stay small for any group, where a walk up to the group would take
    # minutes at 2**31 - 1 query heads.
    needed = -(-target // key_blocks)
    for splits in range(needed, min(group, target) + 1):
        if group % splits == 0:
            return splits
    return _smallest_divisor_above(group, target)


def _smallest_divisor_above(number: int, bound: int) -> int:
    """The smallest divisor of `number` greater than `bound` (`number` itself at most),
    from the divisor pairs ``(d, number // d)`` with ``d <= sqrt(number)``."""
    smallest = number
    divisor = 1
    while divisor * divisor <= number:
        if number % divisor == 0:
            for candidate in (divisor, number // divisor):
                if bound < candidate < smallest:
                    smallest = candidate
        divisor += 1
    return smallest


# The single pass (5 tile products to the two kernels' 7) is taken also
# over a GQA grid the two kernels would cut, where its blocks fill at least this share of
# the waves they make: H200 float32 D 128 B4 N4k, Hq 16 over Hkv 2 (256 blocks) and over
# Hkv 1 (128 blocks, one wave) 35 ms a backward against the cut two kernels' 46
# (NOTES-gpu v41). Below, SMs left idle cost more than the products saved.
SINGLE_PASS_WAVE_FILL = 0.75


# The deterministic backward's single pass has its key blocks add dQ in turns (ORDERED;
# attention_mma_backward.cu), in a fixed order. float32 takes it: H200 B4 N4k, backward
# alone, D 64-256, 0.76-0.90 of the two kernels' time (NOTES-gpu v42). 16-bit keeps the
# two kernels (in turns was slower on the H100, v5; not measured since).
DETERMINISTIC_SINGLE_PASS_DTYPES = frozenset({"float32"})


def runs_single_pass(dtype: str, deterministic: bool) -> bool:
    """Whether a backward of this dtype and setting runs the single pass where it serves
    the problem (and `takes_single_pass` the grid)."""
    return not deterministic or dtype in DETERMINISTIC_SINGLE_PASS_DTYPES


def takes_single_pass(key_blocks: int, group: int, sm_count: int) -> bool:
    """Whether a backward that runs the single pass (`runs_single_pass`) takes it over
    `key_blocks` dK/dV blocks: always where no GQA group would be cut over blocks, else
    where the blocks fill SINGLE_PASS_WAVE_FILL of their waves."""
    if backward_group_splits(key_blocks, group, sm_count) == 1:
        return True
    waves = -(-key_blocks // sm_count)
    return key_blocks >= SINGLE_PASS_WAVE_FILL * waves * sm_count


# --------------------------------------------------------------------------- decode
# Decoding (few query rows, long K/V) is bound by reading K and V once; the prefill families
# run a block per (batch, query head, 128-row tile), which at B = 1 leaves most SMs idle and
# reads K/V once per query head. attention_decode.cu packs a K/V head's query rows (group x
# Nq) into one block and splits the keys across blocks. Its rows below were chosen by
# reasoning (registers from ptxas, bench/experiments/compile_check_gpu.py; shared memory;
# bytes in flight per SM), not yet by a sweep on the device: bench/bench_gpu_decode.py
# measures them (bench/NOTES-gpu.md, decode v1).

# Short caches decode too: the prefill pads one query row to a 64-row tile and reads K/V once
# per query head, which a cache of a few tiles does not hide (B256 H32/8 Nq1 over 200 keys,
# float16, H200: prefill 0.337 ms against cuDNN's 0.078; B128 MHA over 160 keys 0.141 against
# 0.102, NOTES-gpu v52). Only calls where no row keeps a key are left to the prefill.
DECODE_MIN_KEYS = 1
DECODE_MAX_SPLITS = 512  # 4 x 132 SMs at B*Hkv = 1; the merge reads splits x rows x Dv floats
DECODE_MIN_TILES_PER_SPLIT = 2  # a split's prologue (Q, STAGES - 1 tiles) amortised over >= 2
# More blocks than half a wave are not split, except where their waves would run far from
# full: B64 H32/8 Nq8 D64 (32 packed rows, 3 blocks an SM) ran 512 blocks in 396 slots,
# 0.71 of copy bandwidth at 4-16 GiB (NOTES-gpu v32); 3 splits fill 0.97 of four waves.
DECODE_WAVE_SPLITS = 4
DECODE_WAVE_GAIN = 0.1  # a fill at least this much better than one split's
# Splits fill the SMs with one wave of resident blocks, never a second: the blocks stream at
# the same rate, so 576 blocks where 528 fit take twice as long as 512 (the sweep,
# bench/experiments/sweep_gpu_decode.py, NOTES-gpu v19: B8 H32/8 Nk128k 8 splits 0.75 of copy
# bandwidth, 9 splits 0.61; B1 H32/32 Nk64k 16 splits 0.78, 17 splits 0.68). Residency is
# estimated from shared memory and DECODE_REGISTERS (ptxas: 88-138 per thread at 128).
DECODE_REGISTERS = 128
SM_REGISTERS = 64 * 1024
SM_THREADS = 2048
DECODE_STAGE_BYTES = 20 * 1024  # K + V bytes of one stage (block_k keys), see DecodeTiles
DECODE_STAGE_TARGET = 64 * 1024  # stages while they fit this: 3 blocks of ~64 KiB per SM


@dataclass(frozen=True)
class DecodeShape:
    """What the decode choice adds to a `Problem`: query rows, the GQA group (Hq / Hkv),
    B * Hkv (blocks before any split), the keys the band keeps for some row, and the
    device's multiprocessor count."""

    n_q: int
    group: int
    batch_kv_heads: int
    batch_q_heads: int
    band_keys: int
    sm_count: int

    @property
    def rows(self) -> int:
        return self.n_q * self.group


@dataclass(frozen=True)
class DecodeRow:
    """A decode regime: up to `max_rows` packed rows (group x Nq) on `threads` threads."""

    max_rows: int
    threads: int
    note: str


DECODE_ROWS = [
    DecodeRow(16, 128, "group*Nq <= 16: 4 warps, one row of P per thread-column group; "
                       "ptxas 124 registers at fp16 D=128 (no spills)"),
    DecodeRow(64, 256, "group*Nq <= 64 where prefill would leave SMs idle: 8 warps keep the "
                       "64 x Dv accumulator at <= 64 registers a thread (ptxas 177 at D=256)"),
]


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@dataclass(frozen=True)
class DecodeTiles:
    """attention_decode.cu's configuration: `rows` packed-row capacity (a power of two),
    `block_k` keys per stage, `stages` cp.async buffers, `threads`, and `splits` key ranges
    (blocks per (batch, kv head))."""

    rows: int
    block_k: int
    stages: int
    threads: int
    splits: int

    @staticmethod
    def chunk_elements(itemsize: int) -> int:
        return 16 // itemsize

    def row_groups(self, rows: int) -> int:
        """Blocks a (batch, kv head, key range) takes for `rows` packed rows."""
        return -(-rows // self.rows)

    def shared_bytes(self, itemsize: int, accum_size: int, head_dim: int,
                     value_dim: int) -> int:
        """The kernel's dynamic shared memory (kSharedBytes): K and V stages with rows
        padded to 16 bytes plus 16, Q in the accumulation type and P key-major, both with
        rows padded by 16 bytes, and per-row state (4 accumulators, an i64, a u32)."""
        chunk = self.chunk_elements(itemsize)
        head_width, value_width = padded(head_dim, chunk), padded(value_dim, chunk)
        stage = self.block_k * (head_width + value_width + 2 * chunk) * itemsize
        vector = 16 // accum_size
        score_pitch = padded(self.rows, vector) + vector
        return (self.stages * stage + self.rows * (head_width + vector) * accum_size
                + self.block_k * score_pitch * accum_size
                + self.rows * (4 * accum_size + 8 + 4))


def decode_key_tile(itemsize: int, head_dim: int, value_dim: int) -> tuple[int, int]:
    """``(block_k, stages)``: a stage of ~DECODE_STAGE_BYTES of K and V (16..64 keys, a power
    of two), and 3 stages where they fit DECODE_STAGE_TARGET, else 2."""
    chunk = 16 // itemsize
    row_bytes = (padded(head_dim, chunk) + padded(value_dim, chunk) + 2 * chunk) * itemsize
    block_k = 64
    while block_k > 16 and block_k * row_bytes > DECODE_STAGE_BYTES:
        block_k //= 2
    stages = 3 if 3 * block_k * row_bytes <= DECODE_STAGE_TARGET else 2
    return block_k, stages


# The tensor-core decode (attention_decode_mma.cu) for 16-bit inputs: the packed rows are
# m16 tiles that a group of warps holds, the group's warps split each stage's keys. A warp
# holds up to 16 * floor(DECODE_MMA_WIDTH / padded Dv) packed rows (O's accumulators: <= 128
# floats a thread). More than 16 rows take DECODE_MMA_ROW_WARPS groups at most, a row tile
# each, with fewer key warps taking more keys, so that a block keeps DECODE_MMA_WARPS warps
# and a stage of 64 keys (32 where Dv > 128: S's registers would spill beside O's); every
# group reads the same stages, so K/V is read once per block. Row groups (a block each,
# K/V read once per group) take more rows than a block holds (below). ALiBi takes a
# slope per packed row (its query head's); dropout (no inference case) stays on CUDA cores.
# Chosen by sweeps (sweep_gpu_decode.py --kernel tensor_cores, H100, kernels alone):
# NOTES-gpu v20: 4 warps x 16 keys in 2 stages reach 0.86-0.99 of copy bandwidth on the
# fp16 Nq = 1 grid at >= 256 MiB of K/V, where 3 stages lost up to 0.2 at B*Hkv >= 512 (no
# split) and 2 warps or 32 keys a warp were no better; one packed row (MHA) on tensor cores
# matched or beat the CUDA-core kernel (B8 H32/32 Nk128k 0.99 against 0.92). NOTES-gpu v21:
# row warps at 32-64 packed rows (Nq 8, GQA 4-8) took the fp16 grid at >= 256 MiB from
# 0.51-0.61 to 0.61-0.94 of copy bandwidth at 64 rows, and D = 256 at 32 rows from
# 0.56-0.60 to 0.84-0.97; at 32 rows and D <= 128 they matched one row warp of two tiles.
DECODE_MMA_WIDTH = 256
DECODE_MMA_WARPS = 4
DECODE_MMA_WARP_KEYS = 16  # one k16 step of P V a warp a stage
DECODE_MMA_STAGES = 2
# A third stage where a block has its SM alone with either (D 256; 128 rows at D > 64): its
# own copies are the SM's only ones in flight. H200, kernels alone, with the copies' L2
# prefetch (NOTES-gpu v54): D 256 B8 H32/8 Nk4k (256 MiB) 78.9 -> 75.3 us, B1 H8/1 Nk256k
# 79.5 -> 76.1, B64 H32/8 Nk32k bf16 (16 GiB) 4346 -> 3935; where 2-4 blocks share an SM it
# cost 1-9 % (D 40-96 Nq 1, 32 rows at D 64 and 128).
DECODE_MMA_MOST_STAGES = 3
DECODE_MMA_ROW_WARPS = 4
# More packed rows than DECODE_ROWS serve (speculative decoding or chunks of up to 64
# queries with wide GQA groups; one query row of Falcon's 71 heads over one K/V head) take
# DECODE_MMA_MANY_ROW_WARPS groups of one m16 tile each (one key warp, 64 keys a stage),
# not 4 groups of two tiles, whose O and S spill; beyond DECODE_MMA_MAX_ROWS, blocks of
# that many rows (row groups, K/V read once per row group). The prefill reads K/V once per
# query head into tiles of at least 64 rows, the decode once per row group into m16 tiles
# of packed rows, but on mma.sync at one row tile a warp it runs each padded row
# DECODE_MMA_PREFILL_RATE times slower than the wgmma prefill: the decode takes such rows
# where the prefill's padded rows (group x Nq in 64-row tiles) are at least that many times
# its own (`decode_outworks_prefill`). bench/experiments/decode_rows_gpu.py, float16 causal
# D 128 over 8k keys, decode against the split prefill, ms: B4 H32/8 Nq17 (68 rows, 3.2x
# fewer padded rows) 0.140 / 0.162, Nq32 (128 rows, 2x) 0.197 / 0.164 (H200, NOTES-gpu
# v51); 256 rows (B1 H32/8 Nq64 over 32k, 1x) 0.224 / 0.169 (H100, v26). B8 H71/1 Nq1 over
# 32k keys D 64 (57x) ran the prefill at 1.88 ms against cuDNN's 0.090 (v51).
DECODE_MMA_MAX_ROWS = 128
DECODE_MMA_MANY_ROW_WARPS = 8
DECODE_MMA_PREFILL_RATE = 2.5
PREFILL_MIN_ROWS = 64  # the prefill families' fewest rows a query tile
# Where D and Dv are at most DECODE_MMA_NARROW_WIDTH, O and S of two m16 tiles fit a warp's
# registers: such rows take DECODE_MMA_ROW_WARPS groups of two tiles, each K/V fragment a
# warp reads from shared memory feeding two products. decode_rows_gpu.py, H200, D 64,
# causal, ms, 4 x 2 tiles against 8 x 1 (NOTES-gpu v51): B8 H71/1 Nq1 over 32k keys 0.056 /
# 0.065, Nq4 0.149 / 0.193, B4 H32/8 Nq17 over 8k 0.076 / 0.086; D 128 0.193 / 0.141 (spills).
DECODE_MMA_NARROW_WIDTH = 64
# Narrow rows in two row warps (17-32 packed rows at D, Dv <= 64) take stages of 16 keys a
# warp, three of them: blocks small enough for four an SM, so B*Hkv = 512 runs in one wave
# where three an SM needed three splits and their merge. H200 kernels alone (NOTES-gpu v55):
# B64 H32/8 Nq8 Nk4k D64 169.7 -> 131.4 us, Nk32k 1008 -> 965, the other 32-row D 64 rows
# within 3 % (B8 H8/1 Nq4 Nk128k 78.5 -> 78.3, B64 H8/1 Nq4 Nk4k 28.9 -> 29.8).
DECODE_MMA_NARROW_PAIR_KEYS = 16
DECODE_MMA_NARROW_PAIR_STAGES = 3
# float32 and float64 decodes beyond DECODE_ROWS' 64 rows take the CUDA-core decode in row
# groups of 64 where the prefill pads at least this many times its rows: one query row of
# a 71-head MQA group (Falcon) or of MLA's 128 heads over one K/V head read K/V once per
# query head on the prefill, in float32 9.9 ms over 32k keys (B8 D64, H200) and 43 ms over
# 8k (B2 D576, 0.23x torch's math backend); decoded 0.54 and 0.50 ms (NOTES-gpu v51).
DECODE_CUDA_CORE_PREFILL_RATE = 8
# MHA beyond 16 queries (beyond 32 in float32) runs the tensor-core prefill, which splits
# the keys as the decode does (forward_key_splits): no group shares the K/V reads, and the
# prefill's products run on tensor cores. H100 causal, B4 H16 over 8k keys, D128, ms
# (NOTES-gpu v26): float16 Nq 17 / 33 / 64 decode 0.122 / 0.153 / 0.171, split prefill
# 0.102 / 0.103 / 0.106 (B1 H32 Nq24 over 32k 0.216 / 0.190); float32 (CUDA-core decode
# against 3xTF32) Nq 17 0.731 / 0.842 and B1 H32 Nq24 over 32k 1.375 / 1.638, but Nq 33 /
# 64 1.302 / 0.836 and 1.282 / 0.836.
DECODE_MHA_FLOAT32_ROWS = 32


@dataclass(frozen=True)
class DecodeMmaTiles:
    """attention_decode_mma.cu's configuration: `row_warps` groups of warps, each group
    holding `row_tiles` m16 tiles of packed rows in each of its `warps` (key warps) that
    each take `warp_keys` keys of every stage, `stages` cp.async buffers, `splits` key
    ranges (blocks per (batch, kv head))."""

    row_tiles: int
    warps: int
    warp_keys: int
    stages: int
    splits: int
    row_warps: int = 1

    @property
    def rows(self) -> int:
        return 16 * self.row_tiles * self.row_warps

    @property
    def block_k(self) -> int:
        return self.warps * self.warp_keys

    @property
    def threads(self) -> int:
        return 32 * self.warps * self.row_warps

    def row_groups(self, rows: int) -> int:
        """Blocks a (batch, kv head, key range) takes for `rows` packed rows."""
        return -(-rows // self.rows)

    def stage_bytes(self, head_dim: int, value_dim: int) -> int:
        return self.block_k * (padded(head_dim, 16) + padded(value_dim, 16) + 16) * 2

    def shared_bytes(self, head_dim: int, value_dim: int) -> int:
        """kSharedBytes: the stages (after the key loop, the warps' partial O, max and sum
        in float32, rows padded by 16 bytes) and the packed Q tile, rows padded by 16 bytes."""
        value_width = padded(value_dim, 16)
        combine = self.warps * self.rows * (value_width + 4 + 2) * 4
        return (max(self.stages * self.stage_bytes(head_dim, value_dim), combine)
                + self.rows * (padded(head_dim, 16) + 8) * 2)

    def registers(self, head_dim: int, value_dim: int) -> int:
        """ptxas's registers a thread (residency, so the split count): the count measured
        for the table's rows (DECODE_MMA_REGISTERS), else an estimate: O's accumulators,
        Q's fragments where they stay in registers, S, and 72 for the rest."""
        head_width, value_width = padded(head_dim, 16), padded(value_dim, 16)
        measured = DECODE_MMA_REGISTERS.get((head_width, value_width, self.row_tiles,
                                             self.row_warps, self.warps, self.warp_keys))
        if measured is not None:
            return measured
        q_fragments = self.row_tiles * head_width // 4 if self.row_tiles * head_width <= 128 else 0
        count = 72 + self.row_tiles * (value_width // 2 + self.warp_keys // 2) + q_fragments
        return min(255, -(-count // 8) * 8)


# ptxas's registers a thread for the tensor-core decode's table rows, keyed by (padded D,
# padded Dv, row tiles, row warps, key warps, keys a warp): sm_90, 16-bit, no score option,
# no launch bound (bench/experiments/compile_check_gpu.py --decode-registers). The split
# count assumes the residency these give, and the kernel is built with it as its minimum;
# an estimate that undercounts makes ptxas squeeze (spills), one that overcounts leaves a
# block an SM more than the splits assumed, whose grids then end in a part-empty wave
# (NOTES-gpu v33: D = 128 at 168 registers ran 3 blocks an SM where 2 were assumed, B64
# H32/8 Nk4k 275 -> 323 us).
DECODE_MMA_REGISTERS = {
    (64, 64, 1, 1, 4, 16): 120, (64, 64, 1, 2, 2, 32): 144, (64, 64, 1, 4, 1, 64): 160,
    (64, 64, 1, 2, 2, 16): 128,  # ptxas 131 unbounded, 119 (paged 128) at 4 blocks, no spill
    (64, 64, 1, 8, 1, 64): 160, (64, 64, 2, 4, 1, 64): 256,
    (96, 96, 1, 1, 4, 16): 208, (96, 96, 1, 2, 2, 32): 216, (96, 96, 1, 4, 1, 64): 224,
    (96, 96, 1, 8, 1, 64): 200,
    (128, 128, 1, 1, 4, 16): 168, (128, 128, 1, 2, 2, 32): 200, (128, 128, 1, 4, 1, 64): 208,
    (128, 128, 1, 8, 1, 64): 208,
    (192, 192, 1, 1, 4, 16): 248, (192, 192, 1, 2, 2, 32): 255, (192, 192, 1, 4, 1, 32): 240,
    (192, 192, 1, 8, 1, 32): 224,
    (256, 256, 1, 1, 4, 16): 240, (256, 256, 1, 2, 2, 32): 248, (256, 256, 1, 4, 1, 32): 248,
    (256, 256, 1, 8, 1, 32): 248,
}


def decode_on_tensor_cores(problem: Problem, shape: DecodeShape) -> bool:
    """Whether attention_decode_mma.cu serves this decode problem (else attention_decode.cu)."""
    return (problem.dtype in ("float16", "bfloat16") and not problem.dropout
            and max(problem.head_dim, problem.value_dim) <= MAX_TENSOR_CORE_DIM)


def decode_outworks_prefill(shape: DecodeShape, on_tensor_cores: bool = True) -> bool:
    """Whether the decode's padded rows are at most 1 / its rate against the prefill
    (DECODE_MMA_PREFILL_RATE, DECODE_CUDA_CORE_PREFILL_RATE) of the prefill's (each query
    head's Nq rows in tiles of PREFILL_MIN_ROWS), per K/V head: on tensor cores, m16 tiles
    of packed rows in row groups of DECODE_MMA_MAX_ROWS; on CUDA cores, row groups of
    DECODE_ROWS' largest capacity, each run whole."""
    prefill_rows = shape.group * padded(shape.n_q, PREFILL_MIN_ROWS)
    if not on_tensor_cores:
        return prefill_rows >= DECODE_CUDA_CORE_PREFILL_RATE * padded(
            shape.rows, DECODE_ROWS[-1].max_rows)
    full_groups, rest = divmod(shape.rows, DECODE_MMA_MAX_ROWS)
    decode_rows = full_groups * DECODE_MMA_MAX_ROWS + padded(rest, 16)
    return prefill_rows >= DECODE_MMA_PREFILL_RATE * decode_rows


def decode_mma_tiles(problem: Problem, shape: DecodeShape, splits: int | None = None,
                     warps: int | None = None, warp_keys: int | None = None,
                     stages: int | None = None, row_warps: int | None = None,
                     row_tiles: int | None = None) -> DecodeMmaTiles:
    """The tensor-core decode configuration (a test or sweep may force any field)."""
    most = max(1, DECODE_MMA_WIDTH // padded(problem.value_dim, 16))
    row_tiles_needed = -(-shape.rows // 16)
    narrow = max(padded(problem.head_dim, 16), padded(problem.value_dim, 16)) \
        <= DECODE_MMA_NARROW_WIDTH
    if row_warps is None:
        row_warps = (min(row_tiles_needed, DECODE_MMA_ROW_WARPS)
                     if row_tiles_needed <= DECODE_MMA_ROW_WARPS or narrow
                     else DECODE_MMA_MANY_ROW_WARPS)
    if row_tiles is None:  # more rows than a block of DECODE_MMA_MAX_ROWS: row groups
        row_tiles = min(-(-row_tiles_needed // row_warps), most,
                        max(1, DECODE_MMA_MAX_ROWS // (16 * row_warps)))
    if warps is None:
        warps = max(1, DECODE_MMA_WARPS // row_warps)
    narrow_pair = narrow and row_warps == 2 and row_tiles == 1
    if warp_keys is None:  # a stage of DECODE_MMA_WARPS * DECODE_MMA_WARP_KEYS keys,
        warp_keys = max(DECODE_MMA_WARP_KEYS,
                        DECODE_MMA_WARPS * DECODE_MMA_WARP_KEYS // warps)
        if padded(problem.value_dim, 16) > DECODE_MMA_WIDTH // 2:
            # or of half that where O's registers are many: S's registers spill otherwise
            warp_keys = min(warp_keys, 2 * DECODE_MMA_WARP_KEYS)
        if narrow_pair:
            warp_keys = DECODE_MMA_NARROW_PAIR_KEYS
            stages = stages or DECODE_MMA_NARROW_PAIR_STAGES
    tiles = DecodeMmaTiles(row_tiles, warps, warp_keys, stages or DECODE_MMA_STAGES, 1,
                           row_warps)
    if stages is None:
        deeper = replace(tiles, stages=DECODE_MMA_MOST_STAGES)
        if (decode_fits(problem, deeper) and decode_residency(problem, tiles) == 1
                and decode_residency(problem, deeper) == 1):
            tiles = deeper
    return replace(tiles, splits=_splits_of(problem, shape, tiles)[0] if splits is None
                   else splits)


# With splits, the tensor-core decode's last block of each (batch, kv head, row group)
# merges the splits' partials itself (FUSED_MERGE) instead of a second kernel, while the
# partials it reads alone (splits x rows x Dv floats) stay under DECODE_FUSED_MERGE_FLOATS:
# NOTES-gpu v32, H100 fp16 at 128-512 MiB of K/V: the merge kernel (its launch after the
# decode, and its pass) costs ~2-6 us a step; merged in the kernel the step took 2-6 us
# less at <= 4K floats (2-16 splits) and 2-10 us more at >= 16.9K (33-66 splits of 4-8
# rows), where one block's reads of the partials from L2 stand alone at the step's end.
DECODE_FUSED_MERGE_FLOATS = 8 * 1024


def decode_merges_in_kernel(tiles: DecodeMmaTiles, rows: int, value_dim: int,
                            head_dim: int) -> bool:
    """Whether the tensor-core decode merges its own splits (a `rows`-row problem): its
    weights (splits x block rows floats, and a total a row) reuse the kernel's shared memory."""
    block_rows = min(rows, tiles.rows)
    return (tiles.splits > 1
            and tiles.splits * block_rows * value_dim <= DECODE_FUSED_MERGE_FLOATS
            and (tiles.splits + 1) * tiles.rows * 4 <= tiles.shared_bytes(head_dim, value_dim))


def decode_blocks_per_sm(shared_bytes: int, threads: int, shared_limit: int,
                         registers: int = DECODE_REGISTERS) -> int:
    """Decode blocks resident on one SM: by shared memory (the per-block limit plus the 1 KiB
    the runtime reserves a block stands in for the SM's), registers and threads."""
    by_shared = (shared_limit + 1024) // (shared_bytes + 1024)
    by_registers = SM_REGISTERS // (threads * registers)
    return max(1, min(by_shared, by_registers, SM_THREADS // threads))


def _wave_fill(blocks: int, resident: int) -> float:
    """The share of the resident slots that `blocks` blocks of equal work keep busy over
    their waves (the last wave's empty slots idle while it runs)."""
    return blocks / (-(-blocks // resident) * resident)


def decode_splits(shape: DecodeShape, block_k: int, blocks_per_sm: int) -> tuple[int, str]:
    """How many key ranges each (batch, kv head) is cut into, and why."""
    blocks = max(1, shape.batch_kv_heads)
    resident = blocks_per_sm * shape.sm_count
    tiles = -(-shape.band_keys // block_k)
    if 2 * blocks > resident:
        # Blocks enough for the SMs: no split, unless their last wave would run mostly
        # empty; then the split count (up to DECODE_WAVE_SPLITS) whose waves are fullest.
        fills = {splits: _wave_fill(blocks * splits, resident)
                 for splits in range(1, DECODE_WAVE_SPLITS + 1)
                 if splits == 1 or tiles // splits >= DECODE_MIN_TILES_PER_SPLIT}
        splits = max(fills, key=lambda count: (fills[count], -count))  # fullest, then fewest
        if fills[splits] - fills[1] <= DECODE_WAVE_GAIN:
            return 1, f"B*Hkv={blocks} > half of {resident} resident blocks: no split"
        return splits, (f"{splits} splits: B*Hkv={blocks} blocks fill {fills[1]:.2f} of their "
                        f"waves of {resident} resident blocks, {splits}x fill {fills[splits]:.2f}")
    splits = max(1, min(resident // blocks, tiles // DECODE_MIN_TILES_PER_SPLIT,
                        DECODE_MAX_SPLITS))
    if splits == 1:
        return 1, (f"no split: {tiles} key tile{'s' if tiles > 1 else ''}, under "
                   f"{DECODE_MIN_TILES_PER_SPLIT} for each of two splits")
    return splits, (f"{splits} splits: B*Hkv={blocks} blocks in one wave of {resident} "
                    f"({blocks_per_sm} an SM), >= {DECODE_MIN_TILES_PER_SPLIT} of {tiles} key "
                    f"tiles each, <= {DECODE_MAX_SPLITS}")


def _sizes(problem: Problem) -> tuple[int, int]:
    """(element size, accumulator size) of a problem's dtype."""
    itemsize = {"float64": 8, "float32": 4}.get(problem.dtype, 2)
    return itemsize, 8 if itemsize == 8 else 4


def _decode_shared_bytes(problem: Problem, tiles) -> int:
    if isinstance(tiles, DecodeMmaTiles):
        return tiles.shared_bytes(problem.head_dim, problem.value_dim)
    itemsize, accum = _sizes(problem)
    return tiles.shared_bytes(itemsize, accum, problem.head_dim, problem.value_dim)


def decode_fits(problem: Problem, tiles) -> bool:
    return _decode_shared_bytes(problem, tiles) <= problem.shared_limit


def decode_tiles(problem: Problem, shape: DecodeShape, splits: int | None = None,
                 threads: int | None = None, rows: int | None = None) -> DecodeTiles:
    """The configuration for a problem (a test may force `splits`, `threads` and the packed
    rows a block holds, `rows`). Wide float64 rows take fewer stages, then fewer keys a
    stage (down to 8), then row groups of fewer rows, until they fit (`decode_fits` says
    whether they did)."""
    block_k, stages = decode_key_tile(_sizes(problem)[0], problem.head_dim, problem.value_dim)
    # More packed rows than the largest capacity take row groups of it (fewer where wide
    # rows do not fit shared memory otherwise), on the threads of the capacity's row.
    capacity = rows or min(_pow2_at_least(shape.rows), DECODE_ROWS[-1].max_rows)
    while True:
        tiles = DecodeTiles(capacity, block_k, stages, threads or next(
            row.threads for row in DECODE_ROWS if min(capacity, shape.rows) <= row.max_rows), 1)
        while not decode_fits(problem, tiles) and (tiles.stages > 2 or tiles.block_k > 8):
            tiles = (replace(tiles, stages=2) if tiles.stages > 2
                     else replace(tiles, block_k=tiles.block_k // 2))
        if decode_fits(problem, tiles) or rows or capacity >= shape.rows or capacity == 1:
            break
        capacity //= 2
    return replace(tiles, splits=_splits_of(problem, shape, tiles)[0] if splits is None
                   else splits)


def decode_residency(problem: Problem, tiles) -> int:
    """The decode blocks an SM holds, which the split count assumes; the tensor-core kernel
    is compiled with it as its minimum (``__launch_bounds__``), so ptxas keeps its registers
    within that residency instead of growing past it (a D = 64 build took 168 registers, 3
    blocks an SM where the splits assumed 4: two waves, 0.91 -> 0.75 of copy bandwidth)."""
    registers = (tiles.registers(problem.head_dim, problem.value_dim)
                 if isinstance(tiles, DecodeMmaTiles) else DECODE_REGISTERS)
    return decode_blocks_per_sm(_decode_shared_bytes(problem, tiles), tiles.threads,
                                problem.shared_limit, registers)


def _splits_of(problem: Problem, shape: DecodeShape, tiles) -> tuple[int, str]:
    # Row groups are blocks beside the (batch, kv head) ones.
    shape = replace(shape, batch_kv_heads=shape.batch_kv_heads * tiles.row_groups(shape.rows))
    return decode_splits(shape, tiles.block_k, decode_residency(problem, tiles))


@lru_cache(maxsize=1024)
def choose_decode(problem: Problem, shape: DecodeShape) -> Choice | None:
    """The decode family for a forward whose packed rows are few and keys many, or None
    (the prefill families run it)."""
    if problem.capability < 80 or problem.named_blocks:
        return None  # cp.async needs sm_80; named tile sizes ask for the tiled forward
    if shape.band_keys < DECODE_MIN_KEYS:
        return None
    if (shape.group == 1
            and shape.rows > (DECODE_MHA_FLOAT32_ROWS if problem.dtype == "float32"
                              else DECODE_ROWS[0].max_rows)
            and choose_forward(problem).family in ("wgmma", "mma", "tf32")):
        return None  # MHA: the split tensor-core prefill (DECODE_MHA_FLOAT32_ROWS says why)
    row = next((row for row in DECODE_ROWS if shape.rows <= row.max_rows), None)
    prefill_blocks = shape.batch_q_heads * -(-shape.n_q // 128)
    on_tensor_cores = decode_on_tensor_cores(problem, shape)
    if row is None and not (
            on_tensor_cores and decode_outworks_prefill(shape)
            or problem.dtype in ("float32", "float64")
            and decode_outworks_prefill(shape, on_tensor_cores=False)):
        # More rows than DECODE_ROWS serve: the prefill, unless it pads far more (16-bit
        # rows of heads above 256 fold into the tensor-core prefill instead: may_fold).
        return None
    if (row is DECODE_ROWS[1] and prefill_blocks >= shape.sm_count
            and not on_tensor_cores):
        # Many query heads fill the GPU on the tensor-core prefill already, whose wasted rows
        # (Nq of its 64-192) cost less than CUDA-core products; the tensor-core decode reads
        # K/V once per group where the prefill reads it once per query head.
        return None
    if on_tensor_cores:
        tiles = decode_mma_tiles(problem, shape)
        if not decode_fits(problem, tiles) and tiles.row_warps > DECODE_MMA_ROW_WARPS:
            # Wide rows past sm_80's shared memory in eight row warps: blocks of four.
            tiles = decode_mma_tiles(problem, shape, row_warps=DECODE_MMA_ROW_WARPS,
                                     row_tiles=1)
        note = ("16-bit, no dropout: tensor cores (attention_decode_mma.cu), the "
                "warps split each stage's keys")
        if tiles.row_groups(shape.rows) > 1:
            note += (f"; group*Nq = {shape.rows}: {tiles.row_groups(shape.rows)} row groups "
                     f"of {tiles.rows} rows")
    else:
        tiles = decode_tiles(problem, shape)
        note = row.note if row is not None else (
            f"group*Nq = {shape.rows} > {DECODE_ROWS[-1].max_rows}: "
            f"{tiles.row_groups(shape.rows)} row groups of {tiles.rows} rows on CUDA cores")
    if not decode_fits(problem, tiles):
        return None  # Q alone (64 float64 rows of 256) outgrows shared memory
    note = f"{note}; {_splits_of(problem, shape, tiles)[1]}"
    if tiles.splits > 1:
        in_kernel = isinstance(tiles, DecodeMmaTiles) and decode_merges_in_kernel(
            tiles, shape.rows, problem.value_dim, problem.head_dim)
        note += ("; the last block of each group merges the splits" if in_kernel
                 else "; the merge kernel combines the splits")
    return Choice("decode", tiles, note)


# --------------------------------------------------------------------------- split-KV prefill
# A dense forward of few query tiles against many keys (a chunk of 65-512 queries of one
# sequence, MHA with B x Hq under the SM count) leaves multiprocessors idle: its blocks are
# B x Hq x query tiles, each walking every key. FlashAttention-2 splits the keys there; the
# tensor-core forwards do so too (SPLIT_KEYS: grid rows of key shares, float32 partials,
# split_keys_merge.cu). The count follows FlashAttention-2's rule: the fewest shares whose
# waves of resident blocks are at least FORWARD_SPLIT_EFFICIENCY as full as the best
# count's, each share at least FORWARD_SPLIT_MIN_KEYS keys (its prologue, Q and the first
# K/V tiles, and the merge's reading of its partial o amortised over them). H100, float16,
# bench/experiments/split_keys_gpu.py (NOTES-gpu v26): a wave 0.85 full (7 shares of 32
# tiles) ran 4-17 % slower than one 0.97 full (8), hence 0.95 where FlashAttention-2 takes
# 0.85; 512 keys a share beat 341 and 256 (B1 H32 Nq128 over 2048 keys).
FORWARD_SPLIT_BELOW_WAVES = 0.8  # grids with at least this share of a wave stay whole
FORWARD_SPLIT_EFFICIENCY = 0.95
FORWARD_SPLIT_MIN_KEYS = 512
FORWARD_MAX_SPLITS = 16


def key_shares(blocks: int, resident: int, band_keys: int, block_k: int,
               most_splits: int = FORWARD_MAX_SPLITS) -> int:
    """Into how many key shares (`most_splits` at most) a grid of `blocks` query tiles (of
    which `resident` fit the GPU at once) cuts each tile's keys (the longest `band_keys`, in
    tiles of `block_k`)."""
    if blocks >= FORWARD_SPLIT_BELOW_WAVES * resident:
        return 1
    most = min(most_splits, band_keys // FORWARD_SPLIT_MIN_KEYS, -(-band_keys // block_k))
    if most < 2:
        return 1

    def fullness(splits: int) -> float:
        waves = blocks * splits / resident
        return waves / -(-waves // 1)

    best = max(fullness(splits) for splits in range(1, most + 1))
    return next(s for s in range(1, most + 1) if fullness(s) >= FORWARD_SPLIT_EFFICIENCY * best)


def cuts_key_shares(family: str) -> bool:
    """Whether a forward of `family` cuts its keys into shares on small grids."""
    return family in ("wgmma", "mma", "tf32", "f64")


def forward_resident_blocks(tiles, sm_count: int) -> int:
    """The blocks of a tensor-core forward's tiles that the GPU holds at once."""
    return sm_count * getattr(tiles, "blocks_per_sm", 1)


def forward_key_splits(choice: Choice, shape: DecodeShape,
                       most_splits: int = FORWARD_MAX_SPLITS) -> tuple[int, str | None]:
    """Into how many key shares a dense tensor-core forward cuts each query tile, and why
    (None where it does not). Not for tile sizes a caller named (the callers check)."""
    if not cuts_key_shares(choice.family):
        return 1, None
    tiles = choice.tiles
    blocks = shape.batch_q_heads * -(-shape.n_q // tiles.block_q)
    resident = forward_resident_blocks(tiles, shape.sm_count)
    splits = key_shares(blocks, resident, shape.band_keys, tiles.block_k, most_splits)
    if splits == 1:
        return 1, None
    return splits, (f"keys cut into {splits} shares: {blocks} query tiles fill "
                    f"{blocks / resident:.2f} of a wave of {resident} resident blocks")


def dq_key_splits(tiles: WgmmaBackwardTiles | MmaBackwardTiles, shape: DecodeShape) -> int:
    """Into how many key shares a dense tensor-core backward's dQ kernel (one block an SM)
    cuts each query tile; its dK/dV kernels walk the queries of a key tile, whose grid
    grows with the keys."""
    owned, streamed = tiles.dq
    blocks = shape.batch_q_heads * -(-shape.n_q // owned)
    return key_shares(blocks, shape.sm_count, shape.band_keys, streamed)


def with_key_splits(choice: Choice, shape: DecodeShape,
                    most_splits: int = FORWARD_MAX_SPLITS) -> Choice:
    """`choice` with the key splits of `forward_key_splits` (and their reason in its note)."""
    splits, why = forward_key_splits(choice, shape, most_splits)
    if splits == 1:
        return choice
    return replace(choice, key_splits=splits, note=f"{choice.note}; {why}")


# --------------------------------------------------------------------------- wide GQA decode
# A decode step (one query row a head) of a GQA or MQA model whose heads are wider than the
# tensor-core decode's (MAX_TENSOR_CORE_DIM) ran on the CUDA-core decode kernel, bound by its
# products, or, for more rows than it takes, on the prefill with one row of each 64-row tile
# in use, reading K and V once per query head: multi-head latent attention's absorbed decode
# (D = 576, Dv = 512, one K/V head, float16, H100) took 0.234 ms at B 8 with 16 query heads
# over 8k keys (a fifth of the memory's bandwidth) and 2.2 ms at B 1 with 128.
# A group's query heads read the same K and V and, with one row each under a mask that
# keeps the same keys for all of them (the keys outside it are sliced off, not masked),
# are the rows of one head: q (B, Hq, 1, D) is q (B, Hkv, group, D) without a copy, and
# the mma.sync prefill, which serves widths to MAX_WIDE_DIM, runs it with its key shares
# (launch_forward._fold_group). Its O, 16 rows a warp by Dv = 512 columns, is 256 floats a
# thread: the mma.sync forward at 576/512 spills 1.2 KB (ptxas), at 576/256 it uses 242
# registers and none, so wider values run in launches of column slices (V and O views), each
# recomputing S and writing the same lse: 1.4-1.8x faster than one launch (H200, float16,
# bench/experiments/wide_decode_gpu.py, NOTES-gpu v37). Against the unfolded call: 128 query
# heads 13-77x faster at B 1-8; 16 query heads 1.3-2.0x from a wave of folded blocks on
# (B 8-16 over 8k keys, B 1 over 64k, B 4 over 32k); under a wave (B 1-4 over 8k keys:
# 16-64 blocks) the decode kernel's many splits won in one run (the fold at 0.56-0.80x of
# it), while in another the fold took B 4 by 1.20x. A decode's share may hold fewer keys
# than a prefill tile's (FOLD_MAX_SPLITS, not FORWARD_MAX_SPLITS: its partials are a few
# rows), so one long sequence fills a wave too.
FOLD_MIN_WAVE = 0.9  # against the decode kernel: folded grids (key shares included) under
# this share of a wave of resident blocks stay on it
FOLD_MAX_SPLITS = 128
FOLD_VALUE_COLUMNS = 256
# Speculative decoding's few query rows (multi-token prediction: 2) fold one row at a time,
# each over the keys its row keeps (a causal row's differ), a launch per row and slice;
# only where each row's group fills the prefill's 64-row tiles: a group of 128 query heads
# went to the prefill one row of each tile (13-77x slower than folded at one row), whereas
# 16 heads x Nq rows stay on the decode kernel (one launch, K/V read once). The folds' time
# grows with the rows and the prefill's does not (a tile holds up to 64 rows of a head):
# from one row's measured ratio (B 1, 128 heads, 8k keys: 2.3 ms against 0.13-0.18) they
# would meet at about 12 rows, so only up to 4 fold. Two rows, H200 (v38): 8.4-31.6x the
# unfolded call at B 1-4 over 8k-32k keys.
FOLD_MAX_QUERY_ROWS = 4
FOLD_GROUP_PER_ROW = 64


def fold_value_slices(value_dim: int) -> tuple[tuple[int, int], ...]:
    """The column ranges of V and O a folded decode runs one launch each: as few as keep
    each within FOLD_VALUE_COLUMNS, of equal widths rounded up to 16 (the last may be
    narrower, so the first is the widest)."""
    count = -(-value_dim // FOLD_VALUE_COLUMNS)
    width = 16 * -(-value_dim // (16 * count))
    return tuple((start, min(start + width, value_dim)) for start in range(0, value_dim, width))


def folds_group_rows(dtype: str, head_dim: int, value_dim: int, n_q: int, group: int,
                     per_row_options: bool, named_blocks: bool) -> bool:
    """Whether a forward of this shape is a wide GQA decode that folds its group's query
    heads into query rows (the problem's mask must also keep a key for each of its rows)."""
    rows_fold = n_q == 1 or (n_q <= FOLD_MAX_QUERY_ROWS and group >= FOLD_GROUP_PER_ROW)
    return (rows_fold and group > 1 and dtype in ("float16", "bfloat16")
            and not per_row_options and not named_blocks
            and MAX_TENSOR_CORE_DIM < max(head_dim, value_dim) <= MAX_WIDE_DIM)


# GQA decodes of many packed rows at the tensor-core head dims fold too: 64 packed rows
# (MQA with Nq 8, a group of 64 query heads) decode on mma.sync m16 tiles at 0.60-0.83 of
# copy bandwidth, bound by their products (bench/NOTES-gpu.md v55). Folded into the rows of
# one head they run on the wgmma prefill's 64-row tiles, K and V still read once per K/V
# head: a query row alone over the keys it keeps (any mask, as above), or every query row at
# once where no mask cuts the keys (the view needs each head's rows to follow one another,
# as a "bhsd" array's do). H200, whole calls at >= 256 MiB (NOTES-gpu v57): 1.04-1.22x the
# decode at D 64 and D 256, level at D 128 from 512 MiB up; kernels alone over 128 MiB at
# D 128, 1.13-1.29x. Grids that fill less of a wave than the decode's stay on it
# (FOLD_MIN_WAVE: B 1 over 256k keys).
FOLD_DECODE_ENABLED = True
FOLD_DECODE_MIN_ROWS = 64
FOLD_DECODE_MAX_QUERY_ROWS = 16
# Key shares of such a fold: each writes 64 rows of float32 partials that one merge reads
# back, and a single long sequence in 122 shares ran 1.7x the decode's time (B1 H8/1 Nq8
# Nk256k D128); at most 32 shares, such grids fill under FOLD_MIN_WAVE and stay unfolded.
FOLD_DECODE_MAX_SPLITS = 32
# (widest padded head dim, most folded rows, tiles), the first that holds the problem; at
# D 128 the overlapped schedule (one block an SM, 128 keys a tile) wins at 64 rows, two
# blocks of 64 keys at 128 rows (twice the row tiles fill the SMs with fewer key shares).
# Dims padded to 80-112 stay on the decode (no tiles): at 320-448 MiB (B8 H8/1 Nq8 Nk128k)
# the decode ran 110 / 122 / 135 us at D 80 / 96 / 112, the best fold 123 / 120 / 161.
# An overlapped row serves only head dims and value dims both padded to its width: ptxas
# spills 4-144 bytes of its registers at 96 or 112 wide dims (beside 128 too), and an
# overlapped kernel must not spill, its accumulators being written by wgmma in flight.
FOLD_DECODE_TILES = ((64, None, WgmmaTiles(64, 128, 2, 2)),
                     (112, None, None),
                     (128, 64, WgmmaTiles(64, 128, 3, 1, overlap=True)),
                     (128, None, WgmmaTiles(64, 64, 3, 2)),
                     (256, None, WgmmaTiles(64, 32, 2, 2)))


def folds_decode_rows(dtype: str, head_dim: int, value_dim: int, n_q: int, group: int,
                      masked: bool, per_row_options: bool, named_blocks: bool) -> bool:
    """Whether a forward of this shape is a GQA decode at the tensor-core head dims whose
    packed rows fold into the rows of one head, where FOLD_DECODE_ENABLED (the caller's
    test, ahead of the work of asking); several query rows fold only where no mask cuts
    their keys (`masked`: causal or a window)."""
    return (group > 1 and dtype in ("float16", "bfloat16")
            and FOLD_DECODE_MIN_ROWS <= group * n_q and n_q <= FOLD_DECODE_MAX_QUERY_ROWS
            and (n_q == 1 or not masked) and not per_row_options and not named_blocks
            and max(head_dim, value_dim) <= MAX_TENSOR_CORE_DIM)


def _fold_decode_tiles(problem: Problem, rows: int) -> WgmmaTiles | None:
    dims = (padded(problem.head_dim, 16), padded(problem.value_dim, 16))
    return next(tiles for width, most_rows, tiles in FOLD_DECODE_TILES
                if max(dims) <= width and (most_rows is None or rows <= most_rows)
                and (tiles is None or not tiles.overlap or dims == (width, width)))


def folded_choice(problem: Problem, shape: DecodeShape, decodes: bool) -> Choice | None:
    """The tensor-core prefill's choice for a folded decode (`problem` and `shape` those of
    the folded problem: `group` rows in each of B x Hkv heads, no mask), or None where it
    is no tensor-core family, or where the unfolded problem `decodes` (takes the decode
    kernel) and the folded grid, key shares included, fills under FOLD_MIN_WAVE of a wave.
    Head dims the tensor-core decode serves take FOLD_DECODE_TILES on sm_90."""
    if max(problem.head_dim, problem.value_dim) <= MAX_TENSOR_CORE_DIM:
        fold_tiles = _fold_decode_tiles(problem, shape.n_q) if problem.capability >= 90 else None
        if fold_tiles is None:
            return None
        choice = with_key_splits(Choice("wgmma", fold_tiles, "FOLD_DECODE_TILES"), shape,
                                 FOLD_DECODE_MAX_SPLITS)
    else:
        choice = with_key_splits(choose_forward(problem), shape, FOLD_MAX_SPLITS)
    if choice.family not in ("wgmma", "mma"):
        return None
    tiles = choice.tiles
    blocks = shape.batch_q_heads * -(-shape.n_q // tiles.block_q) * choice.key_splits
    if decodes and blocks < FOLD_MIN_WAVE * forward_resident_blocks(tiles, shape.sm_count):
        return None
    return replace(choice, note=f"{choice.note}; the GQA group's query heads folded into "
                                f"{shape.n_q} query rows of each K/V head")


def backward_group_note(problem: Problem, shape: DecodeShape) -> str | None:
    """Where a dense backward's GQA grid is too small for the single pass or the two kernels
    uncut (`backward_group_splits`), a line saying whether the two kernels cut each group
    over blocks (not over a 16-bit query tail, whose keys are flagged instead) and what the
    single pass does there (`takes_single_pass`), else None."""
    choice = choose_backward(problem)
    if choice.family == "generic" or shape.group == 1:
        return None
    key_blocks = _dense_key_blocks(problem, shape)
    splits = backward_group_splits(key_blocks, shape.group, shape.sm_count)
    if splits == 1:
        return None
    if _flags_query_tail(problem, shape):
        line = (f"dK/dV: each group of {shape.group} query heads stays whole over "
                f"{key_blocks} key-tile blocks (a 16-bit query tail flags keys for a redo "
                f"instead of cutting the groups over blocks)")
    else:
        line = (f"dK/dV: each group of {shape.group} query heads cut over {splits} blocks "
                f"({key_blocks} key-tile blocks are under {BACKWARD_GROUP_WAVES} waves of "
                f"{shape.sm_count} SMs)")
    if _single_pass_fits(problem):
        who = ("float32 (either setting of deterministic)"
               if runs_single_pass(problem.dtype, True) else "deterministic=False")
        line += (f"; {who} runs the single pass uncut (its blocks fill "
                 f"at least {SINGLE_PASS_WAVE_FILL:.0%} of their waves)"
                 if takes_single_pass(key_blocks, shape.group, shape.sm_count)
                 else f"; {who} too (the single pass would leave SMs idle)")
    return line


def describe_with_decode(problem: Problem, shape: DecodeShape | None) -> dict[str, str]:
    """`describe`, for the grid of `shape` where given: the forward line naming the decode
    family or the key shares where they run, the backward line the single pass, the GQA
    group's cut and the dQ kernel's key shares where this grid takes them (as
    launch_backward decides)."""
    if shape is None:
        return describe(problem)
    lines = describe(problem)
    choice = choose_decode(problem, shape)
    if choice is not None:
        lines["forward"] = f"decode {choice.tiles} ({choice.note})"
    elif not problem.named_blocks:
        lines["forward"] = _choice_line(with_key_splits(choose_forward(problem), shape))
    lines["backward"] = describe_backward(problem, shape)
    return lines


def describe_backward(problem: Problem, shape: DecodeShape) -> str:
    """The backward line of a dense call of `shape`: the family, its tiles and note, then
    which kernels each setting of ``deterministic`` runs on this grid."""
    choice = choose_backward(problem)
    line = _choice_line(choice)
    if choice.family == "generic":
        return line
    # A setting runs the single pass where it serves the tiles and fills this grid
    # (launch_backward.backward_mma; the wgmma backward never takes it by default).
    single = (_single_pass_fits(problem) and takes_single_pass(
        _dense_key_blocks(problem, shape), shape.group, shape.sm_count))
    if single:
        line += f"; {_single_pass_clause(problem.dtype)}"
    note = backward_group_note(problem, shape)
    if note is not None:
        line += f"; {note}"
    if single and runs_single_pass(problem.dtype, True):
        return line  # no dQ kernel under either setting
    splits = dq_key_splits(choice.tiles, shape)
    if splits > 1:
        who = " (deterministic=True)" if single else ""
        line += f"; dQ{who}: keys cut into {splits} shares (a small grid)"
    return line
