"""GPU-specific tests: the tensor-core path, layouts, the compile cache, bfloat16.

The option-by-option correctness of every backend lives in test_backend_suite.py; this file
covers what only the GPU backend has. Everything skips cleanly without CuPy or a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import tileattn
from tileattn import backends
from tileattn.dropout import keep_mask
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

    from tileattn.gpu import _compile, _launch


def _inputs(shape_q, shape_k, shape_v, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s).astype(dtype) for s in (shape_q, shape_k, shape_v))


def _golden(q, k, v, **options):
    as64 = [a.astype(np.float64) for a in (q, k, v)]
    return tileattn.forward(*as64, backend="reference", return_lse=True, **options)


def _golden_grads(do, q, k, v, o, lse, **options):
    """The golden gradients for the `o` the GPU backward was given (SPEC: D = rowsum(do * o))."""
    as64 = [np.asarray(a).astype(np.float64) for a in (do, q, k, v, o)]
    return tileattn.backward(*as64, lse, backend="reference", **options)


def _check(q, k, v, do, deterministic=True, **options):
    """Forward and backward on the GPU against the float64 golden model."""
    device = [cupy.asarray(a) for a in (q, k, v, do)]
    o, lse = tileattn.forward(*device[:3], backend="gpu", return_lse=True, **options)
    grads = tileattn.backward(device[3], *device[:3], o, lse, backend="gpu",
                              deterministic=deterministic, **options)
    expected_o, expected_lse = _golden(q, k, v, **options)
    assert o.dtype == q.dtype and lse.dtype == _launch.accumulation_dtype(q.dtype)
    assert_attention_close(o.get(), expected_o, q.dtype, name="o")
    assert_attention_close(lse.get(), expected_lse, q.dtype, name="lse")
    expected = _golden_grads(do, q, k, v, o.get(), expected_lse, **options)
    for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
        assert_attention_close(grad.get(), want, q.dtype, name=name)


def _half_dtypes():
    return [np.dtype(np.float16)] + ([bfloat16()] if bfloat16() is not None else [])


TENSOR_CORE_OPTIONS = [
    {},
    {"causal": True},
    {"window": (37, 5)},
    {"causal": True, "window": (100, None), "softcap": 2.0},
    {"alibi_slopes": np.linspace(0.05, 0.5, 4), "scale": 0.3},
    {"dropout_p": 0.3, "seed": 2**63 + 5, "causal": True},
    {"softcap": 5.0, "alibi_slopes": np.linspace(0.1, 0.4, 4), "window": (64, 64),
     "dropout_p": 0.1, "seed": 7},
]


@pytest.mark.parametrize("dtype", _half_dtypes(), ids=lambda d: d.name)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("options", TENSOR_CORE_OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_tensor_core_matches_golden(dtype, head_dim, options):
    """The tensor-core forward and backward, end to end."""
    # GQA (4 query heads on 2 kv heads), Nq != Nk, neither a multiple of any tile.
    q, k, v = _inputs((2, 4, 200, head_dim), (2, 2, 263, head_dim), (2, 2, 263, head_dim), dtype)
    do = np.random.default_rng(1).standard_normal((2, 4, 200, head_dim)).astype(dtype)
    assert _launch.tensor_core_blocks(cupy.asarray(q), cupy.asarray(v), _options_of(q, options))
    assert _launch.tensor_core_backward_applies(cupy.asarray(q), cupy.asarray(v),
                                                _options_of(q, options))
    _check(q, k, v, do, **options)


def test_tensor_core_backward_applies_without_tile_sizes():
    q, _, v = (cupy.asarray(a) for a in _inputs((1, 1, 8, 64), (1, 1, 8, 64), (1, 1, 8, 64),
                                                np.float16))
    assert _launch.tensor_core_backward_applies(q, v, AttentionOptions())
    assert not _launch.tensor_core_backward_applies(q, v, AttentionOptions(block_q=64))
    assert not _launch.tensor_core_backward_applies(q.astype(cupy.float32), v,
                                                    AttentionOptions())


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("n_q,n_k,options", [
    (300, 100, {"causal": True}),  # leading query rows and a whole query tile keep nothing
    (100, 300, {"window": (10, 0)}),  # most key tiles are reached by no query
    (500, 450, {"causal": True, "window": (70, 3), "alibi_slopes": np.array([0.2, 0.4])}),
])
def test_tensor_core_backward_masked_tiles(head_dim, n_q, n_k, options):
    q, k, v = _inputs((1, 2, n_q, head_dim), (1, 1, n_k, head_dim), (1, 1, n_k, head_dim),
                      np.float16, seed=n_q)
    do = np.random.default_rng(n_k).standard_normal(q.shape).astype(np.float16)
    _check(q, k, v, do, **options)


def test_tensor_core_backward_is_deterministic():
    q, k, v = (cupy.asarray(a) for a in _inputs((2, 8, 700, 64), (2, 2, 700, 64),
                                                (2, 2, 700, 64), np.float16))
    o, lse = tileattn.forward(q, k, v, backend="gpu", return_lse=True)
    do = cupy.asarray(np.random.default_rng(6).standard_normal(o.shape).astype(np.float16))
    first = tileattn.backward(do, q, k, v, o, lse, backend="gpu")
    second = tileattn.backward(do, q, k, v, o, lse, backend="gpu")
    for a, b in zip(first, second):
        assert cupy.array_equal(a, b)


@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window": (300, 40)},
                                     {"window": (200, None)}],
                         ids=["plain", "causal", "window", "left-window"])
def test_ordered_single_pass_is_deterministic_and_exact(options):
    """The single pass with the key blocks adding dQ in turns (each band shape ranks the
    turns differently): bitwise the same run after run, and right."""
    q, k, v = _inputs((2, 8, 700, 64), (2, 2, 900, 64), (2, 2, 900, 64), np.float16)
    do = np.random.default_rng(6).standard_normal(q.shape).astype(np.float16)
    device = [cupy.asarray(a) for a in (do, q, k, v)]
    o, lse = tileattn.forward(*device[1:], backend="gpu", return_lse=True, **options)
    resolved = _resolved_options(q, k, v, options)
    assert resolved.deterministic
    first = _launch.backward_tensor_core(*device, o, lse, resolved, single_pass=True)
    for _ in range(3):
        again = _launch.backward_tensor_core(*device, o, lse, resolved, single_pass=True)
        for a, b in zip(first, again):
            assert cupy.array_equal(a, b)
    expected = _golden_grads(do, q, k, v, o.get(), lse.get(), **options)
    for name, grad, want in zip(("dq", "dk", "dv"), first, expected):
        assert_attention_close(grad.get(), want, q.dtype, name=name)


@pytest.mark.parametrize("dtype", _half_dtypes(), ids=lambda d: d.name)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("options", TENSOR_CORE_OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_tensor_core_single_pass_backward(dtype, head_dim, options):
    """deterministic=False: dQ through atomics in the dK/dV kernel, same answers."""
    q, k, v = _inputs((2, 4, 200, head_dim), (2, 2, 263, head_dim), (2, 2, 263, head_dim), dtype)
    do = np.random.default_rng(1).standard_normal((2, 4, 200, head_dim)).astype(dtype)
    _check(q, k, v, do, deterministic=False, **options)
    _check_single_passes(q, k, v, do, **options)


def _check_single_passes(q, k, v, do, **options):
    """Each single-pass backward the device has (mma.sync; wgmma on Hopper), called
    directly (the API may route deterministic=False elsewhere), against the golden model."""
    device = [cupy.asarray(a) for a in (do, q, k, v)]
    o, lse = tileattn.forward(*device[1:], backend="gpu", return_lse=True, **options)
    resolved = _resolved_options(q, k, v, {**options, "deterministic": False})
    expected = _golden_grads(do, q, k, v, o.get(), lse.get(), **options)
    passes = {"mma": _launch.backward_tensor_core}
    if _is_hopper():
        passes["wgmma"] = _launch.backward_wgmma
    for backward in passes.values():
        grads = backward(*device, o, lse, resolved, single_pass=True)
        for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
            assert_attention_close(grad.get(), want, q.dtype, name=name)


@pytest.mark.parametrize("n_q,n_k,options", [
    (300, 100, {"causal": True}),  # leading query rows and a whole query tile keep nothing
    (100, 300, {"window": (10, 0)}),  # most key tiles are reached by no query
])
def test_tensor_core_single_pass_masked_tiles(n_q, n_k, options):
    q, k, v = _inputs((1, 2, n_q, 64), (1, 1, n_k, 64), (1, 1, n_k, 64), np.float16, seed=n_q)
    do = np.random.default_rng(n_k).standard_normal(q.shape).astype(np.float16)
    _check(q, k, v, do, deterministic=False, **options)
    _check_single_passes(q, k, v, do, **options)


def test_tensor_core_single_pass_rows_with_very_negative_lse():
    """Every score near -256, so lse is too: exp2(-lse) of the zero-padded keys past Nk
    overflows float32, and those keys must still add nothing (not inf * 0) to dq."""
    rng = np.random.default_rng(4)
    q = np.full((1, 2, 130, 64), 4.0, dtype=np.float16)
    k = (-1.0 + 0.1 * rng.standard_normal((1, 2, 70, 64))).astype(np.float16)
    v = rng.standard_normal((1, 2, 70, 64)).astype(np.float16)
    do = rng.standard_normal(q.shape).astype(np.float16)
    _check(q, k, v, do, deterministic=False, scale=1.0)
    _check_single_passes(q, k, v, do, scale=1.0)


@pytest.mark.parametrize("blocks", [(64, 32), (64, 128), (128, 64), (128, 128)])
def test_every_tensor_core_tile_shape(blocks):
    q, k, v = _inputs((1, 2, 130, 64), (1, 2, 301, 64), (1, 2, 301, 64), np.float16)
    options = {"causal": True, "block_q": blocks[0], "block_k": blocks[1]}
    assert _launch.tensor_core_blocks(cupy.asarray(q), cupy.asarray(v),
                                      _options_of(q, options)) == tileattn.Blocks(*blocks)
    o = tileattn.forward(*map(cupy.asarray, (q, k, v)), backend="gpu", **options)
    assert_attention_close(o.get(), _golden(q, k, v, **options)[0], q.dtype)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("rows,q_in_registers", [(16, True), (32, True), (32, False)])
@pytest.mark.parametrize("options", [TENSOR_CORE_OPTIONS[1], TENSOR_CORE_OPTIONS[-1]],
                         ids=["causal", "every-option"])
def test_every_tensor_core_warp_layout(head_dim, rows, q_in_registers, options):
    """Warps of 16 or 32 query rows, Q fragments kept or re-read, on edge and masked tiles."""
    q, k, v = _inputs((2, 4, 200, head_dim), (2, 2, 263, head_dim), (2, 2, 263, head_dim),
                      np.float16)
    arrays = [cupy.asarray(a) for a in (q, k, v)]
    o = cupy.empty(arrays[0].shape, dtype=arrays[0].dtype)
    lse = cupy.empty(arrays[0].shape[:3], dtype=cupy.float32)
    attention_options = _resolved_options(q, k, v, options)
    _launch.forward_tensor_core(*arrays, o, lse, attention_options, tileattn.Blocks(128, 64),
                                _launch.WarpLayout(rows, q_in_registers))
    golden_o, golden_lse = _golden(q, k, v, **options)
    assert_attention_close(o.get(), golden_o, q.dtype, name="o")
    assert_attention_close(lse.get(), golden_lse, np.float32, name="lse")


def _float32_tiles(q, v, options):
    tiles = _launch.tf32_tiles(cupy.asarray(q), cupy.asarray(v), _options_of(q, options))
    if tiles is None:
        pytest.skip("the float32 tensor-core forward needs sm_80 and its tiles' shared memory")
    return tiles


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("options", TENSOR_CORE_OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_float32_tensor_core_forward_matches_golden(head_dim, options):
    """3xTF32 holds the float32 tolerance (one TF32 product per float32 product would
    not), forward and backward, end to end."""
    q, k, v = _inputs((2, 4, 200, head_dim), (2, 2, 263, head_dim), (2, 2, 263, head_dim),
                      np.float32)
    do = np.random.default_rng(1).standard_normal((2, 4, 200, head_dim)).astype(np.float32)
    assert _float32_tiles(q, v, options) == _launch.TF32_DEFAULT_TILES[head_dim]
    assert _launch.tf32_backward_applies(cupy.asarray(q), cupy.asarray(v),
                                         _options_of(q, options))
    _check(q, k, v, do, **options)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tiles", [(64, 32, 16), (64, 64, 32), (128, 32, 32), (128, 64, 16)],
                         ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("options", [TENSOR_CORE_OPTIONS[0], TENSOR_CORE_OPTIONS[1],
                                     TENSOR_CORE_OPTIONS[-1]],
                         ids=["plain", "causal", "every-option"])
def test_every_float32_tensor_core_tile_shape(head_dim, tiles, options):
    """Every tile shape and warp layout of the float32 forward, on GQA, Nq != Nk and
    sequence ends inside a tile; o and lse start as NaN, so every element is written."""
    q, k, v = _inputs((2, 4, 200, head_dim), (2, 2, 263, head_dim), (2, 2, 263, head_dim),
                      np.float32)
    tiles = _launch.Tf32Tiles(*tiles)
    _float32_tiles(q, v, {})
    if tiles.shared_bytes(head_dim) > _launch.shared_memory_limit(cupy.cuda.Device().id):
        pytest.skip(f"{tiles} needs more shared memory than this GPU has")
    arrays = [cupy.asarray(a) for a in (q, k, v)]
    o = cupy.full(arrays[0].shape, np.nan, dtype=cupy.float32)
    lse = cupy.full(arrays[0].shape[:3], np.nan, dtype=cupy.float32)
    _launch.forward_tf32(*arrays, o, lse, _resolved_options(q, k, v, options), tiles)
    golden_o, golden_lse = _golden(q, k, v, **options)
    assert_attention_close(o.get(), golden_o, q.dtype, name="o")
    assert_attention_close(lse.get(), golden_lse, np.float32, name="lse")


def test_float32_tensor_core_forward_selection():
    q, _, v = _inputs((1, 1, 8, 64), (1, 1, 8, 64), (1, 1, 8, 64), np.float32)
    tiles = _float32_tiles(q, v, {})
    assert _float32_tiles(q, v, {"block_q": 64, "block_k": 32}) == _launch.Tf32Tiles(
        64, 32, tiles.warp_rows)
    # Tile sizes it is not built for, other head dims, other dtypes: the CUDA-core kernel.
    assert _launch.tf32_tiles(cupy.asarray(q), cupy.asarray(v), AttentionOptions(block_k=16)) \
        is None
    q40 = cupy.zeros((1, 1, 8, 40), dtype=cupy.float32)
    assert _launch.tf32_tiles(q40, q40, AttentionOptions()) is None
    q64 = cupy.zeros((1, 1, 8, 64), dtype=cupy.float64)
    assert _launch.tf32_tiles(q64, q64, AttentionOptions()) is None


def test_float32_tensor_core_non_finite_rows():
    """A NaN query element reaches its row only; a NaN key the rows that keep it."""
    q, k, v = _inputs((1, 2, 150, 64), (1, 2, 150, 64), (1, 2, 150, 64), np.float32)
    _float32_tiles(q, v, {})
    q[0, 0, 5, 3] = np.nan
    k[0, 1, 70, 1] = np.nan
    o = tileattn.forward(*map(cupy.asarray, (q, k, v)), causal=True, backend="gpu").get()
    assert np.isnan(o[0, 0, 5]).all() and np.isnan(o[0, 1, 70:]).all()
    finite = np.ones((2, 150), bool)
    finite[0, 5] = False
    finite[1, 70:] = False
    assert np.isfinite(o[0][finite]).all()


def _is_hopper():
    return backends.availability("gpu") is None and cupy.cuda.Device().compute_capability == "90"


hopper_only = pytest.mark.skipif(backends.availability("gpu") is not None or not _is_hopper(),
                                 reason="the wgmma forward needs an sm_90 GPU")


@hopper_only
@pytest.mark.parametrize("dtype", _half_dtypes(), ids=lambda d: d.name)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tiles", [(128, 128, 2, 2), (128, 64, 2, 2), (64, 64, 3), (128, 64, 4),
                                   (192, 64, 3), (192, 128, 2), (256, 64, 2)],
                         ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("options", [TENSOR_CORE_OPTIONS[0], TENSOR_CORE_OPTIONS[1],
                                     TENSOR_CORE_OPTIONS[2], TENSOR_CORE_OPTIONS[-1]],
                         ids=["plain", "causal", "window", "every-option"])
def test_every_wgmma_tile_shape(dtype, head_dim, tiles, options):
    """The Hopper forward at every tile shape and stage count it is built for, on GQA,
    Nq != Nk and sequence ends inside a tile; o and lse against the golden model."""
    if not _launch.WgmmaTiles(*tiles).builds(head_dim):
        pytest.skip("128 registers cannot hold D=128's 128-key accumulators (ptxas C7512)")
    q, k, v = _inputs((2, 4, 200, head_dim), (2, 2, 263, head_dim), (2, 2, 263, head_dim),
                      dtype)
    arrays = [cupy.asarray(a) for a in (q, k, v)]
    # NaN everywhere first (0x7fff is a NaN in float16 and bfloat16): every element written.
    o = cupy.empty(arrays[0].shape, dtype=arrays[0].dtype)
    o.view(cupy.uint16).fill(0x7FFF)
    lse = cupy.full(arrays[0].shape[:3], np.nan, dtype=cupy.float32)
    _launch.forward_wgmma(*arrays, o, lse, _resolved_options(q, k, v, options),
                          _launch.WgmmaTiles(*tiles))
    golden_o, golden_lse = _golden(q, k, v, **options)
    assert_attention_close(o.get(), golden_o, q.dtype, name="o")
    assert_attention_close(lse.get(), golden_lse, np.float32, name="lse")


@hopper_only
def test_wgmma_forward_is_the_default_on_hopper():
    q = cupy.zeros((1, 1, 8192, 64), dtype=cupy.float16)
    plain, causal = AttentionOptions(), AttentionOptions(causal=True, window_right=0)
    assert _launch.wgmma_tiles(q, q, plain) == _launch.WGMMA_DEFAULT_TILES[64]
    # Up to WGMMA_SHORT_TILES' key count, causal or not: two blocks per multiprocessor.
    max_keys, short = _launch.WGMMA_SHORT_TILES[64]
    for options in (plain, causal):
        assert _launch.wgmma_tiles(q, q[:, :, :max_keys], options) == short
    assert short.blocks_per_sm == 2
    assert _launch.wgmma_tiles(q, q[:, :, :max_keys + 1], causal) == \
        _launch.WGMMA_DEFAULT_TILES[64]
    # Softcap, ALiBi or dropout: the tiles that spill least with them.
    assert _launch.wgmma_tiles(q, q[:, :, :1024], AttentionOptions(softcap=5.0)) == \
        _launch.WGMMA_SCORE_OPTION_TILES[64]
    # Named tiles: the default's stages, one block per multiprocessor.
    assert _launch.wgmma_tiles(q, q, AttentionOptions(block_q=64)) == \
        _launch.WgmmaTiles(64, 128, 2)
    # A tile size the wgmma kernel is not built for selects the mma.sync kernel.
    assert _launch.wgmma_tiles(q, q, AttentionOptions(block_k=32)) is None


@hopper_only
@pytest.mark.parametrize("single_pass", [False, True])
def test_wgmma_backward_tiles_fit_shared_memory(single_pass):
    """Every default backward tiling (with and without a band) fits one block's shared
    memory, in the single pass too."""
    limit = _launch.shared_memory_limit(cupy.cuda.Device().id)
    for table in (_launch.WGMMA_BACKWARD_TILES, _launch.WGMMA_BANDED_BACKWARD_TILES):
        for head_dim, tiles in table.items():
            for entry in ("dq", "dkdv"):
                assert tiles.shared_bytes(entry, head_dim, single_pass) <= limit, \
                    (head_dim, tiles, entry)


@hopper_only
def test_named_wgmma_tiles_fit_shared_memory():
    """A tile size named by the caller keeps the default's stages only where they fit: at
    D = 128 with ALiBi (three stages) 192 x 128 would need 241 KiB (found by hypothesis:
    CUDA_ERROR_INVALID_VALUE raising the kernel's shared-memory limit)."""
    q, k, v = _inputs((1, 1, 300, 128), (1, 1, 260, 128), (1, 1, 260, 128), np.float16)
    options = {"alibi_slopes": np.array([0.4]), "block_k": 128}
    tiles = _launch.wgmma_tiles(cupy.asarray(q), cupy.asarray(k),
                                _resolved_options(q, k, v, options))
    assert tiles is not None and tiles.stages == 2
    assert tiles.shared_bytes(128) <= _launch.shared_memory_limit(cupy.cuda.Device().id)
    o, lse = tileattn.forward(*map(cupy.asarray, (q, k, v)), backend="gpu", return_lse=True,
                              **options)
    golden_o, golden_lse = _golden(q, k, v, **options)
    assert_attention_close(o.get(), golden_o, q.dtype, name="o")
    assert_attention_close(lse.get(), golden_lse, np.float32, name="lse")


@hopper_only
def test_wgmma_forward_long_rows_and_fully_masked_tiles():
    """Causal with Nq > Nk (leading query tiles keep nothing) over several key tiles."""
    q, k, v = _inputs((1, 2, 700, 128), (1, 2, 520, 128), (1, 2, 520, 128), np.float16)
    o, lse = tileattn.forward(*map(cupy.asarray, (q, k, v)), causal=True, backend="gpu",
                              return_lse=True)
    golden_o, golden_lse = _golden(q, k, v, causal=True)
    assert_attention_close(o.get(), golden_o, q.dtype, name="o")
    assert_attention_close(lse.get(), golden_lse, np.float32, name="lse")


@hopper_only
@pytest.mark.parametrize("dtype", _half_dtypes(), ids=lambda d: d.name)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tiles", [((128, 64), (128, 64), 2), ((192, 64), (128, 64), 3),
                                   ((64, 128), (64, 128), 2), ((192, 64), (192, 64), 2)],
                         ids=lambda t: f"dq{t[0][0]}x{t[0][1]}-dkdv{t[1][0]}x{t[1][1]}-s{t[2]}")
@pytest.mark.parametrize("single_pass", [False, True], ids=["two-kernel", "single-pass"])
@pytest.mark.parametrize("options", [TENSOR_CORE_OPTIONS[0], TENSOR_CORE_OPTIONS[1],
                                     TENSOR_CORE_OPTIONS[2], TENSOR_CORE_OPTIONS[-1]],
                         ids=["plain", "causal", "window", "every-option"])
def test_every_wgmma_backward_tile_shape(dtype, head_dim, tiles, single_pass, options):
    """The Hopper backward (both forms) at several tile shapes and stage counts, on GQA,
    Nq != Nk and sequence ends inside tiles, from the golden model's lse (so only the
    backward is tested); dq, dk, dv against the golden model."""
    (owned, streamed) = tiles[1]
    if single_pass and (streamed != 64 or head_dim not in (64, owned)):
        pytest.skip("the single pass streams 64 queries and splits dQ over its warpgroups by "
                    "keys (D = 64) or by 64-column blocks, one each (D = owned keys)")
    q, k, v = _inputs((2, 4, 200, head_dim), (2, 2, 263, head_dim), (2, 2, 263, head_dim),
                      dtype)
    do = np.random.default_rng(1).standard_normal(q.shape).astype(dtype)
    golden_o, golden_lse = _golden(q, k, v, **options)
    given_o = golden_o.astype(dtype)
    grads = _launch.backward_wgmma(*map(cupy.asarray, (do, q, k, v, given_o)),
                                   cupy.asarray(golden_lse.astype(np.float32)),
                                   _resolved_options(q, k, v, options),
                                   _launch.WgmmaBackwardTiles(*tiles), single_pass=single_pass)
    expected = _golden_grads(do, q, k, v, given_o, golden_lse, **options)
    for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
        assert_attention_close(grad.get(), want, q.dtype, name=name)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("options", [TENSOR_CORE_OPTIONS[1], TENSOR_CORE_OPTIONS[-1]],
                         ids=["causal", "every-option"])
def test_mma_two_kernel_backward(head_dim, options):
    """The mma.sync two-kernel backward called directly (on Hopper the default routes to
    the wgmma kernels, so this keeps the sm_80 path tested there too)."""
    q, k, v = _inputs((2, 4, 200, head_dim), (2, 2, 263, head_dim), (2, 2, 263, head_dim),
                      np.float16)
    do = np.random.default_rng(1).standard_normal(q.shape).astype(np.float16)
    golden_o, golden_lse = _golden(q, k, v, **options)
    given_o = golden_o.astype(np.float16)
    grads = _launch.backward_tensor_core(*map(cupy.asarray, (do, q, k, v, given_o)),
                                         cupy.asarray(golden_lse.astype(np.float32)),
                                         _resolved_options(q, k, v, options), single_pass=False)
    expected = _golden_grads(do, q, k, v, given_o, golden_lse, **options)
    for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
        assert_attention_close(grad.get(), want, q.dtype, name=name)


def _resolved_options(q, k, v, options):
    """The AttentionOptions the API would pass a backend for these keyword options."""
    defaults = dict(causal=False, window=None, scale=None, softcap=None, alibi_slopes=None,
                    dropout_p=0.0, seed=None, block_q=None, block_k=None, deterministic=True)
    return validate(q, k, v, **{**defaults, **options}).options


def _options_of(q, options):
    """What `tensor_core_blocks` reads of the options: the caller's tile sizes."""
    return AttentionOptions(block_q=options.get("block_q"), block_k=options.get("block_k"))


def test_tensor_core_fully_masked_rows():
    """Causal with Nq > Nk: leading rows keep nothing; a whole query tile keeps nothing."""
    q, k, v = _inputs((1, 2, 300, 64), (1, 2, 100, 64), (1, 2, 100, 64), np.float16)
    o, lse = tileattn.forward(*map(cupy.asarray, (q, k, v)), causal=True, backend="gpu",
                              return_lse=True)
    o, lse = o.get(), lse.get()
    assert np.all(o[:, :, :200] == 0) and np.all(lse[:, :, :200] == -np.inf)
    assert np.isfinite(o).all() and np.isfinite(lse[:, :, 200:]).all()
    assert_attention_close(o, _golden(q, k, v, causal=True)[0], np.float16)


def test_tensor_core_dropout_drops_exactly_the_golden_entries():
    """With V = identity (Nk = Dv = 64) the kept pattern shows in o."""
    n, seed, dropout_p = 64, 12345, 0.5
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 3, n, 64)).astype(np.float16)
    k = rng.standard_normal((2, 3, n, 64)).astype(np.float16)
    v = np.broadcast_to(np.eye(n, dtype=np.float16), (2, 3, n, n)).copy()
    o = tileattn.forward(*map(cupy.asarray, (q, k, v)), dropout_p=dropout_p, seed=seed,
                         backend="gpu").get()
    bh = np.arange(6).reshape(2, 3, 1, 1)
    keep = keep_mask(seed, dropout_p, bh, np.arange(n)[:, None], np.arange(n)[None, :])
    np.testing.assert_array_equal(o != 0, keep)


@pytest.mark.parametrize("layout", ["transposed", "reversed", "odd_offset"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_strided_inputs(layout, dtype):
    """(B, N, H, D) storage read in place; negative strides and a 2-byte-offset view
    (which the tensor-core path must copy) give the same results."""
    q, k, v = _inputs((2, 3, 70, 64), (2, 3, 90, 64), (2, 3, 90, 64), dtype)
    do = np.random.default_rng(5).standard_normal((2, 3, 70, 64)).astype(dtype)

    def place(array):
        device = cupy.asarray(array)
        if layout == "transposed":
            return cupy.ascontiguousarray(device.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        if layout == "reversed":
            return cupy.ascontiguousarray(device[:, :, ::-1])[:, :, ::-1]
        padded = cupy.zeros(device.shape[:-1] + (device.shape[-1] + 1,), dtype=device.dtype)
        padded[..., 1:] = device
        return padded[..., 1:]

    placed = [place(a) for a in (q, k, v, do)]
    originals = [a.copy() for a in placed]
    o, lse = tileattn.forward(*placed[:3], backend="gpu", causal=True, return_lse=True)
    grads = tileattn.backward(placed[3], *placed[:3], o, lse, backend="gpu", causal=True)
    for before, after in zip(originals, placed):
        assert cupy.array_equal(before, after)
    expected_o, expected_lse = _golden(q, k, v, causal=True)
    assert_attention_close(o.get(), expected_o, dtype)
    expected = _golden_grads(do, q, k, v, o.get(), expected_lse, causal=True)
    for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
        assert_attention_close(grad.get(), want, dtype, name=name)


@pytest.mark.skipif(bfloat16() is None, reason="ml_dtypes is not installed")
@pytest.mark.parametrize("head_dim,value_dim", [(64, 64), (40, 24)])
def test_bfloat16_arrays(head_dim, value_dim):
    q, k, v = _inputs((1, 2, 50, head_dim), (1, 2, 61, head_dim), (1, 2, 61, value_dim),
                      bfloat16())
    do = np.random.default_rng(2).standard_normal((1, 2, 50, value_dim)).astype(bfloat16())
    _check(q, k, v, do, causal=True, softcap=3.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("head_dim,value_dim", [(256, 256), (3, 200), (160, 8)])
def test_generic_head_dims(dtype, head_dim, value_dim):
    q, k, v = _inputs((1, 4, 45, head_dim), (1, 1, 77, head_dim), (1, 1, 77, value_dim), dtype)
    do = np.random.default_rng(4).standard_normal((1, 4, 45, value_dim)).astype(dtype)
    _check(q, k, v, do, window=(20, 3), alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4]),
           dropout_p=0.2, seed=99)


def test_float16_peaked_attention_gradients():
    """Peaked attention (scale 1, D = 16), where dq = scale * P (dP - D) K cancels most:
    the float16 rounding of o, through D = rowsum(dO * o), moves dq by up to 1.2x the
    float16 tolerance from the exact gradient (bench/NOTES-gpu.md, "Backward accuracy"), so
    the GPU's D must be the golden model's D for the same o, not merely close to it."""
    for seed in range(8):
        q, k, v = _inputs((2, 37, 16), (2, 37, 16), (2, 37, 16), np.float16, seed=seed)
        do = np.random.default_rng(seed + 100).standard_normal((2, 37, 16)).astype(np.float16)
        _check(q, k, v, do, scale=1.0)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_cached_launch_refuses_misaligned_arrays(dtype):
    """A repeated problem reuses its cached launches; contiguous arrays with the same shape
    and strides that start 2 elements into an allocation (not 16-byte aligned, so cp.async
    cannot read them in place) must be copied, not launched from the cache."""
    q, k, v = _inputs((1, 2, 96, 64), (1, 2, 96, 64), (1, 2, 96, 64), dtype)
    do = np.random.default_rng(7).standard_normal(q.shape).astype(dtype)

    def misaligned(array):
        flat = cupy.zeros(array.size + 2, dtype=array.dtype)
        view = flat[2:].reshape(array.shape)
        view[...] = cupy.asarray(array)
        assert view.data.ptr % 16 and view.flags.c_contiguous
        return view

    _check(q, k, v, do, causal=True)  # caches the launches of this problem
    placed = [misaligned(a) for a in (q, k, v, do)]
    o, lse = tileattn.forward(*placed[:3], backend="gpu", causal=True, return_lse=True)
    grads = tileattn.backward(placed[3], *placed[:3], o, lse, backend="gpu", causal=True)
    expected_o, expected_lse = _golden(q, k, v, causal=True)
    assert_attention_close(o.get(), expected_o, dtype, name="o")
    expected = _golden_grads(do, q, k, v, o.get(), expected_lse, causal=True)
    for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
        assert_attention_close(grad.get(), want, dtype, name=name)


def test_block_overrides_do_not_recompile():
    q, k, v = (cupy.asarray(a) for a in _inputs((1, 2, 40, 32), (1, 2, 40, 32), (1, 2, 40, 32),
                                                np.float32))
    tileattn.forward(q, k, v, backend="gpu")
    compiled = _compile.compiled_count()
    for block_q, block_k in [(1, 1), (3, 7), (16, 5), (4096, 4096)]:
        tileattn.forward(q, k, v, backend="gpu", block_q=block_q, block_k=block_k)
    assert _compile.compiled_count() == compiled


def test_backward_is_deterministic():
    q, k, v = (cupy.asarray(a) for a in _inputs((2, 8, 300, 64), (2, 2, 300, 64),
                                                (2, 2, 300, 64), np.float32))
    o, lse = tileattn.forward(q, k, v, backend="gpu", return_lse=True, causal=True)
    do = cupy.asarray(np.random.default_rng(6).standard_normal(o.shape).astype(np.float32))
    first = tileattn.backward(do, q, k, v, o, lse, backend="gpu", causal=True,
                              deterministic=False)
    second = tileattn.backward(do, q, k, v, o, lse, backend="gpu", causal=True)
    for a, b in zip(first, second):
        assert cupy.array_equal(a, b)


def test_lse_of_another_float_dtype_is_accepted():
    q, k, v = _inputs((1, 1, 30, 16), (1, 1, 30, 16), (1, 1, 30, 16), np.float32)
    device = [cupy.asarray(a) for a in (q, k, v)]
    o, lse = tileattn.forward(*device, backend="gpu", return_lse=True)
    do = cupy.ones_like(o)
    grads = tileattn.backward(do, *device, o, lse.astype(cupy.float64), backend="gpu")
    expected = tileattn.backward(do, *device, o, lse, backend="gpu")
    for a, b in zip(grads, expected):
        assert cupy.array_equal(a, b)


def test_host_arrays_are_refused():
    q, k, v = _inputs((1, 1, 4, 8), (1, 1, 4, 8), (1, 1, 4, 8), np.float32)
    with pytest.raises(ValueError, match="GPU memory"):
        tileattn.forward(q, k, v, backend="gpu")


def test_arrays_on_another_device_run_there():
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    with cupy.cuda.Device(1):
        q, k, v = (cupy.asarray(a) for a in _inputs((1, 2, 33, 64), (1, 2, 33, 64),
                                                    (1, 2, 33, 64), np.float16))
    o = tileattn.forward(q, k, v, backend="gpu")
    assert o.device.id == 1
    assert_attention_close(o.get(), _golden(q.get(), k.get(), v.get())[0], np.float16)
