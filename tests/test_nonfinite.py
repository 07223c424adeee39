"""Non-finite inputs reach exactly the outputs that depend on them (SPEC, "Errors").

A NaN or an infinity in ``q``, ``k``, ``v`` or ``do`` reaches only the rows, and the gradient
entries, that keep the key or the row it sits in: a masked entry contributes nothing at all,
not ``0 x NaN``, whatever the block sizes. `reach` predicts those entries from the mask alone;
every backend must be non-finite exactly there (NaN anywhere, and infinities in ``v`` or
``do``; an infinity in ``q`` or ``k`` makes a score ``-inf`` or ``+inf`` by the signs of the
other operand, so there the prediction bounds the non-finite entries from above), must match
the golden model on the same inputs, and elsewhere must equal the golden model on inputs
with the non-finite values replaced by zeros, which those entries never read.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tileattn
from tileattn import backends
from tileattn.options import UNLIMITED, keeps
from tileattn.testing import assert_attention_close, bfloat16

# --------------------------------------------------------------------------- prediction


def kept_mask(n_q, n_k, causal=False, window=None):
    """(Nq, Nk) bool: SPEC step 4, written out again from the option values."""
    left, right = window if window is not None else (None, None)
    left = UNLIMITED if left is None or left < 0 else left
    right = UNLIMITED if right is None or right < 0 else right
    if causal:
        right = 0
    return keeps(np.arange(n_q)[:, None], np.arange(n_k)[None, :], n_k - n_q, left, right)


def _any_product(a, b):
    """Boolean matrix product: ``out[..., i, j] = any_l a[..., i, l] & b[..., l, j]``."""
    return (a.astype(np.int64) @ b.astype(np.int64)) > 0


def reach(q, k, v, do, o, kept):
    """Which entries of ``o``, ``lse``, ``dq``, ``dk``, ``dv`` a non-finite input reaches.

    4-D inputs, ``o`` the output the backward is given. Follows each term of SPEC's forward
    and backward through the kept (row, key) pairs only.
    """
    group = q.shape[1] // k.shape[1]
    bad_q = ~np.isfinite(q).all(axis=-1)                                 # (B, Hq, Nq)
    bad_k = np.repeat(~np.isfinite(k).all(axis=-1), group, axis=1)       # (B, Hq, Nk)
    bad_v = np.repeat(~np.isfinite(v), group, axis=1)                    # (B, Hq, Nk, Dv)
    bad_do = ~np.isfinite(do)                                            # (B, Hq, Nq, Dv)
    # A row's scores, hence its P, its o and its lse, are non-finite when its query is and
    # it keeps a key, or when it keeps a non-finite key; o's column d also when it keeps a
    # non-finite v[:, d]. A row that keeps no key has no scores at all.
    bad_scores = (bad_q & kept.any(axis=-1)) | _any_product(kept, bad_k[..., None])[..., 0]
    o_reach = bad_scores[..., None] | _any_product(kept, bad_v)
    # Backward: D = rowsum(do * o) from the given o; dP = do v^T; dS = P (dP - D) on kept
    # pairs; dq = dS k, dk = dS^T q, dv = P^T do over kept pairs.
    bad_row = bad_scores | ~np.isfinite(o).all(axis=-1) | bad_do.any(axis=-1)
    bad_ds = kept & (bad_row[..., None] | bad_v.any(axis=-1)[..., None, :])
    dq_rows = (bad_ds | (kept & bad_k[..., None, :])).any(axis=-1)
    dk_keys = (bad_ds | (kept & bad_q[..., None])).any(axis=-2)
    dv_entries = _any_product(kept.T, bad_scores[..., None] | bad_do)

    def per_kv_head(per_query_head):
        b, hq = per_query_head.shape[:2]
        return per_query_head.reshape(b, hq // group, group, *per_query_head.shape[2:]).any(2)

    return {
        "o": o_reach, "lse": bad_scores,
        "dq": np.broadcast_to(dq_rows[..., None], q.shape),
        "dk": np.broadcast_to(per_kv_head(dk_keys)[..., None], k.shape),
        "dv": per_kv_head(dv_entries),
    }


def cleaned(array):
    return np.where(np.isfinite(array), array, 0).astype(array.dtype)


def check_reach(name, actual, predicted, exact):
    non_finite = ~np.isfinite(actual)
    if exact:
        mismatch = non_finite != predicted
    else:
        mismatch = non_finite & ~predicted
    if mismatch.any():
        where = tuple(np.argwhere(mismatch)[0])
        raise AssertionError(f"{name}: {int(mismatch.sum())} entries non-finite where the "
                             f"prediction says {'finite' if non_finite[where] else 'not'}; "
                             f"first at {where}: {actual[where]!r}")


def check_problem(backend, q, k, v, do, options, exact=True):
    """Forward and backward of one problem against `reach` and both golden models."""
    dtype = q.dtype
    lse_type = np.float64 if dtype == np.float64 else np.float32
    kept = kept_mask(q.shape[2], k.shape[2], options.get("causal", False),
                     options.get("window"))
    as64 = [a.astype(np.float64) for a in (q, k, v, do)]
    clean64 = [cleaned(a) for a in as64]
    golden_o, golden_lse = tileattn.forward(*as64[:3], backend="reference", return_lse=True,
                                            **options)
    clean_o, clean_lse = tileattn.forward(*clean64[:3], backend="reference", return_lse=True,
                                          **options)

    o, lse = backend.forward(q, k, v, return_lse=True, **options)
    predicted = reach(q, k, v, do, golden_o, kept)
    # A row that keeps no key has lse -inf by definition (the golden comparison checks it).
    lse_of_kept_rows = np.where(kept.any(axis=-1), lse, 0)
    for name, actual, golden, clean in (("o", o, golden_o, clean_o),
                                        ("lse", lse, golden_lse, clean_lse)):
        check_reach(name, lse_of_kept_rows if name == "lse" else actual, predicted[name],
                    exact)
        assert_attention_close(actual, golden, dtype, name=name)
        untouched = ~predicted[name]
        assert_attention_close(actual[untouched], clean[untouched], dtype, name=name)

    # The backward alone (as in test_backend_suite.check_backward): given the golden o and
    # lse rounded as a forward returns them, NaN rows included.
    o_given, lse_given = golden_o.astype(dtype), golden_lse.astype(lse_type)
    grads = backend.backward(do, q, k, v, o_given, lse_given, **options)
    predicted = reach(q, k, v, do, o_given, kept)
    golden = tileattn.backward(as64[3], *as64[:3], o_given.astype(np.float64), lse_given,
                               backend="reference", **options)
    o_clean = np.where(np.isfinite(o_given), o_given, clean_o.astype(dtype))
    clean = tileattn.backward(clean64[3], *clean64[:3], o_clean.astype(np.float64), clean_lse,
                              backend="reference", **options)
    for name, actual, want, want_clean in zip(("dq", "dk", "dv"), grads, golden, clean):
        check_reach(name, actual, predicted[name], exact)
        assert_attention_close(actual, want, dtype, name=name)
        untouched = ~predicted[name]
        assert_attention_close(actual[untouched], want_clean[untouched], dtype, name=name)
    return o, grads


# --------------------------------------------------------------------------- examples


def _normal(seed, *shapes, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for shape in shapes]


def _four_d(*arrays):
    return [a[None, None] for a in arrays]


def test_nan_in_v_reaches_only_the_causal_rows_that_keep_it(backend):
    """The issue's example: causal 8 x 8, v[5, 0] = NaN gives NaN in o[5:, 0] only, with the
    default tiles and with 2 x 2 ones (the NaN used to reach rows 0-7 or 4-7)."""
    for blocks in ({}, {"block_q": 2, "block_k": 2}, {"block_q": 3, "block_k": 5}):
        q, k, v, do = _four_d(*_normal(0, (8, 4), (8, 4), (8, 4), (8, 4)))
        v[..., 5, 0] = np.nan
        o, (dq, dk, dv) = check_problem(backend, q, k, v, do, {"causal": True, **blocks})
        assert np.isnan(o[0, 0, 5:, 0]).all() and np.isfinite(o[0, 0, :5]).all()
        assert np.isfinite(o[0, 0, :, 1:]).all()
        assert np.isfinite(dq[0, 0, :5]).all() and np.isfinite(dv).all()


def test_nan_in_k_reaches_dq_only_in_rows_that_keep_it(backend):
    for blocks in ({}, {"block_q": 2, "block_k": 2}):
        q, k, v, do = _four_d(*_normal(1, (8, 4), (8, 4), (8, 4), (8, 4)))
        k[..., 5, 0] = np.nan
        _, (dq, _, _) = check_problem(backend, q, k, v, do, {"causal": True, **blocks})
        assert np.isfinite(dq[0, 0, :5]).all() and np.isnan(dq[0, 0, 5:]).all()


def test_rows_that_keep_no_key_stay_finite_next_to_nan_keys(backend):
    """Causal with Nq = 6 > Nk = 4: rows 0-1 keep no key, so o = 0 and dq = 0 there."""
    q, k, v, do = _four_d(*_normal(2, (6, 4), (4, 4), (4, 4), (6, 4)))
    k[..., 3, 1] = np.nan
    v[..., 2, 0] = np.nan
    o, (dq, _, _) = check_problem(backend, q, k, v, do, {"causal": True})
    assert np.all(o[0, 0, :2] == 0) and np.all(dq[0, 0, :2] == 0)
    assert np.isnan(o[0, 0, 4:]).any(axis=-1).all() and np.isfinite(o[0, 0, :4]).all()


def test_nan_query_and_output_gradient_rows_reach_only_the_keys_they_keep(backend):
    """A window (2, 1): row 6 keeps keys 4-7. Its NaN in q or do reaches dk and dv of those
    keys only (and dv only in the column of do that is NaN)."""
    for poisoned in ("q", "do"):
        q, k, v, do = _four_d(*_normal(3, (12, 4), (12, 4), (12, 3), (12, 3)))
        (q if poisoned == "q" else do)[..., 6, 1] = np.nan
        _, (dq, dk, dv) = check_problem(backend, q, k, v, do,
                                        {"window": (2, 1), "block_q": 4, "block_k": 4})
        keys = np.zeros(12, bool)
        keys[4:8] = True
        assert np.isnan(dk[0, 0, keys]).all() and np.isfinite(dk[0, 0, ~keys]).all()
        assert np.isfinite(dv[0, 0, ~keys]).all()
        rows = np.arange(12) != 6
        assert np.isfinite(dq[0, 0, rows]).all()
        if poisoned == "do":
            assert np.isnan(dv[0, 0, keys, 1]).all() and np.isfinite(dv[0, 0, :, [0, 2]]).all()


def test_a_dropped_entry_is_a_product_with_zero(backend):
    """SPEC step 6 drops an entry by multiplying P with keep / (1 - p) = 0, not by masking
    it: a NaN that the mask keeps reaches the gradients through the entries that dropout
    drops as well (NaN x 0 is NaN), as in the golden model. A NaN in query row 3 makes the
    row's P NaN, so dv is NaN at every key the row keeps, dropped ones included."""
    from tileattn.dropout import keep_mask

    options = {"dropout_p": 0.5, "seed": 11, "window": (3, 2)}
    dropped = ~keep_mask(11, 0.5, 0, 3, np.arange(6))  # row 3's keys 0-5 (window (3, 2))
    assert dropped.any() and not dropped.all()  # the seed drops some of them
    for blocks in ({}, {"block_q": 2, "block_k": 2}):
        q, k, v, do = _four_d(*_normal(9, (8, 4), (8, 4), (8, 4), (8, 4)))
        q[..., 3, 0] = np.nan
        _, (_, _, dv) = check_problem(backend, q, k, v, do, {**options, **blocks})
        keys = np.zeros(8, bool)
        keys[:6] = True
        assert np.isnan(dv[0, 0, keys]).all() and np.isfinite(dv[0, 0, ~keys]).all()


def test_infinite_values_follow_ieee_on_kept_keys_only(backend):
    """+inf in v: kept with p > 0 gives +inf, kept with p == 0 (a score 2000 below the row's
    maximum) gives 0 x inf = NaN, masked gives nothing."""
    for dtype in (np.float32, np.float64):
        q, k, v, do = _normal(4, (6, 2), (6, 2), (6, 3), (6, 3), dtype=dtype)
        # Row 5's scores: 40 k[j, 0], within +-20 except key 1's -2000 (p = 0 in every
        # precision); the other rows' scores do not see k[:, 0].
        k[:, 0] = np.linspace(-0.5, 0.5, 6)
        q[:5, 0] = 0.0
        q[5] = (40.0, 0.0)
        k[1] = (-50.0, 0.0)
        v[1, 2] = np.inf
        v[4, 0] = -np.inf
        q, k, v, do = _four_d(q, k, v, do)
        o, _ = check_problem(backend, q, k, v, do, {"causal": True, "scale": 1.0})
        o = o[0, 0]
        assert np.isfinite(o[:4, 0]).all() and np.all(o[4:, 0] == -np.inf)
        assert np.isfinite(o[0, 2]) and np.all(o[1:5, 2] == np.inf) and np.isnan(o[5, 2])


def test_a_probability_of_one_against_an_infinite_gradient_or_value_follows_ieee(backend):
    """One key per row gives P = 1, a number whose 3xTF32 split (GPU float32) has a zero
    small part: against an infinite dO or V, P x inf must be IEEE's inf, not 0 x inf = NaN
    (the property test's Nq = Nk = D = 1 example, dO = inf)."""
    for dtype in (np.float32, np.float64):
        for poisoned in ("do", "v"):
            q, k, v, do = _normal(11, (3, 8), (1, 8), (1, 8), (3, 8), dtype=dtype)
            (do if poisoned == "do" else v)[0 if poisoned == "v" else 1, 2] = np.inf
            check_problem(backend, *_four_d(q, k, v, do), {})
        one = [np.ones((1, 1), dtype) for _ in range(4)]
        one[3][0, 0] = np.inf
        check_problem(backend, *_four_d(*one), {})


def test_an_infinite_key_that_every_row_scores_minus_inf_drops_out(backend):
    """k[5, 0] = +inf against q[:, 0] < 0 (values no 19-bit float holds, so the GPU's 3xTF32
    split of them rounds, and half its small parts have the sign opposite to the big ones):
    every score of key 5 is -inf, so key 5 drops out of every row, which stays finite."""
    for dtype in (np.float32, np.float64):
        q, k, v, do = _normal(7, (12, 8), (40, 8), (40, 8), (12, 8), dtype=dtype)
        q[:, 0] = -np.abs(q[:, 0]) - 0.1
        k[5, 0] = np.inf
        q, k, v, do = _four_d(q, k, v, do)
        o, _ = check_problem(backend, q, k, v, do, {}, exact=False)
        assert np.isfinite(o).all()


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64)]
                         + [np.dtype(np.float16)] + ([bfloat16()] if bfloat16() else []),
                         ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(12, 40, 5, {}), (100, 300, 200, {"window": (150, 10)}),
                                   (70, 260, 259, {"causal": True})],
                         ids=["short", "window", "causal"])
def test_an_infinite_key_drops_out_beside_a_partial_query_tile(backend, dtype, shape):
    """As above with GQA, two batch elements and Nq a multiple of no tile, so the GPU's
    dK/dV kernels stream a last query tile with zero rows past Nq (inf x 0 = NaN against
    the key): the 16-bit kernels flag the key's block and compute it again on CUDA cores
    (attention_backward_dkdv_redo), float32 zeroes those rows' probabilities. dk and dv
    of the key are 0, as the golden model has them."""
    n_q, n_k, key, options = shape
    q, k, v, do = _normal(9, (2, 2, n_q, 8), (2, 1, n_k, 8), (2, 1, n_k, 8), (2, 2, n_q, 8),
                          dtype=dtype)
    q[..., 0] = -np.abs(q[..., 0]) - np.asarray(0.1, dtype)
    k[1, 0, key, 0] = np.inf
    o, (dq, dk, dv) = check_problem(backend, q, k, v, do, options, exact=False)
    assert np.isfinite(o).all()
    assert (dk[1, 0, key] == 0).all() and (dv[1, 0, key] == 0).all()


@pytest.mark.parametrize("dtype", [np.dtype(np.float16)] + ([bfloat16()] if bfloat16() else []),
                         ids=lambda d: d.name)
def test_infinite_keys_drop_out_in_far_key_blocks_beside_a_partial_query_tile(backend, dtype):
    """Five query rows over 20000 keys, GQA 8/4, two batch elements: on the GPU more 16-bit
    dK/dV blocks than the redo's grid (a few blocks an SM, each walking every gridDim.x-th
    flag), with infinite keys in the first block and in the last. dk and dv of those keys
    are 0; every other entry is the golden model's."""
    q, k, v, do = _normal(4, (2, 8, 5, 8), (2, 4, 20000, 8), (2, 4, 20000, 8), (2, 8, 5, 8),
                          dtype=dtype)
    q[..., 0] = -np.abs(q[..., 0]) - np.asarray(0.1, dtype)
    k[0, 0, 3, 0] = k[1, 3, 19990, 0] = np.inf
    o, (dq, dk, dv) = check_problem(backend, q, k, v, do, {}, exact=False)
    assert np.isfinite(o).all()
    for batch, head, key in ((0, 0, 3), (1, 3, 19990)):
        assert (dk[batch, head, key] == 0).all() and (dv[batch, head, key] == 0).all()


def test_an_infinite_query_against_keys_of_one_sign_scores_minus_inf(backend):
    """q[3, 0] = +inf against k[:, 0] < 0 (not TF32 numbers either): row 3's scores are all
    -inf, and no other row is touched."""
    for dtype in (np.float32, np.float64):
        q, k, v, do = _normal(8, (12, 8), (40, 8), (40, 8), (12, 8), dtype=dtype)
        k[:, 0] = -np.abs(k[:, 0]) - 0.1
        q[3, 0] = np.inf
        q, k, v, do = _four_d(q, k, v, do)
        o, _ = check_problem(backend, q, k, v, do, {"causal": True}, exact=False)
        assert np.isfinite(np.delete(o[0, 0], 3, axis=0)).all()


# The GPU paths added for shapes off FlashAttention's benchmark: a GQA group cut over
# blocks for dK/dV (few K/V heads, no query tail), heads wider than 256 on mma.sync, and a
# decode wider than 256 on the CUDA-core split-KV kernel. A NaN at a key the mask hides
# from some rows reaches only the rows (and gradients) that keep it.
_WIDER_PATHS = {
    # name: (dtype, q shape, k shape, Dv, options, poisoned array, index)
    "gqa-cut-backward": (np.float16, (1, 8, 128, 64), (1, 1, 192, 64), 64, {"causal": True},
                         "k", (0, 0, 150, 3)),
    "head-dim-320": (np.float16, (1, 2, 70, 320), (1, 1, 90, 320), 320, {"causal": True},
                     "v", (0, 0, 80, 7)),
    "decode-576-512": (np.float32, (1, 16, 1, 576), (1, 1, 700, 576), 512,
                       {"window": (300, 0)}, "k", (0, 0, 100, 11)),
    # float32 at D = Dv 161-256: both backward kernels on warp pairs, whose two warps add
    # different terms.
    "float32-256-pairs-q": (np.float32, (1, 4, 150, 256), (1, 2, 170, 256), 256,
                            {"causal": True}, "q", (0, 1, 40, 5)),
    "float32-192-pairs-do": (np.float32, (1, 2, 100, 192), (1, 1, 130, 192), 192,
                             {"window": (30, 5)}, "do", (0, 1, 60, 9)),
    # 16-bit D = 128 backwards of few query rows over many keys (their own tile rows:
    # 64-key dK/dV blocks, 64- or 128-row dQ blocks, a query tail).
    "few-query-rows-k": (np.float16, (1, 4, 20, 128), (1, 2, 600, 128), 128,
                         {"causal": True, "window": (200, 0)}, "k", (0, 1, 385, 3)),
    "few-query-rows-do": (np.float16, (1, 2, 100, 128), (1, 1, 900, 128), 128,
                          {"window": (300, 10)}, "do", (0, 1, 60, 9)),
}


@pytest.mark.parametrize("path", sorted(_WIDER_PATHS))
def test_nan_at_a_masked_key_on_the_wider_paths(backend, path):
    dtype, q_shape, k_shape, value_dim, options, poisoned, index = _WIDER_PATHS[path]
    q, k, v, do = _normal(7, q_shape, k_shape, k_shape[:3] + (value_dim,),
                          q_shape[:3] + (value_dim,), dtype=dtype)
    {"q": q, "k": k, "v": v, "do": do}[poisoned][index] = np.nan
    check_problem(backend, q, k, v, do, options)


# --------------------------------------------------------------------------- properties


@st.composite
def poisoned_problems(draw, dtypes=(np.float32, np.float64), max_len=11,
                      head_dims=st.integers(1, 5), values=(np.nan, np.inf, -np.inf),
                      named_blocks=True):
    """A small problem (GQA, Nq != Nk, masks, tiles from 1 up) with 1-3 non-finite values in
    one of q, k, v, do. The keywords widen it for the 16-bit tests below: longer sequences,
    head dims the tensor-core tables serve, the tables' own tiles (`named_blocks=False`)."""
    dtype = draw(st.sampled_from(list(dtypes)))
    batch, n_kv_heads = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    n_q_heads = n_kv_heads * draw(st.integers(1, 3))
    n_q, n_k = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    head_dim = draw(head_dims)
    value_dim = head_dim if draw(st.booleans()) else draw(head_dims)
    q, k, v, do = _normal(draw(st.integers(0, 2**32 - 1)),
                          (batch, n_q_heads, n_q, head_dim), (batch, n_kv_heads, n_k, head_dim),
                          (batch, n_kv_heads, n_k, value_dim),
                          (batch, n_q_heads, n_q, value_dim), dtype=dtype)
    arrays = {"q": q, "k": k, "v": v, "do": do}
    poisoned = draw(st.sampled_from(sorted(arrays)))
    value = draw(st.sampled_from(list(values)))
    target = arrays[poisoned]
    for _ in range(draw(st.integers(1, 3))):
        index = tuple(draw(st.integers(0, size - 1)) for size in target.shape)
        target[index] = value
    options = {}
    mask = draw(st.sampled_from(["none", "causal", "window", "causal window"]))
    side = st.one_of(st.none(), st.integers(0, 5))
    if "causal" in mask:
        options["causal"] = True
    if "window" in mask:
        options["window"] = (draw(side), None if "causal" in mask else draw(side))
    for block in ("block_q", "block_k"):
        options[block] = draw(st.sampled_from([None, 1, 2, 3, 5, 16])) if named_blocks else None
    # An infinite score is capped to a finite one: only NaN keeps its reach through it.
    if (np.isnan(value) or poisoned in ("v", "do")) and draw(st.booleans()):
        options["softcap"] = 2.0
    # Dropout multiplies (SPEC step 6): a dropped entry is P x 0, so the reach is the mask's.
    if draw(st.booleans()):
        options.update(dropout_p=0.5, seed=draw(st.integers(0, 2**16)))
    exact = bool(np.isnan(value)) or poisoned in ("v", "do")
    return (*(arrays[name] for name in ("q", "k", "v", "do")), options, exact)


@settings(max_examples=40)
@given(problem=poisoned_problems())
def test_non_finite_inputs_reach_exactly_the_entries_that_keep_them(backend, problem):
    q, k, v, do, options, exact = problem
    check_problem(backend, q, k, v, do, options, exact)


# --------------------------------------------------------------------------- 16-bit


def _half_dtypes():
    return [np.dtype(np.float16)] + ([bfloat16()] if bfloat16() is not None else [])


@pytest.mark.parametrize("dtype", _half_dtypes(), ids=lambda d: d.name)
@settings(max_examples=25)
@given(data=st.data())
def test_16_bit_non_finite_inputs_reach_exactly_the_entries_that_keep_them(backend, dtype, data):
    """float16 and bfloat16 through the tensor-core kernels on the GPU (the wgmma backward on
    Hopper, mma.sync elsewhere): the tables' own tiles (named ones go to the generic kernels),
    sequences past one 64-row tile so that bands cut some tiles and keep others whole, head
    dims up to 128. NaN only: a kept probability that rounds to 0 in 16 bits meets an
    infinity as 0 x inf = NaN where the float64 golden model, given the same inputs, keeps
    a tiny p and gets the infinity, so the non-finite values would differ in kind."""
    q, k, v, do, options, exact = data.draw(poisoned_problems(
        dtypes=[dtype], max_len=200, head_dims=st.sampled_from([8, 16, 40, 64, 128]),
        values=[np.nan], named_blocks=False))
    check_problem(backend, q, k, v, do, options, exact)


def _gpu_single_pass(q, k, v, do, options):
    """The mma.sync single pass (deterministic=False where the table sends 16-bit inputs to
    mma.sync, i.e. not on Hopper, and float32 inputs), called directly, with the golden o
    and lse as given."""
    import cupy

    from tileattn.gpu import launch_backward
    from tileattn.gpu.tiles import MmaBackwardTiles
    from tileattn.validation import validate

    defaults = dict(causal=False, window=None, scale=None, softcap=None, alibi_slopes=None,
                    dropout_p=0.0, seed=None, block_q=None, block_k=None, deterministic=False)
    resolved = validate(q, k, v, **{**defaults, **options}).options
    golden_o, golden_lse = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                            backend="reference", return_lse=True, **options)
    o_given, lse_given = golden_o.astype(q.dtype), golden_lse.astype(np.float32)
    if q.dtype == np.float32:  # 8 warps of pairs at D 128, 4 single warps at D 64
        tiles = {64: MmaBackwardTiles((64, 32), (64, 32)),
                 128: MmaBackwardTiles((64, 16), (64, 16), paired=("dkdv",))}[q.shape[-1]]
    else:
        tiles = {64: MmaBackwardTiles((64, 64), (128, 64)),
                 128: MmaBackwardTiles((128, 128), (128, 64))}[q.shape[-1]]
    device = [cupy.asarray(a) for a in (do, q, k, v, o_given, lse_given)]
    grads = launch_backward.backward_mma(*device, resolved, tiles, single_pass=True)
    return [g.get() for g in grads], o_given, lse_given


@pytest.mark.gpu
@pytest.mark.skipif(backends.availability("gpu") is not None,
                    reason=str(backends.availability("gpu")))
@pytest.mark.parametrize("dtype", _half_dtypes() + [np.dtype(np.float32)], ids=lambda d: d.name)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("poisoned", ["k", "q", "do"])
@pytest.mark.parametrize("options", [{"causal": True}, {"window": (40, 10)}],
                         ids=["causal", "window"])
def test_single_pass_dq_ignores_masked_non_finite_keys(dtype, head_dim, poisoned, options):
    """The single pass's dQ share, dS K over the owned keys, with a NaN in K (and in Q, dO:
    its dK/dV products) at rows and keys that cut tiles mask for some rows and keep for
    others: dq, dk, dv are non-finite exactly where `reach` says, and match the golden
    model there and elsewhere."""
    q, k, v = _normal(7, (1, 4, 300, head_dim), (1, 2, 330, head_dim), (1, 2, 330, head_dim),
                      dtype=dtype)
    (do,) = _normal(8, (1, 4, 300, head_dim), dtype=dtype)
    target = {"q": q, "k": k, "do": do}[poisoned]
    for row in (70, 129, 200):  # inside a 64-key tile, just past one, mid-sequence
        target[..., min(row, target.shape[-2] - 1), 3] = np.nan
    grads, o_given, lse_given = _gpu_single_pass(q, k, v, do, options)
    kept = kept_mask(q.shape[2], k.shape[2], options.get("causal", False), options.get("window"))
    predicted = reach(q, k, v, do, o_given, kept)
    golden = tileattn.backward(*(a.astype(np.float64) for a in (do, q, k, v, o_given)),
                               lse_given, backend="reference", **options)
    for name, actual, want in zip(("dq", "dk", "dv"), grads, golden):
        check_reach(name, actual, predicted[name], exact=True)
        assert_attention_close(actual, want, dtype, name=name)
