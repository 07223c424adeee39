"""Scalar options at the edges of the compute dtype, and dropout below the hash's resolution.

A scalar option (scale, softcap, an ALiBi slope) that rounds to zero or to a subnormal, or
overflows, in the compute dtype (float32 for 16/32-bit inputs, float64 for float64) is
rejected at the boundary with both values named: the backends would silently disagree on
it. A ``0 < dropout_p < 2**-16`` (the hash's resolution) drops nothing, and every backend
treats it as off.
"""

from __future__ import annotations

import numpy as np
import pytest

import tileattn
from tileattn.dropout import RANDOM_BITS
from tileattn.testing import assert_attention_close

RESOLUTION = 2.0**-RANDOM_BITS  # the smallest dropout_p that drops anything


def problem(dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((2, 4, 9, 8), (2, 2, 11, 8), (2, 2, 11, 8), (2, 4, 9, 8))
    return tuple(rng.standard_normal(shape).astype(dtype) for shape in shapes)


def assert_rejected(match, dtype=np.float32, **options):
    """Forward and backward both raise, before anything runs, on every backend name."""
    q, k, v, do = problem(dtype)
    lse = np.zeros(q.shape[:-1], np.float64 if dtype == np.float64 else np.float32)
    for backend in ("auto", "reference", "cpu", "gpu"):
        with pytest.raises(ValueError, match=match):
            tileattn.forward(q, k, v, backend=backend, **options)
        with pytest.raises(ValueError, match=match):
            tileattn.backward(do, q, k, v, do, lse, backend=backend, **options)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_a_softcap_that_rounds_to_zero_is_rejected(dtype):
    # The CPU forward ignored it and its backward read a buffer it had never filled.
    name = np.dtype(dtype).name
    assert_rejected(rf"softcap=1e-46 vanishes in float32, the compute dtype of {name} "
                    r"inputs: it rounds to 0.0, below the smallest normal float32 1.17549e-38",
                    dtype, softcap=1e-46)


def test_a_subnormal_softcap_is_rejected():
    # The GPU flushes subnormals to zero, the CPU does not: they would disagree.
    assert_rejected(r"softcap=1e-40 vanishes in float32, .* it rounds to 9.99994610111476e-41",
                    softcap=1e-40)


@pytest.mark.parametrize("name", ["scale", "softcap"])
def test_an_overflowing_scalar_is_rejected(name):
    assert_rejected(rf"{name}=1e\+39 overflows in float32, the compute dtype of float32 "
                    rf"inputs: {name} \* log2\(e\) = 1.4427e\+39, which the kernels use, "
                    r"exceeds the largest float32 3.40282e\+38", **{name: 1e39})
    # Below the largest float32 but not once log2(e) is folded in.
    assert_rejected(rf"{name}=3e\+38 overflows in float32", **{name: 3e38})


def test_a_vanishing_scale_is_rejected():
    assert_rejected(r"scale=1e-46 vanishes in float32, .* it rounds to 0.0", scale=1e-46)
    assert_rejected(r"scale=-1e-310 vanishes in float64, the compute dtype of float64 inputs: "
                    r"it rounds to -1e-310, below the smallest normal float64 2.22507e-308",
                    np.float64, scale=-1e-310)


def test_a_softcap_too_small_for_the_scale_is_rejected():
    assert_rejected(r"softcap=1e-30 is too small for scale=10000000000.0 in float32, the compute "
                    r"dtype of float32 inputs: scale / softcap = 1e\+40 exceeds the largest "
                    r"float32 3.40282e\+38", scale=1e10, softcap=1e-30)


def test_an_int_beyond_float64_is_rejected():
    assert_rejected(r"scale must be finite, got 1000000000.*, which overflows float64",
                    scale=10**400)


@pytest.mark.parametrize("slope, match", [
    (np.nan, r"alibi_slopes must be finite, got nan at index \(2,\)"),
    (np.inf, r"alibi_slopes must be finite, got inf at index \(2,\)"),
    (1e39, r"alibi_slopes\[2\]=1e\+39 overflows in float32"),
    (1e-45, r"alibi_slopes\[2\]=1e-45 vanishes in float32, .* it rounds to 1.401298464324817e-45"),
])
def test_a_degenerate_alibi_slope_is_rejected(slope, match):
    assert_rejected(match, alibi_slopes=np.array([0.5, 0.25, slope, 0.0]))


def test_per_batch_slopes_name_their_index():
    slopes = np.full((2, 4), 0.5)
    slopes[1, 3] = np.nan
    assert_rejected(r"alibi_slopes must be finite, got nan at index \(1, 3\)",
                    alibi_slopes=slopes)


def test_values_the_compute_dtype_holds_are_accepted_on_every_backend(backend):
    """The same magnitudes that float32 rejects are fine for float64 inputs, zero is fine
    everywhere (scale 0 is uniform attention, softcap 0 is off), and every backend agrees
    with the golden model on them."""
    cases = [(np.float64, dict(softcap=1e-46)), (np.float64, dict(softcap=1e39)),
             (np.float64, dict(scale=1e-300)),
             (np.float32, dict(scale=0.0)), (np.float32, dict(softcap=0.0)),
             (np.float32, dict(scale=-0.5, softcap=2e-38)),
             (np.float32, dict(alibi_slopes=np.array([0.0, 2e-38, 0.5, 1e37])))]
    for dtype, options in cases:
        q, k, v, do = problem(dtype)
        o, lse = backend.forward(q, k, v, return_lse=True, **options)
        golden = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)), return_lse=True,
                                  backend="reference", **options)
        assert_attention_close(o, golden[0], dtype, name=f"o with {options}")
        grads = backend.backward(do, q, k, v, o, lse, **options)
        golden_grads = tileattn.backward(*(a.astype(np.float64) for a in (do, q, k, v, o)),
                                         golden[1], backend="reference", **options)
        for name, grad, want in zip(("dq", "dk", "dv"), grads, golden_grads):
            assert_attention_close(grad, want, dtype, name=f"{name} with {options}")


@pytest.mark.parametrize("n_q", [2, 9], ids=["decode", "prefill"])
def test_block_sizes_far_beyond_the_sequence_change_nothing(backend, n_q):
    """SPEC: any positive block size is valid, larger than the sequence included. Block
    sizes near the int64 range, decode-shaped (two query rows) and prefill-shaped, agree
    with the golden model in both directions (the CPU decode had sized its tile buffers by
    block_k: MemoryError)."""
    q, k, v, do = problem(np.float32)
    q, do = q[:, :, :n_q], do[:, :, :n_q]
    golden = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)), return_lse=True,
                              backend="reference", causal=True)
    golden_grads = tileattn.backward(*(a.astype(np.float64) for a in (do, q, k, v)),
                                     golden[0], golden[1], backend="reference", causal=True)
    for blocks in (dict(block_k=10**9), dict(block_q=2**40, block_k=2**62)):
        o, lse = backend.forward(q, k, v, return_lse=True, causal=True, **blocks)
        assert_attention_close(o, golden[0], np.float32, name=f"o with {blocks}")
        grads = backend.backward(do, q, k, v, golden[0].astype(np.float32), lse, causal=True,
                                 **blocks)
        for name, grad, want in zip(("dq", "dk", "dv"), grads, golden_grads):
            assert_attention_close(grad, want, np.float32, name=f"{name} with {blocks}")


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=lambda d: d.__name__)
@pytest.mark.parametrize("softcap", [1e4, 1e9, 1e30])
def test_a_softcap_far_above_the_scores_changes_nothing(backend, dtype, softcap):
    """``softcap * tanh(s / softcap)`` is ``s`` where ``|s|`` is far below the cap, so the
    call is plain attention, forward and backward. (A tanh whose error near 0 is absolute,
    not relative, turns every such score into 0.)"""
    q, k, v, do = problem(dtype)
    o, lse = backend.forward(q, k, v, return_lse=True, softcap=softcap)
    plain, plain_lse = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                        return_lse=True, backend="reference")
    assert_attention_close(o, plain, dtype, name=f"o with softcap={softcap}")
    assert_attention_close(lse, plain_lse, dtype, name=f"lse with softcap={softcap}")
    grads = backend.backward(do, q, k, v, o, lse, softcap=softcap)
    golden = tileattn.backward(*(a.astype(np.float64) for a in (do, q, k, v, o)), plain_lse,
                               backend="reference")
    for name, grad, want in zip(("dq", "dk", "dv"), grads, golden):
        assert_attention_close(grad, want, dtype, name=f"{name} with softcap={softcap}")


@pytest.mark.parametrize("dropout_p", [1e-300, 2.0**-33, RESOLUTION / 2, RESOLUTION * (1 - 2.0**-20)])
def test_dropout_below_the_hash_resolution_is_off_on_every_backend(backend, dropout_p):
    """floor(dropout_p * 2**16) == 0 keeps every entry. The CPU kernels skipped the
    1 / (1 - p) rescale then and the golden model applied it; now every backend gets
    dropout_p = 0 and gives exactly the dropout-free result."""
    q, k, v, do = problem(np.float64)
    o, lse = backend.forward(q, k, v, return_lse=True, dropout_p=dropout_p, seed=5)
    plain_o, plain_lse = backend.forward(q, k, v, return_lse=True)
    np.testing.assert_array_equal(o, plain_o)
    np.testing.assert_array_equal(lse, plain_lse)
    grads = backend.backward(do, q, k, v, o, lse, dropout_p=dropout_p, seed=5)
    for grad, plain in zip(grads, backend.backward(do, q, k, v, o, lse)):
        np.testing.assert_array_equal(grad, plain)


def test_dropout_at_the_hash_resolution_rescales(backend):
    """dropout_p = 2**-16 has threshold 1: dropout is on (rescaled by 1 / (1 - p)) and every
    backend agrees with the golden model."""
    q, k, v, _ = problem(np.float64)
    options = dict(dropout_p=RESOLUTION, seed=5)
    o = backend.forward(q, k, v, **options)
    golden = tileattn.forward(q, k, v, backend="reference", **options)
    assert_attention_close(o, golden, np.float64)
    assert not np.array_equal(golden, tileattn.forward(q, k, v, backend="reference"))


def test_dropout_below_the_resolution_still_needs_a_seed():
    """The seed rule follows the caller's dropout_p, not the effective one: code that runs
    with 1e-12 today and 0.1 tomorrow must already pass a seed."""
    assert_rejected(r"seed must be an int when dropout_p > 0", dropout_p=1e-12)
