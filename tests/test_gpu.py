"""GPU-specific tests: every kernel family and head dim, layouts, the compile cache, bfloat16.

The option-by-option correctness of every backend lives in test_backend_suite.py; this file
covers what only the GPU backend has: each family (wgmma, mma.sync, 3xTF32, generic) run
directly with its tiles, at every head dim the tables cover. Everything skips cleanly
without CuPy or a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import tileattn
from tileattn import backends
from tileattn.dropout import keep_mask
from tileattn.gpu import tiles as tile_tables
from tileattn.gpu.tiles import (Choice, MmaBackwardTiles, MmaTiles, Problem, Tf32Tiles,
                                Tf32WgmmaTiles, WgmmaBackwardTiles, WgmmaTiles)
from tileattn.testing import assert_attention_close, bfloat16, tolerance_for
from tileattn.validation import validate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(backends.availability("gpu") is not None,
                       reason=str(backends.availability("gpu"))),
]

if backends.availability("gpu") is None:
    import cupy

    from tileattn.gpu import _compile
    from tileattn.gpu import launch_backward as gpu_backward
    from tileattn.gpu import launch_forward as gpu_forward
    from tileattn.gpu.operands import accumulation_dtype, problem_of, shared_memory_limit


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
    assert o.dtype == q.dtype and lse.dtype == accumulation_dtype(q.dtype)
    assert_attention_close(o.get(), expected_o, q.dtype, name="o")
    assert_attention_close(lse.get(), expected_lse, q.dtype, name="lse")
    expected = _golden_grads(do, q, k, v, o.get(), expected_lse, **options)
    for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
        assert_attention_close(grad.get(), want, q.dtype, name=name)


def _half_dtypes():
    return [np.dtype(np.float16)] + ([bfloat16()] if bfloat16() is not None else [])


def _resolved_options(q, k, v, options):
    """The AttentionOptions the API would pass a backend for these keyword options."""
    defaults = dict(causal=False, window=None, scale=None, softcap=None, alibi_slopes=None,
                    dropout_p=0.0, seed=None, block_q=None, block_k=None, deterministic=True)
    return validate(q, k, v, **{**defaults, **options}).options


def _choices(q, k, v, options):
    problem = problem_of(*map(cupy.asarray, (q, k, v)), _resolved_options(q, k, v, options))
    return tile_tables.choose_forward(problem), tile_tables.choose_backward(problem)


def _is_hopper():
    return backends.availability("gpu") is None and cupy.cuda.Device().compute_capability == "90"


hopper_only = pytest.mark.skipif(backends.availability("gpu") is not None or not _is_hopper(),
                                 reason="the wgmma kernels need an sm_90 GPU")


def _fits(tiles, widths, *entries, element_size=2):
    limit = shared_memory_limit(cupy.cuda.Device().id)
    if not entries:
        return tiles.shared_bytes(widths) <= limit
    parts = (1, 2) if tiles.split else (0,)
    if isinstance(tiles, WgmmaBackwardTiles):
        return all(tiles.shared_bytes(e, widths, part=p) <= limit for e in entries for p in parts)
    return all(tiles.shared_bytes(e, widths, element_size, part=p) <= limit
               for e in entries for p in parts)


def _forward_with(choice, q, k, v, options):
    """o and lse of one family and tile configuration, run directly, against the golden
    model; the outputs start as NaN, so every element must be written."""
    arrays = [cupy.asarray(a) for a in (q, k, v)]
    o, lse = gpu_forward.run(choice, *arrays, _resolved_options(q, k, v, options))
    golden_o, golden_lse = _golden(q, k, v, **options)
    assert_attention_close(o.get(), golden_o, q.dtype, name="o")
    assert_attention_close(lse.get(), golden_lse, np.float32, name="lse")


def _backward_with(choice, q, k, v, do, options):
    """dq, dk, dv of one family and tile configuration, run directly from the golden model's
    o and lse (so only the backward is tested), against the golden model."""
    golden_o, golden_lse = _golden(q, k, v, **options)
    given_o = golden_o.astype(q.dtype)
    grads = gpu_backward.run(choice, *map(cupy.asarray, (do, q, k, v, given_o)),
                             cupy.asarray(golden_lse.astype(accumulation_dtype(q.dtype))),
                             _resolved_options(q, k, v, options))
    expected = _golden_grads(do, q, k, v, given_o, golden_lse, **options)
    for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
        assert_attention_close(grad.get(), want, q.dtype, name=name)


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
OPTION_IDS = lambda o: ",".join(o) or "plain"  # noqa: E731

# The head dims of real models (diffusion U-Nets 40/80/160, small language models 80/96,
# Gemma 256, multi-head latent attention 192/128), dims that are not a multiple of 16 or of 8
# (padded in shared memory), an odd one (read in 2-byte pieces) and Dv != D both ways.
HEAD_DIMS = [(32, 32), (40, 40), (48, 48), (64, 64), (72, 72), (80, 80), (96, 96),
             (100, 100), (112, 112), (128, 128), (160, 160), (192, 192), (256, 256),
             (192, 128), (128, 64), (64, 128), (33, 33), (24, 200)]
DIM_IDS = lambda d: f"D{d[0]}" + (f"-Dv{d[1]}" if d[1] != d[0] else "")  # noqa: E731


@pytest.mark.parametrize("dtype", _half_dtypes(), ids=lambda d: d.name)
@pytest.mark.parametrize("dims", HEAD_DIMS, ids=DIM_IDS)
@pytest.mark.parametrize("options", [TENSOR_CORE_OPTIONS[0], TENSOR_CORE_OPTIONS[1],
                                     TENSOR_CORE_OPTIONS[-1]], ids=["plain", "causal", "every"])
def test_every_head_dim_runs_on_tensor_cores(dtype, dims, options):
    """The default path at every head dim: a tensor-core family both ways, right answers."""
    head_dim, value_dim = dims
    q, k, v = _inputs((2, 4, 200, head_dim), (2, 2, 263, head_dim), (2, 2, 263, value_dim), dtype)
    do = np.random.default_rng(1).standard_normal((2, 4, 200, value_dim)).astype(dtype)
    forward_choice, backward_choice = _choices(q, k, v, options)
    expected = "wgmma" if _is_hopper() else "mma"
    assert forward_choice.family == expected and backward_choice.family == expected
    _check(q, k, v, do, **options)


@pytest.mark.parametrize("dims", HEAD_DIMS, ids=DIM_IDS)
@pytest.mark.parametrize("options", [TENSOR_CORE_OPTIONS[1], TENSOR_CORE_OPTIONS[-1]],
                         ids=["causal", "every"])
def test_every_head_dim_on_mma_sync(dims, options):
    """The mma.sync family at every head dim (on Hopper the default is wgmma, so this keeps
    the sm_80 path tested there too), with its own table's tiles."""
    head_dim, value_dim = dims
    q, k, v = _inputs((2, 4, 200, head_dim), (2, 2, 263, head_dim), (2, 2, 263, value_dim),
                      np.float16)
    do = np.random.default_rng(1).standard_normal((2, 4, 200, value_dim)).astype(np.float16)
    widths = tile_tables.Widths.padded(head_dim, value_dim, 16)
    problem = Problem(80, shared_memory_limit(cupy.cuda.Device().id), "float16", head_dim,
                      value_dim, 263)
    forward_choice = tile_tables.choose_forward(problem)
    backward_choice = tile_tables.choose_backward(problem)
    assert forward_choice.family == "mma" and backward_choice.family == "mma"
    assert _fits(forward_choice.tiles, widths)
    _forward_with(forward_choice, q, k, v, options)
    _backward_with(backward_choice, q, k, v, do, options)


@pytest.mark.parametrize("dims", HEAD_DIMS, ids=DIM_IDS)
@pytest.mark.parametrize("options", [TENSOR_CORE_OPTIONS[0], TENSOR_CORE_OPTIONS[1],
                                     TENSOR_CORE_OPTIONS[-1]], ids=["plain", "causal", "every"])
def test_every_head_dim_float32_on_tensor_cores(dims, options):
    """float32 on 3xTF32 at every head dim, forward and backward, end to end: 3xTF32 holds
    the float32 tolerance (one TF32 product per float32 product would not)."""
    head_dim, value_dim = dims
    q, k, v = _inputs((2, 4, 200, head_dim), (2, 2, 263, head_dim), (2, 2, 263, value_dim),
                      np.float32)
    do = np.random.default_rng(1).standard_normal((2, 4, 200, value_dim)).astype(np.float32)
    forward_choice, backward_choice = _choices(q, k, v, options)
    assert forward_choice.family == "tf32" and backward_choice.family == "tf32"
    _check(q, k, v, do, **options)


@pytest.mark.parametrize("dtype", _half_dtypes(), ids=lambda d: d.name)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("options", TENSOR_CORE_OPTIONS, ids=OPTION_IDS)
def test_tensor_core_matches_golden(dtype, head_dim, options):
    """The tensor-core forward and backward, end to end, with every option."""
    # GQA (4 query heads on 2 kv heads), Nq != Nk, neither a multiple of any tile.
    q, k, v = _inputs((2, 4, 200, head_dim), (2, 2, 263, head_dim), (2, 2, 263, head_dim), dtype)
    do = np.random.default_rng(1).standard_normal((2, 4, 200, head_dim)).astype(dtype)
    assert all(c.family != "generic" for c in _choices(q, k, v, options))
    _check(q, k, v, do, **options)


def test_named_tile_sizes_select_the_generic_backward():
    q, k, v = _inputs((1, 1, 8, 64), (1, 1, 8, 64), (1, 1, 8, 64), np.float16)
    assert _choices(q, k, v, {})[1].family != "generic"
    assert _choices(q, k, v, {"block_q": 64})[1].family == "generic"
    assert _choices(*(a.astype(np.float64) for a in (q, k, v)), {})[1].family == "generic"


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


@hopper_only
@pytest.mark.parametrize("n_q", [1, 7, 32, 33, 100, 128])
@pytest.mark.parametrize("options", [{}, {"causal": True},
                                     {"causal": True, "alibi_slopes": np.array([0.2, 0.4])}],
                         ids=["plain", "causal", "causal-alibi"])
def test_backward_of_few_query_rows_over_many_keys(n_q, options):
    """Up to 128 query rows over 1100 keys (GQA 2/1, D 128) take the table's rows for few
    queries, and are right."""
    q, k, v = _inputs((1, 2, n_q, 128), (1, 1, 1100, 128), (1, 1, 1100, 128), np.float16,
                      seed=n_q)
    do = np.random.default_rng(n_q).standard_normal(q.shape).astype(np.float16)
    backward = _choices(q, k, v, options)[1]
    assert backward.tiles.dkdv == (64, 64) and "query rows" in backward.note
    _check(q, k, v, do, **options)


@hopper_only
@pytest.mark.parametrize("n", [1, 37, 64, 100, 128, 300, 512])
@pytest.mark.parametrize("head_dim", [64, 80, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"causal": True, "softcap": 5.0}],
                         ids=["plain", "causal", "causal-softcap"])
def test_short_sequences_at_a_large_batch(n, head_dim, options):
    """Short sequences (an encoder's, a batch of 24 in 4/2 heads) take the table's rows for
    few keys, one-warpgroup blocks forward and (D 64 and 128) backward, and are right."""
    q, k, v = _inputs((24, 4, n, head_dim), (24, 2, n, head_dim), (24, 2, n, head_dim),
                      np.float16, seed=n)
    do = np.random.default_rng(n).standard_normal(q.shape).astype(np.float16)
    forward, backward = _choices(q, k, v, options)[:2]
    if n <= 64 and not options.get("softcap"):
        assert forward.tiles.block_q == forward.tiles.block_k == 64
    if head_dim != 80:
        assert backward.tiles.dq == backward.tiles.dkdv == (64, 64)
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


MMA_TABLE_TILES = {64: MmaBackwardTiles((64, 64), (128, 64)),
                   128: MmaBackwardTiles((128, 128), (128, 64))}


def _mma_single_pass(q, k, v, do, options, tiles):
    device = [cupy.asarray(a) for a in (do, q, k, v)]
    o, lse = tileattn.forward(*device[1:], backend="gpu", return_lse=True, **options)
    resolved = _resolved_options(q, k, v, options)
    return gpu_backward.backward_mma(*device, o, lse, resolved, tiles, single_pass=True), o, lse


@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window": (300, 40)},
                                     {"window": (200, None)}],
                         ids=["plain", "causal", "window", "left-window"])
def test_ordered_single_pass_is_deterministic_and_exact(options):
    """The single pass with the key blocks adding dQ in turns (each band shape ranks the
    turns differently): bitwise the same run after run, and right."""
    q, k, v = _inputs((2, 8, 700, 64), (2, 2, 900, 64), (2, 2, 900, 64), np.float16)
    do = np.random.default_rng(6).standard_normal(q.shape).astype(np.float16)
    first, o, lse = _mma_single_pass(q, k, v, do, options, MMA_TABLE_TILES[64])
    for _ in range(3):
        again, _, _ = _mma_single_pass(q, k, v, do, options, MMA_TABLE_TILES[64])
        for a, b in zip(first, again):
            assert cupy.array_equal(a, b)
    expected = _golden_grads(do, q, k, v, o.get(), lse.get(), **options)
    for name, grad, want in zip(("dq", "dk", "dv"), first, expected):
        assert_attention_close(grad.get(), want, q.dtype, name=name)


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["float16", "float32"])
@pytest.mark.parametrize("n_q", [1, 5, 16, 40])
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window": (300, 40)}],
                         ids=["plain", "causal", "window"])
def test_single_pass_into_a_slot_per_key_block(dtype, n_q, options):
    """Few query rows over many keys (GQA 4/2, D 128) through the mma.sync single pass with
    each key block's dQ share in a slot of its own (DQ_PARTS), summed in key-block order:
    right, bitwise the same run after run, and into a "bshd" dq as well."""
    q, k, v = _inputs((2, 4, n_q, 128), (2, 2, 2000, 128), (2, 2, 2000, 128), dtype,
                      seed=n_q)
    do = np.random.default_rng(n_q).standard_normal(q.shape).astype(dtype)
    device = [cupy.asarray(a) for a in (do, q, k, v)]
    o, lse = tileattn.forward(*device[1:], backend="gpu", return_lse=True, **options)
    resolved = _resolved_options(q, k, v, options)
    tiles = MmaBackwardTiles((64, 64), (64, 16))
    expected = _golden_grads(do, q, k, v, o.get(), lse.get(), **options)
    first = gpu_backward.backward_mma(*device, o, lse, resolved, tiles, single_pass=True,
                                      dq_parts=True)
    for name, grad, want in zip(("dq", "dk", "dv"), first, expected):
        assert_attention_close(grad.get(), want, q.dtype, name=name)
    again = gpu_backward.backward_mma(*device, o, lse, resolved, tiles, single_pass=True,
                                      dq_parts=True)
    assert all(cupy.array_equal(a, b) for a, b in zip(first, again))
    strided = cupy.empty((2, n_q, 4, 128), q.dtype).swapaxes(1, 2)
    gpu_backward.backward_mma(*device, o, lse, resolved, tiles, single_pass=True,
                              given=(strided, None, None), dq_parts=True)
    assert cupy.array_equal(strided, first[0])


def _check_single_passes(q, k, v, do, **options):
    """Each single-pass backward the device has (mma.sync; wgmma on Hopper), called
    directly (the API may route deterministic=False elsewhere), against the golden model."""
    head_dim = q.shape[-1]
    device = [cupy.asarray(a) for a in (do, q, k, v)]
    o, lse = tileattn.forward(*device[1:], backend="gpu", return_lse=True, **options)
    resolved = _resolved_options(q, k, v, {**options, "deterministic": False})
    expected = _golden_grads(do, q, k, v, o.get(), lse.get(), **options)
    runs = [lambda: gpu_backward.backward_mma(*device, o, lse, resolved,
                                              MMA_TABLE_TILES[head_dim], single_pass=True)]
    if _is_hopper():
        wgmma_tiles = {64: WgmmaBackwardTiles((192, 64), (192, 64), 2),
                       128: WgmmaBackwardTiles((192, 64), (128, 64), 3)}[head_dim]
        runs.append(lambda: gpu_backward.backward_wgmma(*device, o, lse, resolved, wgmma_tiles,
                                                        single_pass=True))
    for run in runs:
        for name, grad, want in zip(("dq", "dk", "dv"), run(), expected):
            assert_attention_close(grad.get(), want, q.dtype, name=name)


@pytest.mark.parametrize("dtype", _half_dtypes(), ids=lambda d: d.name)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("options", TENSOR_CORE_OPTIONS, ids=OPTION_IDS)
def test_tensor_core_single_pass_backward(dtype, head_dim, options):
    """deterministic=False: dQ through atomics in the dK/dV kernel, same answers."""
    q, k, v = _inputs((2, 4, 200, head_dim), (2, 2, 263, head_dim), (2, 2, 263, head_dim), dtype)
    do = np.random.default_rng(1).standard_normal((2, 4, 200, head_dim)).astype(dtype)
    _check(q, k, v, do, deterministic=False, **options)
    _check_single_passes(q, k, v, do, **options)


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
def test_every_named_tensor_core_tile_shape(blocks):
    """Tile sizes the caller names: the wgmma forward where it is built for them, else the
    mma.sync one, never the generic kernel."""
    q, k, v = _inputs((1, 2, 130, 64), (1, 2, 301, 64), (1, 2, 301, 64), np.float16)
    options = {"causal": True, "block_q": blocks[0], "block_k": blocks[1]}
    choice = _choices(q, k, v, options)[0]
    assert choice.family in ("wgmma", "mma")
    assert (choice.tiles.block_q, choice.tiles.block_k) == blocks
    o = tileattn.forward(*map(cupy.asarray, (q, k, v)), backend="gpu", **options)
    assert_attention_close(o.get(), _golden(q, k, v, **options)[0], q.dtype)


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("rows,q_in_registers", [(16, True), (32, True), (32, False)])
@pytest.mark.parametrize("options", [TENSOR_CORE_OPTIONS[1], TENSOR_CORE_OPTIONS[-1]],
                         ids=["causal", "every-option"])
def test_every_mma_warp_layout(head_dim, rows, q_in_registers, options):
    """Warps of 16 or 32 query rows, Q fragments kept or re-read, on edge and masked tiles."""
    q, k, v = _inputs((2, 4, 200, head_dim), (2, 2, 263, head_dim), (2, 2, 263, head_dim),
                      np.float16)
    _forward_with(Choice("mma", MmaTiles(128, 64, rows, q_in_registers)), q, k, v, options)


@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (80, 80), (192, 128)], ids=DIM_IDS)
@pytest.mark.parametrize("tiles", [(64, 32, 16), (64, 64, 32), (128, 32, 32), (128, 64, 16),
                                   (128, 16, 16)],
                         ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("options", [TENSOR_CORE_OPTIONS[0], TENSOR_CORE_OPTIONS[1],
                                     TENSOR_CORE_OPTIONS[-1]],
                         ids=["plain", "causal", "every-option"])
def test_every_float32_tensor_core_tile_shape(dims, tiles, options):
    """Every tile shape and warp layout of the float32 forward, on GQA, Nq != Nk and
    sequence ends inside a tile."""
    head_dim, value_dim = dims
    q, k, v = _inputs((2, 4, 200, head_dim), (2, 2, 263, head_dim), (2, 2, 263, value_dim),
                      np.float32)
    tiles = Tf32Tiles(*tiles)
    if not _fits(tiles, tile_tables.Widths.padded(head_dim, value_dim, 8)):
        pytest.skip(f"{tiles} needs more shared memory than this GPU has")
    _forward_with(Choice("tf32", tiles), q, k, v, options)


@hopper_only
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (40, 40), (100, 100), (160, 160),
                                  (192, 128), (256, 256), (128, 64), (24, 200)], ids=DIM_IDS)
@pytest.mark.parametrize("tiles", [(128, 64), (128, 32), (64, 32), (128, 16), (64, 16)],
                         ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("options", [TENSOR_CORE_OPTIONS[0], TENSOR_CORE_OPTIONS[1],
                                     TENSOR_CORE_OPTIONS[-1]],
                         ids=["plain", "causal", "every-option"])
def test_every_float32_wgmma_tile_shape(dims, tiles, options):
    """The float32 forward on wgmma at every tile shape that fits, on GQA, Nq != Nk and
    sequence ends inside a tile, with a long run of key tiles (the raw tile refilled while
    the split ones are read)."""
    head_dim, value_dim = dims
    q, k, v = _inputs((2, 4, 200, head_dim), (2, 2, 663, head_dim), (2, 2, 663, value_dim),
                      np.float32)
    tiles = Tf32WgmmaTiles(*tiles)
    if not _fits(tiles, tile_tables.Widths.padded(head_dim, value_dim, 8)):
        pytest.skip(f"{tiles} needs more shared memory than this GPU has")
    _forward_with(Choice("tf32", tiles), q, k, v, options)


def test_float32_tensor_core_forward_selection():
    q, k, v = _inputs((1, 1, 8, 64), (1, 1, 8, 64), (1, 1, 8, 64), np.float32)
    choice = _choices(q, k, v, {})[0]
    assert choice.family == "tf32"
    assert isinstance(choice.tiles, Tf32WgmmaTiles if _is_hopper() else Tf32Tiles)
    # Named tile sizes take the mma.sync forward (on Hopper too), with its table's warps.
    named = _choices(q, k, v, {"block_q": 64, "block_k": 32})[0]
    warp_rows = tile_tables.TF32_FORWARD[0].tiles.warp_rows
    assert named == Choice("tf32", Tf32Tiles(64, 32, warp_rows), named.note)
    # Tile sizes it is not built for, widths above 384: the CUDA-core kernel; float64 the
    # FP64 tensor cores on sm_90 (the CUDA-core kernel elsewhere).
    assert _choices(q, k, v, {"block_k": 16})[0].family == "generic"
    q64 = q.astype(np.float64)
    assert _choices(q64, q64, q64, {})[0].family == ("f64" if _is_hopper() else "generic")
    wide = np.zeros((1, 1, 8, 400), np.float32)
    assert _choices(wide, wide, wide, {})[0].family == "generic"


def test_float32_tensor_core_non_finite_rows():
    """A NaN query element reaches its row only; a NaN key the rows that keep it."""
    q, k, v = _inputs((1, 2, 150, 64), (1, 2, 150, 64), (1, 2, 150, 64), np.float32)
    q[0, 0, 5, 3] = np.nan
    k[0, 1, 70, 1] = np.nan
    o = tileattn.forward(*map(cupy.asarray, (q, k, v)), causal=True, backend="gpu").get()
    assert np.isnan(o[0, 0, 5]).all() and np.isnan(o[0, 1, 70:]).all()
    finite = np.ones((2, 150), bool)
    finite[0, 5] = False
    finite[1, 70:] = False
    assert np.isfinite(o[0][finite]).all()


@hopper_only
@pytest.mark.parametrize("dtype", _half_dtypes(), ids=lambda d: d.name)
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (80, 80), (40, 40), (256, 256)],
                         ids=DIM_IDS)
@pytest.mark.parametrize("tiles", [(128, 128, 2, 2), (128, 64, 2, 2), (64, 64, 3), (64, 64, 2, 4),
                                   (128, 64, 4), (192, 64, 3), (192, 128, 2), (256, 64, 2),
                                   # the overlapped schedule (OVERLAP)
                                   (64, 64, 3, 2, True), (128, 64, 3, 1, True),
                                   (64, 128, 3, 1, True), (64, 16, 4, 1, True)],
                         ids=lambda t: "x".join(map(str, t[:4])) + ("-overlap" if t[4:] else ""))
@pytest.mark.parametrize("options", [TENSOR_CORE_OPTIONS[0], TENSOR_CORE_OPTIONS[1],
                                     TENSOR_CORE_OPTIONS[2], TENSOR_CORE_OPTIONS[-1]],
                         ids=["plain", "causal", "window", "every-option"])
def test_every_wgmma_tile_shape(dtype, dims, tiles, options):
    """The Hopper forward at every tile shape and stage count it is built for, on GQA,
    Nq != Nk and sequence ends inside a tile; o and lse against the golden model."""
    head_dim, value_dim = dims
    tiles = WgmmaTiles(*tiles)
    widths = tile_tables.Widths.padded(head_dim, value_dim, 16)
    if tiles.threads * tiles.blocks_per_sm >= 512 and widths.widest * tiles.block_k > 8192:
        pytest.skip("128 registers cannot hold wide accumulators beside 128-key scores")
    if tiles.blocks_per_sm >= 2 and widths.widest > 128:
        pytest.skip("two blocks per SM or more leave too few registers for D > 128")
    if tiles.overlap and widths.widest > 128 and tiles.block_k > 16:
        pytest.skip("overlapped tiles above D 128 spill beside more than 16 keys (ptxas), "
                    "which the overlap must not")
    if tiles.overlap and tiles.block_k >= 128 and widths.widest > 64 and options:
        pytest.skip("overlapped 128-key tiles above D 64 spill under masks (ptxas: 12-76 "
                    "bytes at D 80) and take minutes to compile; the tables run them "
                    "unmasked only")
    if not _fits(tiles, widths):
        pytest.skip(f"{tiles} needs more shared memory than this GPU has")
    q, k, v = _inputs((2, 4, 200, head_dim), (2, 2, 263, head_dim), (2, 2, 263, value_dim),
                      dtype)
    _forward_with(Choice("wgmma", tiles), q, k, v, options)


@hopper_only
def test_wgmma_forward_is_the_default_on_hopper():
    limit = shared_memory_limit(cupy.cuda.Device().id)
    for head_dim in (32, 64, 80, 128, 160, 256):
        for n_k in (512, 8192):
            problem = Problem(90, limit, "float16", head_dim, head_dim, n_k)
            assert tile_tables.choose_forward(problem).family == "wgmma"
    # Named tiles: the default's stages, one block per multiprocessor; a tile size the wgmma
    # kernel is not built for selects the mma.sync kernel.
    named = Problem(90, limit, "float16", 64, 64, 8192, block_q=64)
    assert tile_tables.choose_forward(named).tiles == WgmmaTiles(64, 128, 2)
    named = Problem(90, limit, "float16", 64, 64, 8192, block_k=32)
    assert tile_tables.choose_forward(named).family == "mma"


@hopper_only
def test_named_wgmma_tiles_fit_shared_memory():
    """A tile size named by the caller keeps the default's stages only where they fit: at
    D = 128 with ALiBi (three stages) 192 x 128 would need 241 KiB (found by hypothesis:
    CUDA_ERROR_INVALID_VALUE raising the kernel's shared-memory limit)."""
    q, k, v = _inputs((1, 1, 300, 128), (1, 1, 260, 128), (1, 1, 260, 128), np.float16)
    options = {"alibi_slopes": np.array([0.4]), "block_k": 128}
    choice = _choices(q, k, v, options)[0]
    assert choice.family == "wgmma" and choice.tiles.stages == 2
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
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (96, 96), (192, 128), (256, 256)],
                         ids=DIM_IDS)
@pytest.mark.parametrize("tiles", [((128, 64), (128, 64), 2), ((192, 64), (128, 64), 3),
                                   ((64, 128), (64, 128), 2), ((192, 64), (192, 64), 2),
                                   ((128, 32), (128, 32), 2, True), ((128, 64), (128, 64), 2, True),
                                   ((128, 64), (192, 64), 3), ((64, 64), (64, 64), 2),
                                   ((128, 64), (128, 32), 2), ((128, 64), (64, 64), 2)],
                         ids=lambda t: (f"dq{t[0][0]}x{t[0][1]}-dkdv{t[1][0]}x{t[1][1]}-s{t[2]}"
                                        + ("-split" if len(t) > 3 else "")))
@pytest.mark.parametrize("single_pass", [False, True], ids=["two-kernel", "single-pass"])
@pytest.mark.parametrize("options", [TENSOR_CORE_OPTIONS[0], TENSOR_CORE_OPTIONS[1],
                                     TENSOR_CORE_OPTIONS[2], TENSOR_CORE_OPTIONS[-1]],
                         ids=["plain", "causal", "window", "every-option"])
def test_every_wgmma_backward_tile_shape(dtype, dims, tiles, single_pass, options):
    """The Hopper backward (both forms, dK and dV together or apart) at several tile shapes
    and stage counts, on GQA, Nq != Nk and sequence ends inside tiles."""
    head_dim, value_dim = dims
    tiles = WgmmaBackwardTiles(*tiles)
    owned, streamed = tiles.dkdv
    widths = tile_tables.Widths.padded(head_dim, value_dim, 16)
    if single_pass and (tiles.split or streamed != 64 or head_dim != value_dim
                        or head_dim not in (64, owned)):
        pytest.skip("the single pass streams 64 queries and splits dQ over its warpgroups by "
                    "keys (D = 64) or by 64-column blocks, one each (D = owned keys)")
    if not tiles.split and widths.head + widths.value > 256 and streamed > 32:
        pytest.skip("dK and dV together beside more than 32 streamed rows need more "
                    "registers than D + Dv > 256 leave")
    if owned > 128 and widths.widest > 128:
        pytest.skip("three warpgroups leave too few registers for D > 128")
    if not _fits(tiles, widths, "dq", "dkdv"):
        pytest.skip(f"{tiles} needs more shared memory than this GPU has")
    q, k, v = _inputs((2, 4, 200, head_dim), (2, 2, 263, head_dim), (2, 2, 263, value_dim),
                      dtype)
    do = np.random.default_rng(1).standard_normal((2, 4, 200, value_dim)).astype(dtype)
    golden_o, golden_lse = _golden(q, k, v, **options)
    given_o = golden_o.astype(dtype)
    grads = gpu_backward.backward_wgmma(*map(cupy.asarray, (do, q, k, v, given_o)),
                                        cupy.asarray(golden_lse.astype(np.float32)),
                                        _resolved_options(q, k, v, options), tiles,
                                        single_pass=single_pass)
    expected = _golden_grads(do, q, k, v, given_o, golden_lse, **options)
    for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
        assert_attention_close(grad.get(), want, q.dtype, name=name)


@hopper_only
def test_named_backward_tiles_bypass_the_plan_cache(monkeypatch):
    """The plan cache is keyed by the problem: a backward with tiles named by a test or a
    sweep must run those tiles, not a plan the table's choice left for the same problem,
    and must leave none of its own."""
    from tileattn.gpu import operands

    q, k, v = _inputs((1, 2, 200, 64), (1, 2, 200, 64), (1, 2, 200, 64), np.float16)
    do = np.random.default_rng(1).standard_normal(q.shape).astype(np.float16)
    device = [cupy.asarray(a) for a in (do, q, k, v)]
    o, lse = tileattn.forward(*device[1:], backend="gpu", return_lse=True, causal=True)
    tileattn.backward(*device, o, lse, backend="gpu", causal=True)  # the table's plan
    plans = dict(operands._PLANS)
    assert plans, "the table's backward should have left a plan"
    table = _choices(q, k, v, {"causal": True})[1]
    named = WgmmaBackwardTiles((128, 64), (128, 64), 2)
    assert table.family == "wgmma" and table.tiles != named
    found = []
    original = gpu_backward.cached
    monkeypatch.setattr(gpu_backward, "cached",
                        lambda *a: found.append(original(*a)) or found[-1])
    grads = gpu_backward.run(Choice("wgmma", named), *device, o, lse,
                             _resolved_options(q, k, v, {"causal": True}))
    assert all(plan is None for plan in found)  # (named tiles do not even look)
    assert dict(operands._PLANS) == plans
    expected = _golden_grads(do, q, k, v, o.get(), _golden(q, k, v, causal=True)[1],
                             causal=True)
    for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
        assert_attention_close(grad.get(), want, q.dtype, name=name)


@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (80, 80), (256, 256), (192, 128)],
                         ids=DIM_IDS)
@pytest.mark.parametrize("split", [False, True], ids=["dkdv", "dk-dv-apart"])
@pytest.mark.parametrize("options", [TENSOR_CORE_OPTIONS[1], TENSOR_CORE_OPTIONS[-1]],
                         ids=["causal", "every-option"])
def test_mma_two_kernel_backward(dims, split, options):
    """The mma.sync two-kernel backward called directly, dK and dV together or apart."""
    head_dim, value_dim = dims
    q, k, v = _inputs((2, 4, 200, head_dim), (2, 2, 263, head_dim), (2, 2, 263, value_dim),
                      np.float16)
    do = np.random.default_rng(1).standard_normal((2, 4, 200, value_dim)).astype(np.float16)
    tiles = MmaBackwardTiles((64, 32), (64, 32), split=split)
    if not split and head_dim + value_dim > 256:
        pytest.skip("dK and dV together spill beyond D + Dv = 256")
    _backward_with(Choice("mma", tiles), q, k, v, do, options)


@pytest.mark.parametrize(
    "dtype,dims",
    [(np.float32, d) for d in ((40, 40), (192, 192), (256, 256), (200, 196), (192, 128),
                               (64, 128))] + [(np.float16, d) for d in ((40, 40), (256, 256),
                                                                        (192, 128))],
    ids=lambda c: c.__name__ if isinstance(c, type) else DIM_IDS(c))
@pytest.mark.parametrize("tiles", [((64, 16), (64, 16)), ((32, 32), (32, 32))],
                         ids=lambda t: f"dq{t[0][0]}x{t[0][1]}-dkdv{t[1][0]}x{t[1][1]}")
@pytest.mark.parametrize("paired", [("dkdv",), ("dq", "dkdv")],
                         ids=lambda p: "pairs-" + "-".join(p))
@pytest.mark.parametrize("options", [TENSOR_CORE_OPTIONS[1], TENSOR_CORE_OPTIONS[-1]],
                         ids=["causal", "every-option"])
def test_backward_by_warp_pairs(dtype, dims, tiles, paired, options):
    """Kernels of warp pairs (PAIRED_WARPS), called directly: dK/dV's pairs hold dV in one
    warp and dK in the other (S^T handed over in shared memory), dQ's hand S and dS over
    and hold half of dQ's columns each; at D = Dv and D != Dv (a pair's warps then share an
    accumulator tile of the wider width) on GQA, Nq != Nk and sequence ends inside tiles."""
    head_dim, value_dim = dims
    step = 8 if dtype == np.float32 else 16
    widths = tile_tables.Widths.padded(head_dim, value_dim, step)
    tiles = MmaBackwardTiles(*tiles, paired=paired)
    if not _fits(tiles, widths, "dq", "dkdv", element_size=np.dtype(dtype).itemsize):
        pytest.skip(f"{tiles} needs more shared memory than this GPU has")
    q, k, v = _inputs((2, 4, 200, head_dim), (2, 2, 263, head_dim), (2, 2, 263, value_dim),
                      dtype)
    do = np.random.default_rng(1).standard_normal((2, 4, 200, value_dim)).astype(dtype)
    _backward_with(Choice("tf32" if dtype == np.float32 else "mma", tiles), q, k, v, do,
                   options)


@pytest.mark.parametrize("dims", [(64, 64), (96, 96), (128, 128), (80, 80), (160, 160),
                                  (192, 192), (256, 256), (40, 24)], ids=DIM_IDS)
@pytest.mark.parametrize("options", [TENSOR_CORE_OPTIONS[1], TENSOR_CORE_OPTIONS[-1]],
                         ids=["causal", "every-option"])
def test_float32_single_pass_backward(dims, options):
    """float32's single pass: the table's dK/dV kernel adds dQ into float32 sums itself
    (no dQ kernel; on warp pairs at D 192 and 256, and column ranges past the head width
    at D 80, 160 and 40), through the API (MHA: so small a GQA grid takes the two
    kernels) in arrival order (deterministic=False) and in turns (the default: bitwise the
    same twice); then on GQA called directly in turns (ORDERED): bitwise the same twice,
    against the golden model."""
    head_dim, value_dim = dims
    q, k, v = _inputs((2, 4, 200, head_dim), (2, 4, 263, head_dim), (2, 4, 263, value_dim),
                      np.float32, seed=5)
    do = np.random.default_rng(2).standard_normal((2, 4, 200, value_dim)).astype(np.float32)
    _check(q, k, v, do, deterministic=False, **options)
    _check(q, k, v, do, **options)
    device = [cupy.asarray(a) for a in (q, k, v, do)]
    o, lse = tileattn.forward(*device[:3], backend="gpu", return_lse=True, **options)
    for first, again in zip(*(tileattn.backward(device[3], *device[:3], o, lse, backend="gpu",
                                                **options) for _ in range(2))):
        assert cupy.array_equal(first, again)
    q, k, v = _inputs((2, 4, 200, head_dim), (2, 2, 263, head_dim), (2, 2, 263, value_dim),
                      np.float32)
    do = np.random.default_rng(1).standard_normal((2, 4, 200, value_dim)).astype(np.float32)
    _, choice = _choices(q, k, v, options)
    widths = tile_tables.Widths.padded(head_dim, value_dim, 8)
    assert choice.family == "tf32" and choice.tiles.serves_single_pass
    assert (choice.tiles.shared_bytes("dkdv", widths, 4, single_pass=True)
            <= shared_memory_limit(cupy.cuda.Device().id))
    device = [cupy.asarray(a) for a in (do, q, k, v)]
    golden_o, golden_lse = _golden(q, k, v, **options)
    o, lse = cupy.asarray(golden_o.astype(np.float32)), cupy.asarray(golden_lse, np.float32)
    resolved = _resolved_options(q, k, v, {**options, "deterministic": True})
    runs = [gpu_backward.backward_mma(*device, o, lse, resolved, choice.tiles, single_pass=True)
            for _ in range(2)]
    for first, again in zip(*runs):
        assert cupy.array_equal(first, again)
    expected = _golden_grads(do, q, k, v, golden_o.astype(np.float32), golden_lse, **options)
    for name, grad, want in zip(("dq", "dk", "dv"), runs[0], expected):
        assert_attention_close(grad.get(), want, np.float32, name=name)


@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1), (1, 2, 2, 1, 300), (2, 3, 3, 300, 1),
                                   (1, 1, 1, 17, 1000), (1, 2, 2, 260, 130),
                                   (2, 4, 2, 70, 500)],
                         ids=lambda s: "B{}-Hq{}-Hkv{}-Nq{}-Nk{}".format(*s))
@pytest.mark.parametrize("head_dim", [8, 40, 128, 200, 256])
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window": (50, 0)}],
                         ids=["full", "causal", "left-window"])
def test_float32_default_backward_at_edge_shapes(shape, head_dim, options):
    """float32's default backward (the single pass in turns where it serves) at shapes at
    the edges of its tiles: one query or one key, fewer rows than a streamed tile, more
    keys than queries and the reverse (causal rows that keep no key), GQA: against the
    golden model, and bitwise the same twice."""
    batch, n_q_heads, n_kv_heads, n_q, n_k = shape
    q, k, v = _inputs((batch, n_q_heads, n_q, head_dim), (batch, n_kv_heads, n_k, head_dim),
                      (batch, n_kv_heads, n_k, head_dim), np.float32, seed=n_q + n_k)
    do = np.random.default_rng(4).standard_normal(q.shape).astype(np.float32)
    device = [cupy.asarray(a) for a in (q, k, v, do)]
    golden_o, golden_lse = _golden(q, k, v, **options)
    o = cupy.asarray(golden_o.astype(np.float32))
    lse = cupy.asarray(golden_lse.astype(np.float32))
    runs = [tileattn.backward(device[3], *device[:3], o, lse, backend="gpu", **options)
            for _ in range(2)]
    for first, again in zip(*runs):
        assert cupy.array_equal(first, again)
    expected = _golden_grads(do, q, k, v, golden_o.astype(np.float32), golden_lse, **options)
    cancelling = n_k == 1 and not options  # every row keeps the one key: P = 1
    for name, grad, want in zip(("dq", "dk", "dv"), runs[0], expected):
        if cancelling and name == "dk":
            _assert_cancelled_key_gradient(grad.get(), do, q, v)
        else:
            assert_attention_close(grad.get(), want, np.float32, name=name)


def _assert_cancelled_key_gradient(dk, do, q, v):
    """dk of a single key that every row keeps (P = 1) is exactly zero: dS_i = dO_i . v -
    D_i with D_i = dO_i . o_i and o_i = v. A float32 backward takes the difference of two
    sums of size |dO_i| |v|, so each dS_i carries their rounding, and dk = scale sum_i dS_i
    q_i gathers that noise over every row. The result's own size (zero) cannot scale the
    allowance; the terms that cancel can: float32's atol times the root sum of squares over
    the rows of the golden terms scale (dO_i . v) q_i. (dq_i = scale dS_i k sums nothing,
    and its terms are the size assert_attention_close assumes.)"""
    batch, n_q_heads, n_q, head_dim = q.shape
    n_kv_heads = v.shape[1]
    scale = 1.0 / np.sqrt(head_dim)
    values = np.repeat(v[:, :, 0].astype(np.float64), n_q_heads // n_kv_heads, axis=1)
    dp = np.einsum("bhid,bhd->bhi", do.astype(np.float64), values)
    squares = (dp[..., None] * q.astype(np.float64)) ** 2  # a group's heads add into one dk
    squares = squares.reshape(batch, n_kv_heads, -1, head_dim).sum(axis=2)
    terms = scale * np.sqrt(squares)
    allowed = tolerance_for(np.float32).atol * max(1.0, float(terms.max()))
    worst = float(np.abs(dk).max())
    assert worst <= allowed, f"dk: {worst:.3g} where {allowed:.3g} is allowed (exactly 0)"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_float32_turns_over_more_key_blocks_than_the_device_holds(causal):
    """The float32 backward in turns (the default) over one head of 32k keys at D 256: 512
    key blocks of 64, more than the device runs at once, so a turn that waited on a block
    not started yet would hang here. Bitwise the same twice; dk and dv bitwise those of
    the single pass in arrival order (the same walk over the same tiles), dq within
    float32's tolerance of it (only the order of its additions differs)."""
    n, head_dim = 32768, 256
    q, k, v = (cupy.asarray(a) for a in _inputs((1, 1, n, head_dim), (1, 1, n, head_dim),
                                                 (1, 1, n, head_dim), np.float32, seed=9))
    do = cupy.asarray(np.random.default_rng(3).standard_normal(q.shape).astype(np.float32))
    o, lse = tileattn.forward(q, k, v, backend="gpu", return_lse=True, causal=causal)
    problem = problem_of(q, k, v, _resolved_options(q, k, v, {"causal": causal}))
    key_blocks = n // tile_tables.choose_backward(problem).tiles.dkdv[0]
    assert key_blocks > 2 * cupy.cuda.Device().attributes["MultiProcessorCount"]
    runs = [tileattn.backward(do, q, k, v, o, lse, backend="gpu", causal=causal)
            for _ in range(2)]
    for first, again in zip(*runs):
        assert cupy.array_equal(first, again)
    arrival = tileattn.backward(do, q, k, v, o, lse, backend="gpu", causal=causal,
                                deterministic=False)
    assert cupy.array_equal(runs[0][1], arrival[1]) and cupy.array_equal(runs[0][2], arrival[2])
    assert_attention_close(runs[0][0].get(), arrival[0].get(), np.float32, name="dq")


@pytest.mark.parametrize("family", ["default", "mma", "mma-apart", "float32", "float64",
                                    "float64-apart"])
@pytest.mark.parametrize("heads", [(8, 1), (12, 3), (6, 2)], ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("options", [TENSOR_CORE_OPTIONS[1], TENSOR_CORE_OPTIONS[-1]],
                         ids=["causal", "every-option"])
def test_gqa_backward_cut_over_blocks(family, heads, options):
    """A small grid of few K/V heads cuts each GQA group's query heads over blocks
    (GROUP_SPLITS), whose partial dK and dV are added up: the sums are the golden model's,
    in the caller's buffers, from the first call and from the cached launches (float64: on
    sm_90's FP64 tensor cores, the parts in doubles)."""
    n_q_heads, n_kv_heads = heads
    dtype = {"float32": np.float32, "float64": np.float64,
             "float64-apart": np.float64}.get(family, np.float16)
    if dtype == np.float64 and not _is_hopper():
        pytest.skip("float64's tensor-core backward needs an sm_90 GPU")
    head_dim = {"mma-apart": 192, "float64-apart": 128}.get(family, 64)
    q, k, v = _inputs((2, n_q_heads, 256, head_dim), (2, n_kv_heads, 320, head_dim),
                      (2, n_kv_heads, 320, head_dim), dtype, seed=n_q_heads)
    do = np.random.default_rng(3).standard_normal(q.shape).astype(dtype)
    if options.get("alibi_slopes") is not None:
        options = {**options, "alibi_slopes": np.linspace(0.1, 0.4, n_q_heads)}
    group = n_q_heads // n_kv_heads
    assert tile_tables.backward_group_splits(2 * n_kv_heads * 3, group, 132) == group
    if family in ("default", "float64", "float64-apart"):
        if dtype == np.float64:
            assert _choices(q, k, v, options)[1].family == "f64"
        _check(q, k, v, do, **options)
        _check(q, k, v, do, **options)  # the cached launches
        return
    tiles = MmaBackwardTiles((64, 32), (64, 32), split=family == "mma-apart")
    _backward_with(Choice("mma", tiles), q, k, v, do, options)


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


@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (40, 72), (3, 5), (128, 24)],
                         ids=DIM_IDS)
def test_float64_forward_on_fp64_tensor_cores(dims):
    """sm_90 runs float64's forward and backward on its FP64 tensor cores at D, Dv <= 128
    (the generic kernels elsewhere); several query and key tiles, GQA, a key tail, every
    option, "bshd" inputs, at float64's tolerance."""
    head_dim, value_dim = dims
    q, k, v = _inputs((2, 4, 150, head_dim), (2, 2, 170, head_dim), (2, 2, 170, value_dim),
                      np.float64, seed=head_dim)
    do = np.random.default_rng(5).standard_normal((2, 4, 150, value_dim))
    forward, backward = _choices(q, k, v, {"causal": True})
    expected_family = "f64" if _is_hopper() else "generic"
    assert forward.family == expected_family and backward.family == expected_family
    _check(q, k, v, do, causal=True)
    _check(q, k, v, do, window=(40, 9), softcap=5.0, alibi_slopes=np.linspace(0.1, 0.4, 4),
           dropout_p=0.1, seed=3)
    bshd = [cupy.asarray(np.ascontiguousarray(a.swapaxes(1, 2))) for a in (q, k, v)]
    o = tileattn.forward(*bshd, layout="bshd", backend="gpu", scale=3.0)
    expected = tileattn.forward(q, k, v, backend="reference", scale=3.0)
    assert_attention_close(o.get().swapaxes(1, 2), expected, np.float64, name="o")


@hopper_only
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (40, 72), (3, 5), (128, 24)],
                         ids=DIM_IDS)
@pytest.mark.parametrize("options", [
    {"causal": True},
    {"window": (40, 9), "softcap": 5.0, "alibi_slopes": np.linspace(0.1, 0.4, 4),
     "dropout_p": 0.1, "seed": 3}], ids=["causal", "every-option"])
def test_float64_backward_on_fp64_tensor_cores(dims, options):
    """float64's backward on sm_90's FP64 tensor cores (`tiles.F64_BACKWARD`:
    attention_mma_backward.cu with IS_FLOAT64), its table's row run directly: several query
    and key tiles, GQA, a query tail, keys past a tile, at float64's tolerance."""
    head_dim, value_dim = dims
    q, k, v = _inputs((2, 4, 150, head_dim), (2, 2, 170, head_dim), (2, 2, 170, value_dim),
                      np.float64, seed=head_dim + value_dim)
    do = np.random.default_rng(6).standard_normal((2, 4, 150, value_dim))
    row = tile_tables.F64_BACKWARD[0 if max(dims) <= 64 else 1]
    _backward_with(Choice("f64", row.tiles), q, k, v, do, options)


@hopper_only
@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize(("dims", "options"), [
    ((64, 64), {"causal": True}),
    ((128, 96), {"causal": True, "softcap": 8.0, "alibi_slopes": np.array([0.02, 0.05]),
                 "dropout_p": 0.1, "seed": 4}),
    ((40, 40), {"window": (300, 20)})], ids=["D64-causal", "D128-Dv96-options", "D40-window"])
def test_float64_key_shares(dims, options, splits):
    """float64's forward over few query tiles with its keys cut into shares (SPLIT_KEYS:
    double partials merged by split_keys_merge.cu in double), run directly: shares of
    uneven sizes, some past every row's band."""
    head_dim, value_dim = dims
    q, k, v = _inputs((1, 2, 100, head_dim), (1, 2, 1600, head_dim), (1, 2, 1600, value_dim),
                      np.float64, seed=splits)
    row = tile_tables.F64_FORWARD[0 if max(dims) <= 64 else -1]
    _forward_with(Choice("f64", row.tiles, "forced", key_splits=splits), q, k, v, options)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_float64_generic_tiles_per_direction(head_dim):
    """float64's CUDA-core kernels take a tile capacity per direction
    (`GENERIC_CAPACITIES`: on 227 KiB a block, 64 x 32 forward tiles to D 128, 32 x 32 at
    256; backward 32 x 32 two an SM at D 64, 32 x 64 at 128, 16 x 32 at 256); a call of
    several tiles each way, causal and with every option, matches the golden model."""
    q, k, v = _inputs((2, 4, 150, head_dim), (2, 2, 170, head_dim), (2, 2, 170, head_dim),
                      np.float64, seed=head_dim)
    do = np.random.default_rng(7).standard_normal(q.shape)
    options = _resolved_options(q, k, v, {})
    configs = [gpu_forward.GenericConfig.for_problem(np.float64, head_dim, head_dim, options,
                                                     direction)
               for direction in ("forward", "backward")]
    capacities = [(c.capacity.block_q, c.capacity.block_k) for c in configs]
    if shared_memory_limit(cupy.cuda.Device().id) >= 227 * 1024:
        assert capacities == {64: [(64, 32), (32, 32)], 128: [(64, 32), (32, 64)],
                              256: [(32, 32), (16, 32)]}[head_dim]
    _check(q, k, v, do, causal=True)
    _check(q, k, v, do, window=(40, 9), softcap=5.0, alibi_slopes=np.linspace(0.1, 0.4, 4),
           dropout_p=0.1, seed=3)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=lambda d: d.__name__)
@pytest.mark.parametrize("head_dim,value_dim", [(264, 264), (320, 64), (64, 300), (512, 512)])
def test_head_dims_above_256(dtype, head_dim, value_dim):
    """Above 256: mma.sync and 3xTF32 to 384 (the 16-bit forward to 576), the generic
    kernels beyond, whose tiles are wider than a block's 256 threads (each thread keeps
    several columns of every row). float64's backward tiles at widths above 256 outgrow an
    H100's shared memory: a clear error (the README says so)."""
    q, k, v = _inputs((1, 2, 45, head_dim), (1, 1, 77, head_dim), (1, 1, 77, value_dim), dtype)
    do = np.random.default_rng(4).standard_normal((1, 2, 45, value_dim)).astype(dtype)
    pads = [gpu_forward.padded_dim(d) for d in (head_dim, value_dim)]
    needs = max(gpu_forward._generic_shared_bytes(8, *pads, 16, 16).values())
    if dtype is np.float64 and needs > shared_memory_limit(cupy.cuda.Device().id):
        _forward_with(_choices(q, k, v, {"causal": True})[0], q, k, v, {"causal": True})
        device = [cupy.asarray(a) for a in (q, k, v, do)]
        o, lse = tileattn.forward(*device[:3], backend="gpu", return_lse=True)
        with pytest.raises(ValueError, match=r"shared memory.*backend='cpu'"):
            tileattn.backward(device[3], *device[:3], o, lse, backend="gpu")
        return
    _check(q, k, v, do, causal=True)
    _check(q, k, v, do, window=(20, 3), softcap=4.0, alibi_slopes=np.array([0.1, 0.3]),
           dropout_p=0.2, seed=5)


@pytest.mark.parametrize("dims", [(576, 512), (384, 384)], ids=DIM_IDS)
def test_widest_tensor_core_rows(dims):
    """The widest rows: the 16-bit forward on mma.sync at 576/512 (its backward on the
    generic kernels) and every kernel on tensor cores at 384."""
    head_dim, value_dim = dims
    q, k, v = _inputs((1, 4, 70, head_dim), (1, 2, 90, head_dim), (1, 2, 90, value_dim),
                      np.float16)
    do = np.random.default_rng(6).standard_normal((1, 4, 70, value_dim)).astype(np.float16)
    forward, backward = _choices(q, k, v, {"causal": True})
    assert forward.family == "mma"
    assert backward.family == ("mma" if head_dim <= 384 else "generic")
    _check(q, k, v, do, causal=True, softcap=6.0)


def test_head_dim_beyond_shared_memory_names_the_way_out():
    q = cupy.zeros((1, 1, 8, 1024), np.float64)
    with pytest.raises(ValueError, match=r"shared memory.*backend='cpu'"):
        tileattn.forward(q, q, q, backend="gpu")


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
    and strides that start 2 elements into an allocation (not 16-byte aligned, so 16-byte
    cp.async copies cannot read them) must be read with narrower copies, not launched from
    the cache."""
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
    # Tile sizes no tensor-core kernel is built for run the generic kernel, which takes them
    # at run time: the first compiles it, the others reuse it.
    tileattn.forward(q, k, v, backend="gpu", block_q=1, block_k=1)
    compiled = _compile.compiled_count()
    for block_q, block_k in [(3, 7), (16, 5), (4096, 4096)]:
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
