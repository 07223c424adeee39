"""Reference points for benchmarks: naive attention in NumPy/CuPy, and PyTorch SDPA.

The naive versions materialise the ``N x N`` score matrix in the benchmark's dtype, as a
user without a fused kernel would write it, so they also show the O(N^2) memory that tileattn
avoids; but NumPy's float16 matmul has no BLAS kernel (~0.5 GFLOP/s on a core against ~150
in float32: bench's float16 memory sweep at N = 16384 took half an hour), so float16 host
arrays are computed in float32, as a NumPy user would (`naive_dtype`). They are written once
over an array module ``xp`` (NumPy or CuPy).
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np


def naive_dtype(on_host: bool, dtype) -> np.dtype:
    """The dtype the naive anchors compute and hold their N x N matrices in."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if on_host and dtype == np.float16 else dtype


def _mask(xp, n_q, n_k, causal):
    if not causal:
        return None
    rows = xp.arange(n_q)[:, None]
    cols = xp.arange(n_k)[None, :]
    return cols <= rows + (n_k - n_q)


def naive_forward(xp, q, k, v, causal):
    """Softmax attention with the full score matrix; returns ``o`` and ``P``."""
    wide = naive_dtype(xp is np, q.dtype)
    if wide != q.dtype:
        o, probs = naive_forward(xp, *(a.astype(wide) for a in (q, k, v)), causal)
        return o.astype(q.dtype), probs
    scores = (q @ xp.swapaxes(k, -1, -2)) * q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
    mask = _mask(xp, q.shape[-2], k.shape[-2], causal)
    if mask is not None:
        scores = xp.where(mask, scores, -xp.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = xp.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs @ v, probs


def naive_forward_backward(xp, q, k, v, do, causal):
    """Forward and the textbook backward through the stored ``P``."""
    wide = naive_dtype(xp is np, q.dtype)
    if wide != q.dtype:
        results = naive_forward_backward(xp, *(a.astype(wide) for a in (q, k, v, do)), causal)
        return tuple(r.astype(q.dtype) for r in results)
    o, probs = naive_forward(xp, q, k, v, causal)
    dv = xp.swapaxes(probs, -1, -2) @ do
    dp = do @ xp.swapaxes(v, -1, -2)
    ds = probs * (dp - (do * o).sum(axis=-1, keepdims=True))
    ds *= q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
    return o, ds @ k, xp.swapaxes(ds, -1, -2) @ q, dv


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def torch_sdpa(q, k, v, causal, backward=False, do=None):
    """``torch.nn.functional.scaled_dot_product_attention`` on torch tensors (CPU: a
    flash-attention kernel; CUDA: whichever backend torch selects)."""
    import torch

    if not backward:
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return torch.autograd.grad(o, (q, k, v), do)
