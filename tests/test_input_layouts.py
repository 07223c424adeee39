"""How the caller's arrays are laid out in memory: byte order and strides.

Every test runs once per backend (the `backend` fixture). A layout changes where the numbers
live, never the computation, so results must equal those of the same numbers in native,
C-contiguous arrays exactly, bit for bit.
"""

from __future__ import annotations

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
