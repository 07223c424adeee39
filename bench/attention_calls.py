"""tileattn's forward and forward + backward on given arrays, as zero-argument calls for the
benchmarks to time (shared by the cliff sweeps)."""

from __future__ import annotations


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
