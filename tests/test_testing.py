"""The public testing kit: the strategies cover what they promise and the check catches errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

import tileattn
from tileattn.testing import (TOLERANCES, AttentionProblem, assert_attention_close,
                              attention_error, attention_problems, tolerance_for,
                              varlen_problems)


def test_close_arrays_pass_and_far_arrays_fail():
    expected = np.random.default_rng(0).standard_normal((4, 5))
    assert_attention_close(expected.astype(np.float32), expected, np.float32)
    with pytest.raises(AssertionError, match=r"o \(float32\): 1 of 20 elements out of tolerance"):
        off = expected.copy()
        off[2, 3] += 1e-3
        assert_attention_close(off, expected, np.float32, name="o")


def test_non_finite_values_must_match_in_place_and_sign():
    expected = np.array([0.0, -np.inf, np.nan, 1.0])
    assert_attention_close(expected.copy(), expected, np.float64)
    for wrong in ([0.0, np.inf, np.nan, 1.0], [0.0, -np.inf, 0.0, 1.0], [0.0, -5.0, np.nan, 1.0],
                  [np.nan, -np.inf, np.nan, 1.0]):
        with pytest.raises(AssertionError, match="non-finite values differ"):
            assert_attention_close(np.array(wrong), expected, np.float64)
    assert attention_error(np.array([0.0, 0.0, np.nan, 1.0]), expected, np.float64) == np.inf


def test_shape_mismatch_fails():
    with pytest.raises(AssertionError, match=r"shape \(3,\) != expected \(4,\)"):
        assert_attention_close(np.zeros(3), np.zeros(4), np.float32)
    with pytest.raises(ValueError, match=r"shape \(3, 4\) != expected \(4,\)"):
        attention_error(np.ones((3, 4)), np.ones(4), np.float32)


def test_a_dtype_without_a_tolerance_is_named():
    with pytest.raises(ValueError, match="no tolerance for dtype int32: attention runs in "
                                         "float64, float32, float16, bfloat16"):
        tolerance_for(np.int32)


def test_every_tolerance_is_found_by_its_name_as_a_string():
    """ "bfloat16" as a string too, which NumPy's np.dtype does not know."""
    for name, tolerance in TOLERANCES.items():
        assert tolerance_for(name) == tolerance
    assert_attention_close(np.ones(3, np.float32) * 1.01, np.ones(3), "bfloat16")
    with pytest.raises(AssertionError, match=r"\(bfloat16\): 3 of 3 elements"):
        assert_attention_close(np.ones(3) * 1.1, np.ones(3), "bfloat16")


def test_tolerances_tighten_with_precision():
    order = ["bfloat16", "float16", "float32", "float64"]
    rtols = [TOLERANCES[name].rtol for name in order]
    assert rtols == sorted(rtols, reverse=True)


@settings(max_examples=200)
@given(problem=attention_problems())
def test_dropout_problems_draw_do_at_the_kept_scale(problem: AttentionProblem):
    """dP = dO V^T / (1 - p) stays at unit scale, which the float32 tolerance of dq and dk
    assumes: at p = 0.9 and Dv = 256, a unit-normal dO made any float32 backward (plain
    NumPy too) 3.6x the tolerance through the cancellation in dP - rowsum(dO * O)."""
    keep = 1.0 - problem.options.get("dropout_p", 0.0)
    assert np.all(np.abs(problem.do.astype(np.float64)) <= 7.0 * keep)


@settings(max_examples=200)
@given(problem=attention_problems())
def test_strategy_draws_valid_problems(problem: AttentionProblem):
    assert problem.q.dtype == problem.k.dtype == problem.v.dtype == problem.do.dtype
    o = tileattn.forward(problem.q, problem.k, problem.v, **problem.options,
                         backend="reference")
    assert o.shape == problem.do.shape


def test_strategy_covers_the_advertised_space():
    seen = {"empty": False, "length_one": False, "gqa": False, "cross": False,
            "dv_differs": False, "two_dim": False, "dropout": False, "non_contiguous": False,
            "block_1": False, "big_head_dim": False}

    @settings(max_examples=400, database=None)
    @given(problem=attention_problems())
    def record(problem):
        q, k, v = problem.q, problem.k, problem.v
        seen["empty"] |= q.size == 0
        seen["length_one"] |= q.shape[-2] == 1
        seen["gqa"] |= q.ndim >= 3 and k.shape[-3] not in (0, q.shape[-3])
        seen["cross"] |= q.shape[-2] != k.shape[-2]
        seen["dv_differs"] |= v.shape[-1] != q.shape[-1]
        seen["two_dim"] |= q.ndim == 2
        seen["dropout"] |= problem.options.get("dropout_p", 0) > 0
        seen["non_contiguous"] |= not q.flags.c_contiguous
        seen["block_1"] |= problem.options.get("block_q") == 1
        seen["big_head_dim"] |= q.shape[-1] >= 128

    record()
    assert all(seen.values()), [name for name, hit in seen.items() if not hit]


def test_strategy_draws_every_dtype():
    dtypes = set()

    @settings(max_examples=200, database=None)
    @given(problem=attention_problems())
    def record(problem):
        dtypes.add(problem.dtype.name)

    record()
    assert {"float16", "float32", "float64"} <= dtypes


@pytest.mark.parametrize("dtypes, names", [
    ([np.float64], {"float64"}),
    (["float16", np.float32], {"float16", "float32"}),
    ("bfloat16", {"bfloat16"}),
    (np.float32, {"float32"}),
])
def test_strategies_take_dtypes_as_a_list_or_by_name(dtypes, names):
    """`dtypes` may be dtypes or names, not only a strategy ("bfloat16" by name too), for
    both strategies."""
    if "bfloat16" in names:
        pytest.importorskip("ml_dtypes")
    drawn = set()

    @settings(max_examples=25, database=None)
    @given(problem=attention_problems(dtypes=dtypes), varlen=varlen_problems(dtypes=dtypes))
    def record(problem, varlen):
        drawn.add(problem.dtype.name)
        drawn.add(varlen.dtype.name)

    record()
    assert drawn == names

    @settings(max_examples=1, database=None)
    @given(problem=attention_problems(dtypes=[]))
    def draw_from_nothing(problem):
        pass
    with pytest.raises(ValueError, match="dtypes is empty"):
        draw_from_nothing()
