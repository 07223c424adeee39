"""tileattn.distributed with P ranks simulated as threads of one process: the whole ring
(forward, backward, shard/unshard, the agreement check) on every backend, exact against the
golden model of the whole problem. The same cases run over MPI in
tests/test_distributed_mpi.py; on a GPU the simulated ranks copy device to device on
streams of their own, as NCCL does.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from distributed_cases import OPTION_SETS, check_case, problem

import tileattn
import tileattn.distributed as td
from tileattn import backends
from tileattn.testing import bfloat16

LAYOUTS = ("contiguous", "zigzag")


def _cupy():
    import cupy
    return cupy


BACKEND_MEMORY = {
    "reference": (lambda a: a, lambda a: a),
    "cpu": (lambda a: a, lambda a: a),
    "gpu": (lambda a: _cupy().asarray(a), lambda a: a.get()),
}


def _usable(name: str):
    reason = backends.availability(name)
    if reason is not None:
        if name == "cpu" and importlib.util.find_spec("numba") is not None:
            pytest.fail(f"numba is installed but the CPU backend cannot run: {reason}")
        pytest.skip(reason)


def _simulate(name, size, function):
    device = 0 if name == "gpu" else None
    return td.simulate(size, function, device=device)


def _run_case(name, size, **case):
    to_memory, to_host = BACKEND_MEMORY[name]
    _simulate(name, size, lambda group: check_case(group, backend=name, to_memory=to_memory,
                                                   to_host=to_host, **case))


@pytest.mark.parametrize("options_name", list(OPTION_SETS))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_reference_float64_is_exact(size, layout, options_name):
    _run_case("reference", size, dtype=np.float64, options_name=options_name, layout=layout)


@pytest.mark.parametrize("options_name", list(OPTION_SETS))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_cpu(dtype, size, layout, options_name):
    _usable("cpu")
    _run_case("cpu", size, dtype=np.dtype(dtype), options_name=options_name, layout=layout)


@pytest.mark.parametrize("options_name", ["causal", "causal-alibi-dropout"])
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cpu_16_bit(dtype, size, options_name):
    _usable("cpu")
    if dtype == "bfloat16" and bfloat16() is None:
        pytest.skip("ml_dtypes is not installed")
    dtype = bfloat16() if dtype == "bfloat16" else np.dtype(dtype)
    _run_case("cpu", size, dtype=dtype, options_name=options_name, layout="zigzag")


def _float32_specials():
    rng = np.random.default_rng(0)
    return np.concatenate([
        rng.standard_normal(10000).astype(np.float32) * 10.0 ** rng.integers(-40, 38, 10000),
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-40, 3.0e38, 1.0 + 2**-8,
                  1.0 + 3 * 2**-8, 1.0 + 2**-9], dtype=np.float32)]).astype(np.float32)


@pytest.mark.skipif(bfloat16() is None, reason="ml_dtypes is not installed")
def test_bfloat16_bits_widen_exactly():
    """The bit-level widening of bfloat16 the ring uses on CuPy arrays (run here on NumPy)
    agrees with ml_dtypes, infinities, NaN and subnormals included."""
    from tileattn.distributed.layouts import bfloat16_bits_to_float32

    expected = _float32_specials().astype(bfloat16())
    widened = bfloat16_bits_to_float32(np, expected.view(np.uint16))
    assert np.array_equal(widened, expected.astype(np.float32), equal_nan=True)


@pytest.mark.skipif(bfloat16() is None, reason="ml_dtypes is not installed")
def test_gpu_bfloat16_narrowing_rounds_to_nearest_even():
    """The ring's cast of its float32 accumulators to bfloat16 (a CuPy kernel on the bits)
    agrees with ml_dtypes: nearest even, infinities, NaN, subnormals, both signs."""
    _usable("gpu")
    from tileattn.distributed.layouts import from_float

    values = _float32_specials()
    bits = from_float(_cupy().asarray(values), bfloat16()).view(np.uint16).get()
    expected = values.astype(bfloat16())
    finite = ~np.isnan(values)
    assert np.array_equal(bits[finite], expected.view(np.uint16)[finite])
    assert np.isnan(bits.view(bfloat16())[~finite].astype(np.float32)).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_gpu_weighted_add_matches_numpy(dtype):
    """The merge's one-pass kernel, acc = acc * w_acc + w_block * block, on a strided view
    of the accumulator with per-row weights, equals NumPy's (bfloat16 blocks by their
    bits); scalar weights of 1 are the gradient sums."""
    _usable("gpu")
    from tileattn.distributed.layouts import weighted_add

    if dtype == "bfloat16" and bfloat16() is None:
        pytest.skip("ml_dtypes is not installed")
    block_dtype = bfloat16() if dtype == "bfloat16" else np.dtype(dtype)
    accumulate = np.float64 if dtype == "float64" else np.float32
    rounding = 8 * np.finfo(accumulate).eps  # fused multiply-adds round differently
    rng = np.random.default_rng(1)
    acc = rng.standard_normal((1, 3, 40, 16)).astype(accumulate)
    w_acc = rng.random((1, 2, 20, 1)).astype(accumulate)
    w_block = rng.random((1, 2, 20, 1)).astype(accumulate)
    block = rng.standard_normal((1, 2, 20, 16)).astype(block_dtype)
    cupy = _cupy()
    on_gpu = cupy.asarray(acc)
    block_gpu = cupy.asarray(block.view(np.uint16)).view(block_dtype) \
        if dtype == "bfloat16" else cupy.asarray(block)
    weighted_add(on_gpu[:, 1:, 10:30], cupy.asarray(w_acc), cupy.asarray(w_block), block_gpu)
    weighted_add(acc[:, 1:, 10:30], w_acc, w_block, block)
    np.testing.assert_allclose(on_gpu.get(), acc, rtol=rounding, atol=rounding)
    weighted_add(on_gpu[:, 1:, 10:30], 1.0, 1.0, block_gpu)
    weighted_add(acc[:, 1:, 10:30], 1.0, 1.0, block)
    np.testing.assert_allclose(on_gpu.get(), acc, rtol=rounding, atol=rounding)


def _gpu_dtypes():
    return ["float16"] + (["bfloat16"] if bfloat16() is not None else []) + ["float32",
                                                                                "float64"]


def _gpu_cases():
    """Every option set with zigzag at P = 2 and 4; the contiguous layout and P = 1, 3 on
    fewer (each option set compiles kernels of its own)."""
    for size in (2, 4):
        for options_name in OPTION_SETS:
            yield size, "zigzag", options_name
        for options_name in ("plain", "causal", "causal-alibi-dropout"):
            yield size, "contiguous", options_name
    for size in (1, 3):
        for options_name in ("causal", "causal-alibi-dropout"):
            yield size, "zigzag", options_name


@pytest.mark.gpu
@pytest.mark.parametrize("size, layout, options_name", list(_gpu_cases()))
@pytest.mark.parametrize("dtype", _gpu_dtypes())
def test_gpu_simulated_ranks(dtype, size, layout, options_name):
    _usable("gpu")
    dtype = bfloat16() if dtype == "bfloat16" else np.dtype(dtype)
    _run_case("gpu", size, dtype=dtype, options_name=options_name, layout=layout)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("options_name", ["causal", "window", "causal-alibi-dropout"])
def test_queries_and_keys_of_different_lengths(size, options_name):
    for layout in LAYOUTS:
        _run_case("reference", size, dtype=np.float64, options_name=options_name,
                  layout=layout, n_q=24, n_k=40)


def test_group_of_one_equals_forward_bit_for_bit():
    q, k, v, do = problem(np.float64)
    options = {"causal": True, "alibi_slopes": np.linspace(0.1, 0.4, 4), "dropout_p": 0.2,
               "seed": 5}

    def run(group):
        o, lse = td.forward(q, k, v, group=group, backend="reference", return_lse=True,
                            **options)
        return (o, lse) + td.backward(do, q, k, v, o, lse, group=group, backend="reference",
                                      **options)

    o, lse, *grads = td.simulate(1, run)[0]
    o_one, lse_one = tileattn.forward(q, k, v, backend="reference", return_lse=True,
                                      **options)
    grads_one = tileattn.backward(do, q, k, v, o_one, lse_one, backend="reference", **options)
    for got, want in zip((o, lse, *grads), (o_one, lse_one, *grads_one)):
        assert np.array_equal(got, want)


# --------------------------------------------------------------------------- shard/unshard


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shard_unshard_round_trip(size, layout):
    x = np.arange(2 * 3 * 24 * 5, dtype=np.float32).reshape(2, 3, 24, 5)
    lse = np.arange(2 * 3 * 24, dtype=np.float64).reshape(2, 3, 24)

    def run(group):
        local = td.shard(x, group, layout=layout)
        local_lse = td.shard(lse, group, layout=layout, axis=-1)
        return (local, td.unshard(local, group, layout=layout),
                td.unshard(local_lse, group, layout=layout, axis=-1))

    results = td.simulate(size, run)
    chunk = 24 // (2 * size)
    for rank, (local, whole, whole_lse) in enumerate(results):
        assert np.array_equal(whole, x) and np.array_equal(whole_lse, lse)
        if layout == "contiguous":
            expected = x[:, :, rank * 24 // size:(rank + 1) * 24 // size]
        else:
            mirror = 2 * size - 1 - rank
            expected = np.concatenate([x[:, :, rank * chunk:(rank + 1) * chunk],
                                       x[:, :, mirror * chunk:(mirror + 1) * chunk]], axis=2)
        assert np.array_equal(local, expected) and local.flags.c_contiguous


@pytest.mark.parametrize("layout, n, size, needs", [("contiguous", 10, 4, "P = 4"),
                                                    ("zigzag", 12, 4, "2P = 8"),
                                                    ("zigzag", 9, 3, "2P = 6")])
def test_shard_needs_divisible_length(layout, n, size, needs):
    x = np.zeros((2, n, 4))

    def run(group):
        with pytest.raises(ValueError, match=f"layout='{layout}'.*{needs}.*got {n}"):
            td.shard(x, group, layout=layout)

    td.simulate(size, run)


def test_unknown_layout():
    with pytest.raises(ValueError, match="layout must be 'contiguous' or 'zigzag'"):
        td.simulate(1, lambda group: td.shard(np.zeros((4, 2)), group, layout="bhsd"))


@pytest.mark.parametrize("axis", [5, -5, 1.0, True])
def test_shard_and_unshard_name_an_axis_the_array_lacks(axis):
    x = np.zeros((2, 8, 4))
    for function in (td.shard, td.unshard):
        with pytest.raises(ValueError, match=f"axis={axis!r} is not an axis of an array "
                                             r"with 3 dimensions \(shape \(2, 8, 4\)\)"):
            td.simulate(1, lambda group, f=function: f(x, group, layout="contiguous",
                                                       axis=axis))


def _forward_errors(error, options_of_rank):
    """What `error` each of two simulated ranks gets from `td.forward` with the options
    `options_of_rank(rank)` gives it (None: no error)."""
    q, k, v, _ = problem(np.float64, n_q=24, n_k=24)

    def run(group):
        local = [td.shard(a, group, layout="zigzag") for a in (q, k, v)]
        try:
            td.forward(*local, group=group, backend="reference",
                       **options_of_rank(group.rank))
        except error as raised:
            return str(raised)
        return None

    return td.simulate(2, run)


def test_an_option_of_the_wrong_type_on_every_rank_is_a_type_error():
    """As `tileattn.forward`: a TypeError, the same on every rank (no hang)."""
    messages = _forward_errors(TypeError, lambda rank: {"causal": "yes"})
    assert messages[0] is not None and "causal must be a bool, got 'yes'" in messages[0]
    assert messages[0] == messages[1]


def test_return_lse_of_the_wrong_type_on_one_rank_is_refused_on_every_rank():
    """As `tileattn.forward` (a truthy ``"no"`` is not True); the rank that passed it and
    the rank that did not raise the same error, neither hangs."""
    messages = _forward_errors(ValueError,
                               lambda rank: {"return_lse": "no" if rank == 0 else True})
    assert messages[0] is not None and "return_lse must be a bool, got 'no'" in messages[0]
    assert messages[0] == messages[1]


# --------------------------------------------------------------------------- agreement


def _outcomes(size, function):
    """Each rank's ValueError message (or None when it returned)."""
    def run(group):
        try:
            function(group)
        except ValueError as error:
            return str(error)
        return None
    return td.simulate(size, run)


MISMATCHES = {
    "shape": (lambda rank, q: q[..., : 6 if rank == 1 else 8, :], {}, "q.shape"),
    "dtype": (lambda rank, q: q.astype(np.float32) if rank == 1 else q, {},
              "rejected on 1 of"),
    "causal": (lambda rank, q: q, {"causal": lambda rank: rank == 0}, "causal"),
    "seed": (lambda rank, q: q, {"dropout_p": lambda rank: 0.1, "seed": lambda rank: rank},
             "seed"),
    "invalid-on-one-rank": (lambda rank, q: q, {"softcap": lambda rank: -1.0 * rank},
                            "softcap must be >= 0"),
}


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("mismatch", list(MISMATCHES))
def test_mismatch_raises_the_same_error_on_every_rank(size, mismatch):
    change_q, options, expected = MISMATCHES[mismatch]
    q, k, v, _ = problem(np.float64, n_q=24, n_k=24)

    def run(group):
        local = [td.shard(a, group, layout="zigzag") for a in (q, k, v)]
        local[0] = change_q(group.rank, local[0])
        kwargs = {name: value(group.rank) for name, value in options.items()}
        td.forward(*local, group=group, backend="reference", **kwargs)

    messages = _outcomes(size, run)
    assert messages[0] is not None and expected in messages[0], messages[0]
    assert all(message == messages[0] for message in messages), messages


def test_backward_mismatch_raises_on_every_rank():
    q, k, v, do = problem(np.float64, n_q=24, n_k=24)

    def run(group):
        local = [td.shard(a, group, layout="zigzag") for a in (q, k, v, do)]
        o, lse = td.forward(*local[:3], group=group, backend="reference", return_lse=True)
        if group.rank == 1:
            lse = lse[..., :-2]
        td.backward(local[3], *local[:3], o, lse, group=group, backend="reference")

    messages = _outcomes(2, run)
    assert messages[0] is not None and "lse must have shape" in messages[0]
    assert messages[0] == messages[1]


@pytest.mark.parametrize("backend, dtype", [("reference", "float64"), ("cpu", "bfloat16"),
                                            ("gpu", "bfloat16"), ("gpu", "float16")])
def test_accumulators_merge_a_few_heads_at_a_time(monkeypatch, backend, dtype):
    """The merge, the gradient sums and the final casts to the input dtype run over chunks
    of heads (bounded temporaries): chunks of one head give the same results."""
    from tileattn.distributed import ring

    if backend != "reference":
        _usable(backend)
    if dtype == "bfloat16" and bfloat16() is None:
        pytest.skip("ml_dtypes is not installed")
    monkeypatch.setattr(ring, "_CHUNK_ELEMENTS", 8)
    _run_case(backend, 3, dtype=bfloat16() if dtype == "bfloat16" else np.dtype(dtype),
              options_name="causal-alibi-dropout", layout="zigzag")


def test_zigzag_needs_an_even_number_of_local_rows():
    q, k, v, _ = problem(np.float64, n_q=10, n_k=10)

    def run(group):
        td.forward(q[..., :5, :], k[..., :5, :], v[..., :5, :], group=group,
                   backend="reference", layout="zigzag")

    messages = _outcomes(2, run)
    assert messages[0] == messages[1]
    assert "layout='zigzag' needs an even number of local rows" in messages[0]


def test_trace_events_come_in_the_documented_order():
    """`ring_forward`/`ring_backward` call `trace` as ring.py's docstring says (the
    benchmark times steps, casts and waits from these events): per step a compute event,
    every wait between a "-wait" (or the forward's step event) and a "-received", and an
    "-end" after the casts."""
    from tileattn.distributed.ring import ring_backward, ring_forward

    q, k, v, do = problem(np.float64, n_q=24, n_k=24)
    options = {"scale": None, "softcap": None, "alibi_slopes": None, "dropout_p": 0.0,
               "seed": None, "block_q": None, "block_k": None}
    common = {"layout": "zigzag", "causal": True, "window": None, "backend": "reference"}

    def run(group):
        local = [td.shard(a, group) for a in (q, k, v, do)]
        forward_events, backward_events = [], []
        o, lse = ring_forward(group, *local[:3], return_lse=True, options=options,
                              trace=lambda name, step: forward_events.append((name, step)),
                              **common)
        ring_backward(group, local[3], *local[:3], o, lse,
                      options={**options, "deterministic": True},
                      trace=lambda name, step: backward_events.append((name, step)), **common)
        return forward_events, backward_events

    for forward_events, backward_events in _simulate("reference", 3, run):
        assert forward_events == [("forward", 0), ("forward-received", 0), ("forward", 1),
                                  ("forward-received", 1), ("forward", 2), ("forward-end", 3)]
        names = [name for name, _ in backward_events]
        assert names.count("backward") == 3 and names[-1] == "backward-end"
        assert names.count("backward-wait") == names.count("backward-received") == 5
        for before, after in zip(names, names[1:]):
            assert (after == "backward-received") == (before == "backward-wait")
