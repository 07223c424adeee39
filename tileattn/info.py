"""``python -m tileattn info``: what can run here, on what, with which tiles, moving what.

Lists each backend and, when it cannot run, why; the device and the cache or shared-memory
sizes a backend detected; the block sizes it would choose for a given shape; and the
modelled main-memory traffic of naive vs tiled attention for those blocks
(`tileattn.traffic.memory_traffic`).
"""

from __future__ import annotations

import numpy as np

from . import backends
from .traffic import memory_traffic


def _megabytes(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:,.1f} MB"


def describe(*, seq_len=4096, n_k=None, head_dim=64, heads=8, batch=1, dtype="float32",
             causal=True, print_fn=print):
    """Print the report for one shape (see the module doc)."""
    n_k = seq_len if n_k is None else n_k
    dtype = np.dtype(dtype)
    print_fn(f"tileattn info for q ({batch}, {heads}, {seq_len}, {head_dim}), Nk={n_k}, "
             f"{dtype.name}, causal={causal}\n")
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
        default_blocks = getattr(module, "default_blocks", None)
        if default_blocks is None:
            print_fn("  tiles: none (materialises the whole score matrix)\n")
            continue
        blocks = default_blocks(seq_len, n_k, head_dim, head_dim, dtype)
        print_fn(f"  tiles for this shape: block_q={blocks.block_q}, block_k={blocks.block_k}")
        traffic = memory_traffic(n_q=seq_len, n_k=n_k, head_dim=head_dim, heads=heads,
                                 batch=batch, itemsize=dtype.itemsize, block_q=blocks.block_q,
                                 block_k=blocks.block_k, causal=causal)
        print_fn("  modelled main-memory traffic (FlashAttention's accounting):")
        print_fn(f"    forward : naive {_megabytes(traffic.naive_forward):>14}   tiled "
                 f"{_megabytes(traffic.tiled_forward):>14}   ({traffic.forward_saving:.1f}x less)")
        print_fn(f"    backward: naive {_megabytes(traffic.naive_backward):>14}   tiled "
                 f"{_megabytes(traffic.tiled_backward):>14}   "
                 f"({traffic.backward_saving:.1f}x less)\n")
