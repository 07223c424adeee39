"""A block of a problem, placed by `AttentionOptions.row_offset`/`col_offset`/`alignment`,
computes exactly that block's share of the whole: what `tileattn.distributed` builds on.

The forward of each (query block, key block) pair, merged over the key blocks by their
log-sum-exp, must equal the forward of the whole problem; the backward of each pair, given
the whole problem's ``o`` and ``lse`` rows, must sum to the whole problem's gradients. Every
score option runs, dropout included (its hash must see global positions).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tileattn
from tileattn.api import run_backward, run_forward
from tileattn.testing import assert_attention_close
from tileattn.validation import validate

OPTION_SETS = [
    {},
    {"causal": True},
    {"causal": True, "window": (5, None)},
    {"window": (3, 7)},
    {"window": (0, 0)},
    {"softcap": 2.0, "alibi": True},
    {"causal": True, "alibi": True, "dropout_p": 0.3},
    {"window": (6, 2), "dropout_p": 0.5, "softcap": 3.0},
]


def _problem(rng, dtype, n_q, n_k, n_q_heads=4, n_kv_heads=2, head_dim=16, value_dim=8):
    def draw(*shape):
        return rng.standard_normal(shape).astype(dtype)
    return (draw(2, n_q_heads, n_q, head_dim), draw(2, n_kv_heads, n_k, head_dim),
            draw(2, n_kv_heads, n_k, value_dim))


def _kwargs(options, n_q_heads=4):
    kwargs = {k: v for k, v in options.items() if k != "alibi"}
    if options.get("alibi"):
        kwargs["alibi_slopes"] = np.linspace(0.05, 0.4, n_q_heads)
    if kwargs.get("dropout_p"):
        kwargs["seed"] = 1234
    return kwargs


def _cuts(n, pieces):
    edges = np.linspace(0, n, pieces + 1).round().astype(int)
    return list(zip(edges[:-1], edges[1:]))


def _placed(problem, row_start, col_start, n_q, n_k, window):
    """The validated block problem, placed at (row_start, col_start) of the whole; the
    window sides come from the whole problem's validation (a block's own would call a
    side reaching past its few keys unlimited)."""
    options = dataclasses.replace(problem.options, row_offset=int(row_start),
                                  col_offset=int(col_start), alignment=n_k - n_q,
                                  window_left=window[0], window_right=window[1])
    return dataclasses.replace(problem, options=options)


def _merge(o_acc, lse_acc, o, lse):
    """Merge two partial results of the same rows by their log-sum-exp (float64)."""
    new = np.logaddexp(lse_acc, lse)
    safe = np.where(np.isneginf(new), 0.0, new)
    w_acc = np.where(np.isneginf(lse_acc), 0.0, np.exp(lse_acc - safe))[..., None]
    w = np.where(np.isneginf(lse), 0.0, np.exp(lse - safe))[..., None]
    return w_acc * o_acc + w * o, new


def _option_id(options):
    return "-".join(sorted(options)) or "plain"


@pytest.mark.parametrize("precision", ["high", "low"])
@pytest.mark.parametrize("options", OPTION_SETS, ids=_option_id)
@pytest.mark.parametrize("n_q, n_k, row_pieces, col_pieces",
                         [(24, 24, 3, 3), (20, 33, 2, 3), (33, 20, 4, 2)])
def test_blocks_merge_to_the_whole_problem(backend, options, n_q, n_k, row_pieces, col_pieces,
                                           precision):
    """`precision`: float64 and float32 on the host; float32 (3xTF32) and float16 on the
    GPU's tensor cores."""
    dtype = {("high", False): np.float64, ("low", False): np.float32,
             ("high", True): np.float32, ("low", True): np.float16}[precision,
                                                                     backend.name == "gpu"]
    _assert_blocks_merge(backend, options, n_q, n_k, row_pieces, col_pieces, dtype=dtype)


def _assert_blocks_merge(backend, options, n_q, n_k, row_pieces, col_pieces, n_q_heads=4,
                         n_kv_heads=2, head_dim=16, value_dim=8, dtype=None, **extra_kwargs):
    rng = np.random.default_rng(n_q * 100 + n_k)
    if dtype is None:
        dtype = np.float64 if backend.name != "gpu" else np.float32
    q, k, v = _problem(rng, dtype, n_q, n_k, n_q_heads, n_kv_heads, head_dim, value_dim)
    do = rng.standard_normal((2, n_q_heads, n_q, value_dim)).astype(dtype)
    kwargs = {**_kwargs(options, n_q_heads), **extra_kwargs}
    as_backend, to_host = backend.to_memory, backend.to_host
    o_full, lse_full = tileattn.forward(q, k, v, backend="reference", return_lse=True,
                                        **kwargs)
    dq_full, dk_full, dv_full = tileattn.backward(do, q, k, v, o_full, lse_full,
                                                  backend="reference", **kwargs)
    whole = validate(q, k, v, **_whole_option_kwargs(kwargs))
    window = (whole.options.window_left, whole.options.window_right)

    o = np.zeros_like(o_full, dtype=np.float64)
    lse = np.full(lse_full.shape, -np.inf)
    dq, dk, dv = (np.zeros(a.shape) for a in (q, k, v))
    for r0, r1 in _cuts(n_q, row_pieces):
        for c0, c1 in _cuts(n_k, col_pieces):
            block = [as_backend(a) for a in (q[:, :, r0:r1], k[:, :, c0:c1], v[:, :, c0:c1])]
            problem = validate(*block, **_whole_option_kwargs(kwargs))
            placed = _placed(problem, r0, c0, n_q, n_k, window)
            o_block, lse_block = (to_host(a)
                                  for a in run_forward(placed, backend.name))
            o[:, :, r0:r1], lse[:, :, r0:r1] = _merge(
                o[:, :, r0:r1], lse[:, :, r0:r1], o_block.astype(np.float64),
                lse_block.astype(np.float64))
            grads = validate(*block, do=as_backend(do[:, :, r0:r1]),
                             o=as_backend(o_full[:, :, r0:r1]),
                             lse=as_backend(lse_full[:, :, r0:r1]),
                             **_whole_option_kwargs(kwargs))
            grads = _placed(grads, r0, c0, n_q, n_k, window)
            dq_b, dk_b, dv_b = (to_host(a).astype(np.float64)
                                for a in run_backward(grads, backend.name))
            dq[:, :, r0:r1] += dq_b
            dk[:, :, c0:c1] += dk_b
            dv[:, :, c0:c1] += dv_b
    assert_attention_close(o, o_full, dtype, name="o")
    assert_attention_close(lse, lse_full, dtype, name="lse", lse_magnitude=1.0)
    for name, got, want in (("dq", dq, dq_full), ("dk", dk, dk_full), ("dv", dv, dv_full)):
        assert_attention_close(got, want, dtype, name=name)


# Windows wider than a block's own rows plus keys (the blocks below are at most 16 x 16):
# a block must keep the whole problem's sides, neither clamped nor taken as unlimited.
WIDE_WINDOWS = [
    {"window": (40, 30)},
    {"causal": True, "window": (50, None), "alibi": True, "dropout_p": 0.2},
]

CPU_PATHS = {
    # Blocks of more than 32 rows (decode.MAX_QUERY_ROWS) take the forward kernel, in 8 x 8
    # tiles that the band skips or cuts; the backward's key-tile and query-tile schedules.
    "tiles": dict(n_q=70, n_k=50, row_pieces=2, col_pieces=2, block_q=8, block_k=8),
    # Blocks of at most 32 rows against many keys: the decode path, split over the keys;
    # one kv head for all four query heads, Dv > D.
    "decode-splits": dict(n_q=12, n_k=400, row_pieces=2, col_pieces=2, n_kv_heads=1,
                          head_dim=8, value_dim=24, block_k=16),
    "wide-window-blocks": dict(n_q=64, n_k=64, row_pieces=4, col_pieces=4),
}


@pytest.mark.parametrize("options", OPTION_SETS + WIDE_WINDOWS, ids=_option_id)
@pytest.mark.parametrize("path", list(CPU_PATHS))
@pytest.mark.parametrize("schedule", ["key-parts", "split"])
@pytest.mark.parametrize("backend", ["cpu"], indirect=True)
def test_cpu_blocks_merge_on_every_path(backend, monkeypatch, options, path, schedule):
    from tileattn import cpu
    from tileattn.cpu import decode

    # Force what a small machine would not choose: a backward schedule over key tiles (dQ
    # in parts per key tile, or in a second pass over query tiles) and three key splits on
    # the decode path.
    monkeypatch.setattr(cpu, "_use_heads_schedule", lambda *args: False)
    if schedule == "split":
        monkeypatch.setattr(cpu, "KEY_PARTS_BUDGET", 0.0)
    else:
        monkeypatch.setattr(cpu, "KEY_PARTS_BUDGET", 100.0)
    monkeypatch.setattr(decode, "split_count", lambda *args: 3)
    _assert_blocks_merge(backend, options, **CPU_PATHS[path])


def _whole_option_kwargs(kwargs):
    """Validation kwargs of a block: the whole problem's, with the deterministic backward."""
    return {"causal": False, "window": None, "scale": None, "softcap": None,
            "alibi_slopes": None, "dropout_p": 0.0, "seed": None, "block_q": None,
            "block_k": None, "deterministic": True, **kwargs}


def test_default_options_are_a_whole_problem():
    options = validate(*_problem(np.random.default_rng(0), np.float64, 5, 9),
                       **_whole_option_kwargs({})).options
    assert (options.row_offset, options.col_offset, options.alignment) == (0, 0, None)
    assert options.band_offset(5, 9) == 4
    placed = dataclasses.replace(options, row_offset=10, col_offset=3, alignment=0)
    assert placed.band_offset(5, 9) == 7
