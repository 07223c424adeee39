"""The value objects every backend receives: normalised options and tile sizes.

The API layer (`tileattn.validation`) turns the caller's keyword arguments into one
`AttentionOptions`; backends read it and never re-parse or re-validate anything.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

UNLIMITED = -1
"""Sentinel for a window side with no limit (FlashAttention's convention)."""


@dataclass(frozen=True)
class Blocks:
    """Tile sizes: `block_q` query rows by `block_k` key columns per tile.

    Any positive integer is valid, including sizes larger than the sequence (one tile).
    Each backend has its own `default_blocks(...)` that picks them from the cache or
    shared-memory size; `Blocks.resolve` applies the caller's overrides on top.
    """

    block_q: int
    block_k: int

    def resolve(self, block_q: int | None, block_k: int | None) -> "Blocks":
        return Blocks(block_q if block_q is not None else self.block_q,
                      block_k if block_k is not None else self.block_k)


def evolve(record, **changes):
    """`dataclasses.replace` for the frozen records below on a hot path (a decode step's
    remembered unchecked call): a shallow copy with `changes`, without `__init__`, whose
    checks the record passed when it was made (the caller answers for `changes`): 1.5 us
    against `replace`'s 5.8 for a VarlenLayout on the 2-core development host."""
    clone = object.__new__(type(record))
    clone.__dict__.update(record.__dict__)
    clone.__dict__.update(changes)
    return clone


@dataclass(frozen=True, eq=False)
class AttentionOptions:
    """Validated, normalised options (see SPEC "Score, masks and options").

    Attributes
    ----------
    causal : bool
        As given; already folded into `window_right` (causal means ``window_right == 0``).
    window_left, window_right : int
        Bottom-right aligned band: query row ``i`` keeps key ``j`` when
        ``i + Nk - Nq - window_left <= j <= i + Nk - Nq + window_right``;
        `UNLIMITED` (-1) removes that side's limit.
    scale : float
        Multiplies ``q . k``; defaults to ``1 / sqrt(D)``.
    softcap : float
        ``0.0`` means off, else ``s = softcap * tanh(s / softcap)``.
    alibi_slopes : numpy.ndarray or None
        float64, shape ``(B, Hq)`` over the flattened batch, host memory.

        Each of scale, softcap and the slopes is 0 or a normal number of the compute dtype
        whose product with log2(e) (and ``scale / softcap``) is finite there.
    dropout_p : float
        The effective dropout, in ``[0, 1)``: 0 when the caller's ``dropout_p`` is below
        ``2**-16`` (the hash cannot drop anything at that rate), so backends never see
        a dropout that drops nothing but rescales.
    seed : int
        In ``[0, 2**64)``; 0 when dropout is off.
    block_q, block_k : int or None
        Caller's tile-size overrides; ``None`` lets the backend choose.
    deterministic : bool
        Backward only: False allows a backend's faster, scheduling-dependent variant.
    row_offset, col_offset, alignment : int
        Where this call's rows and keys sit in a longer sequence (internal: set by
        `tileattn.distributed`, never by the public API). Query row ``i`` is global row
        ``row_offset + i`` and key ``j`` global key ``col_offset + j``; masks and ALiBi
        align the global sequences bottom-right by `alignment` (global ``Nk - Nq``; None
        means this call's own ``n_k - n_q``), and dropout hashes the global positions, so
        a block of a problem computes exactly that block's part of the whole.
    varlen : VarlenLayout or None
        The sequences of a variable-length or paged call (``seqlens_*``, ``cu_seqlens_*``,
        ``block_table``); None for a dense call. ``alibi_slopes`` then has one row per
        sequence (`VarlenLayout.descriptors`, column ``INDEX``).
    """

    causal: bool = False
    window_left: int = UNLIMITED
    window_right: int = UNLIMITED
    scale: float = 1.0
    softcap: float = 0.0
    alibi_slopes: np.ndarray | None = None
    dropout_p: float = 0.0
    seed: int = 0
    block_q: int | None = None
    block_k: int | None = None
    deterministic: bool = True
    row_offset: int = 0
    col_offset: int = 0
    alignment: int | None = None
    varlen: "VarlenLayout | None" = None

    def band_offset(self, n_q: int, n_k: int) -> int:
        """The ``offset`` of the band test ``j - (i + offset)`` in this call's local indices:
        ``n_k - n_q`` for a whole problem, shifted by the global positions for a block."""
        alignment = n_k - n_q if self.alignment is None else self.alignment
        return alignment + self.row_offset - self.col_offset

    @property
    def is_masked(self) -> bool:
        """True when some (row, key) pairs can be masked out."""
        return self.window_left != UNLIMITED or self.window_right != UNLIMITED


def keeps(i, j, band_offset: int, window_left: int, window_right: int):
    """Whether query row `i` keeps key `j` (arrays broadcast); `band_offset` is
    `AttentionOptions.band_offset` (``Nk - Nq`` for bottom-right alignment)."""
    diagonal = np.asarray(j) - (np.asarray(i) + band_offset)
    kept = np.ones(np.broadcast(diagonal).shape, dtype=bool)
    if window_left != UNLIMITED:
        kept &= diagonal >= -window_left
    if window_right != UNLIMITED:
        kept &= diagonal <= window_right
    return kept


def tile_is_masked(row_start: int, row_stop: int, col_start: int, col_stop: int,
                   band_offset: int, window_left: int, window_right: int) -> bool:
    """Whether every (row, key) pair of a tile is masked, so the tile can be skipped.

    The kept band is monotone in both indices, so it is enough to test the tile corner
    nearest the band on each side.
    """
    offset = band_offset
    if window_right != UNLIMITED and col_start > (row_stop - 1) + offset + window_right:
        return True
    if window_left != UNLIMITED and col_stop - 1 < row_start + offset - window_left:
        return True
    return False


# --------------------------------------------------------------------------- sequences

# Columns of `VarlenLayout.descriptors` / `dense_descriptors`: one row per sequence.
BATCH, ROW_BASE, ROWS, KEY_BASE, KEYS, BAND, INDEX = range(7)
DESCRIPTOR_COLUMNS = 7
"""``BATCH``: the batch element of the backends' 4-D arrays (and the block-table row);
``ROW_BASE``/``ROWS``: the sequence's first query row there and its row count;
``KEY_BASE``/``KEYS``: the same for keys (for paged K/V, logical keys from 0 read through
the block table); ``BAND``: the band offset of `keeps` in the sequence's own indices
(``KEYS - ROWS``: bottom-right alignment per sequence); ``INDEX``: the sequence's number,
its dropout heads being ``INDEX * Hq + h`` (docs/varlen.md) and its ALiBi row
``alibi_slopes[INDEX]``."""


def dense_descriptors(batch: int, n_q: int, n_k: int, band_offset: int) -> np.ndarray:
    """The trivial descriptors of a dense call: batch element ``b`` is sequence ``b``."""
    descriptors = np.empty((batch, DESCRIPTOR_COLUMNS), np.int64)
    descriptors[:, BATCH] = descriptors[:, INDEX] = np.arange(batch)
    descriptors[:, ROW_BASE] = descriptors[:, KEY_BASE] = 0
    descriptors[:, ROWS], descriptors[:, KEYS] = n_q, n_k
    descriptors[:, BAND] = band_offset
    return descriptors


@dataclass(frozen=True, eq=False)
class VarlenLayout:
    """The sequences of a variable-length call, validated at the API (SPEC "Variable-length
    batches and paged K/V"); host int64 arrays.

    Attributes
    ----------
    family : {"padded", "packed", "paged"}
    seqlens_q, seqlens_k : numpy.ndarray or None
        ``(B,)`` over the flattened batch (padded and paged); None means the full axis.
        An unchecked padded or paged GPU call keeps the caller's device arrays here and in
        `block_table` (int32 or int64, `on_device`; tileattn.varlen_validation).
    cu_seqlens_q, cu_seqlens_k : numpy.ndarray or None
        ``(S + 1,)`` (packed).
    block_table : numpy.ndarray or None
        ``(B, max_pages)`` (paged); only the entries `descriptors` lets a sequence read are
        page ids, the others may hold anything.
    page_size, num_pages : int
        Of the page pools (paged).
    checked : bool
        False when the caller passed ``check_lengths=False``: the contents were not checked,
        so `descriptors` clamps every length into its axis (and, for paged K/V, into the
        table's capacity), and kernels clamp page ids into ``[0, num_pages)``: a bad table
        gives wrong numbers, never an out-of-bounds access.
    """

    family: str
    seqlens_q: np.ndarray | None = None
    seqlens_k: np.ndarray | None = None
    cu_seqlens_q: np.ndarray | None = None
    cu_seqlens_k: np.ndarray | None = None
    block_table: np.ndarray | None = None
    page_size: int = 0
    num_pages: int = 0
    checked: bool = True

    @property
    def n_sequences(self) -> int:
        if self.family == "packed":
            return len(self.cu_seqlens_q) - 1
        return len(self.seqlens_k if self.seqlens_k is not None else self.seqlens_q)

    @property
    def on_device(self) -> bool:
        """Whether the lengths or the table are device arrays (not yet read on the host)."""
        return any(a is not None and not isinstance(a, np.ndarray)
                   for a in (self.seqlens_q, self.seqlens_k, self.block_table))

    def on_host(self) -> "VarlenLayout":
        """This layout with host int64 arrays (a device-to-host copy where `on_device`)."""
        if not self.on_device:
            return self

        def host(array):
            if array is None or isinstance(array, np.ndarray):
                return array
            return np.asarray(array.get(), dtype=np.int64)
        return replace(self, seqlens_q=host(self.seqlens_q), seqlens_k=host(self.seqlens_k),
                       block_table=host(self.block_table))

    def signature(self) -> tuple:
        """What launches over this layout's tables depend on besides the arrays' contents
        (a padded or paged GPU forward plans by it)."""
        def of(array):
            return None if array is None else (type(array), array.shape, array.strides,
                                               array.dtype)
        return (self.family, self.page_size, self.num_pages, self.checked,
                of(self.seqlens_q), of(self.seqlens_k), of(self.block_table))

    def contents(self) -> tuple:
        """The host lengths' values (and table's): with `signature`, what a plan whose
        tables are built from them is keyed by. Host arrays only."""
        return tuple(None if array is None else (array.dtype.str, array.shape, array.tobytes())
                     for array in (self.seqlens_q, self.seqlens_k, self.cu_seqlens_q,
                                   self.cu_seqlens_k, self.block_table))

    def key_capacity(self, n_k: int) -> int:
        """Logical keys per batch element: ``max_pages * page_size`` when paged, else n_k."""
        if self.family == "paged":
            return self.block_table.shape[1] * self.page_size if self.num_pages else 0
        return n_k

    def descriptors(self, batch: int, n_q: int, n_k: int) -> np.ndarray:
        """``(S, DESCRIPTOR_COLUMNS)`` int64, one row per sequence (columns above), with
        every length clamped into its axis (a no-op once checked), and packed sequences
        made disjoint and in order, so no kernel can reach past an array or race."""
        if self.family == "packed":
            # np.minimum / np.maximum and slices, not np.clip and np.diff: ~4x less host
            # time on these few values (a GPU call's host time is counted)
            cu_q, cu_k = (np.maximum.accumulate(np.minimum(np.maximum(cu, 0), total))
                          for cu, total in ((self.cu_seqlens_q, n_q), (self.cu_seqlens_k, n_k)))
            count = len(cu_q) - 1
            descriptors = np.empty((count, DESCRIPTOR_COLUMNS), np.int64)
            descriptors[:, BATCH] = 0
            descriptors[:, ROW_BASE], descriptors[:, ROWS] = cu_q[:-1], cu_q[1:] - cu_q[:-1]
            descriptors[:, KEY_BASE], descriptors[:, KEYS] = cu_k[:-1], cu_k[1:] - cu_k[:-1]
        else:
            descriptors = np.empty((batch, DESCRIPTOR_COLUMNS), np.int64)
            descriptors[:, BATCH] = np.arange(batch)
            descriptors[:, ROW_BASE] = descriptors[:, KEY_BASE] = 0
            n_keys = self.key_capacity(n_k)
            for column, lengths, limit in ((ROWS, self.seqlens_q, n_q),
                                           (KEYS, self.seqlens_k, n_keys)):
                # np.minimum / np.maximum: np.clip's checks cost ~5 us a call here
                descriptors[:, column] = (limit if lengths is None
                                          else np.minimum(np.maximum(lengths, 0), limit))
        descriptors[:, BAND] = descriptors[:, KEYS] - descriptors[:, ROWS]
        descriptors[:, INDEX] = np.arange(len(descriptors))
        return descriptors
