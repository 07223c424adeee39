"""The tables a variable-length or paged call hands the kernels (sequences.cuh).

A dense call passes null tables and compiles without VARLEN/PAGED, so its kernels and their
compile-cache keys are what they were. A variable-length call uploads, in one copy, its
sequence descriptors (`tileattn.options.VarlenLayout.descriptors`), the tile table of the
launch (every sequence's query tiles, longest first: `tileattn.tile_order`) and,
for paged K/V, the block table. The grid is then the tile table's length times the query
heads, so the work follows the real tokens, not the padded or longest length.
"""

from __future__ import annotations

import cupy
import numpy as np

from ..options import BAND, KEYS, ROWS, AttentionOptions
from ..tile_order import tile_list_by_estimate
from .operands import empty


def dense_arguments(device_id: int) -> tuple:
    """The trailing kernel arguments of a dense call: no tables (sequences.cuh)."""
    none = empty(device_id, "int64")
    return (none, none, none, np.int64(0), np.int64(0), np.int64(0))


def tile_grid(heads: int, n_rows: int, block: int, batch: int, sequences: Sequences | None,
              keys: bool = False) -> tuple[int, tuple]:
    """Blocks of a query-tile (or, with `keys`, key-tile) kernel: `heads` per tile of
    `block` rows of each batch element, or of each entry of the sequences' tile table; and
    the trailing table arguments (sequences.cuh)."""
    if sequences is None:
        return -(-n_rows // block) * batch * heads, dense_arguments(cupy.cuda.Device().id)
    tables, entries = sequences.arguments(block, keys)
    return entries * heads, tables


class Sequences:
    """A variable-length call's sequences on the device, for launches of any tile height."""

    def __init__(self, q, k, options: AttentionOptions):
        layout = options.varlen
        batch, _, n_q, _ = q.shape
        self.paged = layout.family == "paged"
        self.packed = layout.family == "packed"
        # Checked packed sequences tile the row and key axes (cu_seqlens run from 0 to the
        # totals), so the kernels write every output row; otherwise padding rows and keys
        # are left to the launcher to zero.
        self.covers_every_row = self.packed and layout.checked
        self.key_capacity = layout.key_capacity(k.shape[2])
        self.descriptors = layout.descriptors(batch, n_q, k.shape[2])
        self.max_rows = int(self.descriptors[:, ROWS].max(initial=0))
        self.max_keys = int(self.descriptors[:, KEYS].max(initial=0))
        self.n_pages = layout.num_pages if self.paged else 0
        self.page_size = layout.page_size if self.paged else 0
        self._table = (np.ascontiguousarray(layout.block_table, dtype=np.int64) if self.paged
                       else np.zeros((0, 0), np.int64))
        self._options = options

    def defines(self) -> tuple:
        return (("PAGED", int(self.paged)), ("VARLEN", 1))

    def tiles(self, block_rows: int, keys: bool = False) -> np.ndarray:
        """``(sequence, first row)`` of every query tile of `block_rows` rows (with `keys`,
        ``(sequence, first key)`` of every key tile), longest first."""
        d, left, right = self.descriptors, self._options.window_left, self._options.window_right
        if keys:  # the band transposed: key j is kept by rows j - band - right .. + left
            return tile_list_by_estimate(d[:, KEYS], d[:, ROWS], -d[:, BAND], block_rows, right,
                                         left)
        return tile_list_by_estimate(d[:, ROWS], d[:, KEYS], d[:, BAND], block_rows, left, right)

    def arguments(self, block_rows: int | None, keys: bool = False) -> tuple[tuple, int]:
        """The trailing kernel arguments for launches of `block_rows`-row query tiles (or
        key tiles, with `keys`; None: no tile table, for the decode kernel, whose blocks are
        batch elements) and the tile table's length."""
        tiles = (self.tiles(block_rows, keys) if block_rows is not None
                 else np.zeros((0, 2), np.int64))
        host = np.concatenate([self.descriptors.ravel(), tiles.ravel(), self._table.ravel()])
        device = upload(host)
        descriptors_end = self.descriptors.size
        tiles_end = descriptors_end + tiles.size
        return ((device[:descriptors_end], device[descriptors_end:tiles_end],
                 device[tiles_end:], np.int64(self._table.shape[1]), np.int64(self.page_size),
                 np.int64(self.n_pages)), len(tiles))


# Pinned staging for the tables: a copy from pageable host memory waits for the stream's
# earlier work, which serialised each variable-length call's host time with the kernels
# before it (bench/NOTES-gpu.md, v18); from pinned memory the copy is queued like a kernel.
# A slot is reused only once its last copy has run (its event), so the ring never blocks
# unless more than _SLOTS calls are queued at once.
_SLOTS = 8
_staging: dict[int, list] = {}  # device -> [next slot, [(pinned array, event) per slot]]


def upload(host: np.ndarray):
    """`host` (int64) as a new device array, copied asynchronously on the current stream."""
    ring = _staging.setdefault(cupy.cuda.Device().id, [0, [None] * _SLOTS])
    index = ring[0]
    ring[0] = (index + 1) % _SLOTS
    slot = ring[1][index]
    if slot is not None:
        slot[1].synchronize()  # the copy that last read this slot has run
    if slot is None or slot[0].size < host.size:
        memory = cupy.cuda.alloc_pinned_memory(max(host.size, 1024) * 8)
        slot = (np.frombuffer(memory, np.int64), cupy.cuda.Event(disable_timing=True))
        ring[1][index] = slot
    staged = slot[0][:host.size]
    staged[...] = host
    device = cupy.empty(host.size, np.int64)
    stream = cupy.cuda.get_current_stream()
    if host.size:
        device.data.copy_from_host_async(staged.ctypes.data, host.nbytes, stream)
    slot[1].record(stream)
    return device
