"""The split-KV decode forward (attention_decode.cu on CUDA cores, attention_decode_mma.cu on
tensor cores; launch_decode.py) against the golden model.

Each kernel (the tensor-core one where it serves: 16-bit, no dropout) at every forced
split count (one, a few, an uneven number, many, more splits than key tiles; the tensor-core
kernel's splits merged in the kernel and by the merge kernel), Nq from 1 to 16 with GQA/MQA/MHA packing, every option, every dtype, odd head dims and
Dv != D, strided inputs, out=/lse_out= buffers, non-finite values at masked keys, the
dispatch that picks the kernel, ALiBi's slope per packed row on tensor cores (dense, padded,
paged), and CUDA-graph capture. Outputs start as NaN, so every
element must be written. Everything skips cleanly without CuPy or a GPU.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tileattn
from tileattn import backends, reference
from tileattn.options import AttentionOptions
from tileattn.testing import assert_attention_close, bfloat16
from tileattn.validation import validate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(backends.availability("gpu") is not None,
                       reason=str(backends.availability("gpu"))),
]

if backends.availability("gpu") is None:
    import cupy

    from tileattn import gpu as gpu_backend
    from tileattn.gpu import launch_forward, workspace
    from tileattn.gpu import tiles as gpu_tiles
    from tileattn.gpu.launch_decode import decode_shape, forward_decode
    from tileattn.gpu.operands import accumulation_dtype, problem_of
    from tileattn.gpu.tiles import (DECODE_MMA_MANY_ROW_WARPS, DECODE_MMA_NARROW_WIDTH,
                                    DECODE_MMA_ROW_WARPS, DecodeTiles, decode_mma_tiles,
                                    decode_tiles)


def _inputs(batch, n_q_heads, n_kv_heads, n_q, n_k, head_dim, value_dim, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, n_q_heads, n_q, head_dim)).astype(dtype),
            rng.standard_normal((batch, n_kv_heads, n_k, head_dim)).astype(dtype),
            rng.standard_normal((batch, n_kv_heads, n_k, value_dim)).astype(dtype))


def _golden(q, k, v, **options):
    as64 = [np.asarray(a).astype(np.float64) for a in (q, k, v)]
    return tileattn.forward(*as64, backend="reference", return_lse=True, **options)


def _resolved(q, k, v, options):
    """The AttentionOptions the API would pass a backend for these keyword options."""
    defaults = dict(causal=False, window=None, scale=None, softcap=None, alibi_slopes=None,
                    dropout_p=0.0, seed=None, block_q=None, block_k=None, deterministic=True)
    return validate(q, k, v, **{**defaults, **options}).options


KERNELS = ["cuda_cores", "tensor_cores"]


def _skip_unserved(kernel, dtype, options):
    """The tensor-core kernel takes 16-bit inputs without dropout."""
    if kernel == "tensor_cores" and (
            np.dtype(dtype).itemsize != 2 or options.get("dropout_p", 0) > 0):
        pytest.skip("the tensor-core decode takes 16-bit inputs without dropout")


def _decode(q, k, v, options, splits, kernel="cuda_cores", **tile_fields):
    """o and lse of the decode kernel (`kernel`: "cuda_cores" or "tensor_cores", with any
    `DecodeMmaTiles` fields forced) with `splits` key ranges, from NaN-filled outputs;
    `options` are keyword options or an AttentionOptions."""
    device = [a if isinstance(a, cupy.ndarray) else cupy.asarray(a) for a in (q, k, v)]
    resolved = (options if isinstance(options, AttentionOptions)
                else _resolved(*device, options))
    make_tiles = decode_mma_tiles if kernel == "tensor_cores" else decode_tiles
    tiles = make_tiles(problem_of(*device, resolved),
                       decode_shape(device[0], device[1], resolved), splits=splits,
                       **tile_fields)
    batch, n_q_heads, n_q, _ = device[0].shape
    # NaN-filled on the host: CuPy's fill may not take bfloat16.
    o = cupy.asarray(np.full((batch, n_q_heads, n_q, device[2].shape[3]), np.nan,
                             dtype=device[0].dtype))
    lse = cupy.asarray(np.full((batch, n_q_heads, n_q), np.nan,
                               dtype=accumulation_dtype(device[0].dtype)))
    forward_decode(*device, o, lse, resolved, tiles)
    return o.get(), lse.get()


def _check(q, k, v, options, splits, kernel="cuda_cores", **tile_fields):
    _skip_unserved(kernel, q.dtype, options)
    o, lse = _decode(q, k, v, options, splits, kernel, **tile_fields)
    expected_o, expected_lse = _golden(q, k, v, **options)
    assert_attention_close(o, expected_o, q.dtype, name="o")
    assert_attention_close(lse, expected_lse, q.dtype, name="lse")


def _half_dtypes():
    return [np.dtype(np.float16)] + ([bfloat16()] if bfloat16() is not None else [])


# One split, two, an uneven count, many, and more splits than key tiles (333 keys are
# 6-11 tiles): empty splits write lse = -inf and o = 0, which the merge must ignore.
SPLITS = [1, 2, 3, 64, 1000]
# (Hq, Hkv, Nq): MHA, GQA, MQA, a group of 3; packed rows 1, 12 (of a 16-row block), 16, 15.
PACKINGS = [(4, 4, 1), (8, 2, 3), (8, 1, 2), (6, 2, 5)]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("packing", PACKINGS, ids=lambda p: f"Hq{p[0]}-Hkv{p[1]}-Nq{p[2]}")
@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
def test_every_split_count(splits, packing, causal, kernel):
    n_q_heads, n_kv_heads, n_q = packing
    q, k, v = _inputs(2, n_q_heads, n_kv_heads, n_q, 333, 64, 64, np.float16)
    _check(q, k, v, {"causal": causal}, splits, kernel)


@pytest.mark.parametrize("merge", ["in_kernel", "merge_kernel"])
@pytest.mark.parametrize("splits", [2, 3, 64])
@pytest.mark.parametrize("packing", PACKINGS, ids=lambda p: f"Hq{p[0]}-Hkv{p[1]}-Nq{p[2]}")
def test_tensor_core_splits_merged_in_the_kernel_or_by_the_merge_kernel(merge, splits, packing,
                                                                        monkeypatch):
    """The tensor-core decode's last block of each group merges the splits (FUSED_MERGE) or
    the merge kernel does: both equal the golden model, the in-kernel merge gives the same
    o and lse on every run whichever block finishes last, and leaves its split counters at
    zero for the next launch."""
    monkeypatch.setattr(gpu_tiles, "DECODE_FUSED_MERGE_FLOATS",
                        1 << 40 if merge == "in_kernel" else 0)
    n_q_heads, n_kv_heads, n_q = packing
    q, k, v = _inputs(3, n_q_heads, n_kv_heads, n_q, 1200, 64, 64, np.float16, seed=splits)
    _check(q, k, v, {"causal": True}, splits, "tensor_cores")
    again = _decode(q, k, v, {"causal": True}, splits, "tensor_cores")
    third = _decode(q, k, v, {"causal": True}, splits, "tensor_cores")
    np.testing.assert_array_equal(again[0], third[0])
    np.testing.assert_array_equal(again[1], third[1])
    assert not any(counters.get().any() for counters in workspace._COUNTERS.values())
    if merge == "in_kernel":
        assert workspace._COUNTERS, "the in-kernel merge ran without its split counters"


@pytest.mark.parametrize(("batch", "head_dim"), [(3, 64), (3, 128), (70, 64)],
                         ids=["merged-in-kernel", "merge-kernel", "one-split"])
@pytest.mark.parametrize("layout", ["padded", "paged"])
@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi-causal"])
def test_decode_rows_past_a_sequence_write_zeros_whatever_their_q(batch, head_dim, layout,
                                                                  alibi):
    """A padded or paged decode batch (1 or 2 query rows of Nq = 2) whose Q rows past a
    sequence are NaN, as are its keys past the sequence: those rows write o = 0 and
    lse = -inf (not 0 x NaN) whichever way the splits are merged (by the last split block,
    by the merge kernel, or one split), and every other row equals the golden model; with
    ALiBi (a slope per sequence and head) and a causal band, both at each sequence's own
    bottom-right offset."""
    rng = np.random.default_rng(batch + head_dim)
    options = ({"alibi_slopes": rng.uniform(0.01, 0.5, (batch, 8)), "causal": True}
               if alibi else {})
    seqlens_q = 1 + np.arange(batch) % 2
    seqlens_k = rng.integers(300, 700, batch)
    q = rng.standard_normal((batch, 8, 2, head_dim)).astype(np.float16)
    k = rng.standard_normal((batch, 2, 700, head_dim)).astype(np.float16)
    v = rng.standard_normal((batch, 2, 700, head_dim)).astype(np.float16)
    for b in range(batch):
        q[b, :, seqlens_q[b]:] = np.nan
        k[b, :, seqlens_k[b]:] = v[b, :, seqlens_k[b]:] = np.nan
    lengths = {"seqlens_q": seqlens_q, "seqlens_k": seqlens_k}
    keys, values = k, v
    if layout == "paged":  # pages of 16 in reversed order; pool (pages, Hkv, 16, D)
        pages = 700 // 16 + 1
        order = np.arange(batch * pages)[::-1].reshape(batch, pages)
        pool_k = np.full((batch * pages, 2, 16, head_dim), np.nan, np.float16)
        pool_v = pool_k.copy()
        for b in range(batch):
            for j in range(seqlens_k[b]):
                pool_k[order[b, j // 16], :, j % 16] = k[b, :, j]
                pool_v[order[b, j // 16], :, j % 16] = v[b, :, j]
        keys, values, lengths["block_table"] = pool_k, pool_v, order.astype(np.int64)
    o, lse = tileattn.forward(*(cupy.asarray(a) for a in (q, keys, values)), backend="gpu",
                              return_lse=True, **lengths, **options)
    expected_o, expected_lse = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                                backend="reference", return_lse=True,
                                                seqlens_q=seqlens_q, seqlens_k=seqlens_k,
                                                **options)
    assert_attention_close(o.get(), expected_o, np.float16, name="o")
    assert_attention_close(lse.get(), expected_lse, np.float16, name="lse")


# The tensor-core kernel's shapes: warps splitting stages of 32-256 keys, 2-4 stages, 1-4
# row tiles a warp (rows 16-64: group 8 x Nq 2-8) with one row warp, and 2-4 row warps.
TENSOR_CORE_TILES = [dict(warps=1, warp_keys=32, stages=2, row_warps=1),
                     dict(warps=2, warp_keys=16, stages=4, row_warps=1),
                     dict(warps=4, warp_keys=32, stages=2, row_warps=1),
                     dict(warps=8, warp_keys=16, stages=3, row_warps=1),
                     dict(warps=2, warp_keys=32, stages=2, row_warps=2),
                     dict(warps=1, warp_keys=64, stages=2, row_warps=4),
                     dict(warps=2, warp_keys=16, stages=3, row_warps=4, row_tiles=1),
                     dict(warps=1, warp_keys=64, stages=2, row_warps=8, row_tiles=1)]


@pytest.mark.parametrize("row_warps", [None, 1], ids=["table", "one-row-warp"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("shape", [(256, 256, 8, 1, 4), (24, 200, 6, 2, 4), (64, 64, 8, 1, 8),
                                   (256, 256, 8, 1, 8)],
                         ids=["D256-32rows", "Dv200-12rows-ragged", "D64-64rows",
                              "D256-64rows"])
def test_tensor_core_row_groups(shape, splits, row_warps):
    """The table's row warps hold up to 64 packed rows in one block; with one row warp,
    more packed rows than a warp holds (16 at Dv = 256 or 200) run as row groups, a block
    each, and the last group may be partial. 64 rows at D = 64 fit one warp (four row
    tiles)."""
    head_dim, value_dim, n_q_heads, n_kv_heads, n_q = shape
    q, k, v = _inputs(2, n_q_heads, n_kv_heads, n_q, 420, head_dim, value_dim, np.float16,
                      seed=head_dim)
    fields = {} if row_warps is None else {"row_warps": 1}
    _check(q, k, v, {"causal": True}, splits, "tensor_cores", **fields)


@pytest.mark.parametrize("fields", TENSOR_CORE_TILES,
                         ids=lambda f: "-".join(f"{k}{v}" for k, v in f.items()))
@pytest.mark.parametrize("n_q", [1, 2, 5, 8])
def test_tensor_core_tile_shapes(fields, n_q):
    q, k, v = _inputs(2, 8, 1, n_q, 700, 64, 64, np.float16, seed=n_q)
    _check(q, k, v, {"causal": True, "window": (500, None)}, 3, "tensor_cores", **fields)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("n_q", range(1, 17))
def test_every_query_row_count(n_q, kernel):
    """Speculative decoding: Nq = 1..16 new rows (group 2: 2..32 packed rows), causal
    bottom-right, so the rows see different numbers of keys."""
    q, k, v = _inputs(1, 4, 2, n_q, 300, 64, 64, np.float16, seed=n_q)
    _check(q, k, v, {"causal": True}, 3, kernel)


DECODE_OPTIONS = [
    {},
    {"causal": True},
    {"window": (37, 5)},
    {"causal": True, "window": (100, None), "softcap": 2.0},
    {"alibi_slopes": np.linspace(0.05, 0.5, 8), "scale": 0.3},
    {"dropout_p": 0.3, "seed": 2**63 + 5, "causal": True},
    {"softcap": 5.0, "alibi_slopes": np.linspace(0.1, 0.4, 8), "window": (64, 64),
     "dropout_p": 0.1, "seed": 7},
]
OPTION_IDS = lambda o: ",".join(o) or "plain"  # noqa: E731


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("splits", [1, 5])
@pytest.mark.parametrize("options", DECODE_OPTIONS, ids=OPTION_IDS)
def test_every_option(options, splits, kernel):
    q, k, v = _inputs(2, 8, 2, 4, 517, 64, 64, np.float16, seed=3)
    _check(q, k, v, options, splits, kernel)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype", _half_dtypes() + [np.dtype(np.float32), np.dtype(np.float64)],
                         ids=lambda d: d.name)
@pytest.mark.parametrize("options", [DECODE_OPTIONS[0], DECODE_OPTIONS[-1]],
                         ids=["plain", "every"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_every_dtype(dtype, options, splits, kernel):
    q, k, v = _inputs(1, 8, 2, 3, 450, 64, 64, dtype, seed=4)
    _check(q, k, v, options, splits, kernel)


# Head dims of real models, ones that are not a multiple of 8 (zero-padded in shared
# memory, copied in narrower pieces; 33 in 2-byte pieces), Dv != D both ways, D = 1.
HEAD_DIMS = [(1, 1), (32, 32), (33, 33), (40, 40), (80, 80), (100, 100), (128, 128),
             (160, 160), (256, 256), (192, 128), (64, 128), (24, 200)]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dims", HEAD_DIMS, ids=lambda d: f"D{d[0]}-Dv{d[1]}")
def test_every_head_dim(dims, kernel):
    q, k, v = _inputs(2, 4, 2, 2, 290, *dims, np.float16, seed=5)
    _check(q, k, v, {"causal": True}, 4, kernel)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("dims", [(33, 33), (24, 200), (256, 256)],
                         ids=lambda d: f"D{d[0]}-Dv{d[1]}")
def test_odd_head_dims_in_wide_dtypes(dtype, dims):
    q, k, v = _inputs(1, 4, 1, 2, 270, *dims, dtype, seed=6)
    _check(q, k, v, {"window": (100, 3)}, 3)


def _unaligned(array):
    """The same values in a view whose rows start 2 bytes past a 16-byte boundary."""
    batch, heads, n, dim = array.shape
    buffer = cupy.zeros((batch, heads, n, dim + 1), dtype=array.dtype)
    view = buffer[..., 1:]
    view[...] = cupy.asarray(array)
    return view


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("layout", ["bshd", "unaligned", "reversed_keys", "strided_last"])
def test_strided_inputs(layout, kernel):
    """Views read in place (transposed heads, rows at 2-byte offsets, negative key strides)
    or copied where the last axis is strided; the answer is the same."""
    q, k, v = _inputs(2, 8, 2, 3, 310, 64, 64, np.float16, seed=7)
    device = [cupy.asarray(a) for a in (q, k, v)]
    if layout == "bshd":
        device = [cupy.ascontiguousarray(a.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
                  for a in device]
    elif layout == "unaligned":
        device = [_unaligned(a) for a in device]
    elif layout == "reversed_keys":
        device = [device[0]] + [cupy.ascontiguousarray(a[:, :, ::-1])[:, :, ::-1]
                                for a in device[1:]]
    else:
        device = [cupy.repeat(a, 2, axis=3)[..., ::2] for a in device]
    for original, view in zip((q, k, v), device):
        np.testing.assert_array_equal(view.get(), original)
    for splits in (1, 3):
        o, lse = _decode(*device, {"causal": True}, splits, kernel)
        expected_o, expected_lse = _golden(q, k, v, causal=True)
        assert_attention_close(o, expected_o, q.dtype, name="o")
        assert_attention_close(lse, expected_lse, q.dtype, name="lse")


@pytest.mark.parametrize("splits", [1, 3])
def test_a_placed_block_uses_global_positions(splits):
    """A block of a longer sequence (row_offset, col_offset, alignment, as
    tileattn.distributed places it): band, ALiBi and dropout at global positions."""
    q, k, v = _inputs(1, 4, 2, 3, 400, 64, 64, np.float16, seed=14)
    options = dataclasses.replace(
        _resolved(q, k, v, {"causal": True, "window": (200, None), "dropout_p": 0.2, "seed": 9,
                            "alibi_slopes": np.linspace(0.1, 0.4, 4)}),
        row_offset=100, col_offset=37, alignment=300)
    o, lse = _decode(q, k, v, options, splits)
    expected_o, expected_lse = reference.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                                 options)
    assert_attention_close(o, expected_o, q.dtype, name="o")
    assert_attention_close(lse, expected_lse, q.dtype, name="lse")


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", _half_dtypes(), ids=lambda d: d.name)
@pytest.mark.parametrize("packing", [(8, 2, 1), (32, 8, 1), (4, 4, 1), (8, 1, 4), (16, 2, 5),
                                     (8, 1, 16)],
                         ids=lambda p: f"Hq{p[0]}-Hkv{p[1]}-Nq{p[2]}")
def test_tensor_core_alibi_takes_each_packed_rows_slope(packing, dtype, splits):
    """ALiBi on the tensor-core decode: the packed rows of one block belong to different
    query heads (GQA, MQA; 40 and 128 rows in row warps), each with its own slope (here per
    batch element too), at its own query row's bottom-right distance (causal for Nq > 1);
    dispatch takes this kernel for ALiBi."""
    n_q_heads, n_kv_heads, n_q = packing
    q, k, v = _inputs(2, n_q_heads, n_kv_heads, n_q, 600, 64, 64, dtype, seed=n_q_heads + n_q)
    slopes = np.random.default_rng(n_q).uniform(0.01, 0.5, (2, n_q_heads))
    options = {"alibi_slopes": slopes, "causal": n_q > 1}
    _check(q, k, v, options, splits, "tensor_cores")
    device = [cupy.asarray(a) for a in (q, k, v)]
    choice = launch_forward.choose(*device, _resolved(*device, options))
    assert choice.family == "decode" and isinstance(choice.tiles, gpu_tiles.DecodeMmaTiles)


@pytest.mark.parametrize("splits", [1, 3])
def test_tensor_core_alibi_at_global_positions(splits):
    """A placed block (row_offset, col_offset, alignment) on the tensor-core decode: ALiBi
    and the band at global positions."""
    q, k, v = _inputs(1, 8, 2, 3, 400, 64, 64, np.float16, seed=15)
    options = dataclasses.replace(
        _resolved(q, k, v, {"causal": True, "window": (200, None),
                            "alibi_slopes": np.linspace(0.1, 0.4, 8)}),
        row_offset=100, col_offset=37, alignment=300)
    o, lse = _decode(q, k, v, options, splits, "tensor_cores")
    expected_o, expected_lse = reference.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                                 options)
    assert_attention_close(o, expected_o, q.dtype, name="o")
    assert_attention_close(lse, expected_lse, q.dtype, name="lse")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("splits", [1, 3])
def test_rows_that_keep_no_key(splits, kernel):
    """Causal with Nq > Nk (bottom-right: the first rows keep nothing) and a window that
    leaves a split no key: o = 0, lse = -inf, never NaN."""
    q, k, v = _inputs(1, 4, 2, 8, 5, 32, 32, np.float16, seed=8)
    _check(q, k, v, {"causal": True}, splits, kernel)
    q, k, v = _inputs(1, 4, 2, 4, 400, 32, 32, np.float16, seed=9)
    _check(q, k, v, {"window": (2, 0)}, splits, kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("splits", [1, 4])
def test_non_finite_values_at_masked_keys_do_not_leak(splits, kernel):
    """NaN and Inf in K and V at keys that a row masks (past the causal diagonal, before a
    window's left edge) reach no row that masks them; a NaN at a kept key reaches exactly
    the rows that keep it, as in the golden model."""
    dtype = np.float16 if kernel == "tensor_cores" else np.float32
    q, k, v = _inputs(1, 4, 2, 4, 300, 64, 64, dtype, seed=10)
    v[:, :, 299, 3] = np.nan  # kept by the last query row only (causal, Nq = 4)
    k[:, :, 298, 5] = np.inf  # kept by the last two rows: their scores go +-inf
    v[:, :, 297, 0] = np.inf
    for options in ({"causal": True}, {"causal": True, "window": (3, None)}):
        o, lse = _decode(q, k, v, options, splits, kernel)
        expected_o, expected_lse = _golden(q, k, v, **options)
        assert_attention_close(o, expected_o, q.dtype, name="o")
        assert_attention_close(lse, expected_lse, q.dtype, name="lse")
        assert np.isfinite(o[:, :, 0]).all()  # row 0 keeps keys up to 296 only


@pytest.mark.parametrize("dtype", _half_dtypes(), ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(8, 2, 17, 64, 64), (16, 2, 16, 96, 200),
                                   (16, 1, 8, 256, 256), (12, 1, 9, 40, 40), (71, 1, 1, 64, 64),
                                   (71, 1, 3, 64, 64)],
                         ids=["GQA4-Nq17", "GQA8-Nq16-Dv200", "MQA16-Nq8-D256", "MQA12-Nq9",
                              "MQA71-Nq1", "MQA71-Nq3-row-groups"])
@pytest.mark.parametrize("options", [{"causal": True}, {"window": (300, 3), "softcap": 8.0}],
                         ids=OPTION_IDS)
def test_more_than_64_packed_rows_through_dispatch(shape, options, dtype):
    """More than 64 packed rows (speculative decoding, chunks with wide GQA groups, Falcon's
    71 query heads over one K/V head) run the tensor-core decode in eight row warps of one
    m16 tile (four of two at D, Dv <= 64), with key splits; rows of one block span query
    rows of several heads and positions, and beyond 128 rows the blocks of each K/V head
    take 128 rows each (213 rows: the second block's 85 leave a row warp without rows)."""
    n_q_heads, n_kv_heads, n_q, head_dim, value_dim = shape
    q, k, v = _inputs(1, n_q_heads, n_kv_heads, n_q, 1500, head_dim, value_dim, dtype,
                      seed=n_q)
    device = [cupy.asarray(a) for a in (q, k, v)]
    choice = launch_forward.choose(*device, _resolved(*device, options))
    assert choice.family == "decode" and n_q * n_q_heads // n_kv_heads > 64
    narrow = max(head_dim, value_dim) <= DECODE_MMA_NARROW_WIDTH  # two m16 tiles a warp
    assert (choice.tiles.row_warps, choice.tiles.row_tiles) == \
        ((DECODE_MMA_ROW_WARPS, 2) if narrow else (DECODE_MMA_MANY_ROW_WARPS, 1))
    o, lse = tileattn.forward(*device, return_lse=True, **options)
    expected_o, expected_lse = _golden(q, k, v, **options)
    assert_attention_close(o.get(), expected_o, q.dtype, name="o")
    assert_attention_close(lse.get(), expected_lse, q.dtype, name="lse")


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16], ids=str)
@pytest.mark.parametrize("splits", [1, 3])
def test_cuda_core_row_groups(dtype, splits):
    """More packed rows than a CUDA-core decode block holds (16, forced) run as row groups,
    a block each over the same keys; the last group is partial (30 rows: 16 and 14), and
    its rows span two query heads and every query row."""
    q, k, v = _inputs(2, 20, 2, 3, 400, 64, 48, dtype, seed=splits)
    _check(q, k, v, {"causal": True, "softcap": 5.0, "alibi_slopes": np.linspace(0.1, 0.5, 20)},
           splits, rows=16)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=str)
def test_wide_groups_decode_on_cuda_cores_in_row_groups_through_dispatch(dtype, layout):
    """One query row of 71 heads over one K/V head (Falcon-7B) in float32 and float64: the
    CUDA-core decode in two row groups of 64 rows, o written in either layout."""
    q, k, v = _inputs(2, 71, 1, 1, 3000, 64, 64, dtype, seed=71)
    device = [cupy.asarray(a) for a in (q, k, v)]
    choice = launch_forward.choose(*device, _resolved(*device, {}))
    assert choice.family == "decode" and isinstance(choice.tiles, DecodeTiles)
    assert choice.tiles.row_groups(71) == 2
    if layout == "bshd":
        device = [cupy.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in device]
    o, lse = tileattn.forward(*device, return_lse=True, layout=layout)
    o = o.get() if layout == "bhsd" else o.get().transpose(0, 2, 1, 3)
    expected_o, expected_lse = _golden(q, k, v)
    assert_attention_close(o, expected_o, q.dtype, name="o")
    assert_attention_close(lse.get(), expected_lse, q.dtype, name="lse")


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=str)
def test_wide_group_row_groups_ignore_non_finite_keys_the_window_hides(dtype):
    """71 query heads over one K/V head, two query rows (142 packed rows: row groups on
    either kernel): NaN and inf at keys the window hides from every row reach no output."""
    q, k, v = _inputs(1, 71, 1, 2, 2000, 64, 64, dtype, seed=5)
    k[:, :, 1000] = np.nan
    v[:, :, 1001] = np.inf
    options = {"window": (500, 0), "causal": True}  # rows keep keys from 1498 on
    device = [cupy.asarray(a) for a in (q, k, v)]
    choice = launch_forward.choose(*device, _resolved(*device, options))
    assert choice.family == "decode" and choice.tiles.row_groups(142) >= 2
    o, lse = tileattn.forward(*device, return_lse=True, **options)
    expected_o, expected_lse = _golden(q, k, v, **options)
    assert np.isfinite(o.get()).all() and np.isfinite(lse.get()).all()
    assert_attention_close(o.get(), expected_o, q.dtype, name="o")
    assert_attention_close(lse.get(), expected_lse, q.dtype, name="lse")


@pytest.mark.parametrize("head_dim", [64, 96])
@pytest.mark.parametrize("dtype", _half_dtypes(), ids=lambda d: d.name)
def test_many_packed_rows_ignore_non_finite_keys_the_window_hides(dtype, head_dim):
    """68 packed rows (GQA 4, Nq 17) on eight row warps of one m16 tile (D 96), three of
    them without rows in use, and on four of two tiles (D 64), one without: NaN and inf in
    K and V at a key the window hides from every row, inside a key tile the window cuts,
    reach no output (the row warps without rows skip their products but still join the
    tile's non-finite step and its barriers)."""
    q, k, v = _inputs(1, 8, 2, 17, 1500, head_dim, head_dim, dtype, seed=3)
    # Query row i sits at key 1483 + i; a left window of 300 keeps keys from 1183 + i.
    k[:, :, 1182] = np.nan
    v[:, 0, 1182], v[:, 1, 1182] = np.inf, np.nan
    options = {"window": (300, 3)}
    device = [cupy.asarray(a) for a in (q, k, v)]
    choice = launch_forward.choose(*device, _resolved(*device, options))
    assert choice.family == "decode" and choice.tiles.row_warps == (
        DECODE_MMA_ROW_WARPS if head_dim <= DECODE_MMA_NARROW_WIDTH else DECODE_MMA_MANY_ROW_WARPS)
    o, lse = tileattn.forward(*device, return_lse=True, **options)
    expected_o, expected_lse = _golden(q, k, v, **options)
    assert np.isfinite(o.get()).all() and np.isfinite(lse.get()).all()
    assert_attention_close(o.get(), expected_o, q.dtype, name="o")
    assert_attention_close(lse.get(), expected_lse, q.dtype, name="lse")


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize(("n_q", "options"), [(2, {"causal": True}), (3, {"window": (40, 0)}),
                                             (4, {"window": (30, 2), "softcap": 20.0})],
                         ids=lambda c: str(c).replace(" ", ""))
def test_wide_gqa_decode_of_several_rows_folds_each_row(n_q, options, layout):
    """Several query rows (speculative decoding, multi-token prediction) of a wide decode
    whose group fills 64-row tiles (tiles.FOLD_GROUP_PER_ROW) fold one query row at a time,
    each over the keys its own row keeps: a NaN key and an infinite value that only the last
    row keeps reach no other row; the other rows equal the golden model's, written into the
    caller's NaN-filled buffers, on the first call and the cached one; describe says so."""
    group, batch, n_k, (head_dim, value_dim) = 64, 2, 500, (576, 512)
    q, k, v = _inputs(batch, group, 1, n_q, n_k, head_dim, value_dim, np.float16, seed=n_q)
    poisoned = options.get("window", (0, 0))[1] == 0  # the last key is the last row's alone
    if poisoned:
        k[:, :, -1] = np.nan
        v[:, :, -1] = np.inf
    expected_o, expected_lse = _golden(q, k, v, **options)
    kept = slice(0, n_q - 1 if poisoned else n_q)
    for call, o, lse in _calls_into_nan_buffers((q, k, v), np.float16, layout, options):
        assert_attention_close(o[:, :, kept], expected_o[:, :, kept], np.float16,
                               name=f"o ({call} call)")
        assert_attention_close(lse[:, :, kept], expected_lse[:, :, kept], np.float16,
                               name=f"lse ({call} call)")
    resolved = _resolved(*(cupy.asarray(a) for a in (q, k, v)), options)
    described = gpu_backend.describe(n_k, head_dim, value_dim, np.float16, resolved,
                                     n_q=n_q, heads=group, kv_heads=1, batch=batch)
    assert "folded on its own" in described["forward"], described


@pytest.mark.parametrize("dtype", _half_dtypes() + [np.dtype(np.float32)], ids=lambda d: d.name)
@pytest.mark.parametrize("dims", [(576, 512), (320, 320), (264, 64)],
                         ids=lambda d: f"D{d[0]}-Dv{d[1]}")
def test_head_dims_above_256_decode_on_cuda_cores(dims, dtype):
    """Above 256 (multi-head latent attention decodes at D = 576, Dv = 512) the CUDA-core
    decode serves, split and not, through dispatch too; the tensor-core one stops at 256."""
    head_dim, value_dim = dims
    q, k, v = _inputs(2, 16, 1, 1, 700, head_dim, value_dim, dtype, seed=head_dim)
    for splits in (1, 3):
        _check(q, k, v, {"causal": True}, splits, "cuda_cores")
    device = [cupy.asarray(a) for a in (q, k, v)]
    choice = launch_forward.choose(*device, _resolved(*device, {}))
    assert choice.family == "decode" and isinstance(choice.tiles, DecodeTiles), choice
    o, lse = tileattn.forward(*device, return_lse=True)
    expected_o, expected_lse = _golden(q, k, v)
    assert_attention_close(o.get(), expected_o, q.dtype, name="o")
    assert_attention_close(lse.get(), expected_lse, q.dtype, name="lse")


def _calls_into_nan_buffers(arrays, dtype, layout: str, options: dict):
    """tileattn.forward on host (q, k, v) in (B, H, N, D) order, moved to the GPU in
    `layout`, into NaN-filled out= and lse_out= buffers, twice (the second call takes the
    cached plan): yields ``(call, o, lse)`` on the host, o in (B, H, N, Dv) order."""
    q, _, v = arrays
    device = [cupy.asarray(a) for a in arrays]
    out = cupy.full(q.shape[:3] + (v.shape[3],), np.nan, dtype=dtype)
    if layout == "bshd":
        device = [cupy.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in device]
        out = cupy.ascontiguousarray(out.transpose(0, 2, 1, 3))
    lse_out = cupy.full(q.shape[:3], np.nan, dtype=np.float32)
    for call in ("first", "cached"):
        out[...] = np.nan
        lse_out[...] = np.nan
        o, lse = tileattn.forward(*device, return_lse=True, out=out, lse_out=lse_out,
                                  layout=layout, **options)
        assert o is out and lse is lse_out
        yield call, (o.get().transpose(0, 2, 1, 3) if layout == "bshd" else o.get()), lse.get()


FOLD_CASES = [((576, 512), "bfloat16", 16, {}), ((576, 512), "float16", 16, {"causal": True}),
              ((320, 320), "float16", 4, {"window": (300, 0), "softcap": 20.0}),
              ((264, 64), "bfloat16", 8, {"causal": True, "window": (1000, 0)}),
              ((320, 320), "float16", 3, {"window": (10, 5)})]


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize(("dims", "dtype", "group", "options"), FOLD_CASES,
                         ids=lambda c: str(c).replace(" ", ""))
def test_wide_gqa_decode_folds_its_group_into_query_rows(dims, dtype, group, options, layout,
                                                         monkeypatch):
    """A one-row decode wider than the tensor-core decode's heads (tiles.folds_group_rows)
    runs the mma.sync prefill on its group's query heads as rows of one head (its fold
    threshold forced here, for small grids), with key shares: results equal the golden
    model's, written into the caller's NaN-filled buffers, keys outside the window (NaN and
    inf there) sliced off, and the plan cached for the next call."""
    from tileattn.gpu.operands import _PLANS

    monkeypatch.setattr(gpu_tiles, "FOLD_MIN_WAVE", 0.0)
    dtype = _half_dtype(dtype)
    arrays = _fold_inputs(dims, dtype, group, 1, options)
    for folded in _checked_calls(arrays, dtype, layout, options):
        assert len(folded) == 1 and _PLANS[folded.pop()].launches[0] is not None


def _half_dtype(name: str):
    dtype = bfloat16() if name == "bfloat16" else np.dtype(name)
    if dtype is None:
        pytest.skip("no bfloat16 type")
    return dtype


def _checked_calls(arrays, dtype, layout: str, options: dict):
    """`_calls_into_nan_buffers`, each call's o and lse against the golden model: yields,
    after each call, the folded plans made since the first call began."""
    expected_o, expected_lse = _golden(*arrays, **options)
    planned = _folded_plans()
    for call, o, lse in _calls_into_nan_buffers(arrays, dtype, layout, options):
        assert_attention_close(o, expected_o, dtype, name=f"o ({call} call)")
        assert_attention_close(lse, expected_lse, dtype, name=f"lse ({call} call)")
        yield _folded_plans() - planned


def _folded_plans() -> set:
    """The plan cache's keys of folded decodes (`launch_forward._forward_folded`)."""
    from tileattn.gpu.operands import _PLANS

    return {key for key in _PLANS if key[0] == "folded group"}


def _fold_inputs(dims, dtype, group: int, n_q: int, options: dict):
    """q, k, v of a GQA decode of two batch elements over two K/V heads of 1500 keys, the
    keys left of a window (which no row keeps) NaN in K and inf in V."""
    (head_dim, value_dim), n_k = dims, 1500
    q, k, v = _inputs(2, 2 * group, 2, n_q, n_k, head_dim, value_dim, dtype,
                      seed=head_dim + group)
    left = options.get("window", (None, None))[0]
    if left is not None and left < n_k - n_q:
        k[:, :, : n_k - n_q - left] = np.nan
        v[:, :, : n_k - n_q - left] = np.inf
    return q, k, v


FOLD_DECODE_CASES = [((128, 128), "float16", 64, 1, {"causal": True}),
                     ((128, 128), "bfloat16", 64, 1, {"window": (300, 0)}),
                     ((64, 64), "bfloat16", 8, 8, {}),
                     ((256, 256), "float16", 8, 8, {"softcap": 20.0}),
                     ((128, 128), "bfloat16", 16, 4, {"softcap": 20.0}),
                     ((128, 80), "float16", 16, 4, {})]


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize(("dims", "dtype", "group", "n_q", "options"), FOLD_DECODE_CASES,
                         ids=lambda c: str(c).replace(" ", ""))
def test_many_packed_rows_fold_onto_the_wgmma_prefill(dims, dtype, group, n_q, options,
                                                       layout, monkeypatch):
    """A GQA decode of 64 packed rows at D <= 256 (tiles.FOLD_DECODE_ENABLED and the fold
    threshold forced here) runs the wgmma prefill on its group x Nq rows as rows of one head:
    one causal row, one under a window (NaN and inf in the keys left of it), several
    unmasked rows in one fold ("bshd" arrays decline it and decode), into the caller's
    NaN-filled buffers, first call and cached."""
    from tileattn.gpu.operands import _PLANS

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the fold runs the wgmma prefill (sm_90)")
    monkeypatch.setattr(gpu_tiles, "FOLD_MIN_WAVE", 0.0)
    monkeypatch.setattr(gpu_tiles, "FOLD_DECODE_ENABLED", True)
    dtype = _half_dtype(dtype)
    arrays = _fold_inputs(dims, dtype, group, n_q, options)
    folded = list(_checked_calls(arrays, dtype, layout, options))[-1]
    if layout == "bshd" and n_q > 1:
        assert not folded, folded
    else:
        assert len(folded) == 1 and _PLANS[folded.pop()].launches[0] is not None


def test_folded_decode_rows_copied_in_narrow_pieces_run_the_plain_schedule(monkeypatch):
    """64 packed rows at D 128 fold onto the overlapped 64x128 tiles; arrays whose rows
    allow only 8-byte copies (views of 132-wide buffers) would make those spill, so the
    launcher builds the same tiles without OVERLAP, and the result is exact."""
    from tileattn.gpu import _compile

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the fold runs the wgmma prefill (sm_90)")
    monkeypatch.setattr(gpu_tiles, "FOLD_MIN_WAVE", 0.0)
    q, k, v = _fold_inputs((132, 132), np.float16, 8, 8, {})
    expected_o, expected_lse = _golden(q[..., :128], k[..., :128], v[..., :128])
    o, lse = tileattn.forward(*(cupy.asarray(a)[..., :128] for a in (q, k, v)),
                              return_lse=True)
    assert_attention_close(o.get(), expected_o, np.float16, name="o")
    assert_attention_close(lse.get(), expected_lse, np.float16, name="lse")
    built = [dict(key[2]) for key in _compile._modules
             if key[1] == "attention_wgmma_forward.cu"]
    narrow = [defines for defines in built if defines["COPY_BYTES"] < 16]
    assert any(defines["HEAD_DIM"] == 128 and defines["BLOCK_K"] == 128
               and defines["BLOCK_Q"] == 64 for defines in narrow), built
    assert not any("OVERLAP" in defines for defines in narrow), narrow


def test_small_wide_gqa_decodes_stay_on_the_decode_kernel():
    """One sequence's wide decode fills a tenth of the device folded: its fold is declined
    (and the decision cached), the CUDA-core decode kernel runs it, and describe agrees."""
    q, k, v = _inputs(1, 16, 1, 1, 8192, 576, 512, np.float16, seed=5)
    device = [cupy.asarray(a) for a in (q, k, v)]
    o = tileattn.forward(*device)
    assert_attention_close(o.get(), _golden(q, k, v)[0], np.float16, name="o")
    described = gpu_backend.describe(8192, 576, 512, np.float16, n_q=1, heads=16, kv_heads=1)
    assert described["forward"].startswith("decode"), described
    wide = gpu_backend.describe(8192, 576, 512, np.float16, n_q=1, heads=16, kv_heads=1,
                                batch=8)
    assert wide["forward"].startswith("mma") and "folded" in wide["forward"], wide


def test_dispatch_picks_decode_and_writes_into_out_buffers():
    """tileattn.forward on a decode shape runs the decode kernel (describe says so) and
    writes o and lse into the caller's buffers."""
    q, k, v = _inputs(1, 8, 1, 1, 4096, 128, 128, np.float16, seed=11)
    device = [cupy.asarray(a) for a in (q, k, v)]
    choice = launch_forward.choose(*device, _resolved(*device, {"causal": True}))
    assert choice.family == "decode" and choice.tiles.splits > 1, choice
    described = gpu_backend.describe(4096, 128, 128, np.float16, n_q=1, heads=8, kv_heads=1)
    assert described["forward"].startswith("decode"), described
    out = cupy.full((1, 8, 1, 128), np.nan, dtype=np.float16)
    lse_out = cupy.full((1, 8, 1), np.nan, dtype=np.float32)
    o, lse = tileattn.forward(*device, causal=True, return_lse=True, out=out, lse_out=lse_out)
    assert o is out and lse is lse_out
    expected_o, expected_lse = _golden(q, k, v, causal=True)
    assert_attention_close(out.get(), expected_o, q.dtype, name="o")
    assert_attention_close(lse_out.get(), expected_lse, q.dtype, name="lse")
    # The second call takes the cached launches.
    out[...] = np.nan
    tileattn.forward(*device, causal=True, out=out)
    assert_attention_close(out.get(), expected_o, q.dtype, name="o (cached launch)")


def test_repeated_calls_launch_through_packed_arguments():
    """From the second call of a plan on, its launches go through `PackedLaunch` (one
    cuLaunchKernel over an argument buffer built once, the array addresses written per
    call): new arrays of the same shapes give their own results, bit for bit as the first
    call's path on the same values."""
    from tileattn.gpu.operands import cached, contiguous_strides, forward_plan_key

    shapes = [(1, 8, 1, 64), (1, 1, 700, 64), (1, 1, 700, 64)]
    first = _inputs(1, 8, 1, 1, 700, 64, 64, np.float16, seed=15)
    second = _inputs(1, 8, 1, 1, 700, 64, 64, np.float16, seed=16)
    device = [cupy.asarray(a) for a in first]
    expected = tileattn.forward(*device, causal=True).get()  # CuPy's launch, then cached
    tileattn.forward(*device, causal=True)
    options = _resolved(*device, {"causal": True})
    o_strides = contiguous_strides((1, 8, 1, 64), 2)
    launch = cached(forward_plan_key(options, *device, o_strides), *device)[0]
    assert launch.decode._packed, "the cached decode launch packed its arguments"
    np.testing.assert_array_equal(tileattn.forward(*device, causal=True).get(), expected)
    other = [cupy.asarray(a) for a in second]
    assert [a.shape for a in other] == shapes
    np.testing.assert_array_equal(tileattn.forward(*other, causal=True).get(),
                                  tileattn.forward(*(cupy.asarray(a.copy()) for a in second),
                                                   causal=True).get())
    assert_attention_close(tileattn.forward(*other, causal=True).get(),
                           _golden(*second, causal=True)[0], np.float16, name="o")


def test_info_shows_the_decode_kernel():
    """python -m tileattn info --seq-len 1 --n-k 4096 --heads 8 --kv-heads 1 names it."""
    from tileattn.info import describe

    lines = []
    describe(seq_len=1, n_k=4096, head_dim=128, heads=8, kv_heads=1, dtype="float16",
             print_fn=lines.append)
    assert any(line.strip().startswith("forward kernel: decode DecodeMmaTiles")
               for line in lines), lines


@pytest.mark.parametrize(("heads", "kv_heads", "n_q"), [(8, 1, 33), (4, 4, 17), (4, 4, 64)],
                         ids=["MQA-264-rows", "MHA-Nq17", "MHA-Nq64"])
def test_many_rows_and_mha_chunks_take_the_split_prefill(heads, kv_heads, n_q):
    """Packed rows the prefill pads less than DECODE_MMA_PREFILL_RATE times as many of
    (8 heads of 33 queries: 512 against 272 in m16 tiles), and MHA beyond 16 queries (no
    group shares K/V), run the tensor-core prefill with its keys split over the idle SMs,
    not the decode kernel."""
    q = cupy.empty((1, heads, n_q, 64), dtype=np.float16)
    k = v = cupy.empty((1, kv_heads, 8192, 64), dtype=np.float16)
    choice = launch_forward.choose(q, k, v, _resolved(q, k, v, {"causal": True}))
    assert choice.family != "decode" and choice.key_splits > 1, choice


def test_prefill_shapes_keep_the_prefill_path():
    q, k, v = (cupy.empty(s, dtype=np.float16)
               for s in ((2, 8, 512, 64), (2, 8, 4096, 64), (2, 8, 4096, 64)))
    assert launch_forward.choose(q, k, v, _resolved(q, k, v, {})).family != "decode"


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=str)
@pytest.mark.parametrize("n_k", [1, 5, 33, 100, 200])
@pytest.mark.parametrize(("heads", "kv_heads", "n_q"), [(8, 2, 1), (4, 4, 1), (8, 2, 3)],
                         ids=["GQA4", "MHA", "GQA4-Nq3"])
def test_short_caches_decode(heads, kv_heads, n_q, n_k, dtype):
    """The first steps of a generation (caches of one key to a few tiles) take the decode
    kernel too, whose last key tile is partial and whose splits may hold no key."""
    q, k, v = _inputs(3, heads, kv_heads, n_q, n_k, 64, 64, dtype, seed=n_k)
    device = [cupy.asarray(a) for a in (q, k, v)]
    for options in ({}, {"causal": True}, {"window": (7, 0), "softcap": 4.0}):
        assert launch_forward.choose(*device, _resolved(*device, options)).family == "decode"
        o, lse = tileattn.forward(*device, return_lse=True, **options)
        expected_o, expected_lse = _golden(q, k, v, **options)
        assert_attention_close(o.get(), expected_o, q.dtype, name="o")
        assert_attention_close(lse.get(), expected_lse, q.dtype, name="lse")
    for kernel in KERNELS if q.dtype == np.float16 else ["cuda_cores"]:
        _check(q, k, v, {"causal": True}, 3, kernel)


@pytest.mark.parametrize("shape", [(1, 8, 1, 1, 8192), (4, 32, 8, 4, 2048),
                                   (8, 64, 1, 1, 16384)],
                         ids=["MQA-split", "GQA-Nq4", "MQA-64-rows-folded"])
def test_cuda_graph_capture_replays_like_eager_calls(shape):
    """Capture tileattn.forward (preallocated out/lse_out, on a stream) in a CUDA graph;
    replaying it after new values are written into q, k, v equals an eager call on them;
    64 packed rows fold onto the wgmma prefill on sm_90 (its views, key shares and merge
    captured too)."""
    batch, n_q_heads, n_kv_heads, n_q, n_k = shape
    first = _inputs(batch, n_q_heads, n_kv_heads, n_q, n_k, 128, 128, np.float16, seed=12)
    second = _inputs(batch, n_q_heads, n_kv_heads, n_q, n_k, 128, 128, np.float16, seed=13)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        q, k, v = (cupy.asarray(a) for a in first)
        out = cupy.empty((batch, n_q_heads, n_q, 128), dtype=np.float16)
        lse_out = cupy.empty((batch, n_q_heads, n_q), dtype=np.float32)
        options = {"causal": True}
        assert launch_forward.choose(q, k, v, _resolved(q, k, v, options)).family == "decode"
        folds = gpu_backend._forward_run(q, k, v, _resolved(q, k, v, options)).folds
        assert bool(folds) == (n_q_heads == 64
                               and cupy.cuda.Device().compute_capability == "90"), folds
        tileattn.forward(q, k, v, out=out, lse_out=lse_out, return_lse=True, **options)  # warm
        stream.begin_capture()
        tileattn.forward(q, k, v, out=out, lse_out=lse_out, return_lse=True, **options)
        graph = stream.end_capture()
        for values in (second, first):
            for device, host in zip((q, k, v), values):
                device.set(host, stream=stream)
            out.fill(np.nan)
            lse_out.fill(np.nan)
            graph.launch(stream)
            replayed_o, replayed_lse = out.copy(), lse_out.copy()
            eager_o, eager_lse = tileattn.forward(q, k, v, return_lse=True, **options)
            stream.synchronize()
            np.testing.assert_array_equal(replayed_o.get(), eager_o.get())
            np.testing.assert_array_equal(replayed_lse.get(), eager_lse.get())
            expected_o, _ = _golden(*values, **options)
            assert_attention_close(replayed_o.get(), expected_o, np.float16, name="o")
