"""The decode's register-blocked P V (tileattn/cpu/row_products.py): products of a few rows
of float32 weights against value rows, every edge of its blocks, strided operands, and
non-finite values as IEEE arithmetic gives them; the decode kernel's dispatch around it
(`decode_kernel._group_weights_times_values`) at every width and dtype."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from numba import njit  # noqa: E402

from tileattn.cpu.decode_kernel import _group_weights_times_values  # noqa: E402
from tileattn.cpu.row_products import weights_times_values  # noqa: E402


@njit
def _dispatched(weights, values, out):
    _group_weights_times_values(weights, values, out)


def _operands(rng, rows, keys, width, pad):
    """weights (rows, keys) and values (keys, width) as views of buffers `pad` elements
    wider, so that their rows are not contiguous with each other."""
    weights = rng.standard_normal((rows, keys + pad)).astype(np.float32)[:, :keys]
    values = rng.standard_normal((keys, width + pad)).astype(np.float32)[:, :width]
    return weights, values


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 32])
@pytest.mark.parametrize("keys", [0, 1, 17, 300])
@pytest.mark.parametrize("width", [16, 32, 48, 64, 80, 128, 208])
def test_products_of_every_block_edge(rows, keys, width):
    """Blocks of two rows and one, of 64 and 16 columns, and no keys at all (zeros): the
    float64 product to float32 accumulation's rounding, written into a view of a wider
    buffer whose other elements stay, the operands untouched."""
    rng = np.random.default_rng(rows * 10_000 + keys * 100 + width)
    for pad in (0, 3):
        weights, values = _operands(rng, rows, keys, width, pad)
        kept = weights.copy(), values.copy()
        buffer = np.full((rows, width + 5), -7.0, np.float32)
        out = buffer[:, 2:2 + width]
        weights_times_values(weights, values, out)
        want = weights.astype(np.float64) @ values.astype(np.float64)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.sqrt(max(keys, 1)))
        assert (buffer[:, :2] == -7.0).all() and (buffer[:, 2 + width:] == -7.0).all()
        np.testing.assert_array_equal(weights, kept[0])
        np.testing.assert_array_equal(values, kept[1])


def test_columns_past_the_last_whole_vector_are_left_to_the_caller():
    """A width of 40: the first 32 columns computed, the last 8 and the memory past the
    output untouched (the blocks never read or write past the last whole vector)."""
    rng = np.random.default_rng(8)
    weights, values = _operands(rng, 3, 50, 40, 0)
    buffer = np.full((3, 48), -7.0, np.float32)
    weights_times_values(weights, values, buffer[:, :40])
    want = weights.astype(np.float64) @ values.astype(np.float64)
    np.testing.assert_allclose(buffer[:, :32], want[:, :32], rtol=1e-5, atol=1e-4)
    assert (buffer[:, 32:] == -7.0).all()


def test_non_finite_values_follow_ieee():
    """An infinite value reaches the columns it is in, as +-inf where its weight is
    positive or negative, as NaN where its weight is 0 (0 x inf, as BLAS gives: the decode
    kernel redoes masked rows for this); a NaN weight makes its row NaN and no other."""
    rng = np.random.default_rng(3)
    weights, values = _operands(rng, 3, 70, 96, 0)
    weights = np.abs(weights)
    values[40, 5] = np.inf
    values[41, 90] = -np.inf
    weights[1, 41] = 0.0
    weights[2, 7] = np.nan
    out = np.empty((3, 96), np.float32)
    weights_times_values(weights, values, out)
    assert out[0, 5] == np.inf and out[0, 90] == -np.inf
    assert out[1, 5] == np.inf and np.isnan(out[1, 90])
    assert np.isnan(out[2]).all()
    finite = np.ones((3, 96), bool)
    finite[:2, [5, 90]] = False
    finite[2] = False
    assert np.isfinite(out[finite]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("width", [1, 8, 15, 17, 40, 48, 64, 72, 80, 100, 128, 200])
def test_the_decode_dispatch_serves_every_width(dtype, width):
    """The register blocks (float32, contiguous rows, 64 wide or more in whole vectors) and
    the loops (other widths, float64, operands whose elements are strided): the float64
    product."""
    rng = np.random.default_rng(width)
    for rows, keys in ((1, 33), (5, 300)):
        weights, values = (a.astype(dtype) for a in _operands(rng, rows, keys, width, 3))
        strided = np.repeat(values, 2, axis=1)[:, ::2]
        for operand in (values, strided):
            out = np.full((rows, width), np.nan, dtype)
            _dispatched(weights, operand, out)
            want = weights.astype(np.float64) @ values.astype(np.float64)
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.sqrt(keys))
