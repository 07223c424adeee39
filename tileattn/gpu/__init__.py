"""The GPU backend (``backend="gpu"``): CUDA kernels compiled at run time with NVRTC
through CuPy, for CuPy arrays.

Forward: a fused tensor-core kernel (``mma.sync``) for float16/bfloat16 with head dims
64 and 128, a CUDA-core kernel for everything else (float32 without TF32, float64, any
head dim up to 256). Backward: for float16/bfloat16 with D = Dv in {64, 128} (and no tile
size named by the caller) two tensor-core kernels, otherwise two CUDA-core ones; in both
families the first kernel computes dQ per query tile and forms
``D_i = rowsum(dO_i * O_i)`` as ``sum_j P_ij dP_ij / sum_j P_ij`` from the recomputed
probabilities (the same quantity without the rounding of the passed ``o`` to the input
dtype, which for float16 moved dq past its tolerance; ``o`` is not read), then the second
computes dK/dV per key tile, summing a GQA group in-block. Nothing depends on scheduling;
``deterministic=False`` changes nothing here.

Kernels are compiled once per (device, dtype, head dims, tile sizes, option switches) and
cached; the first call of a configuration pays a compile (about a second).

Importing this module does not import CuPy; `availability` says whether it can run.
"""

from __future__ import annotations

from ..options import AttentionOptions

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
