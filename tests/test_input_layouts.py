"""How the caller's arrays are laid out in memory: byte order, strides, and flash-attn's
``(batch, seqlen, heads, dim)`` order (``layout="bshd"``).

Most tests run once per backend (the `backend` fixture). A layout changes where the numbers
live, never the computation, so results must equal those of the same numbers in native,
C-contiguous ``(batch, heads, seqlen, dim)`` arrays exactly, bit for bit.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import tileattn

OPTIONS = dict(causal=True, softcap=3.0, window=(6, None), block_q=4, block_k=8)


def problem(dtype=np.float64, seed=0):
    """q (2, 4, 13, 8), GQA k and v (2, 2, 17, 8 / 5), do like o; C-contiguous, native."""
    rng = np.random.default_rng(seed)
    shapes = ((2, 4, 13, 8), (2, 2, 17, 8), (2, 2, 17, 5), (2, 4, 13, 5))
    return tuple(rng.standard_normal(shape).astype(dtype) for shape in shapes)


def run_both_passes(backend, q, k, v, do):
    o, lse = backend.forward(q, k, v, return_lse=True, **OPTIONS)
    grads = backend.backward(do, q, k, v, o, lse, **OPTIONS)
    return (o, lse) + tuple(grads)


def assert_identical(actual, expected):
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), actual, expected):
        assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
        np.testing.assert_array_equal(a, b, err_msg=name)


def host_only(backend):
    if backend.memory == "cuda":
        pytest.skip("byte order is a host-array matter: CuPy arrays are always native")


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_non_native_byte_order_is_computed_in_its_precision(backend, dtype):
    """A big-endian float64 array was computed in float32 (a backend's ``dtype == float64``
    is False for ``'>f8'`` on x86) and its lse came back float32."""
    host_only(backend)
    native = problem(np.dtype(dtype))
    swapped = tuple(a.astype(a.dtype.newbyteorder()) for a in native)
    assert not swapped[0].dtype.isnative
    results = run_both_passes(backend, *swapped)
    assert_identical(results, run_both_passes(backend, *native))
    assert results[0].dtype == np.dtype(dtype) and results[0].dtype.isnative
    assert results[1].dtype == (np.float64 if dtype == "float64" else np.float32)


def test_mixed_byte_orders_are_one_dtype(backend):
    host_only(backend)
    q, k, v, do = problem()
    big_k, big_do = k.astype(">f8"), do.astype(">f8")
    o, lse = backend.forward(q, big_k, v, return_lse=True, **OPTIONS)
    big_o, big_lse = o.astype(">f8"), lse.astype(">f8")
    mixed = (o, lse) + tuple(backend.backward(big_do, q, big_k, v, big_o, big_lse, **OPTIONS))
    assert_identical(mixed, run_both_passes(backend, q, k, v, do))


def test_byte_order_mismatch_of_different_precisions_names_the_dtypes():
    q, k, v, _ = problem()
    with pytest.raises(TypeError, match=r"k.dtype must equal q.dtype \(float64\), got float32"):
        tileattn.forward(q.astype(">f8"), k.astype("<f4"), v, backend="reference")


def strided_views(arrays, xp):
    """The same numbers as `arrays`, in array module `xp`'s memory (NumPy or CuPy), behind
    four kinds of strides."""
    def reversed_axes(a):  # negative strides on the sequence and feature axes
        return xp.ascontiguousarray(xp.asarray(a[..., ::-1, ::-1]))[..., ::-1, ::-1]

    def every_other_element(a):  # a non-unit stride on the last axis
        wide = xp.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
        wide[..., ::2] = xp.asarray(a)
        return wide[..., ::2]

    def heads_inner(a):  # a (B, N, H, D) buffer seen as (B, H, N, D)
        return xp.ascontiguousarray(xp.asarray(a).swapaxes(1, 2)).swapaxes(1, 2)

    def big_endian_reversed(a):  # negative strides and non-native byte order together
        return reversed_axes(a.astype(a.dtype.newbyteorder()))

    return {"negative": [reversed_axes(a) for a in arrays],
            "odd": [every_other_element(a) for a in arrays],
            "transposed": [heads_inner(a) for a in arrays],
            "big-endian negative": [big_endian_reversed(a) for a in arrays]}


@pytest.mark.parametrize("kind", ["negative", "odd", "transposed", "big-endian negative"])
def test_any_strides_give_the_contiguous_result(backend, kind):
    if kind == "big-endian negative":
        host_only(backend)
    xp = pytest.importorskip("cupy") if backend.memory == "cuda" else np
    arrays = problem(np.float32)
    views = strided_views(arrays, xp)[kind]
    for view, array in zip(views, arrays):
        assert not view.flags.c_contiguous
        np.testing.assert_array_equal(backend.to_host(view), array)
    assert_identical(run_both_passes(backend, *views), run_both_passes(backend, *arrays))


# --------------------------------------------------------------------------- layout="bshd"


def sequence_first(array):
    """A C-contiguous ``(*batch, N, H, D)`` copy of a ``(*batch, H, N, D)`` array, as a
    flash-attn user holds it."""
    return np.ascontiguousarray(array.swapaxes(-3, -2))


def problem_of_shape(batch_shape, seed=1):
    rng = np.random.default_rng(seed)
    shapes = ((4, 13, 8), (2, 17, 8), (2, 17, 5), (4, 13, 5))
    return tuple(rng.standard_normal(batch_shape + shape).astype(np.float32)
                 for shape in shapes)


@pytest.mark.parametrize("batch_shape", [(2,), (), (2, 3)])
def test_bshd_equals_the_transposed_bhsd_call(backend, batch_shape):
    q, k, v, do = problem_of_shape(batch_shape)
    expected = run_both_passes(backend, q, k, v, do)
    q_s, k_s, v_s, do_s = (sequence_first(a) for a in (q, k, v, do))
    o, lse = backend.forward(q_s, k_s, v_s, return_lse=True, layout="bshd", **OPTIONS)
    assert o.shape == q_s.shape[:-1] + (5,) and lse.shape == q.shape[:-1]
    grads = backend.backward(do_s, q_s, k_s, v_s, o, lse, layout="bshd", **OPTIONS)
    assert [g.shape for g in grads] == [q_s.shape, k_s.shape, v_s.shape]
    swapped = (expected[0].swapaxes(-3, -2), expected[1]) + tuple(
        g.swapaxes(-3, -2) for g in expected[2:])
    assert_identical((o, lse) + tuple(grads), swapped)


def test_bshd_reaches_the_backend_as_views(backend, monkeypatch):
    """The backend gets the caller's memory, axes swapped by strides: no copy on the way."""
    xp = pytest.importorskip("cupy") if backend.memory == "cuda" else np
    module = tileattn.backends.load(backend.name)
    received = {}

    def spy(name):
        original = getattr(module, name)

        def recorded(*arrays, **buffers):
            received[name] = arrays
            return original(*arrays, **buffers)
        return recorded

    monkeypatch.setattr(module, "forward", spy("forward"))
    monkeypatch.setattr(module, "backward", spy("backward"))
    q, k, v, do = (xp.asarray(sequence_first(a)) for a in problem_of_shape((2,)))
    o, lse = tileattn.forward(q, k, v, return_lse=True, layout="bshd", backend=backend.name)
    tileattn.backward(do, q, k, v, o, lse, layout="bshd", backend=backend.name)
    for name, given, seen in zip("qkv", (q, k, v), received["forward"]):
        assert xp.shares_memory(seen, given), name
        assert seen.strides == given.swapaxes(1, 2).strides, name
    for name, given, seen in zip(("do", "q", "k", "v", "o"), (do, q, k, v, o),
                                 received["backward"]):
        assert xp.shares_memory(seen, given), name
        assert seen.strides == given.swapaxes(1, 2).strides, name


def _gpu():
    reason = tileattn.backends.availability("gpu")
    if reason is not None:
        pytest.skip(reason)
    import cupy

    return cupy


# One case per way the GPU writes o: (dtype, B, Hq, Hkv, Nq, Nk, D, Dv, options), each
# reaching another kernel (tileattn.info names it): the 16-bit prefill (wgmma on sm_90),
# mma.sync through tile sizes only it is built for, 3xTF32, the generic kernel (float64),
# the tensor-core and the CUDA-core decode with their merges of key splits, the split-KV
# prefill and its merge, odd head dims, and a packed variable-length call.
STRIDED_O_CASES = [
    ("float16", 2, 4, 2, 77, 90, 64, 64, dict(causal=True)),
    ("float16", 1, 2, 2, 70, 130, 64, 64, dict(block_q=64, block_k=32)),
    ("float32", 2, 2, 1, 40, 70, 32, 24, dict(window=(20, 3))),
    ("float64", 1, 3, 3, 20, 33, 16, 8, dict(causal=True)),
    ("float16", 1, 8, 1, 1, 3000, 128, 128, {}),
    ("float32", 2, 4, 4, 2, 3000, 64, 64, dict(causal=True)),
    ("bfloat16", 1, 2, 2, 100, 8192, 128, 128, dict(causal=True)),
    ("float16", 2, 6, 3, 33, 50, 72, 40, dict(softcap=5.0)),
]


@pytest.mark.parametrize("case", STRIDED_O_CASES, ids=lambda c: f"{c[0]}-Nq{c[4]}-Nk{c[5]}")
def test_gpu_writes_bshd_o_in_the_callers_layout(case):
    """On the GPU a "bshd" o is written in place in ``(B, N, H, Dv)`` order (C-contiguous,
    as flash-attn returns it: no transpose for the caller or for XLA), holding bit for bit
    what the "bhsd" call on the same numbers holds."""
    cupy = _gpu()
    from tileattn.testing import bfloat16

    name, batch, hq, hkv, n_q, n_k, dim, value_dim, options = case
    dtype = bfloat16() if name == "bfloat16" else np.dtype(name)
    if dtype is None:
        pytest.skip("ml_dtypes is not installed")
    rng = np.random.default_rng(5)
    q, k, v = (cupy.asarray(rng.standard_normal(shape).astype(np.float32).astype(dtype))
               for shape in ((batch, hq, n_q, dim), (batch, hkv, n_k, dim),
                             (batch, hkv, n_k, value_dim)))
    expected, expected_lse = tileattn.forward(q, k, v, return_lse=True, **options)
    given = [cupy.ascontiguousarray(a.swapaxes(1, 2)) for a in (q, k, v)]
    for _ in range(2):  # the first call plans the launches, the second replays them
        o, lse = tileattn.forward(*given, return_lse=True, layout="bshd", **options)
        assert o.shape == (batch, n_q, hq, value_dim) and o.flags.c_contiguous
        np.testing.assert_array_equal(o.swapaxes(1, 2).view(np.uint8).get(),
                                      cupy.ascontiguousarray(expected).view(np.uint8).get())
        np.testing.assert_array_equal(lse.get(), expected_lse.get())


def test_gpu_writes_a_packed_bshd_o_in_the_callers_layout():
    """Packed sequences in "bshd" (``(N_total, H, D)``): o comes back C-contiguous in that
    order, equal to the "bhsd" call's."""
    cupy = _gpu()
    rng = np.random.default_rng(6)
    cu = np.array([0, 5, 130, 131, 400])
    q, k, v = (cupy.asarray(rng.standard_normal((3, 400, 64)).astype(np.float16))
               for _ in range(3))
    lengths = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    expected = tileattn.forward(q, k, v, **lengths)
    o = tileattn.forward(*(cupy.ascontiguousarray(a.swapaxes(0, 1)) for a in (q, k, v)),
                         layout="bshd", **lengths)
    assert o.shape == (400, 3, 64) and o.flags.c_contiguous
    np.testing.assert_array_equal(o.swapaxes(0, 1).get(), expected.get())


# One case per way the GPU writes gradients: (family forced on the device, or None for the
# table's choice; dtype, B, Hq, Hkv, Nq, Nk, D, Dv, options). The 16-bit table (wgmma on
# sm_90) with a query tail (the flagged dK/dV redo is launched); mma.sync forced, once with
# dK and dV in two kernels (D + Dv > 256); 3xTF32; the generic kernels (float64); a GQA
# group cut over blocks and dQ cut into key shares (few blocks: both added up by
# group_sum.cu into the strided gradients); odd widths (2-byte stores).
STRIDED_GRADIENT_CASES = [
    (None, "float16", 2, 4, 2, 77, 90, 64, 64, dict(causal=True)),
    ("mma", "float16", 2, 4, 2, 77, 90, 64, 64, dict(causal=True)),
    ("mma", "bfloat16", 1, 2, 1, 40, 70, 192, 128, dict(window=(20, 3))),
    (None, "float32", 2, 2, 1, 40, 70, 32, 24, dict(window=(20, 3))),
    # float32 MHA: the single pass in turns, dq converted at the bshd strides
    (None, "float32", 2, 2, 2, 77, 90, 64, 64, dict(causal=True)),
    (None, "float32", 1, 3, 3, 50, 70, 128, 96, dict(window=(20, 3))),
    (None, "float64", 1, 3, 3, 20, 33, 16, 8, dict(causal=True)),
    (None, "bfloat16", 1, 8, 1, 64, 4096, 128, 128, {}),
    (None, "float16", 2, 6, 3, 33, 50, 72, 40, dict(softcap=5.0)),
    (None, "float16", 1, 2, 2, 30, 41, 33, 33, dict(causal=True)),
]


def _gpu_case(cupy, case, seed):
    """q, k, v, do (B, H, N, D) CuPy arrays of a case, its dtype and options."""
    from tileattn.testing import bfloat16

    _, name, batch, hq, hkv, n_q, n_k, dim, value_dim, options = case
    dtype = bfloat16() if name == "bfloat16" else np.dtype(name)
    if dtype is None:
        pytest.skip("ml_dtypes is not installed")
    rng = np.random.default_rng(seed)
    return [cupy.asarray(rng.standard_normal(shape).astype(np.float32).astype(dtype))
            for shape in ((batch, hq, n_q, dim), (batch, hkv, n_k, dim),
                          (batch, hkv, n_k, value_dim), (batch, hq, n_q, value_dim))], options


def _bits(array):
    import cupy

    return cupy.ascontiguousarray(array).view(np.uint8).get()


@pytest.mark.parametrize("case", STRIDED_GRADIENT_CASES,
                         ids=lambda c: f"{c[0] or 'table'}-{c[1]}-D{c[7]}-Dv{c[8]}-Nk{c[6]}")
def test_gpu_writes_bshd_gradients_in_the_callers_layout(case):
    """On the GPU the gradients of a "bshd" call are written in place in ``(B, N, H, D)``
    order (C-contiguous, as flash-attn returns them: no transpose for the caller or for
    XLA), holding bit for bit what the "bhsd" call on the same numbers holds, also when a
    call replays the cached launches and when the caller passes the buffers."""
    cupy = _gpu()
    (q, k, v, do), options = _gpu_case(cupy, case, seed=7)
    o, lse = tileattn.forward(q, k, v, return_lse=True, **options)
    family = case[0]
    if family is None:
        expected = tileattn.backward(do, q, k, v, o, lse, **options)
        given = [cupy.ascontiguousarray(a.swapaxes(1, 2)) for a in (do, q, k, v, o)]
        for _ in range(2):  # the first call plans the launches, the second replays them
            grads = tileattn.backward(*given, lse, layout="bshd", **options)
            for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
                assert grad.flags.c_contiguous and grad.shape == want.swapaxes(1, 2).shape
                np.testing.assert_array_equal(_bits(grad.swapaxes(1, 2)), _bits(want),
                                              err_msg=name)
        buffers = [cupy.full_like(a, np.nan) for a in given[1:4]]
        filled = tileattn.backward(*given, lse, layout="bshd", dq_out=buffers[0],
                                   dk_out=buffers[1], dv_out=buffers[2], **options)
        for name, grad, buffer, want in zip(("dq", "dk", "dv"), filled, buffers, expected):
            assert grad is buffer
            np.testing.assert_array_equal(_bits(grad.swapaxes(1, 2)), _bits(want),
                                          err_msg=name)
        return
    from dataclasses import replace

    from tileattn.gpu import launch_backward, tiles
    from tileattn.gpu.operands import problem_of
    from tileattn.validation import validate

    defaults = dict(causal=False, window=None, scale=None, softcap=None, alibi_slopes=None,
                    dropout_p=0.0, seed=None, block_q=None, block_k=None, deterministic=True)
    resolved = validate(q, k, v, **{**defaults, **options}).options
    choice = tiles.choose_backward(replace(problem_of(q, k, v, resolved), capability=80))
    assert choice.family == family
    expected = launch_backward.run(choice, do, q, k, v, o, lse, resolved)
    buffers = [cupy.full(a.swapaxes(1, 2).shape, np.nan, a.dtype) for a in (q, k, v)]
    grads = launch_backward.run(choice, do, q, k, v, o, lse, resolved,
                                given=tuple(b.swapaxes(1, 2) for b in buffers))
    for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
        np.testing.assert_array_equal(_bits(grad), _bits(want), err_msg=name)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gpu_bshd_gradients_with_non_finite_keys_no_query_keeps(dtype):
    """inf and NaN in K and V rows that no query keeps (a window: keys 0-1 lie left of
    every row's band) reach no output: the 16-bit dK/dV kernels flag those blocks and the
    redo writes them again, at the "bshd" gradients' strides; the result equals the "bhsd"
    call's bit for bit and is finite."""
    cupy = _gpu()
    rng = np.random.default_rng(9)
    q, do = (cupy.asarray(rng.standard_normal((1, 2, 77, 64)).astype(dtype)) for _ in range(2))
    k, v = (cupy.asarray(rng.standard_normal((1, 1, 90, 64)).astype(dtype)) for _ in range(2))
    k[:, :, 0, 3] = np.inf
    v[:, :, 1, 5] = np.nan
    options = dict(causal=True, window=(10, 0))
    o, lse = tileattn.forward(q, k, v, return_lse=True, **options)
    expected = tileattn.backward(do, q, k, v, o, lse, **options)
    given = [cupy.ascontiguousarray(a.swapaxes(1, 2)) for a in (do, q, k, v, o)]
    grads = tileattn.backward(*given, lse, layout="bshd", **options)
    for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
        assert grad.flags.c_contiguous, name
        assert bool(cupy.isfinite(grad).all()), name
        np.testing.assert_array_equal(_bits(grad.swapaxes(1, 2)), _bits(want), err_msg=name)


@pytest.mark.parametrize("lengths", ["packed", "padded"])
def test_gpu_writes_variable_length_bshd_gradients_in_the_callers_layout(lengths):
    """Packed and padded sequences in "bshd": the gradients come back C-contiguous in that
    order, equal to the "bhsd" call's, padding rows and keys 0."""
    cupy = _gpu()
    rng = np.random.default_rng(8)
    if lengths == "packed":
        cu = np.array([0, 5, 130, 131, 400])
        keywords = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
        shapes, axes = [(3, 400, 64)] * 4, (0, 1)
    else:
        keywords = dict(seqlens_q=np.array([70, 3]), seqlens_k=np.array([90, 0]), causal=True)
        shapes, axes = [(2, 4, 80, 64), (2, 2, 96, 64), (2, 2, 96, 64), (2, 4, 80, 64)], (1, 2)
    q, k, v, do = (cupy.asarray(rng.standard_normal(s).astype(np.float16)) for s in shapes)
    o, lse = tileattn.forward(q, k, v, return_lse=True, **keywords)
    expected = tileattn.backward(do, q, k, v, o, lse, **keywords)
    given = [cupy.ascontiguousarray(a.swapaxes(*axes)) for a in (do, q, k, v, o)]
    grads = tileattn.backward(*given, lse, layout="bshd", **keywords)
    for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
        assert grad.flags.c_contiguous, name
        np.testing.assert_array_equal(_bits(grad.swapaxes(*axes)), _bits(want), err_msg=name)


def test_two_dimensional_arrays_mean_the_same_in_both_layouts():
    q, k, v, _ = problem_of_shape((), seed=3)
    q, k, v = q[0], k[0], v[0]
    for backend in ("reference", "cpu"):
        np.testing.assert_array_equal(
            tileattn.forward(q, k, v, layout="bshd", backend=backend),
            tileattn.forward(q, k, v, backend=backend))


@pytest.mark.parametrize("layout", ["BSHD", "bsdh", None, ["bshd"]])
def test_unknown_layouts_are_rejected(layout):
    q, k, v, do = problem_of_shape((2,))
    match = r"layout must be 'bhsd' \(batch, heads, seqlen, dim\) or 'bshd' .* got "
    with pytest.raises(ValueError, match=match + re.escape(repr(layout))):
        tileattn.forward(q, k, v, layout=layout)
    with pytest.raises(ValueError, match=match):
        tileattn.backward(do, q, k, v, do, do[..., 0], layout=layout)


def test_bshd_shape_errors_show_the_callers_shapes():
    q, k, v, do = (sequence_first(a) for a in problem_of_shape((2,)))
    with pytest.raises(ValueError, match=r"k head dim must equal q head dim D=8, got 7 "
                                         r"\(q shape \(2, 13, 4, 8\), k shape \(2, 17, 2, 7\)\)"):
        tileattn.forward(q, k[..., :7], v, layout="bshd")
    o, lse = tileattn.forward(q, k, v, layout="bshd", return_lse=True)
    with pytest.raises(ValueError, match=r"do must have shape \(2, 13, 4, 5\) \(layout='bshd'\), "
                                         r"got \(2, 4, 13, 5\)"):
        tileattn.backward(do.swapaxes(1, 2), q, k, v, o, lse, layout="bshd")
    with pytest.raises(ValueError, match=r"lse must have shape \(2, 4, 13\), got \(2, 13, 4\)"):
        tileattn.backward(do, q, k, v, o, lse.swapaxes(1, 2), layout="bshd")
