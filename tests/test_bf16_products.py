"""The bfloat16 pair products of the CPU backward (tileattn/cpu/bf16_products.py): the
products of the operands rounded to bfloat16, in every operand layout the backward gives,
bfloat16's rounding as ml_dtypes rounds, the same sums without AVX512-BF16, and the
backward on them against the golden model."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

import tileattn  # noqa: E402
from tileattn.testing import assert_attention_close, attention_error, bfloat16  # noqa: E402

bf16_products = pytest.importorskip("tileattn.cpu.bf16_products")
from numba import njit  # noqa: E402

PRODUCTS = {
    # name: (operand shapes from (rows, inner, columns), the product of those operands)
    "nt": (lambda m, k, n: ((m, k), (n, k)), lambda a, b: a @ b.T),
    "tn": (lambda m, k, n: ((k, m), (k, n)), lambda a, b: a.T @ b),
    "nn": (lambda m, k, n: ((m, k), (k, n)), lambda a, b: a @ b),
}


def _rounded(array):
    dtype = bfloat16()
    if dtype is None:  # round half to even by hand
        bits = np.ascontiguousarray(array, np.float32).view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        return bits.astype(np.uint32).view(np.float32).reshape(array.shape)
    return array.astype(dtype).astype(np.float32)


def _product(name, a, b, out=None):
    rows = a.shape[1] if name == "tn" else a.shape[0]
    columns = b.shape[0] if name == "nt" else b.shape[1]
    inner = a.shape[0] if name == "tn" else a.shape[1]
    shape = (rows, columns)
    buffers = [np.full(size, 7, dtype) for size, dtype in
               zip(bf16_products.workspace_sizes(rows, inner, columns),
                   (np.uint32, np.uint32, np.float32))]
    out = np.full(shape, np.nan, np.float32) if out is None else out
    getattr(bf16_products, f"dot_{name}")(a, b, out, *buffers)
    return out


@pytest.mark.parametrize("name", sorted(PRODUCTS))
@pytest.mark.parametrize("rows, inner, columns", [(1, 1, 1), (8, 2, 32), (9, 3, 33),
                                                  (37, 13, 50), (64, 64, 128), (130, 71, 65)])
def test_products_of_the_rounded_operands(name, rows, inner, columns):
    """Every edge (one row, odd inner sizes, partial blocks), from C-ordered operands and
    from transposed views: the float64 product of the bfloat16-rounded operands, to float32
    accumulation's rounding; the inputs untouched."""
    rng = np.random.default_rng(rows * 1000 + inner)
    shapes = PRODUCTS[name][0](rows, inner, columns)
    for views in ("C", "F"):
        operands = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
        if views == "F":
            operands = [np.asfortranarray(x) for x in operands]
        kept = [x.copy() for x in operands]
        got = _product(name, *operands)
        want = PRODUCTS[name][1](*(_rounded(x).astype(np.float64) for x in operands))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(inner))
        for x, before in zip(operands, kept):
            np.testing.assert_array_equal(x, before)


def test_products_write_into_strided_outputs():
    """An output whose rows are not contiguous (a column slice) and one whose rows are (a
    row slice of a wider buffer, blocks stored in place): every element written, none
    outside."""
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((40, 20)).astype(np.float32), rng.standard_normal(
        (70, 20)).astype(np.float32)
    want = _rounded(a).astype(np.float64) @ _rounded(b).astype(np.float64).T
    for buffer, out in ((lambda w: (w, w[:, 3:73]))(np.full((40, 80), -5.0, np.float32)),
                        (lambda w: (w, w[::2]))(np.full((80, 70), -5.0, np.float32)),
                        (lambda w: (w, w.T[:40, :70]))(np.full((70, 40), -5.0, np.float32))):
        _product("nt", a, b, out)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)
        assert np.count_nonzero(buffer == -5.0) == buffer.size - out.size


def test_non_finite_operands_reach_only_their_rows_and_columns():
    """A NaN or an infinity in a row of a reaches that row of the product only, as BLAS's
    does (the backward's redo of non-finite rows relies on it); one in a column of b that
    column only."""
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((20, 16)).astype(np.float32), rng.standard_normal(
        (16, 40)).astype(np.float32)
    a[3, 5], a[11, 0], b[7, 33] = np.nan, np.inf, -np.inf
    got = _product("nn", a, b)
    with np.errstate(invalid="ignore"):
        want = _rounded(a).astype(np.float64) @ _rounded(b).astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-4)


def test_rounding_to_bfloat16_as_ml_dtypes_rounds():
    """Random float32 patterns, the ties between bfloat16 values and their neighbours,
    infinities and the largest finite values: ml_dtypes' bfloat16 bits; NaNs stay NaNs."""
    if bfloat16() is None:
        pytest.skip("ml_dtypes is not installed")
    rng = np.random.default_rng(6)
    bits = np.concatenate([rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32),
                           np.arange(0, 2**32, 2**16 - 2**15, dtype=np.uint64).astype(np.uint32),
                           np.array([0x7F7FFFFF, 0x7F7F8000, 0x7F800000, 0xFF800000, 0x80000000,
                                     0x00008000, 0x00018000, 0x7FC00000], np.uint32)])
    values = bits.view(np.float32)

    @njit
    def rounded_bits(values):
        out = np.empty(values.size, np.uint32)
        for i in range(values.size):
            out[i] = bf16_products._bfloat16_bits(values[i])
        return out

    got = rounded_bits(values)
    nan = np.isnan(values)
    np.testing.assert_array_equal(got[~nan],
                                  values[~nan].astype(bfloat16()).view(np.uint16))
    assert np.isnan(got[nan].astype(np.uint16).view(bfloat16()).astype(np.float32)).all()


def test_without_avx512_bf16_the_sums_are_the_same(monkeypatch):
    """The micro-kernel compiled for a CPU without `vdpbf16ps` (fused multiply-adds of the
    widened pairs, odd products first) gives the same float32 sums as the instruction."""
    rng = np.random.default_rng(8)
    a = rng.standard_normal((24, 40)).astype(np.float32)
    b = rng.standard_normal((70, 40)).astype(np.float32)
    with_instruction = _product("nt", a, b)
    monkeypatch.setattr(bf16_products, "HAS_PAIR_DOT", False)

    @njit
    def block_of(out, a_words, b_words, pairs, width):
        bf16_products._pair_products(out, 0, bf16_products.COLUMNS, a_words, 0, pairs, 1,
                                     b_words, 0, width, pairs)

    rows, columns, pairs = bf16_products.ROWS, bf16_products.COLUMNS, 20
    a_words = np.zeros(rows * pairs, np.uint32)
    b_words = np.zeros(pairs * 96, np.uint32)
    bf16_products._pack_along_rows(a[:rows], a_words, pairs, 1, rows)
    bf16_products._pack_along_rows(b, b_words, 1, 96, 96)
    out = np.empty(rows * columns, np.float32)
    block_of(out, a_words, b_words, pairs, 96)
    np.testing.assert_array_equal(out.reshape(rows, columns), with_instruction[:rows, :columns])


@pytest.mark.parametrize("options", [
    {}, {"causal": True}, {"window": (40, 7), "softcap": 4.0},
    {"causal": True, "dropout_p": 0.2, "seed": 5, "alibi_slopes": np.array([0.2, 0.5])}],
    ids=["plain", "causal", "window-softcap", "dropout-alibi"])
def test_the_bfloat16_forward_and_backward_on_pair_products(options):
    """bfloat16's tiled CPU forward and backward on the pair products (where the CPU has
    them) against the golden model, GQA and Dv != D, several tiles each way: no worse than
    a third of the tolerance (the float32 products of the same calls are within a tenth)."""
    import tileattn.cpu

    dtype = bfloat16()
    if dtype is None:
        pytest.skip("ml_dtypes is not installed")
    if not tileattn.cpu.BF16_PAIR_PRODUCTS:
        pytest.skip("this CPU has no AVX512-BF16: the backward keeps float32 products")
    rng = np.random.default_rng(9)
    q = rng.standard_normal((1, 2, 300, 72)).astype(dtype)
    k = rng.standard_normal((1, 1, 700, 72)).astype(dtype)
    v = rng.standard_normal((1, 1, 700, 40)).astype(dtype)
    do = rng.standard_normal((1, 2, 300, 40)).astype(dtype)
    o, lse = tileattn.forward(q, k, v, backend="cpu", return_lse=True, block_q=128,
                              block_k=256, **options)
    golden_o, golden_lse = tileattn.forward(*(x.astype(np.float64) for x in (q, k, v)),
                                            backend="reference", return_lse=True, **options)
    assert attention_error(o, golden_o, dtype) < 1 / 3
    assert_attention_close(lse, golden_lse, dtype, name="lse")
    wide = [x.astype(np.float64) for x in (do, q, k, v, o)]
    golden = tileattn.backward(*wide, lse, backend="reference", **options)
    grads = tileattn.backward(do, q, k, v, o, lse, backend="cpu", block_q=128, block_k=256,
                              **options)
    for name, grad, want in zip(("dq", "dk", "dv"), grads, golden):
        assert grad.dtype == dtype
        assert_attention_close(grad, want, dtype, name=name)
        assert attention_error(grad, want, dtype) < 1 / 3, name


def test_a_fixed_numba_target_decides_the_instruction(monkeypatch):
    """``NUMBA_CPU_NAME`` (e.g. "generic", for caches shared between machines) keeps
    `vdpbf16ps` out unless ``NUMBA_CPU_FEATURES`` names it; without it the host decides."""
    import llvmlite.binding as llvm
    from numba.core import config

    monkeypatch.setattr(config, "CPU_NAME", "generic")
    monkeypatch.setattr(config, "CPU_FEATURES", "")
    assert bf16_products._targets_pair_dot() is False
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx512f,+avx512bf16")
    assert bf16_products._targets_pair_dot() is True
    monkeypatch.setattr(config, "CPU_NAME", None)
    assert bf16_products._targets_pair_dot() == bool(
        llvm.get_host_cpu_features().get("avx512bf16", False))


def test_info_names_the_bfloat16_products(monkeypatch):
    """`describe` (``python -m tileattn info``) says where bfloat16's tiled kernels multiply
    in bfloat16, and says nothing of it for other dtypes, for the decode path or where the
    CPU has no AVX512-BF16."""
    import tileattn.cpu

    if bfloat16() is None:
        pytest.skip("ml_dtypes is not installed")
    clause = "products in bfloat16 on AVX512-BF16"
    monkeypatch.setattr(tileattn.cpu, "BF16_PAIR_PRODUCTS", True)
    lines = tileattn.cpu.describe(2048, 64, 64, bfloat16(), heads=8)
    assert clause in lines["forward"] and clause in lines["backward"]
    decode = tileattn.cpu.describe(8192, 64, 64, bfloat16(), n_q=1, heads=8)
    assert clause not in decode["forward"] and clause in decode["backward"]
    assert all(clause not in line for line in
               tileattn.cpu.describe(2048, 64, 64, np.float32, heads=8).values())
    monkeypatch.setattr(tileattn.cpu, "BF16_PAIR_PRODUCTS", False)
    assert all(clause not in line for line in
               tileattn.cpu.describe(2048, 64, 64, bfloat16(), heads=8).values())


def test_a_host_whose_features_llvm_cannot_read_takes_float32_products(monkeypatch):
    """Where LLVM cannot read the host's features (some platforms raise), the instruction
    counts as absent."""
    import llvmlite.binding as llvm
    from numba.core import config

    def unreadable():
        raise RuntimeError("failed to get host cpu features")

    monkeypatch.setattr(config, "CPU_NAME", None)
    monkeypatch.setattr(llvm, "get_host_cpu_features", unreadable)
    assert bf16_products._targets_pair_dot() is False
