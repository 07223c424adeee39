"""The validated-problem cache (`tileattn.problem_cache`): a repeated call gets exactly the
problem validation would give, with its own arrays, and a call validation rejects is
rejected even when a call of the same shapes was remembered before."""

from __future__ import annotations

import contextlib
import gc
import weakref
from dataclasses import fields

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tileattn
from tileattn import problem_cache
from tileattn.testing import attention_problems
from tileattn.validation import validate

FORWARD_OPTIONS = dict(causal=False, window=None, scale=None, softcap=None, alibi_slopes=None,
                       dropout_p=0.0, seed=None, block_q=None, block_k=None,
                       deterministic=True)


def _arrays(shape_q, shape_k, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(shape_q).astype(dtype)
    k = rng.standard_normal(shape_k).astype(dtype)
    v = rng.standard_normal(shape_k).astype(dtype)
    return q, k, v


def _same_problem(got, expected):
    for field in fields(expected):
        if field.name == "tensors":
            assert got.tensors.keys() == expected.tensors.keys()
            for name, array in expected.tensors.items():
                assert got.tensors[name].shape == array.shape
                assert got.tensors[name].strides == array.strides
                assert np.shares_memory(got.tensors[name], array) or array.size == 0
        elif field.name == "options":  # AttentionOptions compares by identity
            for option in fields(expected.options):
                assert (getattr(got.options, option.name)
                        == getattr(expected.options, option.name)), option.name
        else:
            assert getattr(got, field.name) == getattr(expected, field.name), field.name


class _Validations:
    """`problem_cache.validate` counted: one entry in `calls` per validation, except while
    `paused` (fresh validations a test makes to compare with)."""

    def __init__(self):
        self.calls = []
        self._counting = True

    def __call__(self, *args, **kwargs):
        if self._counting:
            self.calls.append(1)
        return validate(*args, **kwargs)

    def pause(self):
        self._counting = False

    @contextlib.contextmanager
    def paused(self):
        self.pause()
        try:
            yield
        finally:
            self._counting = True


@pytest.fixture
def validations(monkeypatch):
    counter = _Validations()
    monkeypatch.setattr(problem_cache, "validate", counter)
    return counter


CASES = {
    "4-D": ((2, 4, 8, 16), (2, 2, 12, 16), "bhsd"),
    "bshd": ((2, 8, 4, 16), (2, 12, 2, 16), "bshd"),
    "2-D": ((8, 16), (12, 16), "bhsd"),
    "two batch axes": ((2, 3, 4, 8, 16), (2, 3, 1, 12, 16), "bhsd"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_repeated_call_gets_the_problem_validation_gives(case):
    shape_q, shape_k, layout = CASES[case]
    first = _arrays(shape_q, shape_k, seed=1)
    second = _arrays(shape_q, shape_k, seed=2)
    problem_cache.validate_call(*first, layout=layout, **FORWARD_OPTIONS)
    remembered = problem_cache.validate_call(*second, layout=layout, **FORWARD_OPTIONS)
    _same_problem(remembered, validate(*second, layout=layout, **FORWARD_OPTIONS))
    for name, array in zip("qkv", second):
        assert np.shares_memory(remembered.tensors[name], array)


@pytest.mark.parametrize("case", CASES)
def test_a_repeated_backward_call_gets_the_problem_validation_gives(case):
    shape_q, shape_k, layout = CASES[case]
    q, k, v = _arrays(shape_q, shape_k)
    o, lse = tileattn.forward(q, k, v, layout=layout, return_lse=True, backend="reference")
    do = np.ones_like(o)
    options = dict(FORWARD_OPTIONS, deterministic=False)
    problem_cache.validate_call(q, k, v, do=do, o=o, lse=lse, layout=layout, **options)
    do_again, lse_again = do + 1, lse.copy()
    remembered = problem_cache.validate_call(q, k, v, do=do_again, o=o, lse=lse_again,
                                             layout=layout, **options)
    _same_problem(remembered, validate(q, k, v, do=do_again, o=o, lse=lse_again,
                                       layout=layout, **options))
    assert np.shares_memory(remembered.tensors["do"], do_again)
    assert np.shares_memory(remembered.tensors["lse"], lse_again)


def test_repeated_calls_give_the_results_of_fresh_ones():
    q, k, v = _arrays((1, 2, 5, 8), (1, 2, 7, 8))
    first = tileattn.forward(q, k, v, causal=True, backend="reference")
    for seed in (3, 4):
        q2, k2, v2 = _arrays((1, 2, 5, 8), (1, 2, 7, 8), seed=seed)
        again = tileattn.forward(q2, k2, v2, causal=True, backend="reference")
        problem_cache._PROBLEMS.clear()
        fresh = tileattn.forward(q2, k2, v2, causal=True, backend="reference")
        np.testing.assert_array_equal(again, fresh)
        assert not np.array_equal(again, first)


def test_calls_validation_rejects_stay_rejected_after_a_remembered_one():
    """Option values equal to a remembered one but of another type (causal=1 == True), other
    dtypes, shapes, strides and byte orders are validated again."""
    q, k, v = _arrays((1, 2, 4, 8), (1, 2, 4, 8))
    tileattn.forward(q, k, v, causal=True, scale=1.0, backend="reference")
    with pytest.raises(TypeError, match="causal must be a bool"):
        tileattn.forward(q, k, v, causal=1, scale=1.0, backend="reference")
    with pytest.raises(TypeError, match="dtype"):
        tileattn.forward(q, k.astype(np.float64), v, causal=True, scale=1.0,
                         backend="reference")
    with pytest.raises(ValueError, match="head dim"):
        tileattn.forward(q, k[..., :4], v, causal=True, scale=1.0, backend="reference")
    with pytest.raises(ValueError, match="scale"):
        tileattn.forward(q, k, v, causal=True, scale=float("nan"), backend="reference")
    swapped = q.astype(q.dtype.newbyteorder())
    swapped[...] = q
    o = tileattn.forward(swapped, k, v, causal=True, scale=1.0, backend="reference")
    assert o.dtype == np.float32 and o.dtype.isnative


def test_items_of_a_remembered_window_and_check_lengths_keep_their_type_checks():
    """window=(True, 1) and (1.0, 1) equal (1, 1), and check_lengths=1 equals True, in value
    and hash; after a remembered call with the valid ones they are still rejected."""
    q = np.ones((4, 8), np.float32)
    tileattn.forward(q, q, q, window=(1, 1), backend="reference")
    for window in ((True, 1), (1.0, 1), (1, np.float64(1.0))):
        with pytest.raises(TypeError, match="window"):
            tileattn.forward(q, q, q, window=window, backend="reference")
    tileattn.forward(q, q, q, check_lengths=True, backend="reference")
    with pytest.raises(TypeError, match="check_lengths must be a bool"):
        tileattn.forward(q, q, q, check_lengths=1, backend="reference")


def test_the_cache_keeps_no_array_alive():
    q, k, v = _arrays((1, 1, 4, 8), (1, 1, 4, 8))
    tileattn.forward(q, k, v, backend="reference")
    tileattn.forward(q, k, v, backend="reference")
    references = [weakref.ref(a) for a in (q, k, v)]
    del q, k, v
    gc.collect()
    assert all(reference() is None for reference in references)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_output_buffers_of_a_remembered_call_are_checked_and_written(layout):
    """out= and lse_out= of a remembered signature: the results land in this call's
    buffers, and buffers that overlap an input or are read-only are still rejected."""
    shape_q, shape_k = ((1, 2, 5, 8), (1, 2, 7, 8)) if layout == "bhsd" else (
        (1, 5, 2, 8), (1, 7, 2, 8))
    q, k, v = _arrays(shape_q, shape_k)
    expected, expected_lse = tileattn.forward(q, k, v, layout=layout, return_lse=True,
                                              backend="reference")
    for _ in range(2):
        out, lse_out = np.empty_like(expected), np.empty_like(expected_lse)
        if layout == "bshd":  # a swapaxes view of a (B, H, N, D) buffer, as results are
            out = np.empty((1, 2, 5, 8), np.float32).swapaxes(1, 2)
        o, lse = tileattn.forward(q, k, v, layout=layout, return_lse=True, out=out,
                                  lse_out=lse_out, backend="reference")
        assert o is out and lse is lse_out
        np.testing.assert_array_equal(out, expected)
        np.testing.assert_array_equal(lse_out, expected_lse)
    # The remembered signature, with lse_out on k's first bytes.
    k_memory = np.empty(k.size, np.float32)
    k_shared = k_memory.reshape(k.shape)
    k_shared[...] = k
    with pytest.raises(ValueError, match="lse_out must not share memory with k"):
        tileattn.forward(q, k_shared, v, layout=layout, return_lse=True, out=out,
                         lse_out=k_memory[:lse_out.size].reshape(lse_out.shape),
                         backend="reference")
    read_only = np.empty_like(out)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        tileattn.forward(q, k, v, layout=layout, out=read_only, lse_out=lse_out,
                         backend="reference")


def test_calls_it_does_not_remember_are_validated_each_time(validations):
    """ALiBi slopes, lengths given as lists and unhashable option values."""
    calls = validations.calls
    q, k, v = _arrays((1, 2, 4, 8), (1, 2, 4, 8))
    for _ in range(2):
        tileattn.forward(q, k, v, alibi_slopes=np.ones(2), backend="reference")
        tileattn.forward(q, k, v, window=[1, 1], backend="reference")
        tileattn.forward(q, k, v, seqlens_k=[3], backend="reference")
    assert len(calls) == 6
    for _ in range(2):
        tileattn.forward(q, k, v, window=(1, 1), backend="reference")
        tileattn.forward(q, k, v, window=(1, 1), out=np.empty_like(q), backend="reference")
    assert len(calls) == 8


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_repeated_dense_forwards_go_straight_to_the_backend(backend, case, monkeypatch):
    """A repeated forward without buffers or lengths hands its arrays (in the backends'
    4-D order) and the remembered options to the backend (`problem_cache.dense_call`),
    past `api.run_forward`: the same o and lse as a fresh call, in the caller's layout,
    the inputs untouched, and the backend's errors still raised. Calls with buffers and
    empty problems keep the way through `run_forward`."""
    from tileattn import api

    through = []
    run_forward = api.run_forward
    monkeypatch.setattr(api, "run_forward",
                        lambda problem, name: through.append(1) or run_forward(problem, name))
    shape_q, shape_k, layout = CASES[case]
    q, k, v = _arrays(shape_q, shape_k, seed=3)
    problem_cache._PROBLEMS.clear()
    tileattn.forward(q, k, v, causal=True, backend=backend, layout=layout)
    assert len(through) == 1
    for seed in (4, 5):
        q2, k2, v2 = _arrays(shape_q, shape_k, seed=seed)
        kept = [a.copy() for a in (q2, k2, v2)]
        o, lse = tileattn.forward(q2, k2, v2, causal=True, backend=backend, layout=layout,
                                  return_lse=True)
        assert len(through) == 1
        for array, copy in zip((q2, k2, v2), kept):
            np.testing.assert_array_equal(array, copy)
        problem_cache._PROBLEMS.clear()
        fresh_o, fresh_lse = tileattn.forward(q2, k2, v2, causal=True, backend=backend,
                                              layout=layout, return_lse=True)
        assert len(through) == 2
        through.pop()
        for got, expected in ((o, fresh_o), (lse, fresh_lse)):
            assert got.shape == expected.shape and got.strides == expected.strides
            np.testing.assert_array_equal(got, expected)
    for other in ("gpu", "tpu"):  # the errors of a fresh call: GPU memory, or no CuPy
        raised = []
        for remembered in (True, False):
            if not remembered:
                problem_cache._PROBLEMS.clear()
            with pytest.raises((ValueError, tileattn.BackendUnavailableError)) as error:
                tileattn.forward(q, k, v, causal=True, backend=other, layout=layout)
            raised.append((error.type, str(error.value)))
        assert raised[0] == raised[1]
    through.clear()
    o = tileattn.forward(q, k, v, causal=True, backend=backend, layout=layout)
    empty = (q[..., :0, :], k, v) if layout == "bhsd" else (q[:, :0], k, v)
    for arrays, keywords in (((q, k, v), {"out": np.empty_like(o)}),
                             ((q, k, v), {"lse_out": np.empty(q.shape[:-1], np.float32)
                                          if layout == "bhsd" else
                                          np.empty((2, 4, 8), np.float32)}),
                             (empty, {})):
        for _ in range(2):
            tileattn.forward(*arrays, causal=True, backend=backend, layout=layout,
                             **keywords)
    assert len(through) == 6


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_repeated_dense_backwards_go_straight_to_the_backend(backend, case, monkeypatch):
    """As forwards do: a repeated backward without buffers skips `api.run_backward`, with
    the gradients of a fresh call in the caller's layout; with buffers it does not."""
    from tileattn import api

    through = []
    run_backward = api.run_backward
    monkeypatch.setattr(api, "run_backward",
                        lambda problem, name: through.append(1) or run_backward(problem, name))
    shape_q, shape_k, layout = CASES[case]
    problem_cache._PROBLEMS.clear()
    for seed in (6, 7, 8):
        q, k, v = _arrays(shape_q, shape_k, seed=seed)
        o, lse = tileattn.forward(q, k, v, causal=True, backend=backend, layout=layout,
                                  return_lse=True)
        do = np.random.default_rng(seed).standard_normal(o.shape).astype(np.float32)
        grads = tileattn.backward(do, q, k, v, o, lse, causal=True, backend=backend,
                                  layout=layout)
        assert len(through) == 1
        problem_cache._PROBLEMS.clear()
        fresh = tileattn.backward(do, q, k, v, o, lse, causal=True, backend=backend,
                                  layout=layout)
        assert len(through) == 2
        through.pop()
        for got, expected in zip(grads, fresh):
            assert got.shape == expected.shape and got.strides == expected.strides
            np.testing.assert_array_equal(got, expected)
    buffers = {"dk_out": np.empty_like(k)}
    for _ in range(2):
        tileattn.backward(do, q, k, v, o, lse, causal=True, backend=backend, layout=layout,
                          **buffers)
    assert len(through) == 3
    np.testing.assert_array_equal(buffers["dk_out"], fresh[1])


@settings(max_examples=60, deadline=None)
@given(problem=attention_problems(max_seq=24, max_elements=20_000),
       layout=st.sampled_from(["bhsd", "bshd"]))
def test_a_repeated_call_gives_the_bits_of_a_fresh_one(problem, layout):
    """Any drawn problem (shapes, strides, dtypes, options) on the CPU backend: the repeated
    forward and backward (straight to the backend where `dense_call` allows) give exactly
    the results of the first call and of a call validated afresh, in the caller's layout,
    and leave the inputs as they were."""
    arrays = [problem.q, problem.k, problem.v, problem.do]
    if layout == "bshd":
        if problem.q.ndim < 3:
            layout = "bhsd"
        else:
            arrays = [a.swapaxes(-3, -2) for a in arrays]
    q, k, v, do = arrays
    kept = [a.copy() for a in arrays]
    options = dict(problem.options, layout=layout, backend="cpu")

    def both():
        o, lse = tileattn.forward(q, k, v, return_lse=True, **options)
        return (o, lse) + tileattn.backward(do, q, k, v, o, lse, **options)

    problem_cache._PROBLEMS.clear()
    first, again = both(), both()
    problem_cache._PROBLEMS.clear()
    fresh = both()
    for name, got, expected, reference in zip(("o", "lse", "dq", "dk", "dv"), again, fresh,
                                              first):
        assert got.shape == expected.shape and got.dtype == expected.dtype, name
        assert got.strides == expected.strides, name
        np.testing.assert_array_equal(got, expected, err_msg=name)
        np.testing.assert_array_equal(reference, expected, err_msg=name)
    for array, copy in zip(arrays, kept):
        np.testing.assert_array_equal(array, copy)


def test_host_torch_tensors_are_remembered_and_get_tensors_back(validations):
    torch = pytest.importorskip("torch")
    calls = validations.calls
    q, k, v = (torch.from_numpy(a) for a in _arrays((1, 2, 5, 8), (1, 2, 7, 8), seed=7))
    results = [tileattn.forward(q, k, v, causal=True, backend="reference") for _ in range(2)]
    q2 = q + 1
    results.append(tileattn.forward(q2, k, v, causal=True, backend="reference"))
    assert len(calls) == 1
    assert all(isinstance(o, torch.Tensor) for o in results)
    expected = tileattn.forward(q2.numpy(), k.numpy(), v.numpy(), causal=True,
                                backend="reference")
    np.testing.assert_array_equal(results[2].numpy(), expected)
    # A NumPy call of the same shapes is its own signature: its results stay NumPy.
    assert isinstance(tileattn.forward(q.numpy(), k.numpy(), v.numpy(), causal=True,
                                       backend="reference"), np.ndarray)


def test_evolve_copies_a_record_with_the_changes_and_leaves_it_as_it_was():
    """`options.evolve` (a remembered unchecked call's layout and options around its new
    length arrays) equals `dataclasses.replace` field by field, without touching the
    record it copies."""
    from dataclasses import replace

    from tileattn.options import VarlenLayout, evolve

    table = np.arange(12).reshape(4, 3)
    layout = VarlenLayout("paged", seqlens_k=np.full(4, 40), block_table=table,
                          page_size=16, num_pages=12, checked=False)
    new_lengths = np.full(4, 7)
    evolved = evolve(layout, seqlens_k=new_lengths)
    replaced = replace(layout, seqlens_k=new_lengths)
    assert type(evolved) is VarlenLayout and evolved is not layout
    for field in fields(VarlenLayout):
        assert getattr(evolved, field.name) is getattr(replaced, field.name), field.name
    assert np.array_equal(layout.seqlens_k, np.full(4, 40)) and layout.block_table is table
    with pytest.raises(AttributeError):  # still frozen
        evolved.page_size = 1


UNCHECKED_HOST_LENGTHS = {
    "padded": lambda rng: {"seqlens_q": rng.integers(0, 6, 3).astype(np.int32),
                           "seqlens_k": rng.integers(0, 8, 3)},
    "paged": lambda rng: {"seqlens_k": rng.integers(0, 13, 3),
                          "block_table": rng.permutation(12).reshape(3, 4)},
}


@pytest.mark.parametrize("family", UNCHECKED_HOST_LENGTHS)
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_unchecked_host_lengths_are_remembered_and_each_call_uses_its_own(family, backend,
                                                                         validations):
    """An unchecked call with NumPy lengths of a remembered signature skips validation and
    attends with its own lengths and table: the same result as validating it afresh."""
    rng = np.random.default_rng(7)
    q, k, v = _arrays((3, 2, 5, 8), (3, 1, 8, 8))
    if family == "paged":  # 12 pages of 4 slots
        k, v = (rng.standard_normal((12, 1, 4, 8)).astype(np.float32) for _ in range(2))
    calls = validations.calls
    problem_cache._PROBLEMS.clear()
    results = []
    for _ in range(3):
        lengths = UNCHECKED_HOST_LENGTHS[family](rng)
        kept = {name: array.copy() for name, array in lengths.items()}
        o = tileattn.forward(q, k, v, causal=True, check_lengths=False, backend=backend,
                             **lengths)
        for name, array in lengths.items():  # read, never written
            np.testing.assert_array_equal(array, kept[name])
        with validations.paused():
            problem_cache._PROBLEMS.clear()
            fresh = tileattn.forward(q, k, v, causal=True, check_lengths=False,
                                     backend=backend, **lengths)
            problem_cache._PROBLEMS.clear()
            again = tileattn.forward(q, k, v, causal=True, check_lengths=False,
                                     backend=backend, **lengths)  # remembered afresh
        np.testing.assert_array_equal(o, fresh)
        np.testing.assert_array_equal(again, fresh)
        results.append(o)
    assert len(calls) == 1  # the first call only: the others found its problem
    assert not np.array_equal(results[0], results[1])


def test_unchecked_uint64_host_lengths_keep_their_range_check():
    """A remembered unchecked call with uint64 lengths is validated afresh: a value past
    int64 is still refused by name."""
    q, k, v = _arrays((2, 1, 4, 8), (2, 1, 6, 8))
    tileattn.forward(q, k, v, seqlens_k=np.array([3, 6], np.uint64), check_lengths=False,
                     backend="reference")
    with pytest.raises(ValueError, match="seqlens_k holds"):
        tileattn.forward(q, k, v, seqlens_k=np.array([3, 2**63], np.uint64),
                         check_lengths=False, backend="reference")


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_checked_lengths_are_remembered_and_checked_at_every_call(backend, validations):
    """A checked call with NumPy lengths of a remembered signature skips the rest of
    validation but checks its own lengths: bad contents are refused by name, good ones
    give what a fresh validation gives."""
    calls = validations.calls
    problem_cache._PROBLEMS.clear()
    q, k, v = _arrays((2, 2, 5, 8), (2, 2, 7, 8))
    cu_q, cu_k = np.array([0, 2, 5]), np.array([0, 3, 7])
    packed = [a.transpose(1, 0, 2, 3).reshape(2, -1, 8)[:, :n] for a, n in
              ((q, 5), (k, 7), (v, 7))]
    results = {}
    for lengths in (np.array([5, 3]), np.array([0, 7]), np.array([4, 4])):
        results[tuple(lengths)] = tileattn.forward(q, k, v, causal=True, seqlens_k=lengths,
                                                   backend=backend)
        tileattn.forward(*packed, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend=backend)
    assert len(calls) == 2  # one padded and one packed signature
    with pytest.raises(ValueError, match=r"seqlens_k must be <= Nk = 7"):
        tileattn.forward(q, k, v, causal=True, seqlens_k=np.array([8, 3]), backend=backend)
    with pytest.raises(ValueError, match="seqlens_k must be >= 0"):
        tileattn.forward(q, k, v, causal=True, seqlens_k=np.array([3, -1]), backend=backend)
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        tileattn.forward(*packed, cu_seqlens_q=cu_q, cu_seqlens_k=np.array([0, 5, 4]),
                         backend=backend)
    with pytest.raises(ValueError, match="cu_seqlens_q must end at"):
        tileattn.forward(*packed, cu_seqlens_q=np.array([0, 2, 4]), cu_seqlens_k=cu_k,
                         backend=backend)
    assert len(calls) == 2
    validations.pause()
    for lengths, remembered in results.items():
        problem_cache._PROBLEMS.clear()
        fresh = tileattn.forward(q, k, v, causal=True, seqlens_k=np.array(lengths),
                                 backend=backend)
        np.testing.assert_array_equal(remembered, fresh)


def test_keyword_order_does_not_matter_and_the_api_shares_the_entries(validations):
    """`validate_call` takes the options by keyword in any order and remembers them under
    the key that `tileattn.forward` uses (`remembered_problem`); a missing or unknown
    keyword is validation's TypeError."""
    calls = validations.calls
    q, k, v = _arrays((1, 2, 5, 8), (1, 2, 7, 8))
    options = dict(FORWARD_OPTIONS, causal=True)
    problem_cache._PROBLEMS.clear()
    tileattn.forward(q, k, v, causal=True, backend="reference")
    in_reverse = dict(reversed(list(options.items())))
    remembered = problem_cache.validate_call(q, k, v, **in_reverse)
    assert len(calls) == 1
    with validations.paused():
        _same_problem(remembered, validate(q, k, v, **options))
    with pytest.raises(TypeError, match="not_an_option"):
        problem_cache.validate_call(q, k, v, **options, not_an_option=1)
    del options["seed"]
    with pytest.raises(TypeError, match="seed"):
        problem_cache.validate_call(q, k, v, **options)
