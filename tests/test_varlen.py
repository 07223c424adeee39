"""Variable-length batches and paged K/V through the public API, on every backend, against
the golden model (`tileattn.reference_varlen`): padded (`seqlens_q`, `seqlens_k`), packed
(`cu_seqlens_q`, `cu_seqlens_k`) and paged (`block_table`) calls, every option, both
layouts, output buffers, the errors naming each argument, and ``check_lengths=False``.

The drawn problems (`tileattn.testing.varlen_problems`) hold NaN wherever nothing may be
read (padding rows and keys, pages no row names, page slots past a length, table entries
past the ones read), so every comparison also proves that none of it leaks.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tileattn
from tileattn import reference_varlen as rv
from tileattn.testing import assert_attention_close, varlen_problems

BLOCKS = st.sampled_from([None, 1, 5, 16])
# Up to 40 rows: past the decode path's 16, so the CPU forward kernel runs as well.
PROBLEM = dict(max_seq=40, page_sizes=(1, 2, 3, 16))


def _lse_dtype(dtype):
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def _float64(array):
    return None if array is None else np.asarray(array).astype(np.float64)


def _given(lengths: dict) -> dict:
    return {name: value for name, value in lengths.items() if value is not None}


def _golden_forward(problem):
    return getattr(rv, f"forward_{problem.family}")(
        *(_float64(a) for a in (problem.q, problem.k, problem.v)), **problem.lengths,
        **problem.options)


def _golden_backward(problem, o, lse):
    return getattr(rv, f"backward_{problem.family}")(
        *(_float64(a) for a in (problem.do, problem.q, problem.k, problem.v, o)), lse,
        **problem.lengths, **problem.options)


def check_forward(backend, problem, **blocks):
    o, lse = backend.forward(problem.q, problem.k, problem.v, return_lse=True,
                             **_given(problem.lengths), **problem.options, **blocks)
    expected_o, expected_lse = _golden_forward(problem)
    assert o.dtype == problem.dtype and lse.dtype == _lse_dtype(problem.dtype)
    assert_attention_close(o, expected_o, problem.dtype, name="o")
    assert_attention_close(lse, expected_lse, problem.dtype, name="lse")


def check_backward(backend, problem, **blocks):
    """The backward given the golden o and lse as a forward returns them (rounded), judged
    against the golden gradients for that o, as tests/test_backend_suite.py does."""
    expected_o, expected_lse = _golden_forward(problem)
    o, lse = expected_o.astype(problem.dtype), expected_lse.astype(_lse_dtype(problem.dtype))

    def run():
        return backend.backward(problem.do, problem.q, problem.k, problem.v, o, lse,
                                **_given(problem.lengths), **problem.options, **blocks)

    grads = run()
    expected = _golden_backward(problem, o, lse)
    for name, grad, want, like in zip(("dq", "dk", "dv"), grads, expected,
                                      (problem.q, problem.k, problem.v)):
        assert grad.shape == like.shape and grad.dtype == like.dtype, name
        assert_attention_close(grad, want, problem.dtype, name=name)


# --------------------------------------------------------------------------- properties


@pytest.mark.parametrize("family", ["padded", "packed", "paged"])
@given(data=st.data())
def test_forward_matches_golden_model(backend, family, data):
    problem = data.draw(varlen_problems(family=family, **PROBLEM))
    check_forward(backend, problem, block_q=data.draw(BLOCKS), block_k=data.draw(BLOCKS))


@pytest.mark.parametrize("family", ["padded", "packed"])
@given(data=st.data())
def test_backward_matches_golden_model(backend, family, data):
    problem = data.draw(varlen_problems(family=family, **PROBLEM))
    check_backward(backend, problem, block_q=data.draw(BLOCKS), block_k=data.draw(BLOCKS))


@pytest.mark.parametrize("family", ["padded", "packed", "paged"])
@given(data=st.data())
def test_unchecked_lengths_give_the_same_results(backend, family, data):
    """``check_lengths=False`` on valid lengths and tables changes nothing."""
    problem = data.draw(varlen_problems(family=family, **PROBLEM))
    lengths = _given(problem.lengths)
    checked = backend.forward(problem.q, problem.k, problem.v, return_lse=True, **lengths,
                              **problem.options)
    unchecked = backend.forward(problem.q, problem.k, problem.v, return_lse=True,
                                check_lengths=False, **lengths, **problem.options)
    for a, b in zip(checked, unchecked):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------- fixed problems


def _padded_problem(rng, batch=3, heads=(4, 2), n_q=37, n_k=45, dims=(16, 8),
                    lengths_q=(37, 0, 20), lengths_k=(45, 7, 0), dtype=np.float64):
    """Arrays with NaN in every padding row and key."""
    (n_q_heads, n_kv_heads), (d, d_v) = heads, dims
    lengths_q, lengths_k = np.array(lengths_q), np.array(lengths_k)

    def normal(n_heads, n, dim, lengths):
        array = rng.standard_normal((batch, n_heads, n, dim))
        array[_padding(batch, n_heads, n, dim, lengths)] = np.nan
        return array.astype(dtype)

    return (normal(n_q_heads, n_q, d, lengths_q), normal(n_kv_heads, n_k, d, lengths_k),
            normal(n_kv_heads, n_k, d_v, lengths_k), normal(n_q_heads, n_q, d_v, lengths_q),
            lengths_q, lengths_k)


def _padding(batch, n_heads, n, dim, lengths):
    rows = np.arange(n)[None, :] >= lengths[:, None]  # (batch, n)
    return np.broadcast_to(rows[:, None, :, None], (batch, n_heads, n, dim))


OPTIONS = [{}, {"causal": True}, {"window": (5, 3)},
           {"causal": True, "softcap": 2.0, "alibi_slopes": np.array([0.1, 0.2, 0.3, 0.4])},
           {"dropout_p": 0.3, "seed": 7, "causal": True}]


@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "causal", "window", "softcap-alibi",
                                                   "dropout"])
def test_padding_is_zero_and_never_read(backend, options):
    """Padding rows: o = 0, lse = -inf, dq = 0; padding keys: dk = dv = 0; a sequence with
    no keys gives o = 0; NaN in the padding reaches nothing."""
    rng = np.random.default_rng(0)
    q, k, v, do, lengths_q, lengths_k = _padded_problem(rng)
    lengths = {"seqlens_q": lengths_q, "seqlens_k": lengths_k}
    o, lse = backend.forward(q, k, v, return_lse=True, block_q=8, block_k=8, **lengths,
                             **options)
    expected = rv.forward_padded(q, k, v, **lengths, **options)
    assert_attention_close(o, expected[0], np.float64, name="o")
    assert_attention_close(lse, expected[1], np.float64, name="lse")
    assert (o[1] == 0).all() and (lse[1] == -np.inf).all()
    assert (o[2] == 0).all() and (lse[2] == -np.inf).all()  # no keys at all
    assert (o[0, :, 37:] == 0).all() and np.isfinite(o[0]).all()

    def backward():
        return backend.backward(do, q, k, v, o, lse, block_q=8, block_k=8, **lengths,
                                **options)

    dq, dk, dv = backward()
    expected_grads = rv.backward_padded(do, q, k, v, *expected, **lengths, **options)
    for name, actual, want in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, dq, dk, dv),
                                  (*expected, *expected_grads)):
        assert_attention_close(actual, want, np.float64, name=name)
    assert (o[1] == 0).all() and (lse[1] == -np.inf).all() and (dq[1] == 0).all()
    assert (o[2] == 0).all() and (lse[2] == -np.inf).all()  # no keys at all
    assert (o[0, :, 37:] == 0).all() and (dq[2, :, 20:] == 0).all()
    assert (dk[1, :, 7:] == 0).all() and (dv[2] == 0).all() and (dk[2] == 0).all()
    for result in (o[0], dq[0], dk[0], dv[0], o[2, :, :20]):
        assert np.isfinite(result).all()


@pytest.mark.parametrize("family", ["padded", "packed", "paged"])
def test_all_padding_and_empty_batches(backend, family):
    """Every length 0 (and no packed sequences at all): zeros and -inf, no kernel reads."""
    q = np.full((2, 3, 5, 4), np.nan)
    k = np.full((2, 1, 6, 4), np.nan)
    zero = np.zeros(2, np.int32)
    if family == "padded":
        args, lengths = (q, k, k), {"seqlens_q": zero, "seqlens_k": zero}
    elif family == "packed":
        args = (q[0, :, :0], k[0, :, :0], k[0, :, :0])
        lengths = {"cu_seqlens_q": np.zeros(1, np.int64), "cu_seqlens_k": np.zeros(1, np.int64)}
    else:
        pool = np.full((3, 1, 4, 4), np.nan)
        args = (q, pool, pool)
        lengths = {"seqlens_k": zero, "block_table": np.full((2, 2), -1)}
    o, lse = backend.forward(*args, return_lse=True, **lengths)
    assert o.shape == args[0].shape[:-1] + (4,)
    assert (o == 0).all() and (lse == -np.inf).all()

    def backward():
        return backend.backward(np.zeros_like(o), *args, o, lse, **lengths)

    if family != "paged":
        grads = backward()
        for grad, like in zip(grads, args):
            assert grad.shape == like.shape and (grad == 0).all()


def _paged_cache(rng, batch, n_kv_heads, lengths_k, page_size, d, d_v, page_major,
                 dtype=np.float32):
    """Padded keys and values, the same in a NaN-filled page pool with shuffled pages, a
    table padded with -1, and the pools as the API takes them (transposed views when
    stored ``(num_pages, page_size, Hkv, D)``)."""
    n_k = max(lengths_k)
    k = rng.standard_normal((batch, n_kv_heads, n_k, d)).astype(dtype)
    v = rng.standard_normal((batch, n_kv_heads, n_k, d_v)).astype(dtype)
    pages_used = [-(-n // page_size) for n in lengths_k]
    num_pages = sum(pages_used) + 3
    order = rng.permutation(num_pages)
    table = np.full((batch, max(pages_used) + 1), -1, np.int32)
    pools = []
    for array, dim in ((k, d), (v, d_v)):
        shape = ((num_pages, page_size, n_kv_heads, dim) if page_major
                 else (num_pages, n_kv_heads, page_size, dim))
        stored = np.full(shape, np.nan, dtype)
        pool = stored.transpose(0, 2, 1, 3) if page_major else stored
        start = 0
        for b, length in enumerate(lengths_k):
            table[b, :pages_used[b]] = order[start:start + pages_used[b]]
            start += pages_used[b]
            j = np.arange(length)
            pool[table[b, j // page_size], :, j % page_size] = np.swapaxes(
                array[b, :, :length], 0, 1)
        pools.append(pool)
    return k, v, pools, table


@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("n_q", [1, 4, 16, 20])
@pytest.mark.parametrize("page_major", [False, True], ids=["heads-major", "page-major"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
def test_decode_against_a_paged_cache(backend, page_size, n_q, page_major, dtype):
    """What servers call: a few new query rows per request against a paged cache of
    different lengths, GQA, causal (bottom-right: the new rows are the last ones), pages
    shuffled in a pool (a transposed view when page-major) full of NaN where unused. On the
    GPU float32 decodes on CUDA cores and float16 on tensor cores (page ids staged one tile
    ahead)."""
    rng = np.random.default_rng(page_size + n_q)
    lengths_k = [700, 35, 0, 300]
    k, v, (k_pool, v_pool), table = _paged_cache(rng, 4, 2, lengths_k, page_size, 32, 16,
                                                 page_major, dtype)
    q = rng.standard_normal((4, 8, n_q, 32)).astype(dtype)
    lengths = {"block_table": table, "seqlens_k": np.array(lengths_k)}
    o, lse = backend.forward(q, k_pool, v_pool, return_lse=True, causal=True, **lengths)
    expected_o, expected_lse = rv.forward_padded(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
        np.full(4, n_q), np.array(lengths_k), causal=True)
    assert_attention_close(o, expected_o, dtype, name="o")
    assert_attention_close(lse, expected_lse, dtype, name="lse")


@pytest.mark.parametrize("page_size", [64, 128])
@pytest.mark.parametrize("n_q", [1, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_long_pages_decode_as_a_contiguous_cache_does(page_size, n_q, dtype):
    """The CPU decode reads pools of long pages in place, each key tile ending at a page
    end (`decode_kernel.IN_PLACE_PAGE_ROWS`): every option, sequences ending inside a page,
    unused pages full of NaN, key splits that start inside a page and more than one
    tile per page (block_k 48): the results of the same keys laid out contiguously."""
    rng = np.random.default_rng(page_size + n_q)
    lengths_k = [700, 130, 1]
    k, v, (k_pool, v_pool), table = _paged_cache(rng, 3, 2, lengths_k, page_size, 32, 24,
                                                 False, dtype)
    q = rng.standard_normal((3, 8, n_q, 32)).astype(dtype)
    options = {"window": (500, 0), "softcap": 5.0, "alibi_slopes": np.linspace(0.01, 0.1, 8),
               "dropout_p": 0.1, "seed": 4, "scale": 0.3}
    for block_k in (None, 48):
        paged = tileattn.forward(q, k_pool, v_pool, return_lse=True, block_table=table,
                                 seqlens_k=np.array(lengths_k), block_k=block_k,
                                 backend="cpu", **options)
        contiguous = tileattn.forward(q, k, v, return_lse=True,
                                      seqlens_k=np.array(lengths_k), block_k=block_k,
                                      backend="cpu", **options)
        assert np.isfinite(paged[0]).all()  # no NaN from the unused pages
        for got, expected in zip(paged, contiguous):
            assert_attention_close(got, expected, dtype)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_paged_equals_contiguous_with_every_option(backend, kv_heads):
    """Paged K/V gives what the same keys laid out contiguously give, option for option
    (dropout counts logical key positions, never page slots), also where pools stored
    slots outermost hold several kv heads (the CPU decode then gathers all heads at once)."""
    rng = np.random.default_rng(3)
    lengths_k = [90, 33]
    k, v, (k_pool, v_pool), table = _paged_cache(rng, 2, kv_heads, lengths_k, 16, 8, 8, True,
                                                 np.float64)
    q = rng.standard_normal((2, 2, 24, 8))
    options = {"window": (30, 2), "softcap": 3.0, "alibi_slopes": np.array([0.2, 0.05]),
               "dropout_p": 0.2, "seed": 11, "scale": 0.4}
    lengths = {"block_table": table, "seqlens_k": np.array(lengths_k),
               "seqlens_q": np.array([24, 10])}
    paged = backend.forward(q, k_pool, v_pool, return_lse=True, block_q=7, block_k=5,
                            **lengths, **options)
    contiguous = backend.forward(q, k, v, return_lse=True, block_q=7, block_k=5,
                                 seqlens_q=lengths["seqlens_q"], seqlens_k=lengths["seqlens_k"],
                                 **options)
    for a, b in zip(paged, contiguous):
        assert_attention_close(a, b, np.float64)


def test_bshd_layout_and_output_buffers(backend):
    """layout="bshd" (flash-attn's varlen layout: packed ``(N_total, H, D)``, page pools
    ``(num_pages, page_size, Hkv, D)``) and out= buffers work as for dense calls."""
    rng = np.random.default_rng(5)
    q, k, v, do, lengths_q, lengths_k = _padded_problem(rng)
    lengths = {"seqlens_q": lengths_q, "seqlens_k": lengths_k}
    o, lse = backend.forward(q, k, v, return_lse=True, causal=True, **lengths)
    bshd = [np.ascontiguousarray(a.swapaxes(1, 2)) for a in (q, k, v, do)]
    o_bshd, lse_bshd = backend.forward(*bshd[:3], return_lse=True, causal=True,
                                       layout="bshd", **lengths)
    np.testing.assert_array_equal(o_bshd, o.swapaxes(1, 2))
    np.testing.assert_array_equal(lse_bshd, lse)

    grads = backend.backward(do, q, k, v, o, lse, causal=True, **lengths)
    grads_bshd = backend.backward(bshd[3], *bshd[:3], o_bshd, lse_bshd, causal=True,
                                  layout="bshd", **lengths)
    for a, b in zip(grads_bshd, grads):
        np.testing.assert_array_equal(a, b.swapaxes(1, 2))
    if backend.memory == "host":
        out, lse_out = np.full_like(o, 5.0), np.full_like(lse, 5.0)
        result = tileattn.forward(q, k, v, return_lse=True, causal=True, out=out,
                                  lse_out=lse_out, backend=backend.name, **lengths)
        assert result[0] is out and result[1] is lse_out
        np.testing.assert_array_equal(out, o)
        np.testing.assert_array_equal(lse_out, lse)
        buffers = [np.full_like(a, 5.0) for a in (q, k, v)]
        result = tileattn.backward(do, q, k, v, o, lse, causal=True, dq_out=buffers[0],
                                   dk_out=buffers[1], dv_out=buffers[2], backend=backend.name,
                                   **lengths)
        for given, buffer, want in zip(result, buffers, grads):
            assert given is buffer
            np.testing.assert_array_equal(buffer, want)

    # packed, bshd: (N_total, H, D) as flash_attn_varlen_func takes it
    cu_q, cu_k = np.array([0, 37, 37, 57]), np.array([0, 45, 52, 52])
    packed = [np.concatenate([a[b, :, :n] for b, n in enumerate(np.diff(cu))], axis=1)
              for a, cu in ((q, cu_q), (k, cu_k), (v, cu_k))]
    o_packed = backend.forward(*(np.ascontiguousarray(a.swapaxes(0, 1)) for a in packed),
                               causal=True, layout="bshd", cu_seqlens_q=cu_q,
                               cu_seqlens_k=cu_k)
    expected = np.concatenate([o[b, :, :n] for b, n in enumerate(np.diff(cu_q))], axis=1)
    assert_attention_close(o_packed, expected.swapaxes(0, 1), np.float64)

    # paged, bshd: pools (num_pages, page_size, Hkv, D) as stored
    _, _, (k_pool, v_pool), table = _paged_cache(rng, 2, 2, [9, 20], 4, 16, 8, True,
                                                 np.float64)
    q2 = rng.standard_normal((2, 4, 5, 16))
    lengths = {"block_table": table, "seqlens_k": np.array([9, 20])}
    o_bhsd = backend.forward(q2, k_pool, v_pool, **lengths)
    o_bshd = backend.forward(np.ascontiguousarray(q2.swapaxes(1, 2)),
                             k_pool.transpose(0, 2, 1, 3), v_pool.transpose(0, 2, 1, 3),
                             layout="bshd", **lengths)
    np.testing.assert_array_equal(o_bshd, o_bhsd.swapaxes(1, 2))


@pytest.mark.parametrize("family", ["padded", "packed", "paged"])
def test_unchecked_bad_lengths_never_fault(backend, family):
    """``check_lengths=False`` with lengths past their axes, decreasing cu_seqlens and
    page ids outside the pool: wrong numbers are allowed, an out-of-bounds access or a crash
    is not; results keep their shapes."""
    rng = np.random.default_rng(9)
    q = rng.standard_normal((2, 2, 20, 8))
    k = rng.standard_normal((2, 2, 24, 8))
    if family == "padded":
        args = (q, k, k)
        lengths = {"seqlens_q": np.array([-5, 1000]), "seqlens_k": np.array([10**9, -1])}
    elif family == "packed":
        args = (q[0], k[0], k[0])
        lengths = {"cu_seqlens_q": np.array([3, 50, 2, -7]),
                   "cu_seqlens_k": np.array([0, 30, 10, 1000])}
    else:
        pool = rng.standard_normal((3, 2, 4, 8))
        args = (q, pool, pool)
        lengths = {"seqlens_k": np.array([10**6, 7]),
                   "block_table": np.array([[5, -3, 10**9], [2, 1, 99]])}
    for n_q in (args[0].shape[-2], 3):  # the forward kernel and the decode path
        part = args[0][..., :n_q, :]
        if family == "packed" and n_q == 3:
            lengths = {**lengths, "cu_seqlens_q": np.array([0, 2, 1, 3])}
        o, lse = backend.forward(part, *args[1:], return_lse=True, check_lengths=False,
                                 **lengths)
        assert o.shape == part.shape and lse.shape == part.shape[:-1]

    def backward():
        return backend.backward(np.ones_like(o), part, *args[1:], o, lse,
                                check_lengths=False, **lengths)

    if family != "paged":
        grads = backward()
        assert [g.shape for g in grads] == [a.shape for a in (part, *args[1:])]


# --------------------------------------------------------------------------- errors


def _padded_args():
    q = np.zeros((2, 2, 5, 4))
    k = np.zeros((2, 1, 6, 4))
    return q, k, k


def _packed_args():
    return np.zeros((2, 5, 4)), np.zeros((1, 6, 4)), np.zeros((1, 6, 4))


def _paged_args():
    pool = np.zeros((4, 1, 3, 4))
    return np.zeros((2, 2, 5, 4)), pool, pool


ERRORS = [
    # padded
    (_padded_args, {"seqlens_q": np.array([1, -1])}, ValueError, "seqlens_q must be >= 0"),
    (_padded_args, {"seqlens_k": np.array([2**63, 1], dtype=np.uint64)}, ValueError,
     r"seqlens_k holds 9223372036854775808 at \(0,\), beyond any sequence length"),
    (_padded_args, {"seqlens_q": np.array([1, 6])}, ValueError, r"seqlens_q must be <= Nq = 5"),
    (_padded_args, {"seqlens_k": np.array([7, 1])}, ValueError, r"seqlens_k must be <= Nk = 6"),
    (_padded_args, {"seqlens_k": np.array([1.0, 2.0])}, TypeError, "seqlens_k must have an "
                                                                   "integer dtype"),
    (_padded_args, {"seqlens_q": np.array([1, 2, 3])}, ValueError, r"seqlens_q must have the "
                                                                   r"batch shape of q, \(2,\)"),
    # packed
    (_packed_args, {"cu_seqlens_q": np.array([1, 5]), "cu_seqlens_k": np.array([0, 6])},
     ValueError, "cu_seqlens_q must start at 0"),
    (_packed_args, {"cu_seqlens_q": np.array([0, 4, 3, 5]),
                    "cu_seqlens_k": np.array([0, 1, 2, 6])}, ValueError,
     "cu_seqlens_q must be non-decreasing"),
    (_packed_args, {"cu_seqlens_q": np.array([0, 5]), "cu_seqlens_k": np.array([0, 5])},
     ValueError, r"cu_seqlens_k must end at k.shape\[-2\] = 6"),
    (_packed_args, {"cu_seqlens_q": np.array([0, 5]), "cu_seqlens_k": np.array([0, 2, 6])},
     ValueError, "cu_seqlens_k must have the shape of cu_seqlens_q"),
    (_packed_args, {"cu_seqlens_q": np.array([0, 5])}, ValueError,
     "cu_seqlens_q and cu_seqlens_k must be given together"),
    (_packed_args, {"cu_seqlens_q": np.array([0.0, 5.0]), "cu_seqlens_k": np.array([0, 6])},
     TypeError, "cu_seqlens_q must have an integer dtype"),
    (_padded_args, {"cu_seqlens_q": np.array([0, 5]), "cu_seqlens_k": np.array([0, 6])},
     ValueError, r"q must have shape \(H, N_total, D\) with cu_seqlens"),
    (_packed_args, {"cu_seqlens_q": np.array([0, 5]), "cu_seqlens_k": np.array([0, 6]),
                    "seqlens_k": np.array([1])}, ValueError, "seqlens_k cannot be combined"),
    (_packed_args, {"cu_seqlens_q": np.array([0, 5]), "cu_seqlens_k": np.array([0, 6]),
                    "alibi_slopes": np.ones((2, 2))}, ValueError,
     r"alibi_slopes of packed sequences must have shape \(Hq,\) = \(2,\) or \(S, Hq\) = "
     r"\(1, 2\)"),
    # paged
    (_paged_args, {"block_table": np.zeros((2, 2), np.int32)}, ValueError,
     "seqlens_k must be given with block_table"),
    (_paged_args, {"block_table": np.array([[0, 4], [1, 2]]), "seqlens_k": np.array([6, 1])},
     ValueError, r"block_table entries must be page ids in \[0, num_pages\) = \[0, 4\), got "
                 r"block_table\[0, 1\] = 4"),
    (_paged_args, {"block_table": np.array([[0, 1], [2, 3]]), "seqlens_k": np.array([7, 1])},
     ValueError, "block_table is too short for seqlens_k"),
    (_paged_args, {"block_table": np.array([0, 1]), "seqlens_k": np.array([1, 1])},
     ValueError, r"block_table must have shape \(\*batch, max_pages\)"),
    (_paged_args, {"block_table": np.zeros((2, 2)), "seqlens_k": np.array([1, 1])},
     TypeError, "block_table must have an integer dtype"),
    (_paged_args, {"block_table": np.zeros((2, 2), int), "seqlens_k": np.array([-1, 1])},
     ValueError, "seqlens_k must be >= 0"),
    (_padded_args, {"seqlens_k": np.array([1, 1]), "check_lengths": "no"}, TypeError,
     "check_lengths must be a bool"),
]


@pytest.mark.parametrize("make_args, keywords, error, message", ERRORS)
def test_bad_lengths_and_tables_name_the_argument(backend, make_args, keywords, error,
                                                  message):
    args = [backend.to_memory(a) for a in make_args()]
    with pytest.raises(error, match=message):
        tileattn.forward(*args, backend=backend.name, **keywords)


def test_backward_rejects_a_block_table(backend):
    q, pool, _ = _paged_args()
    o = np.zeros((2, 2, 5, 4))
    with pytest.raises(ValueError, match="block_table is not accepted by backward"):
        tileattn.backward(*(backend.to_memory(a) for a in (o, q, pool, pool, o, o[..., 0])),
                          block_table=np.zeros((2, 2), int), seqlens_k=np.array([1, 1]),
                          backend=backend.name)


def test_lengths_checks_run_before_any_kernel_and_change_no_input(backend):
    q, k, v = _padded_args()
    lengths = np.array([1, 9])
    with pytest.raises(ValueError, match=r"seqlens_k\[\(1,\)\] = 9"):
        tileattn.forward(*(backend.to_memory(a) for a in (q, k, v)), seqlens_k=lengths,
                         backend=backend.name)
    assert lengths.tolist() == [1, 9]


# --------------------------------------------------------------------------- the CPU kernels


def test_cpu_varlen_calls_add_no_kernel_signature():
    """Variable-length and paged calls reuse the dense calls' compiled kernels (one
    signature per compute dtype): descriptors are int64 arrays, never new types."""
    pytest.importorskip("numba")
    from tileattn.cpu.backward_kernel import backward_kernel
    from tileattn.cpu.decode_kernel import decode_kernel
    from tileattn.cpu.forward_kernel import forward_kernel

    rng = np.random.default_rng(2)
    for dtype in (np.float32, np.float64):
        q = rng.standard_normal((2, 2, 20, 8)).astype(dtype)
        k = rng.standard_normal((2, 1, 30, 8)).astype(dtype)
        o, lse = tileattn.forward(q, k, k, backend="cpu", return_lse=True)
        tileattn.backward(o, q, k, k, o, lse, backend="cpu")
        tileattn.forward(q[:, :, :2], k, k, backend="cpu")
        before = [len(kernel.signatures) for kernel in (forward_kernel, decode_kernel,
                                                        backward_kernel)]
        lengths = {"seqlens_q": np.array([3, 20], np.int32), "seqlens_k": np.array([30, 0])}
        o, lse = tileattn.forward(q, k, k, backend="cpu", return_lse=True, **lengths)
        tileattn.backward(o, q, k, k, o, lse, backend="cpu", **lengths)
        pool = k.reshape(6, 1, 10, 8)
        paged = {"block_table": np.array([[0, 1, 2], [5, 4, 3]], np.int32),
                 "seqlens_k": np.array([25, 30])}
        tileattn.forward(q, pool, pool, backend="cpu", **paged)
        tileattn.forward(q[:, :, :2], pool.transpose(0, 2, 1, 3).copy().transpose(0, 2, 1, 3),
                         pool, backend="cpu", **paged)
        tileattn.forward(q[0], k[0], k[0], backend="cpu", cu_seqlens_q=np.array([0, 5, 20]),
                         cu_seqlens_k=np.array([0, 10, 30]))
        after = [len(kernel.signatures) for kernel in (forward_kernel, decode_kernel,
                                                       backward_kernel)]
        assert after == before


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (7, 0), (3, 5)])
def test_both_tile_orders_cover_every_tile_once_longest_first(window):
    """The GPU launcher's estimated order (`tile_list_by_estimate`) deals the same tiles as
    the exact one, sequence by sequence (the costliest sequence first, each sequence's
    costliest tile first), and where the band cuts no tile its costs are the exact ones."""
    from tileattn.tile_order import kept_pairs_per_row, tile_list, tile_list_by_estimate

    rows, cols = np.array([0, 1, 37, 64, 200, 37]), np.array([5, 0, 40, 64, 150, 40])
    bands = cols - rows
    exact = tile_list(rows, cols, bands, 16, *window)[0]
    estimated = tile_list_by_estimate(rows, cols, bands, 16, *window)
    assert sorted(map(tuple, exact)) == sorted(map(tuple, estimated))
    assert len(estimated) == int((-(-rows // 16)).sum())
    sequences = [int(s) for s, _ in estimated]
    runs = [s for i, s in enumerate(sequences) if i == 0 or sequences[i - 1] != s]
    assert len(runs) == len(set(runs)), "a sequence's tiles lie together"
    pairs = [kept_pairs_per_row(rows[s], cols[s], bands[s], *window)[r:r + 16].sum()
             for s, r in estimated]
    totals = [sum(p for p, s in zip(pairs, sequences) if s == run) for run in runs]
    if window in ((-1, -1), (-1, 0)):  # no clip inside a tile but the diagonal's
        assert totals == sorted(totals, reverse=True)
        assert runs.index(2) < runs.index(5)  # equal sequences keep their order
    for run in runs:
        own = [p for p, s in zip(pairs, sequences) if s == run]
        if window == (-1, -1):  # every row keeps every key: the estimate is exact
            assert own == sorted(own, reverse=True)
    if window == (-1, -1):
        costs = [min(16, rows[s] - r) * cols[s] for s, r in estimated]
        assert pairs == costs


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_prefill_over_pages_shorter_than_key_tiles(backend, dtype, page_size):
    """A prefill of new rows onto a paged cache, pages shorter than the key tiles the
    dense table picks (the GPU then runs tiles of one page): the contiguous call's
    results, to the dtype's tolerance, and the golden model's."""
    rng = np.random.default_rng(page_size)
    lengths_k = [700, 333]
    k, v, (k_pool, v_pool), table = _paged_cache(rng, 2, 2, lengths_k, page_size, 64, 64,
                                                 False, dtype)
    q = rng.standard_normal((2, 4, 200, 64)).astype(dtype)
    lengths = {"seqlens_k": np.array(lengths_k)}
    paged = backend.forward(q, k_pool, v_pool, return_lse=True, causal=True,
                            block_table=table, **lengths)
    contiguous = backend.forward(q, k, v, return_lse=True, causal=True, **lengths)
    expected = rv.forward_padded(*(a.astype(np.float64) for a in (q, k, v)), np.full(2, 200),
                                 np.array(lengths_k), causal=True)
    for name, actual, same, want in zip(("o", "lse"), paged, contiguous, expected):
        assert_attention_close(actual, same, dtype, name=name)
        assert_attention_close(actual, want, dtype, name=name)


# --------------------------------------------------------------------------- device lengths

_NO_GPU = tileattn.backends.availability("gpu")


@pytest.mark.gpu
@pytest.mark.skipif(_NO_GPU is not None, reason=str(_NO_GPU))
@pytest.mark.parametrize("family", ["padded", "paged"])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("n_q", [3, 90], ids=["decode", "tiles"])
def test_unchecked_device_lengths_stay_on_the_device(monkeypatch, family, index_dtype, n_q):
    """An unchecked padded or paged forward with CuPy lengths and table (what a serving loop
    passes) reads none of them on the host (the descriptors come from a kernel, the tile
    table lists every padded tile) and gives what the checked call with host lengths gives:
    int32 and int64, some sequences shorter than the padded axis (tiles past their rows
    return at once), the decode path and the query-tile kernels, causal."""
    import cupy

    from tileattn import options as options_module

    rng = np.random.default_rng(n_q)
    lengths_k = [300, 35, 0, 170]
    lengths_q = np.array([n_q, 1, 0, n_q // 2], dtype=index_dtype)
    q = rng.standard_normal((4, 4, n_q, 64)).astype(np.float16)
    if family == "paged":
        _, _, (k, v), table = _paged_cache(rng, 4, 2, lengths_k, 16, 64, 64, False, np.float16)
        lengths = {"block_table": table.astype(index_dtype)}
    else:
        k, v = (rng.standard_normal((4, 2, 300, 64)).astype(np.float16) for _ in range(2))
        lengths = {}
    lengths.update(seqlens_k=np.array(lengths_k, dtype=index_dtype), seqlens_q=lengths_q)
    device = [cupy.asarray(a) for a in (q, k, v)]
    checked = tileattn.forward(*device, return_lse=True, causal=True, **lengths)

    def no_host_copy(*_):
        raise AssertionError("an unchecked call read its device lengths on the host")

    monkeypatch.setattr(tileattn.arrays, "to_host", no_host_copy)
    monkeypatch.setattr(options_module.VarlenLayout, "on_host", no_host_copy)
    unchecked = tileattn.forward(*device, return_lse=True, causal=True, check_lengths=False,
                                 **{name: cupy.asarray(a) for name, a in lengths.items()})
    monkeypatch.undo()
    for name, a, b in zip(("o", "lse"), checked, unchecked):
        assert_attention_close(b.get(), a.get().astype(np.float64), np.float16, name=name)
    padding = np.arange(n_q)[None, :] >= lengths_q[:, None]
    assert (unchecked[0].get()[padding.nonzero()[0], :, padding.nonzero()[1]] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(_NO_GPU is not None, reason=str(_NO_GPU))
def test_unchecked_device_lengths_serve_the_backward_and_the_reference():
    """The backward (its key tiles need the lengths on the host) and the reference backend
    (which computes on the host) read an unchecked call's device lengths there."""
    import cupy

    rng = np.random.default_rng(4)
    q, k, v, do, lengths_q, lengths_k = _padded_problem(rng, dtype=np.float32)
    lengths = {"seqlens_q": lengths_q, "seqlens_k": lengths_k}
    device = {name: cupy.asarray(a.astype(np.int32)) for name, a in lengths.items()}
    arrays = [cupy.asarray(a) for a in (q, k, v, do)]
    golden_o, golden_lse = rv.forward_padded(*(a.astype(np.float64) for a in (q, k, v)),
                                             lengths_q, lengths_k, causal=True)
    for backend in ("gpu", "reference"):
        o, lse = tileattn.forward(*arrays[:3], return_lse=True, causal=True,
                                  check_lengths=False, backend=backend, **device)
        assert_attention_close(o.get(), golden_o, np.float32, name="o")
        grads = tileattn.backward(arrays[3], *arrays[:3], o, lse, causal=True,
                                  check_lengths=False, backend=backend, **device)
        expected = rv.backward_padded(*(a.astype(np.float64) for a in (do, q, k, v)),
                                      o.get().astype(np.float64), lse.get(), lengths_q,
                                      lengths_k, causal=True)
        for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
            assert_attention_close(grad.get(), want, np.float32, name=name)


@pytest.mark.gpu
@pytest.mark.skipif(_NO_GPU is not None, reason=str(_NO_GPU))
@pytest.mark.parametrize("n_q", [1, 90], ids=["decode", "tiles"])
def test_repeated_unchecked_device_calls_follow_lengths_changed_in_place(n_q):
    """A decode loop: the same CuPy lengths and table, updated in place between calls of
    one signature (remembered: problem_cache, the plan's tables refilled per call), on the
    default stream and on another one: every call reads the lengths it was given."""
    import cupy

    rng = np.random.default_rng(12)
    lengths_k = np.array([200, 35, 0, 120])
    _, _, (k, v), table = _paged_cache(rng, 4, 2, [260, 95, 60, 180], 16, 64, 64, False,
                                       np.float16)
    q = cupy.asarray(rng.standard_normal((4, 8, n_q, 64)).astype(np.float16))
    k, v = cupy.asarray(k), cupy.asarray(v)
    device_lengths, device_table = cupy.asarray(lengths_k, np.int32), cupy.asarray(table)
    for stream in (cupy.cuda.Stream.null, cupy.cuda.Stream(non_blocking=True)):
        with stream:
            for step in range(3):
                device_lengths += 20
                o, lse = tileattn.forward(q, k, v, return_lse=True, causal=True,
                                          check_lengths=False, seqlens_k=device_lengths,
                                          block_table=device_table)
                expected = tileattn.forward(q, k, v, return_lse=True, causal=True,
                                            seqlens_k=lengths_k + 20 * (step + 1),
                                            block_table=table)
                for name, a, b in zip(("o", "lse"), (o, lse), expected):
                    assert_attention_close(a.get(), b.get().astype(np.float64), np.float16,
                                           name=f"{name} at step {step}")
            device_lengths -= 60
            stream.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(_NO_GPU is not None, reason=str(_NO_GPU))
@pytest.mark.parametrize("index_dtype", [np.int16, np.int32, np.int64])
def test_repeated_unchecked_device_calls_read_new_arrays(index_dtype):
    """A decode loop that passes new CuPy lengths and a new table each step (same shapes
    and dtypes: the remembered problem takes them without re-checking), a (2, 2) batch whose
    lengths and table are reshaped to the flat batch, and an index dtype the kernels take
    as int64: every step gives what the checked call with the same values gives."""
    import cupy

    rng = np.random.default_rng(13)
    full = [260, 95, 60, 180]
    _, _, (k, v), table = _paged_cache(rng, 4, 2, full, 16, 64, 64, False, np.float16)
    q = cupy.asarray(rng.standard_normal((2, 2, 8, 1, 64)).astype(np.float16))
    k, v = cupy.asarray(k), cupy.asarray(v)
    for step in range(4):
        lengths = np.array([int(rng.integers(0, n + 1)) for n in full]).reshape(2, 2)
        # a new table each step: the used pages as they are, the rest new garbage ids
        step_table = table.copy()
        step_table[step_table < 0] = -(step + 2)
        step_table = step_table.reshape(2, 2, -1)
        o, lse = tileattn.forward(q, k, v, return_lse=True, check_lengths=False,
                                  seqlens_k=cupy.asarray(lengths.astype(index_dtype)),
                                  block_table=cupy.asarray(step_table.astype(index_dtype)))
        expected = tileattn.forward(q, k, v, return_lse=True, seqlens_k=lengths,
                                    block_table=table.reshape(2, 2, -1))
        for name, a, b in zip(("o", "lse"), (o, lse), expected):
            assert_attention_close(a.get(), b.get().astype(np.float64), np.float16,
                                   name=f"{name} at step {step}")


@pytest.mark.gpu
@pytest.mark.skipif(_NO_GPU is not None, reason=str(_NO_GPU))
@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("page_size", [None, 16, 64, 128])
def test_repeated_host_length_calls_follow_their_own_lengths(page_size, check):
    """Padded (page_size None) and paged prefills with NumPy lengths and tables, repeated
    with new values and with the same arrays changed in place (one plan per signature,
    its device tables refilled per call: gpu/operands.py plans_once): every call equals
    the golden model on its own lengths, and nothing of a row past its length or of a
    page the table does not name (NaN there) reaches the outputs."""
    import cupy

    rng = np.random.default_rng(15)
    full = [300, 95, 0, 180]
    n_q = 70
    if page_size is None:
        k_host = rng.standard_normal((4, 2, max(full), 64)).astype(np.float16)
        v_host = rng.standard_normal((4, 2, max(full), 64)).astype(np.float16)
        k_host[:, :, 290:], v_host[:, :, 290:] = np.nan, np.inf
        pools, table = (k_host, v_host), None
    else:
        _, _, pools, table = _paged_cache(rng, 4, 2, full, page_size, 64, 64, False,
                                          np.float16)
    q_host = rng.standard_normal((4, 4, n_q, 64)).astype(np.float16)
    q = cupy.asarray(q_host)
    k, v = (cupy.asarray(a) for a in pools)
    lengths_k = np.array(full)
    lengths_q = np.array([70, 3, 0, 41], np.int32)
    for step in range(4):
        if step % 2:  # the same arrays, changed in place
            lengths_k -= np.minimum(lengths_k, 17 * step)
            lengths_q[:] = rng.integers(0, n_q + 1, 4)
        else:
            lengths_k = np.array([int(rng.integers(0, n + 1)) for n in full])
        keywords = {"seqlens_k": lengths_k}
        if page_size is None:
            keywords["seqlens_q"] = lengths_q
            lengths_k[0] = min(lengths_k[0], 290)  # the NaN rows past every length
        else:
            keywords["block_table"] = table
        o, lse = tileattn.forward(q, k, v, return_lse=True, causal=True, check_lengths=check,
                                  **keywords)
        expected = tileattn.forward(q_host, *pools, return_lse=True, causal=True,
                                    backend="reference", **keywords)
        for name, a, b in zip(("o", "lse"), (o, lse), expected):
            assert_attention_close(a.get(), b, np.float16, name=f"{name} at step {step}")


@pytest.mark.gpu
@pytest.mark.skipif(_NO_GPU is not None, reason=str(_NO_GPU))
@pytest.mark.parametrize("n_q", [1, 4])
def test_unchecked_page_ids_outside_the_pool_are_clamped(n_q):
    """The 16-bit decode over device tables with page ids outside ``[0, num_pages)`` among a
    sequence's pages (what a server's bug or a stale table passes unchecked): the kernels
    clamp them into the pool, so the call equals the checked call on the clamped table,
    and nothing past the pool is read."""
    import cupy

    rng = np.random.default_rng(14)
    lengths = [300, 77]
    _, _, (k, v), table = _paged_cache(rng, 2, 2, lengths, 16, 64, 64, False, np.float16)
    num_pages = k.shape[0]
    bad = table.astype(np.int64)
    bad[0, 1], bad[0, 5], bad[1, 2] = -3, num_pages + 7, 10**12
    q = cupy.asarray(rng.standard_normal((2, 8, n_q, 64)).astype(np.float16))
    k, v = cupy.asarray(np.nan_to_num(k)), cupy.asarray(np.nan_to_num(v))
    o, lse = tileattn.forward(q, k, v, return_lse=True, check_lengths=False,
                              seqlens_k=cupy.asarray(np.array(lengths, np.int32)),
                              block_table=cupy.asarray(bad))
    expected = tileattn.forward(q, k, v, return_lse=True, seqlens_k=np.array(lengths),
                                block_table=np.clip(bad, 0, num_pages - 1))
    for name, a, b in zip(("o", "lse"), (o, lse), expected):
        assert_attention_close(a.get(), b.get().astype(np.float64), np.float16, name=name)


def test_exact_tile_order_equals_the_per_sequence_count():
    """`tile_list` (one NumPy pass over every row of every sequence) gives each sequence's
    tiles the costs `kept_pairs_per_row` gives them one sequence at a time, in the same
    stable longest-first order, and the same total (random lengths, bands, windows)."""
    from tileattn.tile_order import kept_pairs, kept_pairs_per_row, tile_list

    rng = np.random.default_rng(12)
    for _ in range(300):
        count = int(rng.integers(1, 10))
        rows, cols = rng.integers(0, 80, count), rng.integers(0, 80, count)
        bands = rng.integers(-40, 40, count)
        block = int(rng.choice([1, 5, 16, 64]))
        window = (int(rng.choice([-1, 0, 7])), int(rng.choice([-1, 0, 3])))
        tiles, total = tile_list(rows, cols, bands, block, *window)
        listed, expected_total = [], 0
        for s in range(count):
            pairs = kept_pairs_per_row(int(rows[s]), int(cols[s]), int(bands[s]), *window)
            expected_total += int(pairs.sum())
            listed += [(-(int(pairs[r:r + block].sum()) + 1), s, r)
                       for r in range(0, int(rows[s]), block)]
        expected = [(s, r) for _, s, r in sorted(listed, key=lambda item: item[0])]
        assert list(map(tuple, tiles.tolist())) == expected
        assert total == expected_total == kept_pairs(rows, cols, bands, *window)


@pytest.mark.gpu
@pytest.mark.skipif(_NO_GPU is not None, reason=str(_NO_GPU))
@pytest.mark.parametrize("family", ["packed", "padded"])
@pytest.mark.parametrize("check", [True, False])
def test_repeated_host_length_calls_reuse_plans_only_for_the_same_lengths(family, check):
    """Packed forwards and variable-length backwards with NumPy lengths keep their launches
    per lengths' contents (gpu/operands.py SequenceContents): a call repeated with the same
    values, with new values, and with the same arrays changed in place, each equal to the
    golden model on its own lengths; the same lengths plan once; more lengths than the
    cache holds evict the oldest, never a wrong plan."""
    import cupy

    from tileattn.gpu import operands

    rng = np.random.default_rng(21)
    heads, n_rows, head_dim = 4, 300, 64
    if family == "packed":
        shapes = [(heads, n_rows, head_dim)] * 4
    else:
        shapes = [(3, heads, 100, head_dim)] * 4
    host = [rng.standard_normal(s).astype(np.float16) for s in shapes]
    q, k, v, do = (cupy.asarray(a) for a in host)
    wide = [a.astype(np.float64) for a in host]

    def lengths_of(step):
        if family == "packed":
            cuts = np.sort(rng.integers(0, n_rows + 1, 3))
            return {"cu_seqlens_q": np.array([0, *cuts, n_rows], np.int32),
                    "cu_seqlens_k": np.array([0, *cuts, n_rows], np.int32)}
        return {"seqlens_q": rng.integers(0, 101, 3).astype(np.int32),
                "seqlens_k": rng.integers(1, 101, 3).astype(np.int32)}

    def golden(lengths):
        if family == "packed":
            o, lse = rv.forward_packed(*wide[:3], **lengths, causal=True)
            return (o, *rv.backward_packed(wide[3], *wide[:3], o, lse, **lengths,
                                           causal=True))
        o, lse = rv.forward_padded(*wide[:3], **lengths, causal=True)
        return (o, *rv.backward_padded(wide[3], *wide[:3], o, lse, **lengths, causal=True))

    operands._SEQUENCE_PLANS.clear()
    lengths = lengths_of(0)
    steps = ["new", "same", "same", "in place", "new", "same"]
    for step, what in enumerate(steps):
        if what == "new":
            lengths = lengths_of(step)
        elif what == "in place":
            fresh = lengths_of(step)
            for name in lengths:
                lengths[name][:] = fresh[name]
        before = len(operands._SEQUENCE_PLANS)
        o, lse = tileattn.forward(q, k, v, return_lse=True, causal=True, check_lengths=check,
                                  **lengths)
        grads = tileattn.backward(do, q, k, v, o, lse, causal=True, check_lengths=check,
                                  **lengths)
        if what == "same":
            assert len(operands._SEQUENCE_PLANS) == before, "the same lengths planned again"
        for name, got, want in zip(("o", "dq", "dk", "dv"), (o, *grads), golden(lengths)):
            assert_attention_close(got.get(), want, np.float16, name=f"{name} at step {step}")
    for step in range(operands._SEQUENCE_PLAN_LIMIT + 3):  # past the cache's size
        lengths = lengths_of(100 + step)
        o = tileattn.forward(q, k, v, causal=True, check_lengths=check, **lengths)
    assert len(operands._SEQUENCE_PLANS) <= operands._SEQUENCE_PLAN_LIMIT
    assert_attention_close(o.get(), golden(lengths)[0], np.float16, name="o after eviction")
