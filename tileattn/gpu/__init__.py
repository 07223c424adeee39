"""The GPU backend (``backend="gpu"``): CUDA kernels compiled at run time with NVRTC
through CuPy, for CuPy arrays.

Forward: for float16/bfloat16 with head dims 64 and 128 a fused tensor-core kernel, on
Hopper (sm_90) the wgmma kernel (attention_wgmma_forward.cu, compiled for sm_90a), on other
sm_80+ GPUs the mma.sync one (attention_mma_forward.cu); for float32 with D = Dv in
{64, 128} on sm_80+ a tensor-core kernel at float32 accuracy (attention_tf32_forward.cu:
each float32 product as three TF32 products, "3xTF32", as torch's memory-efficient
attention does; an infinite input comes out as NaN in the rows it reaches); a CUDA-core
kernel for everything else (float64, other head dims up to 256). Backward: first
``D_i = rowsum(dO_i * o_i)`` from the passed ``o`` (attention_backward_delta.cu, SPEC's D),
then for float16/bfloat16 with D = Dv in {64, 128} (and no tile size named by the caller)
two tensor-core kernels (wgmma on Hopper, mma.sync elsewhere), for float32 with those head
dims two 3xTF32 ones, otherwise two CUDA-core ones: the first computes dQ per query tile,
the second dK/dV per key tile, summing a GQA group in-block; 7 tile products per (query
tile, key tile). Nothing depends on scheduling.

``deterministic=False`` on sm_80 GPUs other than Hopper runs FlashAttention-2's single pass
instead: no dQ kernel; the dK/dV kernel also adds each key tile's dQ share into a float32
buffer with atomics (5 tile products per (query tile, key tile) instead of 7,
``4 * B * Hq * Nq * D`` bytes of extra memory, dq's last bits vary from run to run). On
Hopper the two deterministic kernels are faster than the single pass (its dS^T staging and
barriers cost more than the products it saves), so both settings run them there.
bench/NOTES-gpu.md has the measured speeds.

Kernels are compiled once per (device, dtype, head dims, tile sizes, option switches) and
cached; the first call of a configuration pays a compile (about a second). The launches of
a problem (its kernels, grids and scalar arguments) are cached too, per shapes, strides and
options (not with ALiBi or dropout), so a repeated call costs ~50 us of host time forward
and ~90 us backward on the H100 machine.

Importing this module does not import CuPy; `availability` says whether it can run.
"""

from __future__ import annotations

import numpy as np

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


def forward(q, k, v, options: AttentionOptions):
    """``(o, lse)`` for CuPy arrays ``q (B, Hq, Nq, D)``, ``k (B, Hkv, Nk, D)``,
    ``v (B, Hkv, Nk, Dv)``; see `tileattn.backends` for the contract."""
    from . import _launch

    with q.device:
        return _launch.forward(q, k, v, options)


def backward(do, q, k, v, o, lse, options: AttentionOptions):
    """``(dq, dk, dv)`` for CuPy arrays; see `tileattn.backends` for the contract."""
    from . import _launch

    with q.device:
        return _launch.backward(do, q, k, v, o, lse, options)


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


def tile_sizes(n_q: int, n_k: int, head_dim: int, value_dim: int, dtype) -> dict[str, Blocks]:
    """Default tiles on the current device: the tensor-core kernels' (wgmma on Hopper) for
    float16/bfloat16 with D = Dv in {64, 128} (backward: the dK/dV kernel's, keys owned by a
    block x queries streamed), the float32 tensor-core forward's for float32 with those
    head dims, else the generic kernels' capacity for the shared-memory budget."""
    import cupy

    from . import _launch

    if (np.dtype(dtype).name in ("float16", "bfloat16") and head_dim == value_dim
            and head_dim in _launch.MMA_HEAD_DIMS):
        if _launch.compute_capability(cupy.cuda.Device().id) == 90:
            forward = _launch.WGMMA_DEFAULT_TILES[head_dim]
            keys_owned, queries_streamed = _launch.WGMMA_BACKWARD_TILES[head_dim].dkdv
            return {"forward": Blocks(forward.block_q, forward.block_k),
                    "backward": Blocks(block_q=queries_streamed, block_k=keys_owned)}
        keys_owned, queries_streamed = _launch.MMA_BACKWARD_TILES[head_dim]["dkdv"]
        return {"forward": _launch.MMA_DEFAULT_BLOCKS[head_dim],
                "backward": Blocks(block_q=queries_streamed, block_k=keys_owned)}
    capacity = _launch.GenericConfig.for_problem(dtype, head_dim, value_dim,
                                                 AttentionOptions()).capacity
    float32_tiles = None
    if np.dtype(dtype).name == "float32":  # tf32_tiles reads the arrays' dtype and shapes
        float32_tiles = _launch.tf32_tiles(cupy.empty((1, 1, 1, head_dim), dtype=dtype),
                                           cupy.empty((1, 1, 1, value_dim), dtype=dtype),
                                           AttentionOptions())
    if float32_tiles is not None:
        return {"forward": Blocks(float32_tiles.block_q, float32_tiles.block_k),
                "backward": capacity}
    return {"forward": capacity, "backward": capacity}
