"""The golden model checked against first principles: finite differences, hand-worked
cases for each option, and the tiled FlashAttention-2 form equal to the dense form."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tileattn
from tileattn import dropout
from tileattn.options import AttentionOptions, keeps
from tileattn.reference import (dense_backward, dense_forward, dense_probabilities,
                                tiled_backward, tiled_forward)
from tileattn.testing import assert_attention_close, attention_problems
from tileattn.validation import validate


def options_for(problem_or_arrays, **kwargs) -> tuple:
    """Validated 4-D arrays and options, as a backend would receive them."""
    q, k, v = problem_or_arrays
    problem = validate(q, k, v, causal=kwargs.pop("causal", False),
                       window=kwargs.pop("window", None), scale=kwargs.pop("scale", None),
                       softcap=kwargs.pop("softcap", None),
                       alibi_slopes=kwargs.pop("alibi_slopes", None),
                       dropout_p=kwargs.pop("dropout_p", 0.0), seed=kwargs.pop("seed", None),
                       block_q=kwargs.pop("block_q", None), block_k=kwargs.pop("block_k", None),
                       deterministic=True)
    assert not kwargs
    t = problem.tensors
    return t["q"], t["k"], t["v"], problem.options


# --------------------------------------------------------------------------- dense backward


@pytest.mark.parametrize("kwargs", [
    {},
    {"causal": True},
    {"window": (2, 1), "softcap": 1.5},
    {"alibi_slopes": np.array([0.3, 0.7, 0.1, 0.5]), "scale": 0.8},
    {"dropout_p": 0.3, "seed": 99, "causal": True},
    {"softcap": 0.7, "window": (None, 0), "alibi_slopes": np.array([1.0, 0.0, 0.2, 0.4])},
])
def test_dense_backward_matches_finite_differences(kwargs):
    rng = np.random.default_rng(0)
    # Nq > Nk with causal leaves fully masked rows; GQA with 4 query heads on 2 kv heads.
    q = rng.standard_normal((1, 4, 6, 3))
    k = rng.standard_normal((1, 2, 5, 3))
    v = rng.standard_normal((1, 2, 5, 2))
    do = rng.standard_normal((1, 4, 6, 2))
    q4, k4, v4, options = options_for((q, k, v), **kwargs)
    grads = dense_backward(do, q4, k4, v4, dense_forward(q4, k4, v4, options)[0], options)

    def loss(q_, k_, v_):
        return float(np.sum(dense_forward(q_, k_, v_, options)[0] * do))

    step = 1e-6
    for index, (name, array) in enumerate((("q", q4), ("k", k4), ("v", v4))):
        numeric = np.zeros_like(array)
        for position in np.ndindex(array.shape):
            args = [q4.copy(), k4.copy(), v4.copy()]
            args[index][position] += step
            plus = loss(*args)
            args[index][position] -= 2 * step
            numeric[position] = (plus - loss(*args)) / (2 * step)
        np.testing.assert_allclose(grads[index], numeric, rtol=1e-6, atol=1e-7, err_msg=name)


# --------------------------------------------------------------------------- tiled == dense


@given(problem=attention_problems(dtypes=st.just(np.dtype(np.float64)), allow_empty=False),
       block_q=st.sampled_from([1, 2, 3, 5, 16, 100]), block_k=st.sampled_from([1, 4, 7, 64]))
def test_tiled_form_equals_dense_form(problem, block_q, block_k):
    options = {k: v for k, v in problem.options.items() if k not in ("block_q", "block_k")}
    q, k, v, opts = options_for((problem.q, problem.k, problem.v), **options)
    do = problem.do.reshape(q.shape[:-1] + (v.shape[-1],))
    o, lse = dense_forward(q, k, v, opts)
    tiled_o, tiled_lse = tiled_forward(q, k, v, opts, block_q, block_k)
    assert_attention_close(tiled_o, o, np.float64, name="o")
    assert_attention_close(tiled_lse, lse, np.float64, name="lse")
    for name, tiled, dense in zip(("dq", "dk", "dv"),
                                  tiled_backward(do, q, k, v, o, lse, opts, block_q, block_k),
                                  dense_backward(do, q, k, v, o, opts)):
        assert_attention_close(tiled, dense, np.float64, name=name)


def test_dense_backward_takes_D_from_the_given_o():
    """SPEC: ``D_i = rowsum(do_i * o_i)`` with the ``o`` passed in. Moving ``o`` by ``e``
    moves ``D`` by ``rowsum(do * e)``, hence ``dS = P (dP - D)`` by ``-P rowsum(do * e)``:
    dq by ``-scale rowsum(do * e) (P K)``, dk by ``-scale P^T (rowsum(do * e) Q)``, and dv
    not at all."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(shape) for shape in ((1, 2, 5, 4), (1, 1, 6, 4), (1, 1, 6, 3)))
    do = rng.standard_normal((1, 2, 5, 3))
    q4, k4, v4, options = options_for((q, k, v), causal=True, scale=0.7)
    o = dense_forward(q4, k4, v4, options)[0]
    moved = o + 1e-3 * rng.standard_normal(o.shape)
    exact, shifted = dense_backward(do, q4, k4, v4, o, options), dense_backward(
        do, q4, k4, v4, moved, options)
    probs = dense_probabilities(q4, k4, options)[0]
    delta_shift = np.sum(do * (moved - o), axis=-1, keepdims=True)
    k_rep = np.repeat(k4, 2, axis=1)
    np.testing.assert_allclose(shifted[0] - exact[0], -0.7 * delta_shift * (probs @ k_rep),
                               atol=1e-13)
    dk_shift = -0.7 * np.swapaxes(probs, -1, -2) @ (delta_shift * q4)
    np.testing.assert_allclose(shifted[1] - exact[1], dk_shift.sum(axis=1, keepdims=True),
                               atol=1e-13)
    np.testing.assert_array_equal(shifted[2], exact[2])


# --------------------------------------------------------------------------- hand-worked


def test_two_keys_by_hand():
    # s = [0, ln 3] -> p = [1/4, 3/4] -> o = 4/4 + 3*8/4 = 7, lse = ln(1 + 3) = ln 4.
    q = np.array([[1.0]])
    k = np.array([[0.0], [math.log(3.0)]])
    v = np.array([[4.0], [8.0]])
    o, lse = tileattn.forward(q, k, v, scale=1.0, backend="reference", return_lse=True)
    np.testing.assert_allclose(o, [[7.0]], rtol=1e-14)
    np.testing.assert_allclose(lse, [math.log(4.0)], rtol=1e-14)


def test_equal_keys_average_the_kept_values_8x4():
    """8 queries, 4-dim heads, every key equal: each row averages the values it keeps.
    Causal with bottom-right alignment on 8 x 8 keeps keys 0..i, so o_i = mean(v_0..v_i)."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((8, 4))
    k = np.tile(rng.standard_normal((1, 4)), (8, 1))
    v = rng.standard_normal((8, 4))
    o = tileattn.forward(q, k, v, causal=True, backend="reference")
    expected = np.cumsum(v, axis=0) / np.arange(1, 9)[:, None]
    np.testing.assert_allclose(o, expected, rtol=1e-13)
    # A window of (2, 0) keeps keys i-2..i: a moving average of length 3 (shorter at the top).
    o = tileattn.forward(q, k, v, window=(2, 0), backend="reference")
    for i in range(8):
        np.testing.assert_allclose(o[i], v[max(0, i - 2):i + 1].mean(axis=0), rtol=1e-13)


def test_bottom_right_alignment_picture():
    kept = keeps(np.arange(3)[:, None], np.arange(5)[None, :], 2, -1, 0)
    np.testing.assert_array_equal(kept, [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    kept = keeps(np.arange(5)[:, None], np.arange(3)[None, :], -2, 1, 0)
    np.testing.assert_array_equal(kept, [[0, 0, 0], [0, 0, 0], [1, 0, 0], [1, 1, 0], [0, 1, 1]])


def test_softcap_by_hand():
    # Two keys with raw scores 0 and 4; softcap 2 turns 4 into 2 tanh(2).
    q, k, v = np.array([[1.0]]), np.array([[0.0], [4.0]]), np.array([[0.0], [1.0]])
    o = tileattn.forward(q, k, v, scale=1.0, softcap=2.0, backend="reference")
    capped = 2.0 * math.tanh(2.0)
    np.testing.assert_allclose(o, [[math.exp(capped) / (1 + math.exp(capped))]], rtol=1e-14)


def test_alibi_by_hand():
    # Zero raw scores; ALiBi slope 0.5 on the last query row of 1 x 3: distances 2, 1, 0.
    q, k = np.zeros((1, 2)), np.zeros((3, 2))
    v = np.array([[1.0], [2.0], [3.0]])
    o = tileattn.forward(q[None], k[None], v[None], alibi_slopes=np.array([0.5]),
                         backend="reference")
    weights = np.exp([-1.0, -0.5, 0.0])
    np.testing.assert_allclose(o[0], [[weights @ [1, 2, 3] / weights.sum()]], rtol=1e-14)


def test_gqa_by_hand():
    # Two kv heads with constant values 10 and 20; four query heads -> heads 0,1 read 10.
    q = np.zeros((4, 3, 2))
    k = np.zeros((2, 3, 2))
    v = np.stack([np.full((3, 1), 10.0), np.full((3, 1), 20.0)])
    o = tileattn.forward(q, k, v, backend="reference")
    np.testing.assert_allclose(o[:, 0, 0], [10, 10, 20, 20])


def test_dropout_hash_known_values():
    # fmix32 is MurmurHash3's finaliser: fmix32(1) is a published constant.
    assert dropout.fmix32(1) == 0x514E28B7
    assert dropout.fmix32(0) == 0
    assert dropout.dropout_threshold(0.0) == 0
    assert dropout.dropout_threshold(0.5) == 2**15
    assert dropout.dropout_threshold(0.3) == 19660  # floor(0.3 * 2**16)
    key = dropout.dropout_key(2**40 + 7)
    # Rows 5 and 13 are one pair: one base, one hash a key; row 5 takes its low 16 bits.
    base = dropout.fmix32((dropout.fmix32(key ^ 3) + 5) & 0xFFFFFFFF) & ~1
    assert int(dropout.row_states(key, 3, 5)) == base
    assert int(dropout.row_states(key, 3, 13)) == base | 1
    bits = dropout.fmix32(((base ^ 9) * 0x9E3779B9 + base) & 0xFFFFFFFF)
    for row, random in ((5, bits & 0xFFFF), (13, bits >> 16)):
        assert bool(dropout.keep_mask(2**40 + 7, 0.3, 3, row, 9)) == (random >= 19660)


def test_dropout_keep_rate_and_scaling():
    keep = dropout.keep_mask(123, 0.25, np.arange(8)[:, None, None], np.arange(128)[:, None],
                             np.arange(128)[None, :])
    assert abs(keep.mean() - 0.75) < 0.01
    # Rows and heads get different patterns.
    assert (keep[0] != keep[1]).mean() > 0.3 and (keep[0, 0] != keep[0, 1]).mean() > 0.3
    # The two rows that share a hash (i, i + 8) are independent: both kept at rate 0.75 ** 2.
    pairs = keep.reshape(8, 8, 2, 8, 128)
    assert abs((pairs[:, :, 0] & pairs[:, :, 1]).mean() - 0.75**2) < 0.01
    # No row repeats another's pattern shifted by a few keys (chance agreement: 0.625).
    rows = keep.reshape(-1, 128)
    for shift in range(1, 9):
        agreement = (rows[:, None, shift:] == rows[None, :, :-shift]).mean(axis=-1)
        assert agreement.max() < 0.9, shift  # a shifted copy agrees at 1.0
    # Scaling by 1/(1-p) keeps the expectation: with uniform scores and v = 1, o averages 1.
    q, k, v = np.zeros((64, 64, 2)), np.zeros((64, 64, 2)), np.ones((64, 64, 1))
    o = tileattn.forward(q, k, v, dropout_p=0.25, seed=11, backend="reference")
    assert abs(o.mean() - 1.0) < 0.01


def test_fully_masked_rows_give_zero_not_nan():
    q, k, v = (np.random.default_rng(0).standard_normal((n, 2)) for n in (5, 2, 2))
    o, lse = tileattn.forward(q, k, v, causal=True, backend="reference", return_lse=True)
    assert np.all(o[:3] == 0) and np.all(lse[:3] == -np.inf)
    dq, dk, dv = tileattn.backward(np.ones_like(o), q, k, v, o, lse, causal=True,
                                   backend="reference")
    assert np.all(dq[:3] == 0) and np.isfinite(dk).all() and np.isfinite(dv).all()


def test_reference_returns_input_dtype():
    q = np.ones((2, 3, 4), np.float16)
    o, lse = tileattn.forward(q, q, q, backend="reference", return_lse=True)
    assert o.dtype == np.float16 and lse.dtype == np.float32
    assert AttentionOptions().window_left == -1


def test_tiled_form_keeps_nan_rows_nan():
    q, k, v = (np.random.default_rng(3).standard_normal((1, 1, 6, 4)) for _ in range(3))
    q[0, 0, 2, 1] = np.nan
    _, _, _, options = options_for((q, k, v))
    dense_o, dense_lse = dense_forward(q, k, v, options)
    tiled_o, tiled_lse = tiled_forward(q, k, v, options, 4, 2)
    assert np.isnan(dense_o[0, 0, 2]).all() and np.isnan(tiled_o[0, 0, 2]).all()
    assert_attention_close(tiled_o, dense_o, np.float64)
    assert_attention_close(tiled_lse, dense_lse, np.float64)


@pytest.mark.parametrize("poisoned", ["q", "k", "v", "do"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_tiled_form_equals_dense_form_with_non_finite_inputs(poisoned, value):
    """Masked entries contribute nothing in either form, whatever the tiles: the same NaN and
    infinities land in the same places (tests/test_nonfinite.py checks which places)."""
    rng = np.random.default_rng(6)
    arrays = {"q": rng.standard_normal((1, 4, 9, 3)), "k": rng.standard_normal((1, 2, 7, 3)),
              "v": rng.standard_normal((1, 2, 7, 2)), "do": rng.standard_normal((1, 4, 9, 2))}
    arrays[poisoned][0, 1, 4, 0] = value
    for kwargs in ({"causal": True}, {"window": (2, 1)}):
        q, k, v, options = options_for((arrays["q"], arrays["k"], arrays["v"]), **kwargs)
        o, lse = dense_forward(q, k, v, options)
        dense = dense_backward(arrays["do"], q, k, v, o, options)
        for block_q, block_k in ((1, 2), (3, 5), (4, 4), (16, 16)):
            tiled_o, tiled_lse = tiled_forward(q, k, v, options, block_q, block_k)
            assert_attention_close(tiled_o, o, np.float64, name="o")
            assert_attention_close(tiled_lse, lse, np.float64, name="lse")
            tiled = tiled_backward(arrays["do"], q, k, v, o, lse, options, block_q, block_k)
            for name, tiled_grad, dense_grad in zip(("dq", "dk", "dv"), tiled, dense):
                assert_attention_close(tiled_grad, dense_grad, np.float64, name=name)
