"""What the cliff sweeps share: tileattn's forward and forward + backward on given arrays
as zero-argument calls to time, and when a row counts as a cliff."""

from __future__ import annotations

CLIFF_AGAINST_TORCH = 0.8
CLIFF_OPTION_COST = 1.5
NO_OPTION = "no option"  # the anchor of an option torch lacks: the call without it


def is_cliff(anchor: str | None, ratio: float) -> bool:
    """Whether anchor time / tileattn time `ratio` marks a cliff: under CLIFF_AGAINST_TORCH
    against a torch backend, or an option costing over CLIFF_OPTION_COST times the call
    without it (`NO_OPTION`); never without an anchor (None or "-")."""
    if anchor == NO_OPTION:
        return 1 / ratio > CLIFF_OPTION_COST
    return anchor not in (None, "-") and ratio < CLIFF_AGAINST_TORCH


def tileattn_calls(options: dict, arrays, backend: str):
    """``(forward, forward_backward)`` on ``arrays = (q, k, v, do)`` with `options`."""
    import tileattn

    q, k, v, do = arrays

    def forward():
        tileattn.forward(q, k, v, backend=backend, **options)

    def forward_backward():
        o, lse = tileattn.forward(q, k, v, return_lse=True, backend=backend, **options)
        tileattn.backward(do, q, k, v, o, lse, backend=backend, **options)

    return forward, forward_backward
