"""Compile every CPU kernel ahead of time (``python -m tileattn warmup``)."""

from __future__ import annotations

import contextlib

import numpy as np

from ..options import AttentionOptions

DTYPES = ("float16", "bfloat16", "float32", "float64")
"""What `warmup` accepts; float16 and bfloat16 inputs run on the float32 kernels."""


def _compute_dtypes(dtypes) -> list[np.dtype]:
    if dtypes is None:
        dtypes = DTYPES
    elif isinstance(dtypes, (str, np.dtype, type)):
        dtypes = [dtypes]
    compute = []
    for dtype in dtypes:
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
        if name not in DTYPES:
            raise ValueError(f"warmup dtypes must be among {DTYPES}, got {dtype!r}")
        kernel_dtype = np.dtype(np.float64 if name == "float64" else np.float32)
        if kernel_dtype not in compute:
            compute.append(kernel_dtype)
    return compute


def _takes_16_bit(dtypes, names=("float16", "bfloat16")) -> bool:
    if dtypes is None:
        return True
    if isinstance(dtypes, (str, np.dtype, type)):
        dtypes = [dtypes]
    return any((d if isinstance(d, str) else np.dtype(d).name) in names for d in dtypes)


def _bfloat16_with_pair_products():
    """bfloat16's dtype where its tiled forward and backward multiply in bfloat16 on this
    CPU (kernels of their own), else None."""
    from . import BF16_PAIR_PRODUCTS
    from ..arrays import bfloat16_dtype

    if not BF16_PAIR_PRODUCTS:
        return None
    try:
        return bfloat16_dtype()
    except ImportError:  # no ml_dtypes: no bfloat16 arrays to multiply
        return None


def warmup(dtypes=None, progress=None) -> None:
    """Compile, or load from Numba's on-disk cache, the forward, decode and backward kernels.

    Parameters
    ----------
    dtypes : iterable of dtypes or dtype names, optional
        Among ``float16``, ``bfloat16``, ``float32``, ``float64`` (default: all four). The
        16-bit types share the float32 kernels, and add one step together: the decode path
        over 16-bit K and V; bfloat16 one more where the CPU multiplies its tiled forward
        and backward in bfloat16 (`bf16_products`).
    progress : callable ``progress(done, total, label)``, optional
        Called after each step (``label`` like ``"forward float32"``). While it is given, the
        one-line compile notice on stderr stays silent: the caller shows progress instead.

    Each step runs its kernel once on a tiny problem, which compiles exactly what a real
    call needs (the same argument types) and caches it for later processes: the forward on
    more query rows than the decode path takes (and, for float32, the widening of 16-bit
    inputs and the narrowing of float16 results), the decode path on one row (and the merge of its key splits), the backward
    (and the sum of its dQ parts, `backward_kernel.KEY_PARTS`); for float16 or bfloat16 one
    more step, the decode path reading 16-bit K and V (`decode_kernel`'s widening).
    """
    from . import backward, decode, forward
    from .backward_kernel import sum_key_parts
    from .compile_notice import NOTICE
    from .decode_kernel import merge_kernel
    from .widen import _narrow_kernel, _widen_kernel

    rows = {"forward": decode.MAX_QUERY_ROWS + 1, "decode": 1,
            "backward": decode.MAX_QUERY_ROWS + 1}
    steps = [(kind, dtype) for dtype in _compute_dtypes(dtypes)
             for kind in ("forward", "decode", "backward")]
    if _takes_16_bit(dtypes):
        steps.append(("decode", np.dtype(np.float16)))
    bfloat16 = _bfloat16_with_pair_products()
    if bfloat16 is not None and _takes_16_bit(dtypes, ("bfloat16",)):
        steps.append(("backward", bfloat16))
    options = AttentionOptions()
    with NOTICE.silenced() if progress is not None else contextlib.nullcontext():
        for done, (kind, dtype) in enumerate(steps, start=1):
            q = np.zeros((1, 1, rows[kind], 2), dtype)
            o, lse = forward(q, q, q, options)
            if kind == "decode" and dtype != np.float16:
                # The merge of key splits, which a call of one split never reaches (a
                # 16-bit call's is the float32 one).
                merge_kernel(np.zeros((1,) + o.shape, dtype), np.zeros((1,) + lse.shape, dtype),
                             np.zeros((1,) + lse.shape, dtype), np.empty_like(o),
                             np.empty_like(lse))
            if kind == "forward" and dtype == np.float32:
                # The widening of 16-bit inputs, which tiny arrays leave to NumPy.
                _widen_kernel(np.zeros(1, np.uint16), np.empty(1, np.float32), False, 1,
                              np.zeros(1, np.int64))
                _narrow_kernel(np.zeros(1, np.uint32), np.empty(1, np.uint16), False, 1,
                               np.zeros(1, np.int64))
            if kind == "backward":
                backward(o, q, q, q, o, lse, options)
            if kind == "backward" and dtype != bfloat16:
                # The sum of dQ's parts, which a tiny call on one thread never reaches.
                sum_key_parts(np.zeros((1,) + q.shape, dtype), np.empty(q.shape, dtype),
                              np.zeros(1, np.int64))
            if progress is not None:
                label = "16-bit" if dtype == np.float16 else dtype.name
                progress(done, len(steps), f"{kind} {label}")
