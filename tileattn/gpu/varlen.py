"""The tables a variable-length or paged call hands the kernels (sequences.cuh).

A dense call passes null tables and compiles without VARLEN/PAGED, so its kernels and their
compile-cache keys are what they were. A variable-length call uploads, in one copy, its
sequence descriptors (`tileattn.options.VarlenLayout.descriptors`), the tile table of the
launch (every sequence's query tiles, longest first: `tileattn.tile_order`) and,
for paged K/V, the block table. The grid is then the tile table's length times the query
heads, so the work follows the real tokens, not the padded or longest length.
"""

from __future__ import annotations

from functools import lru_cache

import cupy
import numpy as np

from ..options import BAND, DESCRIPTOR_COLUMNS, KEYS, ROWS, AttentionOptions
from ..tile_order import tile_list_by_estimate
from . import _compile
from .operands import Launch, empty, plans_once
from .tiles import pages_hold_tiles

DESCRIPTORS_SOURCE = "sequence_descriptors.cu"


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


def leaves_padding(layout) -> bool:
    """Whether some rows or keys of a call of `layout` (a `VarlenLayout`; None: dense)
    belong to no sequence: their gradients, 0, are then the launcher's to write. Checked
    packed sequences tile the row and key axes (cu_seqlens run from 0 to the totals), so
    the kernels write every output row and gradient."""
    return layout is not None and not (layout.family == "packed" and layout.checked)


class Sequences:
    """A variable-length call's sequences on the device, for launches of any tile height.

    A padded or paged forward (`plans_once`) takes its lengths and block table to the device
    as they are (device arrays of an unchecked call stay there; host arrays are copied
    there in one asynchronous copy): its descriptors come from a kernel
    (sequence_descriptors.cu) and its tile table lists every tile of the padded row axis
    (`dense_grid`), the same for every call of that shape, so the host reads no length,
    waits for nothing and plans once per signature; a tile past its sequence's rows returns
    at once (sequences.cuh: tile_past_rows). Its choices then go by the key capacity.
    Packed sequences and backwards (whose key tiles need the lengths) read them on the
    host and order their tiles there.
    """

    def __init__(self, q, k, options: AttentionOptions, forward: bool = False):
        layout = options.varlen
        batch, _, n_q, _ = q.shape
        self.paged = layout.family == "paged"
        self.packed = layout.family == "packed"
        self.dense_grid = plans_once(layout, forward)
        if not self.dense_grid:
            layout = layout.on_host()
        # A forward writes every row of o where the sequences tile the rows
        # (`leaves_padding`), and also where every batch element has all the rows (no
        # seqlens_q: a row that keeps no key gets 0 and -inf from its tile).
        self.forward_covers_every_row = not leaves_padding(layout) or (
            not self.packed and layout.seqlens_q is None)
        self.key_capacity = layout.key_capacity(k.shape[2])
        self.n_pages = layout.num_pages if self.paged else 0
        self.page_size = layout.page_size if self.paged else 0
        self._batch, self._n_q = batch, n_q
        self._options = options
        if self.dense_grid:
            self.descriptors = None
            self.max_rows, self.max_keys = n_q, self.key_capacity
            self.device_tables = DeviceTables(layout, batch, n_q, self.key_capacity)
            self._table = self.device_tables.table
            return
        self.descriptors = layout.descriptors(batch, n_q, k.shape[2])
        self.max_rows = int(self.descriptors[:, ROWS].max(initial=0))
        self.max_keys = int(self.descriptors[:, KEYS].max(initial=0))
        self._table = (np.ascontiguousarray(layout.block_table, dtype=np.int64) if self.paged
                       else np.zeros((0, 0), np.int64))

    def defines(self) -> tuple:
        return (("PAGED", int(self.paged)), ("VARLEN", 1))

    def pages_hold_tiles(self, rows: int) -> bool:
        """Whether this call is paged and every tile of `rows` keys lies in one page
        (`tiles.pages_hold_tiles`)."""
        return self.paged and pages_hold_tiles(self.page_size, rows)

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
        if self.dense_grid:
            assert not keys, "key tiles need the lengths on the host"
            tiles = (_dense_tiles(cupy.cuda.Device().id, self._batch, self._n_q, block_rows)
                     if block_rows is not None else empty(cupy.cuda.Device().id, "int64"))
            table_stride = self._table.shape[1] if self.paged else 0
            return ((self.device_tables.descriptors, tiles, self._table, np.int64(table_stride),
                     np.int64(self.page_size), np.int64(self.n_pages)), tiles.size // 2)
        tiles = (self.tiles(block_rows, keys) if block_rows is not None
                 else np.zeros((0, 2), np.int64))
        host = np.concatenate([self.descriptors.ravel(), tiles.ravel(), self._table.ravel()])
        device = upload(host)
        descriptors_end = self.descriptors.size
        tiles_end = descriptors_end + tiles.size
        return ((device[:descriptors_end], device[descriptors_end:tiles_end],
                 device[tiles_end:], np.int64(self._table.shape[1]), np.int64(self.page_size),
                 np.int64(self.n_pages)), len(tiles))


class DeviceTables:
    """The descriptors and block table of a padded or paged forward (host or device
    lengths), in buffers of their own that a kernel (sequence_descriptors.cu:
    padded_tables) fills from the caller's arrays at every call (`fill`; the first by the
    constructor): a repeated call's cached launches read these buffers, so only the filling
    launch takes the new arrays. One stream's calls run in order, so a call never
    overwrites tables that an earlier call's kernels still read; plans are kept per stream
    (launch_forward.py)."""

    def __init__(self, layout, batch: int, n_q: int, n_keys: int):
        device = cupy.cuda.Device().id
        paged = layout.family == "paged"
        pages = layout.block_table.shape[1] if paged else 0
        self.descriptors = cupy.empty((batch, DESCRIPTOR_COLUMNS), np.int64)
        self.table = (cupy.empty((batch, pages), np.int64) if paged
                      else empty(device, "int64"))
        inputs = self._inputs(layout)
        defines = tuple(("i64" if a.dtype == np.int64 else "int") for a in inputs)
        function = _compile.kernel(DESCRIPTORS_SOURCE, "padded_tables",
                                   (("K_LENGTH", defines[1]), ("Q_LENGTH", defines[0]),
                                    ("TABLE", defines[2])))
        row_stride = inputs[2].strides[0] // inputs[2].itemsize if paged else 0
        threads = max(batch, batch * pages)
        self._prepare = Launch(function, (-(-threads // 128),), (128,), 0,
                               (np.int64(batch), np.int64(n_q), np.int64(n_keys),
                                np.int64(row_stride), np.int64(pages), self.descriptors,
                                self.table))
        self._prepare(*inputs)

    def fill(self, layout) -> None:
        """Refill the tables from `layout`'s arrays (a call of this plan's signature)."""
        self._prepare(*self._inputs(layout))

    @staticmethod
    def _inputs(layout) -> tuple:
        """``(seqlens_q, seqlens_k, block_table)`` of a call as the filling kernel reads
        them (1-D lengths, table rows of unit column stride; empty stand-ins for absent
        ones); host arrays (int64 once validated) arrive in one copy."""
        given = (layout.seqlens_q, layout.seqlens_k, layout.block_table)
        on_host = [a for a in given if isinstance(a, np.ndarray)]
        uploaded = iter(())
        if on_host:
            flat = upload(np.concatenate([a.astype(np.int64, copy=False).ravel()
                                          for a in on_host]))
            ends = np.cumsum([a.size for a in on_host])
            uploaded = iter(flat[end - a.size:end].reshape(a.shape)
                            for a, end in zip(on_host, ends))
        arrays = []
        for array in given:
            if array is None:
                arrays.append(empty(cupy.cuda.Device().id, "int32"))
                continue
            if isinstance(array, np.ndarray):
                array = next(uploaded)
            elif array.strides[-1] != array.itemsize:  # a copy only for strided rows: a
                array = cupy.ascontiguousarray(array)  # decode step's host time counts
            arrays.append(array)
        return tuple(arrays)


@lru_cache(maxsize=64)
def _dense_tiles(device_id: int, batch: int, n_rows: int, block_rows: int):
    """``(sequence, first row)`` of every tile of `block_rows` rows of the padded axis, for
    every batch element, on the device: the last tiles first (with a band they hold the
    most keys). The same for every call of a shape, so it is built once."""
    starts = np.arange(-(-n_rows // block_rows) - 1, -1, -1, dtype=np.int64) * block_rows
    table = np.stack([np.tile(np.arange(batch, dtype=np.int64), len(starts)),
                      np.repeat(starts, batch)], axis=1)
    with cupy.cuda.Device(device_id):
        return cupy.asarray(table.ravel())


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
