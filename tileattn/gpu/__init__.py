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
  cores (attention_decode_mma.cu, ALiBi included), the rest, wider heads and dropout on
  CUDA cores (attention_decode.cu; launch_decode.py for both).

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

from dataclasses import dataclass

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
    operands._SEQUENCE_PLANS.clear()
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


class _Shaped:
    """What dispatch reads of an array (`launch_forward.choose`, `launch_decode.decode_shape`):
    its shape, dtype and device, without memory; `describe` asks dispatch itself."""

    def __init__(self, shape: tuple, dtype, device_id: int):
        self.shape, self.dtype = tuple(shape), dtype
        self.device = _Device(device_id)


@dataclass(frozen=True)
class _Device:
    id: int


@dataclass(frozen=True)
class _ForwardRun:
    """The forward a dense call of some shape runs: dispatch's `choice`, or where it folds a
    wide GQA decode, each query row's ``(kept keys, folded choice)`` in `folds`."""

    choice: object
    folds: tuple = ()


def _arrays(n_q, n_k, head_dim, value_dim, dtype, heads, kv_heads, batch):
    import cupy

    device = cupy.cuda.Device().id
    return (_Shaped((batch, heads, n_q, head_dim), dtype, device),
            _Shaped((batch, kv_heads, n_k, head_dim), dtype, device),
            _Shaped((batch, kv_heads, n_k, value_dim), dtype, device))


def _forward_run(q, k, v, options: AttentionOptions) -> _ForwardRun:
    """What `launch_forward.forward` runs for arrays of these shapes."""
    from .launch_forward import choose

    folds = _folds(q, k, v, options)
    return _ForwardRun(folds[0][1], folds) if folds else _ForwardRun(choose(q, k, v, options))


def _folds(q, k, v, options: AttentionOptions):
    """Each query row's ``(kept keys, choice)`` where `launch_forward.forward` folds a GQA
    decode (`_forward_folded_rows`: one fold a row, over the keys that row keeps, or none
    at all where a row keeps no key or declines its fold; unmasked rows at the tensor-core
    head dims in one fold), else None."""
    from .launch_forward import choose, fold_choice, fold_rows, may_fold, unmasked
    from .tiles import MAX_TENSOR_CORE_DIM

    if not may_fold(q, k, v, options):
        return None
    batch, heads, n_q, head_dim = q.shape
    kv_heads, n_k, value_dim = k.shape[1], k.shape[2], v.shape[3]
    decodes = choose(q, k, v, options).family == "decode"
    if n_q > 1 and max(head_dim, value_dim) <= MAX_TENSOR_CORE_DIM:
        # Unmasked rows at the tensor-core head dims fold at once (a "bhsd" call's).
        folded_q = _Shaped((batch, kv_heads, heads // kv_heads * n_q, head_dim), q.dtype,
                           q.device.id)
        choice = fold_choice(folded_q, k, value_dim, unmasked(options), decodes)
        return None if choice is None else ((n_k, choice),)
    folded_q = _Shaped((batch, kv_heads, heads // kv_heads, head_dim), q.dtype, q.device.id)
    folds = []
    for alone, low, high in fold_rows(options, n_q, n_k):
        if low >= high:
            return None
        cut_k = _Shaped((batch, kv_heads, high - low, head_dim), q.dtype, q.device.id)
        choice = fold_choice(folded_q, cut_k, value_dim, unmasked(alone), decodes)
        if choice is None:
            return None
        folds.append((high - low, choice))
    return tuple(folds)


def _fold_line(folds: tuple, value_dim: int) -> str:
    from .tiles import fold_value_slices

    choice = folds[0][1]
    slices = fold_value_slices(value_dim)
    line = f"{choice.family} {choice.tiles} ({choice.note}"
    if len(slices) > 1:
        line += f"; V and O in {len(slices)} launches of up to {slices[0][1]} columns"
    if len(folds) > 1:
        keys = ", ".join(str(kept) for kept, _ in folds)
        shares = ", ".join(str(folded.key_splits) for _, folded in folds)
        line += (f"; each of the {len(folds)} query rows folded on its own, over its own "
                 f"keys ({keys}) in key shares ({shares})")
    return line + ")"


def _generic_refusal(dtype, head_dim: int, value_dim: int, options: AttentionOptions,
                     direction: str) -> str | None:
    """Why the CUDA-core kernels of `direction` refuse these head dims on the current device
    (`GenericConfig.kernel` raises it as a ValueError), or None where they run."""
    import cupy

    from .launch_forward import GENERIC_ENTRIES, GenericConfig, _generic_shared_bytes
    from .operands import accumulation_dtype, shared_memory_limit

    config = GenericConfig.for_problem(dtype, head_dim, value_dim, options, direction)
    shared = _generic_shared_bytes(accumulation_dtype(config.dtype).itemsize, config.head_pad,
                                   config.value_pad, config.capacity.block_q,
                                   config.capacity.block_k)
    limit = shared_memory_limit(cupy.cuda.Device().id)
    for entry in GENERIC_ENTRIES[direction]:
        if shared[entry] > limit:
            return (f"not served on the GPU (backend='cpu'): head dims {config.head_pad}/"
                    f"{config.value_pad} (padded) in {config.dtype} need "
                    f"{shared[entry] // 1024} KiB of shared memory a block for {entry} on "
                    f"the CUDA-core kernels; this device offers {limit // 1024} KiB")
    return None


def describe(n_k: int, head_dim: int, value_dim: int, dtype,
             options: AttentionOptions | None = None, *, n_q: int | None = None,
             heads: int = 1, kv_heads: int | None = None, batch: int = 1) -> dict[str, str]:
    """The kernel family and tile-table row each direction runs for this shape on the current
    device, and why (`tiles.describe`); given `n_q` (and the heads and batch), what a dense
    call of that shape runs, as dispatch chooses it: the split-KV decode kernel, key shares,
    a folded wide decode (`launch_forward.choose` and the fold's own choice), the backward's
    single pass, group cut and dQ shares (`tiles.describe_backward`)."""
    from .launch_decode import decode_shape
    from .tiles import choose_backward, describe_with_decode

    options = options or AttentionOptions()
    if n_q is None:
        return describe_with_decode(_problem(n_k, head_dim, value_dim, dtype, options), None)
    kv_heads = heads if kv_heads is None else kv_heads
    q, k, v = _arrays(n_q, n_k, head_dim, value_dim, dtype, heads, kv_heads, batch)
    # The forward's grid picks rows of its table; no backward row reads it.
    problem = _problem(n_k, head_dim, value_dim, dtype, options, batch * heads, n_q)
    lines = describe_with_decode(problem, decode_shape(q, k, options))
    run = _forward_run(q, k, v, options)
    if run.folds:
        lines["forward"] = _fold_line(run.folds, value_dim)
    else:
        choice = run.choice
        tiles = "" if choice.tiles is None else f" {choice.tiles}"
        lines["forward"] = f"{choice.family}{tiles} ({choice.note})"
    for direction, family in (("forward", run.choice.family),
                              ("backward", choose_backward(problem).family)):
        refusal = (_generic_refusal(dtype, head_dim, value_dim, options, direction)
                   if family == "generic" else None)
        if refusal is not None:
            lines[direction] = refusal
    return lines


def tile_sizes(n_q: int, n_k: int, head_dim: int, value_dim: int, dtype,
               query_heads: int = 0, options: AttentionOptions | None = None, *,
               kv_heads: int | None = None, batch: int = 1) -> dict[str, Blocks | None]:
    """The tiles each direction of a dense call runs on the current device (`query_heads` =
    B x Hq heads, `kv_heads` K/V heads a batch element): the forward's query x key tile of
    the kernel dispatch chooses (the decode kernel: every packed row of a K/V head against
    its key tiles; a folded decode: its prefill's), the backward's dK/dV kernel's (keys owned
    by a block x queries streamed), the generic kernels' tiles where they run; None for a
    direction the GPU does not serve (`describe` says why)."""
    from .launch_forward import GenericConfig
    from .tiles import choose_backward

    options = options or AttentionOptions()
    heads = max(1, query_heads // batch)
    kv_heads = heads if kv_heads is None else kv_heads
    q, k, v = _arrays(n_q, n_k, head_dim, value_dim, dtype, heads, kv_heads, batch)

    def generic(direction):
        if _generic_refusal(dtype, head_dim, value_dim, options, direction):
            return None
        return GenericConfig.for_problem(dtype, head_dim, value_dim, options,
                                         direction).blocks(options)

    choice = _forward_run(q, k, v, options).choice
    if choice.family == "generic":
        forward = generic("forward")
    elif choice.family == "decode":
        forward = Blocks(n_q, choice.tiles.block_k)
    else:
        forward = Blocks(choice.tiles.block_q, choice.tiles.block_k)
    choice = choose_backward(_problem(n_k, head_dim, value_dim, dtype, options, n_q=n_q))
    if choice.family == "generic":
        backward = generic("backward")
    else:
        keys_owned, queries_streamed = choice.tiles.dkdv
        backward = Blocks(block_q=queries_streamed, block_k=keys_owned)
    return {"forward": forward, "backward": backward}
