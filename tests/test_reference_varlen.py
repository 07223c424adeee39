"""The variable-length golden model (`tileattn.reference_varlen`) checked against the dense
golden model: full lengths are the dense model, each sequence is the dense model on its
slice, packed and paged problems are the same padded problem laid out differently, and
nothing that must not be read (padding, unnamed pages) reaches any result."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tileattn
from tileattn import reference_varlen as rv
from tileattn.testing import (assert_attention_close, attention_problems, cu_seqlens,
                              page_tables, sequence_lengths, varlen_problems)

FLOAT64 = st.just(np.dtype(np.float64))


def _run(problem):
    """Forward, then backward with ``problem.do``, of a drawn `VarlenProblem`."""
    o, lse = getattr(rv, f"forward_{problem.family}")(
        problem.q, problem.k, problem.v, **problem.lengths, **problem.options)
    if problem.family == "paged":  # forward only (SPEC)
        return o, lse
    grads = getattr(rv, f"backward_{problem.family}")(
        problem.do, problem.q, problem.k, problem.v, o, lse, **problem.lengths,
        **problem.options)
    return (o, lse, *grads)


def _batch_shape(array) -> tuple:
    return array.shape[:-3] if array.ndim > 2 else ()


# --------------------------------------------------------------------------- (a) full lengths


@given(problem=attention_problems(dtypes=FLOAT64, max_seq=16, max_elements=20_000),
       pass_lengths=st.booleans())
def test_padded_with_full_lengths_is_the_dense_model(problem, pass_lengths):
    options = {k: v for k, v in problem.options.items() if k not in ("block_q", "block_k")}
    q, k, v, do = problem.q, problem.k, problem.v, problem.do
    lengths = {}
    if pass_lengths:
        lengths = {"seqlens_q": np.full(_batch_shape(q), q.shape[-2]),
                   "seqlens_k": np.full(_batch_shape(k), k.shape[-2])}
    o, lse = rv.forward_padded(q, k, v, **lengths, **options)
    dense_o, dense_lse = tileattn.forward(q, k, v, **options, backend="reference",
                                          return_lse=True)
    assert_attention_close(o, dense_o, np.float64, name="o")
    assert_attention_close(lse, dense_lse, np.float64, name="lse")
    grads = rv.backward_padded(do, q, k, v, o, lse, **lengths, **options)
    dense_grads = tileattn.backward(do, q, k, v, dense_o, dense_lse, **options,
                                    backend="reference")
    for name, grad, dense in zip(("dq", "dk", "dv"), grads, dense_grads):
        assert_attention_close(grad, dense, np.float64, name=name)


# --------------------------------------------------------------------------- (b) each slice


@given(problem=varlen_problems(family="padded", dtypes=FLOAT64))
def test_padded_is_the_dense_model_on_each_batch_element(problem):
    q, k, v, do = problem.q, problem.k, problem.v, problem.do
    batch_shape = _batch_shape(q)
    options = dict(problem.options)
    if np.prod(batch_shape) > 1:
        # Dropout numbers element b's heads from b * Hq; a dense call on one slice numbers
        # them from 0, so only a single element can compare with dropout here. Test (a)
        # checks that numbering against the dense model's, with full lengths.
        options.pop("dropout_p", None)
        options.pop("seed", None)
    o, lse, dq, dk, dv = _run(dataclasses.replace(problem, options=options))
    lengths_q = problem.lengths["seqlens_q"]
    lengths_k = problem.lengths["seqlens_k"]
    slopes = options.get("alibi_slopes")
    for b in np.ndindex(batch_shape):
        n_q = q.shape[-2] if lengths_q is None else int(lengths_q[b])
        n_k = k.shape[-2] if lengths_k is None else int(lengths_k[b])
        sliced = {**options}
        if slopes is not None and slopes.ndim > 1:
            sliced["alibi_slopes"] = slopes[b]
        q_b, k_b, v_b, do_b = q[b][:, :n_q], k[b][:, :n_k], v[b][:, :n_k], do[b][:, :n_q]
        dense_o, dense_lse = tileattn.forward(q_b, k_b, v_b, **sliced, backend="reference",
                                              return_lse=True)
        assert_attention_close(o[b][:, :n_q], dense_o, np.float64, name=f"o{b}")
        assert_attention_close(lse[b][:, :n_q], dense_lse, np.float64, name=f"lse{b}")
        dense_grads = tileattn.backward(do_b, q_b, k_b, v_b, dense_o, dense_lse, **sliced,
                                        backend="reference")
        for name, grad, dense in zip(("dq", "dk", "dv"), (dq[b][:, :n_q], dk[b][:, :n_k],
                                                          dv[b][:, :n_k]), dense_grads):
            assert_attention_close(grad, dense, np.float64, name=f"{name}{b}")
        # Padding: rows give o = 0, lse = -inf, dq = 0; keys get dk = dv = 0.
        assert (o[b][:, n_q:] == 0).all() and (lse[b][:, n_q:] == -np.inf).all()
        assert (dq[b][:, n_q:] == 0).all()
        assert (dk[b][:, n_k:] == 0).all() and (dv[b][:, n_k:] == 0).all()


def test_padded_dropout_uses_positions_as_passed():
    """Without masks or ALiBi, a shorter seqlens_q leaves its rows' scores unchanged, so they
    equal the dense model's rows on the whole padded batch, dropout pattern included: element
    b's heads are ``b * Hq + h`` and its rows are numbered from 0."""
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal(shape) for shape in ((3, 2, 5, 4), (3, 1, 6, 4),
                                                         (3, 1, 6, 2)))
    seqlens_q = np.array([5, 2, 3])
    options = {"dropout_p": 0.5, "seed": 11}
    o, _ = rv.forward_padded(q, k, v, seqlens_q, **options)
    dense_o = tileattn.forward(q, k, v, **options, backend="reference")
    for b, n_q in enumerate(seqlens_q):
        np.testing.assert_allclose(o[b, :, :n_q], dense_o[b, :, :n_q], rtol=1e-12)


# --------------------------------------------------------------------------- (c) packed


@given(problem=varlen_problems(family="packed", dtypes=FLOAT64))
def test_packed_is_padded_on_the_same_sequences(problem):
    o, lse, dq, dk, dv = _run(problem)
    padded_o, padded_lse, padded_dq, padded_dk, padded_dv = _run(problem.padded)
    cu_q, cu_k = problem.lengths["cu_seqlens_q"], problem.lengths["cu_seqlens_k"]
    for s in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        n_q, n_k = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        for name, packed, padded in (("o", o[:, rows], padded_o[s, :, :n_q]),
                                     ("lse", lse[:, rows], padded_lse[s, :, :n_q]),
                                     ("dq", dq[:, rows], padded_dq[s, :, :n_q]),
                                     ("dk", dk[:, keys], padded_dk[s, :, :n_k]),
                                     ("dv", dv[:, keys], padded_dv[s, :, :n_k])):
            assert_attention_close(packed, padded, np.float64, name=f"{name}[{s}]")


# --------------------------------------------------------------------------- (d) paged


@given(problem=varlen_problems(family="paged", dtypes=FLOAT64, max_seq=40,
                               page_sizes=(1, 16, 64, 256)))
def test_paged_is_padded_on_the_gathered_keys(problem):
    o, lse = _run(problem)
    padded_o, padded_lse = _run(problem.padded)[:2]
    assert_attention_close(o, padded_o, np.float64, name="o")
    assert_attention_close(lse, padded_lse, np.float64, name="lse")


@pytest.mark.parametrize("page_major", [False, True], ids=["head_major", "page_major"])
@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
def test_paged_pages_in_any_order_and_either_memory_order(page_size, page_major):
    """Keys spanning three pages (the last one partly used) at shuffled pool positions."""
    rng = np.random.default_rng(page_size)
    n_kv_heads, d, d_v = 2, 4, 3
    lengths_k = np.array([2 * page_size + 1, page_size, 1])
    n_keys = 3 * page_size
    q = rng.standard_normal((3, 4, 5, d))
    k = rng.standard_normal((3, n_kv_heads, n_keys, d))
    v = rng.standard_normal((3, n_kv_heads, n_keys, d_v))
    order = rng.permutation(3 * 3 + 2)  # two spare pages that no row names
    block_table = order[:9].reshape(3, 3)
    block_table[1:, 1:] = -1  # columns those rows never read
    block_table[2, 0] = order[3 * 1]  # element 2 shares its one page with element 1's,
    k[2, :, :1], v[2, :, :1] = k[1, :, :1], v[1, :, :1]  # so its first key is element 1's
    pools = []
    for keys in (k, v):
        shape = (len(order), page_size, n_kv_heads, keys.shape[-1])
        stored = np.full(shape if page_major else (shape[0], shape[2], shape[1], shape[3]),
                         np.nan)
        pool = stored.transpose(0, 2, 1, 3) if page_major else stored
        for b in range(3):
            for j in range(lengths_k[b]):
                pool[block_table[b, j // page_size], :, j % page_size] = keys[b, :, j]
        pools.append(pool)
    options = {"causal": True, "alibi_slopes": np.array([0.1, 0.2, 0.3, 0.4]),
               "dropout_p": 0.2, "seed": 7}
    o, lse = rv.forward_paged(q, *pools, block_table, lengths_k, **options)
    padded_o, padded_lse = rv.forward_padded(q, k, v, seqlens_k=lengths_k, **options)
    assert_attention_close(o, padded_o, np.float64, name="o")
    assert_attention_close(lse, padded_lse, np.float64, name="lse")
    assert np.isfinite(o).all()


# --------------------------------------------------------------------------- (e) NaN unread


@settings(max_examples=100)
@given(problem=varlen_problems())
def test_nan_in_padding_and_unnamed_pages_reaches_no_result(problem):
    """`varlen_problems` puts NaN in padding rows and keys, in pages no row names and in
    page slots past seqlens_k; every other input is finite."""
    for name, result in zip(("o", "lse", "dq", "dk", "dv"), _run(problem)):
        assert not np.isnan(result.astype(np.float64)).any(), name


# --------------------------------------------------------------------------- (f) lengths 0, 1


def test_lengths_zero_and_one():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((4, 2, 3, 5))
    k = rng.standard_normal((4, 1, 2, 5))
    v = rng.standard_normal((4, 1, 2, 3))
    do = rng.standard_normal((4, 2, 3, 3))
    seqlens_q, seqlens_k = np.array([0, 2, 1, 3]), np.array([2, 0, 1, 1])
    o, lse = rv.forward_padded(q, k, v, seqlens_q, seqlens_k, causal=True)
    dq, dk, dv = rv.backward_padded(do, q, k, v, o, lse, seqlens_q, seqlens_k, causal=True)
    # b=0: no rows; b=1: no keys, so its rows keep nothing.
    assert (o[:2] == 0).all() and (lse[:2] == -np.inf).all() and (dq[:2] == 0).all()
    assert (dk[:2] == 0).all() and (dv[:2] == 0).all()
    # b=2: one row, one key: the softmax is 1, o is that value row, dv is do.
    np.testing.assert_allclose(o[2, :, 0], np.repeat(v[2], 2, axis=0)[:, 0])
    np.testing.assert_allclose(dv[2, :, 0], do[2, :, 0].sum(axis=0, keepdims=True))
    # A softmax over one key has no gradient: dq is rounding noise around 0.
    np.testing.assert_allclose(dq[2, :, 0], 0.0, atol=1e-12)
    # b=3: three rows, one key, bottom-right causal: only the last row keeps the key.
    assert (lse[3, :, :2] == -np.inf).all() and np.isfinite(lse[3, :, 2]).all()
    np.testing.assert_allclose(o[3, :, 2], np.repeat(v[3], 2, axis=0)[:, 0])
    assert (o[3, :, :2] == 0).all() and (dq[3, :, :2] == 0).all()


def test_packed_with_empty_sequences():
    rng = np.random.default_rng(2)
    cu_q, cu_k = np.array([0, 0, 2, 2, 3]), np.array([0, 1, 1, 3, 3])
    q, k, v = (rng.standard_normal(shape) for shape in ((2, 3, 4), (1, 3, 4), (1, 3, 2)))
    o, lse = rv.forward_packed(q, k, v, cu_q, cu_k)
    # Sequence 1 (rows 0-1) has no keys; sequence 3 (row 2) has none either.
    assert (o == 0).all() and (lse == -np.inf).all()
    dq, dk, dv = rv.backward_packed(np.ones_like(o), q, k, v, o, lse, cu_q, cu_k)
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()


def test_no_heads():
    """Zero heads are valid (SPEC "Shapes"): correctly shaped empty results."""
    q, k = np.zeros((2, 0, 3, 4)), np.zeros((2, 0, 5, 4))
    o, lse = rv.forward_padded(q, k, k, [1, 2], [3, 4])
    assert o.shape == (2, 0, 3, 4) and lse.shape == (2, 0, 3)
    grads = rv.backward_padded(o, q, k, k, o, lse, [1, 2], [3, 4])
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
    o, lse = rv.forward_packed(q[0], k[0], k[0], [0, 1, 3], [0, 5, 5])
    assert o.shape == (0, 3, 4) and lse.shape == (0, 3)


def test_the_strategies_draw_what_they_promise():
    @settings(max_examples=50, database=None)
    @given(lengths=sequence_lengths(5, batch_shape=(2, 3)), cu=cu_seqlens(3, 4),
           data=st.data())
    def check(lengths, cu, data):
        assert lengths.shape == (2, 3) and lengths.dtype.kind == "i"
        assert ((0 <= lengths) & (lengths <= 5)).all()
        assert cu.shape == (4,) and cu[0] == 0 and (np.diff(cu) >= 0).all()
        assert (np.diff(cu) <= 4).all()
        table, num_pages = data.draw(page_tables(lengths, 2))
        assert table.shape[:2] == (2, 3)
        used = np.arange(table.shape[-1]) < -(-lengths[..., None] // 2)
        named = table[used]
        assert ((0 <= named) & (named < num_pages)).all()
        assert len(set(named.tolist())) == named.size  # distinct pages

    check()


def test_varlen_problems_cover_the_advertised_space():
    seen = set()

    @settings(max_examples=300, database=None)
    @given(problem=varlen_problems())
    def record(problem):
        seen.add(problem.family)
        lengths = problem.lengths if problem.padded is None else problem.padded.lengths
        for name in ("seqlens_q", "seqlens_k"):
            if lengths[name] is None:
                seen.add(f"no {name}")
            else:
                seen.update(f"{name} = {n}" for n in (0, 1) if (lengths[name] == n).any())
        if problem.family == "paged":
            page_major = problem.k.strides[1] < problem.k.strides[2]
            seen.add("page_major" if page_major else "head_major")
            if (problem.lengths["block_table"] == -1).any():
                seen.add("unread -1 entries")
        slopes = problem.options.get("alibi_slopes")
        if slopes is not None and slopes.ndim > 1:
            seen.add("slopes per sequence")
        if "dropout_p" in problem.options:
            seen.add("dropout")
        if problem.q.shape[-3] != problem.k.shape[-3]:
            seen.add("gqa")

    record()
    expected = {"padded", "packed", "paged", "no seqlens_q", "no seqlens_k", "seqlens_q = 0",
                "seqlens_q = 1", "seqlens_k = 0", "seqlens_k = 1", "page_major", "head_major",
                "unread -1 entries", "slopes per sequence", "dropout", "gqa"}
    assert expected <= seen, expected - seen


# --------------------------------------------------------------------------- (g) bad inputs


def _padded_arrays():
    rng = np.random.default_rng(3)
    return (rng.standard_normal((2, 2, 4, 3)), rng.standard_normal((2, 1, 5, 3)),
            rng.standard_normal((2, 1, 5, 3)))


PADDED_ERRORS = [
    ({"seqlens_q": np.array([-1, 2])}, ValueError,
     r"seqlens_q must be >= 0, got seqlens_q\[\(0,\)\] = -1"),
    ({"seqlens_k": np.array([2, 6])}, ValueError,
     r"seqlens_k must be <= Nk = 5, got seqlens_k\[\(1,\)\] = 6"),
    ({"seqlens_q": np.array([5, 0])}, ValueError,
     r"seqlens_q must be <= Nq = 4, got seqlens_q\[\(0,\)\] = 5"),
    ({"seqlens_q": np.array([1.0, 2.0])}, TypeError,
     "seqlens_q must have an integer dtype, got dtype float64"),
    ({"seqlens_k": np.array([True, False])}, TypeError,
     "seqlens_k must have an integer dtype, got dtype bool"),
    ({"seqlens_k": np.array([1, 2, 3])}, ValueError,
     r"seqlens_k must have the batch shape of q, \(2,\), got shape \(3,\)"),
    ({"seqlens_q": 3}, ValueError,
     r"seqlens_q must have the batch shape of q, \(2,\), got shape \(\)"),
    ({"block_q": 4}, TypeError, r"unexpected keyword arguments \['block_q'\]"),
]


@pytest.mark.parametrize("kwargs, error, message", PADDED_ERRORS)
def test_padded_bad_lengths_raise_naming_the_argument(kwargs, error, message):
    q, k, v = _padded_arrays()
    with pytest.raises(error, match=message):
        rv.forward_padded(q, k, v, **kwargs)
    o, lse = rv.forward_padded(q, k, v)
    with pytest.raises(error, match=message):
        rv.backward_padded(o, q, k, v, o, lse, **kwargs)


def _packed_arrays():
    rng = np.random.default_rng(4)
    return (rng.standard_normal((2, 5, 3)), rng.standard_normal((1, 4, 3)),
            rng.standard_normal((1, 4, 3)))


PACKED_ERRORS = [
    ({"cu_seqlens_q": [1, 3, 5]}, ValueError,
     r"cu_seqlens_q must start at 0, got cu_seqlens_q\[0\] = 1"),
    ({"cu_seqlens_q": [0, 4, 3, 5], "cu_seqlens_k": [0, 1, 2, 4]}, ValueError,
     r"cu_seqlens_q must be non-decreasing, got cu_seqlens_q\[1\] = 4 > "
     r"cu_seqlens_q\[2\] = 3"),
    ({"cu_seqlens_q": [0, 2, 4]}, ValueError,
     r"cu_seqlens_q must end at q.shape\[-2\] = 5, got cu_seqlens_q\[-1\] = 4"),
    ({"cu_seqlens_k": [0, 1, 5]}, ValueError,
     r"cu_seqlens_k must end at k.shape\[-2\] = 4, got cu_seqlens_k\[-1\] = 5"),
    ({"cu_seqlens_k": np.array([0.0, 1.0, 4.0])}, TypeError,
     "cu_seqlens_k must have an integer dtype, got dtype float64"),
    ({"cu_seqlens_k": [0, 4]}, ValueError,
     r"cu_seqlens_k must have the shape of cu_seqlens_q, \(S \+ 1,\) = \(3,\), "
     r"got shape \(2,\)"),
    ({"cu_seqlens_q": np.zeros(0, dtype=int)}, ValueError,
     r"cu_seqlens_q must have shape \(S \+ 1,\) with S >= 0 sequences, got shape \(0,\)"),
    ({"cu_seqlens_q": [[0, 2, 5]]}, ValueError,
     r"cu_seqlens_q must have shape \(S \+ 1,\) with S >= 0 sequences, got shape \(1, 3\)"),
    ({"alibi_slopes": np.ones((3, 2))}, ValueError,
     r"alibi_slopes of packed sequences must have shape \(Hq,\) = \(2,\) or \(S, Hq\) = "
     r"\(2, 2\), got \(3, 2\)"),
]


@pytest.mark.parametrize("kwargs, error, message", PACKED_ERRORS)
def test_packed_bad_cu_seqlens_raise_naming_the_argument(kwargs, error, message):
    q, k, v = _packed_arrays()
    arguments = {"cu_seqlens_q": np.array([0, 2, 5]), "cu_seqlens_k": np.array([0, 1, 4]),
                 **kwargs}
    with pytest.raises(error, match=message):
        rv.forward_packed(q, k, v, **arguments)
    o, lse = rv.forward_packed(q, k, v, [0, 2, 5], [0, 1, 4])
    with pytest.raises(error, match=message):
        rv.backward_packed(o, q, k, v, o, lse, **arguments)


def test_packed_arrays_must_have_no_batch_axes():
    q, k, v = _padded_arrays()
    with pytest.raises(ValueError, match=r"q must have shape \(H, N_total, D\) with "
                                         r"cu_seqlens .* got shape \(2, 2, 4, 3\)"):
        rv.forward_packed(q, k, v, [0, 4], [0, 5])


def test_packed_alibi_slopes_per_sequence():
    """``(S, Hq)`` slopes give each sequence its own row; ``(Hq,)`` is every sequence's."""
    q, k, v = _packed_arrays()
    per_head = np.array([0.5, 0.25])
    shared = rv.forward_packed(q, k, v, [0, 2, 5], [0, 1, 4], alibi_slopes=per_head)
    per_sequence = rv.forward_packed(q, k, v, [0, 2, 5], [0, 1, 4],
                                     alibi_slopes=np.stack([per_head, per_head]))
    np.testing.assert_array_equal(shared[0], per_sequence[0])
    other = rv.forward_packed(q, k, v, [0, 2, 5], [0, 1, 4],
                              alibi_slopes=np.stack([per_head, 2 * per_head]))
    # Sequence 0 (rows 0-1) is unchanged; sequence 1 (rows 2-4, 3 keys) sees new slopes.
    np.testing.assert_array_equal(other[0][:, :2], shared[0][:, :2])
    assert not np.allclose(other[0][:, 2:], shared[0][:, 2:])


def _paged_arrays():
    rng = np.random.default_rng(5)
    # Two batch elements, a pool of 4 pages of 2 slots.
    return (rng.standard_normal((2, 2, 3, 3)), rng.standard_normal((4, 1, 2, 3)),
            rng.standard_normal((4, 1, 2, 3)))


PAGED_ERRORS = [
    ({"block_table": np.array([[0, 7], [1, 2]])}, ValueError,
     r"block_table entries must be page ids in \[0, num_pages\) = \[0, 4\), got "
     r"block_table\[0, 1\] = 7"),
    ({"block_table": np.array([[0, 3], [-1, 2]])}, ValueError,
     r"got block_table\[1, 0\] = -1"),
    ({"seqlens_k": np.array([5, 2])}, ValueError,
     r"block_table is too short for seqlens_k: \(flattened\) batch element 0 has "
     r"seqlens_k = 5 keys, which need 3 pages of page_size 2, got max_pages = 2"),
    ({"block_table": np.array([[0.0, 1.0], [2.0, 3.0]])}, TypeError,
     "block_table must have an integer dtype, got dtype float64"),
    ({"block_table": np.array([0, 1])}, ValueError,
     r"block_table must have shape \(\*batch, max_pages\) with the batch shape of q, "
     r"\(2,\), got shape \(2,\)"),
    ({"seqlens_k": None}, ValueError,
     "seqlens_k must be given with block_table"),
    ({"seqlens_k": np.array([-1, 2])}, ValueError,
     r"seqlens_k must be >= 0, got seqlens_k\[\(0,\)\] = -1"),
    ({"seqlens_k": np.array([1.0, 2.0])}, TypeError,
     "seqlens_k must have an integer dtype"),
    ({"seqlens_q": np.array([4, 1])}, ValueError,
     r"seqlens_q must be <= Nq = 3, got seqlens_q\[\(0,\)\] = 4"),
    ({"v_pages": np.zeros((4, 1, 3, 3))}, ValueError,
     r"v must be a page pool of shape \(num_pages, Hkv, page_size, Dv\) = "
     r"\(4, 1, 2, Dv\) like k, got shape \(4, 1, 3, 3\)"),
    ({"k_pages": np.zeros((4, 2, 3))}, ValueError,
     r"k must be a page pool of shape \(num_pages, Hkv, page_size, D\) with block_table, "
     r"got shape \(4, 2, 3\)"),
    ({"k_pages": np.zeros((4, 1, 0, 3)), "v_pages": np.zeros((4, 1, 0, 3))}, ValueError,
     r"page_size \(k.shape\[2\]\) must be >= 1, got 0"),
    ({"q": np.zeros((3, 3))}, ValueError,
     r"q must have shape \(\*batch, Hq, Nq, D\) with block_table \(paged K/V\), got "
     r"shape \(3, 3\)"),
]


@pytest.mark.parametrize("kwargs, error, message", PAGED_ERRORS)
def test_paged_bad_tables_raise_naming_the_argument(kwargs, error, message):
    q, k_pages, v_pages = _paged_arrays()
    arguments = {"q": q, "k_pages": k_pages, "v_pages": v_pages,
                 "block_table": np.array([[0, 3], [1, -1]]), "seqlens_k": np.array([4, 2]),
                 **kwargs}
    with pytest.raises(error, match=message):
        rv.forward_paged(**arguments)


def test_paged_ignores_the_table_entries_it_does_not_read():
    q, k_pages, v_pages = _paged_arrays()
    lengths = np.array([4, 2])
    read = rv.forward_paged(q, k_pages, v_pages, np.array([[0, 3], [1, 0]]), lengths)
    padding = rv.forward_paged(q, k_pages, v_pages, np.array([[0, 3], [1, -5]]), lengths)
    np.testing.assert_array_equal(read[0], padding[0])
