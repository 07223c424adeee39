"""The GQA decodes' folds (tileattn/gpu/launch_forward.py: `_forward_folded_rows`; wide heads,
and many packed rows at D <= 256 with tiles.FOLD_DECODE_ENABLED forced on) on a stand-in for
CuPy, no GPU: dispatch, the views of q, o and lse as rows of one head, each
query row's keys, the value slices and the launch cache run as on a GPU; the launches of the
folded problems run the float64 golden model instead of a kernel, and check the contract
the kernels have with their launcher on the way: no mask left (the keys are cut), rows of
contiguous elements, lse a contiguous (B, H, N) array (the kernels take no lse strides).

    python3 bench/experiments/fold_views_cpu.py

The fold's threshold against the decode kernel is forced to 0 (these grids are small), so
every launch is a fold's. Each case, "bhsd" and "bshd", a first call and a cached one,
against the golden model on the whole problem; with several causal query rows a NaN key
and an infinite value that only the last row keeps, which must reach no other row.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from emulate_decode_cpu import _install_cupy_standin  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import tileattn  # noqa: E402
from tileattn.options import UNLIMITED  # noqa: E402
from tileattn.testing import assert_attention_close  # noqa: E402
from tileattn.validation import validate  # noqa: E402

CASES = [
    # (B, Hq, Hkv, Nq, Nk, D, Dv), options
    ((2, 16, 1, 1, 300, 576, 512), {"causal": True}),
    ((1, 8, 2, 1, 200, 320, 320), {"window": (50, 0), "softcap": 20.0}),
    ((2, 128, 1, 2, 300, 576, 512), {"causal": True}),
    ((1, 64, 1, 3, 200, 288, 320), {"window": (50, 0)}),
    ((1, 128, 1, 4, 100, 576, 512), {"window": (20, 1)}),
    ((1, 64, 1, 2, 150, 264, 64), {"causal": True, "window": (1000, 0)}),
    # many packed rows at D <= 256 (tiles.FOLD_DECODE_ENABLED, forced on): one causal row,
    # several unmasked rows at once ("bshd" declines the fold and decodes)
    ((2, 64, 1, 1, 300, 128, 128), {"causal": True}),
    ((1, 16, 2, 8, 200, 64, 80), {"softcap": 20.0}),
]

DEFAULTS = dict(causal=False, window=None, scale=None, softcap=None, alibi_slopes=None,
                dropout_p=0.0, seed=None, block_q=None, block_k=None, deterministic=True)


def golden_launch(choice, q, k, v, o, lse, options, *_, **__):
    """`launch_forward._run` for a folded problem: the golden model into o and lse, after
    the kernels' contract is checked; returns the launch (for the cache) and its alignment."""
    def launch(q, k, v, o, lse):
        assert options.window_left == UNLIMITED and options.window_right == UNLIMITED, \
            "a folded problem keeps no mask"
        assert options.alignment is None and options.row_offset == options.col_offset == 0
        assert lse.flags.c_contiguous, f"lse strides {lse.strides}: the kernels take none"
        for name, array in (("q", q), ("k", k), ("v", v), ("o", o)):
            assert array.strides[3] == array.itemsize, f"{name}'s rows are not contiguous"
        wide = [np.asarray(a, np.float64) for a in (q, k, v)]
        result, row_lse = tileattn.forward(*wide, backend="reference", return_lse=True,
                                           scale=options.scale, softcap=options.softcap or None)
        o[...] = result
        lse[...] = row_lse
    launch(q, k, v, o, lse)
    return launch, 16


def main() -> int:
    standin = _install_cupy_standin()
    from tileattn.gpu import launch_forward, tiles

    launch_forward._run = golden_launch
    tiles.FOLD_MIN_WAVE = 0.0  # small grids fold too (every launch here must be a fold)
    tiles.FOLD_DECODE_ENABLED = True
    rng = np.random.default_rng(0)
    failures = 0
    for (batch, hq, hkv, nq, nk, d, dv), options in CASES:
        q, k, v = (rng.standard_normal(s).astype(np.float16)
                   for s in ((batch, hq, nq, d), (batch, hkv, nk, d), (batch, hkv, nk, dv)))
        poisoned = nq > 1 and (options.get("causal", False)
                               or options.get("window", (None, None))[1] == 0)
        if poisoned:  # the last key: the last row's alone
            k[:, :, -1] = np.nan
            v[:, :, -1] = np.inf
        golden_o, golden_lse = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                                backend="reference", return_lse=True,
                                                **options)
        kept = slice(0, nq - 1 if poisoned else nq)
        for layout in ("bhsd", "bshd"):
            arrays = [standin.asarray(a) for a in (q, k, v)]
            if layout == "bshd":  # the caller's (B, N, H, D) arrays, seen heads first
                arrays = [standin.asarray(np.ascontiguousarray(a.swapaxes(1, 2))).swapaxes(1, 2)
                          for a in (q, k, v)]
            resolved = validate(*arrays, **{**DEFAULTS, **options}).options
            for call in ("first", "cached"):
                out = (standin.empty((batch, nq, hq, dv), np.float16).swapaxes(1, 2)
                       if layout == "bshd" else None)
                label = f"{call} {layout} q{q.shape} k{k.shape} v{v.shape} {options}"
                try:
                    o, lse = launch_forward.forward(*arrays, resolved, out=out)
                    assert_attention_close(np.asarray(o)[:, :, kept], golden_o[:, :, kept],
                                           np.float16, name="o")
                    assert_attention_close(np.asarray(lse)[:, :, kept],
                                           golden_lse[:, :, kept], np.float16, name="lse")
                    print(f"ok {label}")
                except AssertionError as error:
                    print(f"FAILED {label}: {error}")
                    failures += 1
    print("all passed" if not failures else f"{failures} failed")
    return failures


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
