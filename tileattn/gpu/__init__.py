"""The GPU backend (``backend="gpu"``): CUDA kernels compiled at run time with NVRTC
through CuPy, for CuPy arrays.

Four kernel families; `tiles` chooses one per problem and direction from its table, and
``python -m tileattn info`` (or `describe`) shows the choice:

* float16/bfloat16 on Hopper (sm_90): wgmma tensor-core kernels (attention_wgmma_*.cu);
* float16/bfloat16 on other sm_80+ GPUs: mma.sync ones (attention_mma_*.cu);
* float32 on sm_80+: the mma.sync kernels on TF32 tensor cores at float32 accuracy
  ("3xTF32": each float32 product as three TF32 products, as torch's memory-efficient
  attention does; infinities follow IEEE as SPEC asks, tf32.cuh says how);
* everything else (float64, head dims beyond the tensor-core rows, older GPUs, tile sizes
  the caller names that no tensor-core kernel is built for): CUDA-core kernels
  (attention_generic.cu);
* forward decoding, every dtype on sm_80+ (a few query rows per K/V head, group x Nq <= 64,
  against >= 256 keys; up to 128 packed rows in 16-bit where the prefill grid leaves SMs
  idle; MHA only up to 16 queries, 32 in float32): split-KV with GQA packing, K/V read
  once per group, partials merged by log-sum-exp; 16-bit inputs up to D = 256 on tensor
  cores (attention_decode_mma.cu), the rest, wider heads and ALiBi or dropout on CUDA
  cores (attention_decode.cu; launch_decode.py for both).

A dense tensor-core forward whose query tiles fill under 0.8 of a wave (a chunk of queries
against a long cache, few heads) cuts each tile's keys into shares, blocks of their own,
merged by log-sum-exp (split_keys_merge.cu); the backward's dQ kernel does the same, its
parts added in a fixed order (group_sum.cu). `tiles.forward_key_splits` and
`tiles.dq_key_splits` choose the share counts.

The tensor-core kernels take every D and Dv up to 256 (Dv != D included), and the mma.sync
and 3xTF32 ones wider heads with Q read from shared memory (tiles.MAX_WIDE_DIM,
tiles.WIDE_BACKWARD_DIM): head dims are zero-padded in shared memory to the tensor cores' K
step (16, or 8 for TF32), and the caller's arrays are read in place with the widest copies
their alignment allows.

Backward: first ``D_i = rowsum(dO_i * o_i)`` from the passed ``o``
(attention_backward_delta.cu, SPEC's D), then a dQ kernel per query tile and a dK/dV kernel
per key tile that sums a GQA group in-block (two, dK and dV apart, where both accumulators
do not fit the registers): 7 tile products per (query tile, key tile), nothing depending on
scheduling. ``deterministic=False`` on sm_80 GPUs other than Hopper runs FlashAttention-2's
single pass instead (no dQ kernel; dQ added into a float32 buffer with atomics, 5 products,
``4 * B * Hq * Nq * D`` bytes of extra memory, dq's last bits vary from run to run). On
Hopper the two deterministic 16-bit kernels are faster than the single pass, so both
settings run them there. float32 runs the single pass under both settings: by default the
key blocks that share a query tile add their dQ shares in turns, in a fixed order (a
counter per query tile), so dq is bitwise reproducible; ``deterministic=False`` adds them
in arrival order. Where a GQA grid is too small for the single pass, the two kernels cut
its groups over blocks instead. bench/NOTES-gpu.md has the measured speeds.

Kernels are compiled once per (device, dtype, head dims, tile sizes, option switches) and
cached; the first call of a configuration pays a compile (about a second). The launches of
a problem (its kernels, grids and scalar arguments) are cached too, per shapes, strides and
options (not with ALiBi or dropout), so a repeated call costs ~50 us of host time forward
and ~90 us backward on the H100 machine.

Importing this module does not import CuPy; `availability` says whether it can run.
"""

from __future__ import annotations

from ..options import AttentionOptions, Blocks

MEMORY = "cuda"


def availability() -> str | None:
    """None when CuPy imports and sees a CUDA device, else the reason."""
    try:
        import cupy
    except ImportError as error:
        return f"CuPy is not importable ({error}); pip install 'tileattn[gpu]'"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as error:
        return f"CuPy found no usable CUDA device ({error})"
    if count == 0:
        return "CuPy found no CUDA device"
    return None


WRITES_OUT = True  # the kernels write into the caller's output buffers (`tileattn.backends`)
# The forward kernels write o's rows at any batch, head and row strides: a "bshd" result is
# allocated in the caller's layout and written in place (`tileattn.backends`).
STRIDED_OUT = True
VARLEN = True  # variable-length and paged calls (`tileattn.backends`, gpu/varlen.py)


def forward(q, k, v, options: AttentionOptions, out=None, lse_out=None):
    """``(o, lse)`` for CuPy arrays ``q (B, Hq, Nq, D)``, ``k (B, Hkv, Nk, D)``,
    ``v (B, Hkv, Nk, Dv)``; see `tileattn.backends` for the contract."""
    from . import launch_forward

    with q.device:
        return launch_forward.forward(q, k, v, options, out, lse_out)


def backward(do, q, k, v, o, lse, options: AttentionOptions, dq_out=None, dk_out=None,
             dv_out=None):
    """``(dq, dk, dv)`` for CuPy arrays; see `tileattn.backends` for the contract."""
    from . import launch_backward

    with q.device:
        return launch_backward.backward(do, q, k, v, o, lse, options,
                                        (dq_out, dk_out, dv_out))


def replay(function_name: str, tensors: dict, options: AttentionOptions, allocate=None,
           outputs=None):
    """The call just run on these validated arrays (and output buffers, the backend's views),
    repeatable on new device addresses (`replays.Replay`; its scratch from
    ``allocate(bytes) -> address`` where given), or None where its plan is not cached."""
    from .replays import replay as make

    with tensors["q"].device:
        return make(function_name, tensors, options, allocate, outputs or {})


def clear_plans() -> None:
    """Forgets the launches planned by earlier calls and the tile choices made for their
    problems (the registry's `clear_plans`)."""
    from . import operands, tiles

    operands._PLANS.clear()
    tiles.choose_forward.cache_clear()
    tiles.choose_backward.cache_clear()


def hardware() -> dict[str, str]:
    """The current device as `python -m tileattn info` shows it."""
    import cupy

    device = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(device.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return {
        "device": f"{name} (sm_{device.compute_capability}), {props['multiProcessorCount']} SMs",
        "shared memory per block": f"{props['sharedMemPerBlockOptin'] // 1024} KiB (opt-in)",
        "L2 cache": f"{props['l2CacheSize'] // 1024**2} MiB",
        "memory": f"{device.mem_info[1] / 1e9:.1f} GB",
    }


def _problem(n_k: int, head_dim: int, value_dim: int, dtype, options: AttentionOptions,
             query_heads: int = 0, n_q: int = 0):
    import cupy

    from .operands import problem_for

    return problem_for(cupy.cuda.Device().id, dtype, head_dim, value_dim, n_k, options,
                       query_heads, n_q)


def describe(n_k: int, head_dim: int, value_dim: int, dtype,
             options: AttentionOptions | None = None, *, n_q: int | None = None,
             heads: int = 1, kv_heads: int | None = None, batch: int = 1) -> dict[str, str]:
    """The kernel family and tile-table row each direction runs for this shape on the current
    device, and why (`tiles.describe`); given `n_q` (and the heads and batch), the forward
    line names the split-KV decode kernel where it runs (`tiles.choose_decode`)."""
    import cupy

    from .launch_decode import band_keys
    from .operands import sm_count
    from .tiles import DecodeShape, describe_with_decode

    options = options or AttentionOptions()
    shape = None
    grid = (0, 0)
    if n_q is not None:
        kv_heads = heads if kv_heads is None else kv_heads
        shape = DecodeShape(n_q=n_q, group=heads // kv_heads, batch_kv_heads=batch * kv_heads,
                            batch_q_heads=batch * heads, band_keys=band_keys(options, n_q, n_k),
                            sm_count=sm_count(cupy.cuda.Device().id))
        grid = (batch * heads, n_q)
    lines = describe_with_decode(_problem(n_k, head_dim, value_dim, dtype, options, *grid),
                                 shape)
    folded = (None if shape is None
              else _folded_line(options, shape, n_k, head_dim, value_dim, dtype))
    if folded is not None:
        lines["forward"] = folded
    return lines


def _folded_line(options: AttentionOptions, shape, n_k: int, head_dim: int, value_dim: int,
                 dtype):
    """The forward line of a wide GQA decode that folds its group into query rows
    (`launch_forward._fold_group`), else None."""
    from .launch_forward import folds_group, unmasked
    from .tiles import DecodeShape, choose_decode, fold_value_slices, folded_choice

    if shape.band_keys == 0 or not folds_group(dtype, head_dim, value_dim, shape.n_q,
                                               shape.group, options):
        return None
    folded = DecodeShape(n_q=shape.group, group=1, batch_kv_heads=shape.batch_kv_heads,
                         batch_q_heads=shape.batch_kv_heads, band_keys=shape.band_keys,
                         sm_count=shape.sm_count)
    decodes = choose_decode(_problem(n_k, head_dim, value_dim, dtype, options,
                                     shape.batch_q_heads, shape.n_q), shape) is not None
    slices = fold_value_slices(value_dim)
    widest = slices[0][1]  # (the first slice is the widest)
    choice = folded_choice(_problem(shape.band_keys, head_dim, widest, dtype,
                                    unmasked(options), shape.batch_kv_heads, shape.group),
                           folded, decodes)
    if choice is None:
        return None
    sliced = (f"; V and O in {len(slices)} launches of up to {widest} columns"
              if len(slices) > 1 else "")
    if shape.n_q > 1:
        sliced += f"; each of the {shape.n_q} query rows folded on its own"
    return f"{choice.family} {choice.tiles} ({choice.note}{sliced})"


def tile_sizes(n_q: int, n_k: int, head_dim: int, value_dim: int, dtype,
               query_heads: int = 0, options: AttentionOptions | None = None
               ) -> dict[str, Blocks]:
    """Default tiles on the current device: the forward's query x key tile (for a grid of
    `query_heads` = B x Hq heads where given: rows that go by waves), and the backward's
    dK/dV kernel's (keys owned by a block x queries streamed); the generic kernels'
    capacity where they run."""
    from .launch_forward import GenericConfig
    from .tiles import choose_backward, choose_forward

    options = options or AttentionOptions()
    problem = _problem(n_k, head_dim, value_dim, dtype, options, query_heads,
                       n_q if query_heads else 0)
    capacity = GenericConfig.for_problem(dtype, head_dim, value_dim, options).capacity
    forward_choice, backward_choice = choose_forward(problem), choose_backward(problem)
    forward_tiles = (capacity if forward_choice.tiles is None
                     else Blocks(forward_choice.tiles.block_q, forward_choice.tiles.block_k))
    if backward_choice.tiles is None:
        backward_tiles = capacity
    else:
        keys_owned, queries_streamed = backward_choice.tiles.dkdv
        backward_tiles = Blocks(block_q=queries_streamed, block_k=keys_owned)
    return {"forward": forward_tiles, "backward": backward_tiles}
