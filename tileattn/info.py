"""``python -m tileattn info``: what can run here, on what, with which tiles, moving what.

Lists each backend and, when it cannot run, why; the device and the cache or shared-memory
sizes a backend detected; whether it serves variable-length and paged calls; for the GPU, the kernel family and tile-table row each direction
runs and why (`tileattn.gpu.tiles`); the block sizes it would choose for a given shape; and the
modelled main-memory traffic of naive vs tiled attention for those blocks
(`tileattn.traffic.memory_traffic`).
"""

from __future__ import annotations

import numpy as np

from . import backends
from .options import UNLIMITED, AttentionOptions
from .traffic import memory_traffic


def _megabytes(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:,.1f} MB"


def describe(*, seq_len=4096, n_k=None, head_dim=64, value_dim=None, heads=8, kv_heads=None,
             batch=1, dtype="float32", causal=True, print_fn=print):
    """Print the report for one shape (see the module doc)."""
    n_k = seq_len if n_k is None else n_k
    value_dim = head_dim if value_dim is None else value_dim
    kv_heads = heads if kv_heads is None else kv_heads
    dtype = np.dtype(dtype)
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
            options = AttentionOptions(window_right=0 if causal else UNLIMITED)
            lines = kernels(n_k, head_dim, value_dim, dtype, options, n_q=seq_len, heads=heads,
                            kv_heads=kv_heads, batch=batch)
            for direction, line in lines.items():
                print_fn(f"  {direction} kernel: {line}")
        tiles = tile_sizes(seq_len, n_k, head_dim, value_dim, dtype, batch * heads)
        print_fn("  tiles for this shape: " + ", ".join(
            f"{direction} block_q={blocks.block_q} block_k={blocks.block_k}"
            for direction, blocks in tiles.items()))
        print_fn("  modelled main-memory traffic (FlashAttention's accounting):")
        for direction, blocks in tiles.items():
            traffic = memory_traffic(n_q=seq_len, n_k=n_k, head_dim=head_dim, heads=heads,
                                     batch=batch, itemsize=dtype.itemsize,
                                     block_q=blocks.block_q, block_k=blocks.block_k,
                                     causal=causal)
            naive, tiled = ((traffic.naive_forward, traffic.tiled_forward)
                            if direction == "forward"
                            else (traffic.naive_backward, traffic.tiled_backward))
            ratio = (f"{naive / tiled:.1f}x less" if tiled <= naive
                     else f"{tiled / naive:.1f}x more: the score matrix is small here, and the "
                     "tiled passes read K and V more than once")
            print_fn(f"    {direction:<8}: naive {_megabytes(naive):>14}   tiled "
                     f"{_megabytes(tiled):>14}   ({ratio})")
        print_fn("")
