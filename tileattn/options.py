"""The value objects every backend receives: normalised options and tile sizes.

The API layer (`tileattn.validation`) turns the caller's keyword arguments into one
`AttentionOptions`; backends read it and never re-parse or re-validate anything.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        ``2**-32`` (the hash cannot drop anything at that rate), so backends never see
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
