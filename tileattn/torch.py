"""PyTorch autograd adapter: ``tileattn.torch.attention(q, k, v, ...)`` is differentiable.

Optional: importing this module imports torch (``import tileattn`` never does). Tensors are
handed to tileattn through DLPack without copying; CPU tensors run on the CPU backend and
CUDA tensors on the GPU backend (``backend="auto"``). The backward pass calls
`tileattn.backward`, recomputing score tiles from the saved log-sum-exp, so only ``o`` and
``lse`` are kept between the passes.
"""

from __future__ import annotations

import torch

from . import api


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, options, deterministic):
        o, lse = api.forward(q, k, v, return_lse=True, **options)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.options = options
        ctx.deterministic = deterministic
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = api.backward(do.to(o.dtype), q, k, v, o, lse, **ctx.options,
                                  deterministic=ctx.deterministic)
        return dq, dk, dv, None, None


def attention(q, k, v, *, causal=False, window=None, scale=None, softcap=None,
              alibi_slopes=None, dropout_p=0.0, seed=None, block_q=None, block_k=None,
              backend="auto", deterministic=True, layout="bhsd"):
    """Differentiable `tileattn.forward` on torch tensors ``(*batch, H, N, D)``, or
    ``(*batch, N, H, D)`` with ``layout="bshd"`` (flash-attn's ``flash_attn_func`` layout).

    Same options as `tileattn.forward`; `deterministic` applies to the backward pass.
    Returns ``o``, a tensor of q's dtype on q's device, in q's layout; with "bshd" it and
    the gradients are strided views of "bhsd" buffers (``.contiguous()`` packs them).
    """
    options = dict(causal=causal, window=window, scale=scale, softcap=softcap,
                   alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed,
                   block_q=block_q, block_k=block_k, backend=backend, layout=layout)
    return _Attention.apply(q, k, v, options, deterministic)
