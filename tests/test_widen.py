"""The CPU backend's threaded widening of float16 and bfloat16 inputs and narrowing of float16
results (tileattn/cpu/widen.py): NumPy's values bit for bit, and the same attention as inputs
NumPy converted."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

import tileattn  # noqa: E402
from tileattn.arrays import bfloat16_dtype  # noqa: E402
from tileattn.cpu.widen import MIN_ELEMENTS, narrowed, widened  # noqa: E402


def _half_dtypes():
    dtypes = [np.dtype(np.float16)]
    try:
        dtypes.append(bfloat16_dtype())
    except ImportError:
        pass
    return dtypes


@pytest.mark.parametrize("dtype", _half_dtypes(), ids=lambda d: d.name)
def test_every_bit_pattern_widens_as_numpy_converts(dtype):
    """All 65,536 patterns (infinities, NaN payloads, signed zeros, subnormals), enough
    times over to take the threaded path, in C order and through strides."""
    patterns = np.tile(np.arange(65536, dtype=np.uint16), -(-2 * MIN_ELEMENTS // 65536))
    source = patterns.view(dtype)
    for array in (source, source.reshape(-1, 64)[:, ::-1], source.reshape(-1, 64).T):
        wide = widened(array)
        assert wide is not None and wide.flags.c_contiguous and wide.dtype == np.float32
        np.testing.assert_array_equal(wide.view(np.uint32),
                                      array.astype(np.float32).view(np.uint32))
        assert wide.shape == array.shape


@pytest.mark.parametrize("dtype", _half_dtypes(), ids=lambda d: d.name)
@pytest.mark.parametrize("width", [40, 128])
def test_a_key_tile_widens_as_numpy_converts(dtype, width):
    """`widen_rows` (the decode kernel's key and value tiles: rows start:stop of one head of
    C-contiguous 16-bit bits) into the start of a longer scratch: every pattern in place,
    in float16's vectors of 16 (`half_vectors`) and the elements after the last whole one
    (7 rows of 40), the scratch past the tile untouched."""
    from numba import njit

    from tileattn.cpu.widen import widen_rows

    @njit
    def tile(bits, head, start, stop, out, bfloat16):
        widen_rows(bits[0, head, start:stop], out, bfloat16)

    rows = 65536 // width + 2
    patterns = np.resize(np.arange(65536, dtype=np.uint16), (1, 2, rows, width))
    out = np.full(rows * width + 5, 7.0, np.float32)
    for start, stop in ((0, rows), (3, rows - 1), (5, 5), (1, 8), (2, rows - 5)):
        out[:] = 7.0
        tile(patterns, 1, start, stop, out, dtype != np.float16)
        expected = patterns[0, 1, start:stop].view(dtype).astype(np.float32).reshape(-1)
        np.testing.assert_array_equal(out[:expected.size].view(np.uint32),
                                      expected.view(np.uint32))
        assert np.all(out[expected.size:] == 7.0)


def _quiet_nan_free_of_signals(bits):
    """`bits` with every signalling float32 NaN made quiet: NumPy builds may narrow those
    in hardware (which quiets them) or in software (which does not)."""
    nan = (bits & 0x7F800000 == 0x7F800000) & (bits & 0x7FFFFF != 0)
    return np.where(nan, bits | np.uint32(0x400000), bits)


def test_float32_narrows_to_float16_as_numpy_rounds():
    """Random float32 bit patterns, every float16 value and the midpoints between them (ties
    to even, subnormal ones included), their neighbours, overflow and underflow edges,
    infinities and NaN payloads: NumPy's float16 bit for bit, through the threaded path."""
    rng = np.random.default_rng(11)
    halves = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    halves = halves.view(np.uint32)
    edges = np.array([0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000, 0x38800000, 0x387FFFFF,
                      0x38000000, 0x33000000, 0x32FFFFFF, 0x33000001, 0x337FFFFF, 0x7F800000,
                      0x7FC00000, 0x7F802000, 0x7FC00001, 0x7F800000 | 0x400000 | 0x1FFF],
                     np.uint32)
    bits = np.concatenate([rng.integers(0, 2**32, 2 * MIN_ELEMENTS, dtype=np.uint64)
                           .astype(np.uint32), edges, edges | np.uint32(0x80000000), halves,
                           halves + np.uint32(1 << 12), halves + np.uint32(1),
                           halves - np.uint32(1)])
    values = _quiet_nan_free_of_signals(bits).view(np.float32).reshape(-1, 8)
    half = narrowed(values, np.dtype(np.float16))
    assert half.dtype == np.float16 and half.shape == values.shape
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(half.view(np.uint16),
                                      values.astype(np.float16).view(np.uint16))


def test_float32_narrows_to_bfloat16_as_ml_dtypes_rounds():
    """Random float32 bit patterns (NaNs of every payload and sign among them), the ties
    between bfloat16 values and their neighbours, the largest finite values, infinities and
    subnormals: ml_dtypes' bfloat16 bit for bit, through the threaded path."""
    dtype = bfloat16_dtype() if len(_half_dtypes()) > 1 else pytest.skip("no ml_dtypes")
    rng = np.random.default_rng(12)
    steps = np.arange(0, 2**32, 2**15, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0x7F7FFFFF, 0x7F7F8000, 0x7F800000, 0xFF800000, 0x80000000, 0x00008000,
                      0x00018000, 0x7FC00000, 0x7F800001, 0xFF800001, 0x00000001, 0x807FFFFF],
                     np.uint32)
    bits = np.concatenate([rng.integers(0, 2**32, 2 * MIN_ELEMENTS, dtype=np.uint64)
                           .astype(np.uint32), steps, steps + np.uint32(1),
                           steps - np.uint32(1), edges])
    values = bits.view(np.float32).reshape(-1, 4)
    narrow = narrowed(values, dtype)
    assert narrow.dtype == dtype and narrow.shape == values.shape
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(narrow.view(np.uint16),
                                      values.astype(dtype).view(np.uint16))


def test_what_numpy_narrows_instead():
    """Small or strided arrays and float32 targets are left to NumPy's (or ml_dtypes')
    conversion, with its values."""
    small = np.linspace(-3, 3, MIN_ELEMENTS - 1, dtype=np.float32)
    np.testing.assert_array_equal(narrowed(small, np.dtype(np.float16)),
                                  small.astype(np.float16))
    strided = np.linspace(-3, 3, 2 * MIN_ELEMENTS, dtype=np.float32).reshape(-1, 2).T
    np.testing.assert_array_equal(narrowed(strided, np.dtype(np.float16)),
                                  strided.astype(np.float16))
    same = np.ones(MIN_ELEMENTS, np.float32)
    assert narrowed(same, np.dtype(np.float32)) is same
    for dtype in _half_dtypes()[1:]:
        np.testing.assert_array_equal(narrowed(same, dtype), same.astype(dtype))


def test_what_numpy_converts_instead():
    """Small arrays, other dtypes and a non-native byte order are left to NumPy (None)."""
    assert widened(np.ones(MIN_ELEMENTS - 1, np.float16)) is None
    assert widened(np.ones(MIN_ELEMENTS, np.float32)) is None
    assert widened(np.ones(MIN_ELEMENTS, np.dtype(np.float16).newbyteorder())) is None


@pytest.mark.parametrize("dtype", _half_dtypes(), ids=lambda d: d.name)
def test_widened_inputs_give_the_same_attention(dtype, monkeypatch):
    """A decode step whose K and V take the threaded path (8 heads x 2048 keys x 16) and a
    prefill's backward: the same bits as the same values given in float32 (bfloat16's
    backward on float32 products here: its pair products are tests/test_bf16_products.py's)."""
    import tileattn.cpu

    monkeypatch.setattr(tileattn.cpu, "BF16_PAIR_PRODUCTS", False)
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(shape).astype(dtype) for shape in
               ((1, 8, 4, 16), (1, 8, 2048, 16), (1, 8, 2048, 16)))
    k[0, 1, 5] = np.inf  # a masked-out key's infinities stay where they were
    as32 = [a.astype(np.float32) for a in (q, k, v)]
    o, lse = tileattn.forward(q, k, v, causal=True, backend="cpu", return_lse=True,
                              window=(100, 0))
    o32, lse32 = tileattn.forward(*as32, causal=True, backend="cpu", return_lse=True,
                                  window=(100, 0))
    np.testing.assert_array_equal(o, o32.astype(dtype))
    np.testing.assert_array_equal(lse, lse32)
    k[0, 1, 5] = 0
    q = rng.standard_normal((1, 8, 2048, 16)).astype(dtype)
    do = rng.standard_normal(q.shape).astype(dtype)
    as32 = [a.astype(np.float32) for a in (q, k, v, do)]
    o, lse = tileattn.forward(q, k, v, causal=True, backend="cpu", return_lse=True)
    grads = tileattn.backward(do, q, k, v, o, lse, causal=True, backend="cpu")
    grads32 = tileattn.backward(as32[3], *as32[:3], o.astype(np.float32), lse, causal=True,
                                backend="cpu")
    for grad, want in zip(grads, grads32):
        np.testing.assert_array_equal(grad, want.astype(dtype))


@pytest.mark.parametrize("dtype", _half_dtypes(), ids=lambda d: d.name)
def test_decode_reads_16_bit_keys_as_float32_would(dtype):
    """The decode kernel widens 16-bit key tiles itself (no float32 copy of K and V):
    padded lengths with NaN past them, GQA, every score option and dropout, the same bits
    as the same values given in float32."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 4, 3, 24)).astype(dtype)
    k, v = (rng.standard_normal((2, 2, 700, 24)).astype(dtype) for _ in range(2))
    lengths = np.array([650, 123])
    for array in (k, v):
        array[0, :, 650:] = np.nan
        array[1, :, 123:] = np.inf
    k[0, 0, 7, 3] = 2.0 ** -20  # a float16 subnormal, a normal bfloat16
    options = dict(causal=True, seqlens_k=lengths, softcap=5.0, window=(300, None),
                   alibi_slopes=np.array([0.1, 0.2, 0.0, 0.3]), dropout_p=0.2, seed=9)
    o, lse = tileattn.forward(q, k, v, backend="cpu", return_lse=True, **options)
    o32, lse32 = tileattn.forward(*(a.astype(np.float32) for a in (q, k, v)), backend="cpu",
                                  return_lse=True, **options)
    np.testing.assert_array_equal(o, o32.astype(dtype))
    np.testing.assert_array_equal(lse, lse32)
    assert np.isfinite(o.astype(np.float32)).all()


@pytest.mark.parametrize("slots_outer", [False, True], ids=["heads-major", "slots-major"])
@pytest.mark.parametrize("dtype", _half_dtypes(), ids=lambda d: d.name)
@pytest.mark.parametrize("page", [1, 5, 16])
def test_paged_decode_reads_16_bit_pages_as_float32_would(dtype, slots_outer, page):
    """Paged 16-bit pools are read page by page (a page's rows of one kv head widened
    together, or each row where the pool holds slots outermost), not widened whole: the
    same bits as the same pools in float32, pages the table does not name full of NaN,
    both pool orders, pages of 1, 5 and 16 rows, GQA with few and many packed rows."""
    rng = np.random.default_rng(8)
    pages = 40
    pools = [np.full((pages, 2, page, 24), np.nan, dtype) for _ in range(2)]
    table = np.array([[3, 7, 1, 30, 12], [5, 0, 22, 9, 2]], np.int32)
    lengths = np.array([5 * page - 10 if page > 10 else 5 * page, 3 * page - 1])
    for pool in pools:
        pool[table] = rng.standard_normal((2, 5, 2, page, 24)).astype(dtype)
    if slots_outer:  # (pages, page, Hkv, D) in memory, passed as the (pages, Hkv, page, D) view
        pools = [np.ascontiguousarray(p.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
                 for p in pools]
    for n_q, heads in ((1, 4), (3, 8)):
        q = rng.standard_normal((2, heads, n_q, 24)).astype(dtype)
        options = dict(causal=True, seqlens_k=lengths, block_table=table)
        o, lse = tileattn.forward(q, *pools, backend="cpu", return_lse=True, **options)
        wide = [p.astype(np.float32) for p in pools]
        o32, lse32 = tileattn.forward(q.astype(np.float32), *wide, backend="cpu",
                                      return_lse=True, **options)
        np.testing.assert_array_equal(o, o32.astype(dtype))
        np.testing.assert_array_equal(lse, lse32)
        assert np.isfinite(o.astype(np.float32)).all()
