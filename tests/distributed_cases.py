"""Cases and checks shared by the distributed tests: the in-process simulated ranks
(tests/test_distributed.py) and the MPI ranks (tests/distributed_worker.py under mpiexec).

Each case runs `td.forward` and `td.backward` on every rank's shards, gathers the results
with `td.unshard`, and compares them on every rank with the float64 golden model of the
whole problem: float64 within 1e-12 relative, other dtypes within `tileattn.testing`'s
tolerances.
"""

from __future__ import annotations

import numpy as np

import tileattn
import tileattn.distributed as td
from tileattn.testing import assert_attention_close, bfloat16

OPTION_SETS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window": (5, 3)},
    # wider than a shard's own keys at P >= 2 (a shard's validation calls it unlimited)
    "wide-window": {"window": (30, 25)},
    "causal-window": {"causal": True, "window": (7, None)},
    "softcap-alibi-scale": {"softcap": 2.0, "alibi": True, "scale": 0.3},
    "causal-alibi-dropout": {"causal": True, "alibi": True, "dropout_p": 0.3},
    "window-dropout-softcap-blocks": {"window": (6, 2), "dropout_p": 0.5, "softcap": 3.0,
                                      "block_q": 3, "block_k": 5},
}

FLOAT64_RELATIVE = 1e-12


def dtype_named(name: str):
    return bfloat16() if name == "bfloat16" else np.dtype(name)


def option_kwargs(name: str, n_q_heads: int) -> dict:
    options = dict(OPTION_SETS[name])
    if options.pop("alibi", False):
        options["alibi_slopes"] = np.linspace(0.05, 0.4, n_q_heads)
    if options.get("dropout_p"):
        options["seed"] = 1234
    return options


def problem(dtype, n_q=48, n_k=48, n_q_heads=4, n_kv_heads=2, head_dim=16, value_dim=8,
            seed=0):
    """q, k, v, do of a GQA problem with Dv != D, drawn in float64 and rounded to dtype."""
    rng = np.random.default_rng(seed)

    def draw(*shape):
        return rng.standard_normal(shape).astype(dtype)
    return (draw(2, n_q_heads, n_q, head_dim), draw(2, n_kv_heads, n_k, head_dim),
            draw(2, n_kv_heads, n_k, value_dim), draw(2, n_q_heads, n_q, value_dim))


def assert_float64_exact(actual, expected, name):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    finite = np.isfinite(expected)
    assert np.array_equal(np.isfinite(actual), finite), f"{name}: non-finite values differ"
    scale = max(1.0, float(np.max(np.abs(expected[finite]), initial=0.0)))
    error = float(np.max(np.abs(actual[finite] - expected[finite]), initial=0.0)) / scale
    assert error <= FLOAT64_RELATIVE, f"{name}: relative error {error:.3g} > {FLOAT64_RELATIVE}"


def check_case(group, *, dtype, options_name, layout, backend, to_memory=lambda a: a,
               to_host=lambda a: a, n_q=48, n_k=48):
    """Forward and backward of one case on this rank; raises AssertionError when the
    gathered results are out of tolerance. Returns the largest error seen, as a string."""
    q, k, v, do = problem(dtype, n_q=n_q, n_k=n_k)
    options = option_kwargs(options_name, q.shape[1])
    wide = [a.astype(np.float64) for a in (q, k, v, do)]
    o_gold, lse_gold = tileattn.forward(*wide[:3], backend="reference", return_lse=True,
                                        **options)

    def shard(x, axis=-2):
        return to_memory(td.shard(x, group, layout=layout, axis=axis))

    def gather(x, axis=-2):
        return to_host(td.unshard(x, group, layout=layout, axis=axis))

    o, lse = td.forward(shard(q), shard(k), shard(v), group=group, layout=layout,
                        backend=backend, return_lse=True, **options)
    grads = td.backward(shard(do), shard(q), shard(k), shard(v), o, lse, group=group,
                        layout=layout, backend=backend, **options)
    o_all, lse_all = gather(o), gather(lse, axis=-1)
    # The gradients are exact for the o they are given (SPEC "Backward"): the golden model's
    # backward gets the ring's o, so a 16-bit o's rounding does not count against them.
    grads_gold = tileattn.backward(wide[3], *wide[:3], o_all.astype(np.float64), lse_gold,
                                   backend="reference", **options)
    assert o_all.dtype == q.dtype, f"o has dtype {o_all.dtype}, not {q.dtype}"
    expected_lse = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    assert lse_all.dtype == expected_lse, f"lse has dtype {lse_all.dtype}, not {expected_lse}"
    results = [("o", o_all, o_gold), ("lse", lse_all, lse_gold)]
    results += [(name, gather(grad), want)
                for name, grad, want in zip(("dq", "dk", "dv"), grads, grads_gold)]
    for name, got, want in results:
        assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
        if np.dtype(dtype) == np.float64:
            assert_float64_exact(got, want, name)
        else:
            assert_attention_close(got, want, dtype, name=name)
    return "ok"
