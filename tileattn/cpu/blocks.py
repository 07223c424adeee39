"""Default tile sizes for the CPU kernels, and the cache sizes `python -m tileattn info` shows."""

from __future__ import annotations

import functools
import glob
import os
from dataclasses import dataclass

from ..options import Blocks

_SYSFS_CACHES = "/sys/devices/system/cpu/cpu0/cache/index*"


BOUNDARY_SLICE_ROWS = 64
"""Rows per slice of a tile that the mask cuts (see `forward_kernel._query_tile`): small
enough that a 64-row slice of the causal diagonal wastes an eighth of a 512-key tile, large
enough that its matrix products still run near BLAS peak."""


@dataclass(frozen=True)
class CacheSizes:
    """Per-core data cache sizes in bytes."""

    l1d: int
    l2: int


FALLBACK_CACHES = CacheSizes(l1d=32 * 1024, l2=512 * 1024)
"""Used where sysfs says nothing (macOS, Windows, containers hiding it): common x86 sizes."""


def _parse_size(text: str) -> int:
    """sysfs writes sizes like ``32K`` or ``1024K`` (or ``8M``)."""
    text = text.strip().upper()
    units = {"K": 1024, "M": 1024**2, "G": 1024**3}
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


@functools.cache
def cache_sizes() -> CacheSizes:
    """The L1 data and L2 sizes of CPU 0 from sysfs, else `FALLBACK_CACHES`."""
    sizes = {}
    for index in glob.glob(_SYSFS_CACHES):
        try:
            with open(os.path.join(index, "level")) as f:
                level = int(f.read())
            with open(os.path.join(index, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(index, "size")) as f:
                size = _parse_size(f.read())
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified") and level in (1, 2):
            sizes[level] = size
    return CacheSizes(l1d=sizes.get(1, FALLBACK_CACHES.l1d), l2=sizes.get(2, FALLBACK_CACHES.l2))


def _power_of_two_at_most(value: float, low: int, high: int) -> int:
    power = low
    while power * 2 <= min(value, high):
        power *= 2
    return power


KEY_TILE_BYTES = 1024 * 1024
"""What the K and V rows of one key tile may take. The tiles are sized for the matrix
products, not for L2: BLAS blocks its operands for the caches itself, and what a larger tile
buys is longer products (fewer calls, less packing and fewer passes over the accumulators
per FLOP), while the score tiles stream from L2 or L3 at a cost that measured smaller.
Half of L2 (the rule before) gave 64 x 128 backward tiles at D = 256 on a 512 KiB L2 (Zen 3):
256 x 512 ran 1.3x faster there (D = 160-256, forward 512 x 512 1.10-1.15x); on the 2 MiB L2
of session 4's Sapphire Rapids both rules give the same tiles (bench/NOTES-cpu.md,
session 16)."""


@functools.cache
def default_blocks(kind: str, head_dim: int, value_dim: int, itemsize: int,
                   masked: bool = True) -> Blocks:
    """Tile sizes for ``kind`` ``"forward"`` or ``"backward"`` (powers of two).

    ``block_k``: as many keys as fit their K and V rows in `KEY_TILE_BYTES` (512 for
    D = Dv = 256 in float32), at most 512: 1024-key tiles ran slower in both passes
    (single thread, N=2048, forward 1024x1024 against 1024x512 5-12% slower for D <= 96,
    backward 512x1024 against 256x512 3-17% slower for D <= 128; bench/NOTES-cpu.md,
    session 4).
    ``block_q``: as many query rows as keys in the forward, half as many in the backward,
    which keeps two score-sized tiles (P and dS): forward 512x512 ran 3% faster than 256x512
    and 7% faster than 128x512, backward 256x512 4% faster than 256x256 (session 4).

    A forward without a mask (`masked` False) takes twice as many query rows again: 1024x512
    ran 1-2% faster than 512x512 (v7); taller was not measured, so 1024 at most. With a
    causal or window mask the taller tile lost 3-6%: its cut diagonal runs as more, smaller
    slices.
    """
    block_k = _power_of_two_at_most(KEY_TILE_BYTES / (itemsize * (head_dim + value_dim)),
                                    32, 512)
    if kind == "forward":
        block_q = block_k if masked else min(2 * block_k, 1024)
    else:
        block_q = max(block_k // 2, 32)
    return Blocks(block_q=block_q, block_k=block_k)


def spread_over_threads(block_q: int, n_tiles_per_row_block, n_threads: int) -> int:
    """Halve `block_q` (to 64 at least) until there are 4 query tiles per thread.

    `n_tiles_per_row_block(block_q)` counts the tasks a block size makes. Four per thread
    keeps causal work, which varies along the sequence, evenly dealt.
    """
    while block_q > 64 and n_tiles_per_row_block(block_q) < 4 * n_threads:
        block_q //= 2
    return block_q
