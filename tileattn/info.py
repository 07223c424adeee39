"""``python -m tileattn info``: what can run here, on what, with which tiles, moving what.

Lists each backend and, when it cannot run, why; the device and the cache or shared-memory
sizes a backend detected; whether it serves variable-length and paged calls; the kernel and
schedule each direction of a dense call of the given shape runs, as the backend's own
dispatch chooses them (for the GPU the family and tile-table row, and why:
`tileattn.gpu.tiles`); the tiles of those kernels; and the modelled main-memory traffic of
naive vs tiled attention for those tiles (`tileattn.traffic.memory_traffic`).
"""

from __future__ import annotations

import numpy as np

from . import backends
from .arrays import is_supported_float
from .options import UNLIMITED, AttentionOptions
from .traffic import memory_traffic
from .validation import _check_int, check_bool

DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")


def _megabytes(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:,.1f} MB"


def _checked_dtype(dtype) -> np.dtype:
    """`dtype` as a NumPy dtype, one of `DTYPE_NAMES` (bfloat16 by name too, through
    ml_dtypes, as the command line takes it)."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        from .arrays import bfloat16_dtype

        try:
            return bfloat16_dtype()
        except ImportError:
            raise ValueError("dtype='bfloat16' needs ml_dtypes, which is not installed: "
                             "pip install ml_dtypes") from None
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}") \
            from None
    if not is_supported_float(resolved):
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
    return resolved


def describe(*, seq_len=4096, n_k=None, head_dim=64, value_dim=None, heads=8, kv_heads=None,
             batch=1, dtype="float32", causal=True, print_fn=print):
    """Print the report for one shape (see the module doc).

    Parameters
    ----------
    seq_len, n_k : query rows Nq and keys Nk (Nk defaults to Nq)
    head_dim, value_dim : D and Dv (Dv defaults to D)
    heads, kv_heads : query heads Hq and K/V heads Hkv (a divisor of Hq; defaults to Hq)
    batch : B
    dtype : float16, bfloat16, float32 or float64 (a name or a NumPy dtype)
    causal : bool, the bottom-right aligned causal mask
    print_fn : called with each line
    """
    seq_len = _check_int("seq_len", seq_len, minimum=1)
    n_k = seq_len if n_k is None else _check_int("n_k", n_k, minimum=1)
    head_dim = _check_int("head_dim", head_dim, minimum=1)
    value_dim = head_dim if value_dim is None else _check_int("value_dim", value_dim, minimum=1)
    heads = _check_int("heads", heads, minimum=1)
    kv_heads = heads if kv_heads is None else _check_int("kv_heads", kv_heads, minimum=1)
    if heads % kv_heads:
        raise ValueError(f"heads must be a multiple of kv_heads, got heads={heads}, "
                         f"kv_heads={kv_heads}")
    batch = _check_int("batch", batch, minimum=1)
    check_bool("causal", causal)
    causal = bool(causal)
    dtype = _checked_dtype(dtype)
    options = AttentionOptions(causal=causal, window_right=0 if causal else UNLIMITED)
    print_fn(f"tileattn info for q ({batch}, {heads}, {seq_len}, {head_dim}), Nk={n_k}, "
             f"Dv={value_dim}, Hkv={kv_heads}, {dtype.name}, causal={causal}\n")
    for name in backends.REGISTRY:
        reason = backends.availability(name)
        if reason is not None:
            print_fn(f"[{name}] not available: {reason}\n")
            continue
        module = backends.load(name)
        print_fn(f"[{name}] available")
        hardware = getattr(module, "hardware", None)
        for key, value in (hardware() if hardware else {}).items():
            print_fn(f"  {key}: {value}")
        print_fn("  variable-length and paged calls (seqlens_*, cu_seqlens_*, block_table): "
                 + ("yes" if getattr(module, "VARLEN", False) else "not implemented yet"))
        tile_sizes = getattr(module, "tile_sizes", None)
        if tile_sizes is None:
            print_fn("  tiles: none (materialises the whole score matrix)\n")
            continue
        kernels = getattr(module, "describe", None)
        if kernels is not None:
            lines = kernels(n_k, head_dim, value_dim, dtype, options, n_q=seq_len, heads=heads,
                            kv_heads=kv_heads, batch=batch)
            for direction, line in lines.items():
                print_fn(f"  {direction} kernel: {line}")
        # The tiles of the kernels just named (None: a direction this backend refuses).
        tiles = tile_sizes(seq_len, n_k, head_dim, value_dim, dtype, batch * heads, options,
                           kv_heads=kv_heads, batch=batch)
        print_fn("  tiles for this shape: " + ", ".join(
            f"{direction} not served" if blocks is None else
            f"{direction} block_q={blocks.block_q} block_k={blocks.block_k}"
            for direction, blocks in tiles.items()))
        print_fn("  modelled main-memory traffic (FlashAttention's accounting):")
        for direction, blocks in tiles.items():
            if blocks is None:
                continue
            traffic = memory_traffic(n_q=seq_len, n_k=n_k, head_dim=head_dim,
                                     value_dim=value_dim, heads=heads, batch=batch,
                                     itemsize=dtype.itemsize, block_q=blocks.block_q,
                                     block_k=blocks.block_k, causal=causal)
            naive, tiled = ((traffic.naive_forward, traffic.tiled_forward)
                            if direction == "forward"
                            else (traffic.naive_backward, traffic.tiled_backward))
            ratio = (f"{naive / tiled:.1f}x less" if tiled <= naive
                     else f"{tiled / naive:.1f}x more: the score matrix is small here, and the "
                     "tiled passes read K and V more than once")
            print_fn(f"    {direction:<8}: naive {_megabytes(naive):>14}   tiled "
                     f"{_megabytes(tiled):>14}   ({ratio})")
        print_fn("")
