"""Split-KV in the tensor-core forwards (tiles.forward_key_splits, SPLIT_KEYS in the
kernels, split_keys_merge.cu): a dense grid of few query tiles cuts each tile's keys into
shares whose partial (o, lse) are merged by log-sum-exp. The rule is tested anywhere; the
kernels against the float64 golden model on a GPU, with the shares forced and as chosen."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tileattn
from tileattn import backends
from tileattn.gpu import tiles
from tileattn.gpu.tiles import (Choice, DecodeShape, MmaTiles, Tf32Tiles, WgmmaTiles,
                                forward_key_splits, with_key_splits)
from tileattn.testing import assert_attention_close, bfloat16
from tileattn.validation import validate

GPU_MISSING = backends.availability("gpu")

if GPU_MISSING is None:
    import cupy

    from tileattn.gpu import describe, launch_forward
    from tileattn.gpu.operands import problem_of


def _shape(query_heads: int, n_q: int, band_keys: int, sm_count: int = 132) -> DecodeShape:
    return DecodeShape(n_q=n_q, group=1, batch_kv_heads=query_heads,
                       batch_q_heads=query_heads, band_keys=band_keys, sm_count=sm_count)


WGMMA = Choice("wgmma", WgmmaTiles(128, 64, 2, 2), "a row")


# ----------------------------------------------------------------------------- the rule


def test_a_grid_of_a_wave_or_more_stays_whole():
    # 16 heads x 32 query tiles of 128 rows: 512 blocks, about two waves of 264.
    assert forward_key_splits(WGMMA, _shape(16, 4096, 4096)) == (1, None)
    assert with_key_splits(WGMMA, _shape(16, 4096, 4096)) is WGMMA


def test_few_query_tiles_over_many_keys_are_split_into_full_waves():
    # 64 heads of 100 queries: 64 one-tile blocks of 264 resident.
    splits, why = forward_key_splits(WGMMA, _shape(64, 100, 8192))
    assert splits == 4  # 256 blocks: the first count whose wave is about as full as the best
    assert "64 query tiles" in why and "264 resident" in why
    choice = with_key_splits(WGMMA, _shape(64, 100, 8192))
    assert choice.key_splits == 4 and choice.tiles == WGMMA.tiles
    assert choice.note.startswith("a row; keys cut into 4 shares")


def test_shares_keep_at_least_the_minimum_keys():
    # One head of 64 queries: many shares would fill the GPU, but the keys allow only two.
    keys = 2 * tiles.FORWARD_SPLIT_MIN_KEYS + 100
    assert forward_key_splits(WGMMA, _shape(1, 64, keys))[0] == 2
    assert forward_key_splits(WGMMA, _shape(1, 64, tiles.FORWARD_SPLIT_MIN_KEYS + 1))[0] == 1
    most = forward_key_splits(WGMMA, _shape(1, 64, 10**7))[0]  # near the cap
    assert tiles.FORWARD_SPLIT_EFFICIENCY * tiles.FORWARD_MAX_SPLITS <= most
    assert most <= tiles.FORWARD_MAX_SPLITS


def test_mma_and_tf32_tiles_count_one_block_an_sm_and_others_never_split():
    mma = Choice("mma", MmaTiles(128, 64, 32, True))
    tf32 = Choice("tf32", Tf32Tiles(128, 64, 32))
    # 33 blocks of 132 resident: four shares fill one wave.
    assert forward_key_splits(mma, _shape(33, 128, 8192))[0] == 4
    assert forward_key_splits(tf32, _shape(33, 128, 8192))[0] == 4
    for family in ("generic", "decode"):
        assert forward_key_splits(Choice(family, None), _shape(1, 64, 10**6)) == (1, None)


@given(blocks=st.integers(1, 2000), resident=st.integers(1, 1056),
       band_keys=st.integers(0, 10**6), block_k=st.sampled_from([16, 32, 64, 128, 256]))
def test_key_shares_fill_waves_within_their_limits(blocks, resident, band_keys, block_k):
    """Whatever the grid: 1 share where it fills most of a wave or the keys are too few
    for two; else at most FORWARD_MAX_SPLITS shares of at least FORWARD_SPLIT_MIN_KEYS keys
    (and a key tile) each, the fewest whose wave is about as full as any allowed count's."""
    shares = tiles.key_shares(blocks, resident, band_keys, block_k)
    assert 1 <= shares <= tiles.FORWARD_MAX_SPLITS
    if blocks >= tiles.FORWARD_SPLIT_BELOW_WAVES * resident:
        assert shares == 1
    if shares > 1:
        assert band_keys // shares >= tiles.FORWARD_SPLIT_MIN_KEYS
        assert -(-band_keys // block_k) >= shares

    def fullness(count):
        waves = blocks * count / resident
        return waves / -(-waves // 1)

    allowed = range(1, min(tiles.FORWARD_MAX_SPLITS, band_keys // tiles.FORWARD_SPLIT_MIN_KEYS,
                           -(-band_keys // block_k)) + 1)
    if shares > 1:
        best = max(fullness(count) for count in allowed)
        assert fullness(shares) >= tiles.FORWARD_SPLIT_EFFICIENCY * best
        assert all(fullness(count) < tiles.FORWARD_SPLIT_EFFICIENCY * best
                   for count in range(1, shares))


# ----------------------------------------------------------------------------- the kernels


def _inputs(shape_q, shape_k, shape_v, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s).astype(dtype) for s in (shape_q, shape_k, shape_v))


def _resolved(q, k, v, options):
    defaults = dict(causal=False, window=None, scale=None, softcap=None, alibi_slopes=None,
                    dropout_p=0.0, seed=None, block_q=None, block_k=None, deterministic=True)
    return validate(q, k, v, **{**defaults, **options}).options


def _golden(q, k, v, **options):
    as64 = [a.astype(np.float64) for a in (q, k, v)]
    return tileattn.forward(*as64, backend="reference", return_lse=True, **options)


def _dtypes_of(family):
    if family == "tf32":
        return [np.dtype(np.float32)]
    if family == "f64":
        return [np.dtype(np.float64)]
    return [np.dtype(np.float16)] + ([bfloat16()] if bfloat16() is not None else [])


def _table_choice(family, q, k, v, options, backward=False):
    """The family's table row for this problem (forward, or with `backward` the backward),
    the grid unknown (no splits): wgmma's and float64's (FP64 tensor cores) on an sm_90
    GPU, the mma.sync and 3xTF32 rows whatever the device."""
    problem = problem_of(*map(cupy.asarray, (q, k, v)), _resolved(q, k, v, options))
    if family in ("wgmma", "f64"):
        if cupy.cuda.Device().compute_capability != "90":
            pytest.skip(f"the {family} kernels need an sm_90 GPU")
        choice = (tiles.choose_backward if backward else tiles.choose_forward)(problem)
    else:
        table = {("mma", False): tiles.MMA_FORWARD, ("tf32", False): tiles.TF32_FORWARD,
                 ("mma", True): tiles.MMA_BACKWARD, ("tf32", True): tiles.TF32_BACKWARD}
        widths = tiles.Widths.of(problem, 8 if family == "tf32" else 16)
        row = next(r for r in table[family, backward] if r.when.matches(problem, widths))
        choice = Choice(family, row.tiles, row.note)
    assert choice.family == family
    return choice


OPTIONS = [
    {},
    {"causal": True},
    {"window": (37, 5)},  # most shares of a tile keep no key: o = 0, lse = -inf to merge
    {"causal": True, "window": (300, None), "softcap": 3.0},
    {"alibi_slopes": np.linspace(0.05, 0.5, 4), "scale": 0.3},
    {"dropout_p": 0.3, "seed": 11, "causal": True},
]


def forced_cases(test):
    """On a GPU, for every family, option set, share count (2, or 5: more than some tiles
    have key tiles) and shape."""
    shapes = [
        (100, 1000, 64, 64, 4),  # a partial query tile, GQA 4/4
        (70, 777, 128, 96, 2),  # Dv != D, GQA 4/2, keys not a multiple of any tile
        (200, 130, 40, 40, 1),  # more queries than keys (bottom-right: the first rows keep none)
    ]
    for mark in (pytest.mark.parametrize(("n_q", "n_k", "head_dim", "value_dim", "kv_heads"),
                                         shapes),
                 pytest.mark.parametrize("splits", [2, 5]),
                 pytest.mark.parametrize("options", OPTIONS,
                                         ids=lambda o: "-".join(sorted(o)) or "plain"),
                 pytest.mark.parametrize("family", ["wgmma", "mma", "tf32", "f64"]),
                 pytest.mark.skipif(GPU_MISSING is not None, reason=str(GPU_MISSING)),
                 pytest.mark.gpu):
        test = mark(test)
    return test


@forced_cases
def test_forced_shares_match_the_golden_model(family, options, splits, n_q, n_k, head_dim,
                                              value_dim, kv_heads):
    for dtype in _dtypes_of(family):
        q, k, v = _inputs((2, 4, n_q, head_dim), (2, kv_heads, n_k, head_dim),
                          (2, kv_heads, n_k, value_dim), dtype, seed=n_q + splits)
        choice = _table_choice(family, q, k, v, options)
        forced = Choice(family, choice.tiles, choice.note, key_splits=splits)
        o, lse = launch_forward.run(forced, *map(cupy.asarray, (q, k, v)),
                                    _resolved(q, k, v, options))
        golden_o, golden_lse = _golden(q, k, v, **options)
        assert_attention_close(o.get(), golden_o, dtype, name="o")
        assert_attention_close(lse.get(), golden_lse, _lse_dtype(dtype), name="lse")


def _lse_dtype(dtype):
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


@pytest.mark.gpu
@pytest.mark.skipif(GPU_MISSING is not None, reason=str(GPU_MISSING))
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_the_public_forward_splits_a_small_grid_and_repeats_from_its_plan(dtype):
    """One head of 96 queries over 4096 keys fills a few SMs: the chosen forward splits its
    keys, writes the caller's buffers, leaves the inputs alone and repeats (the cached
    plan, a packed launch) with the same result; NaN at a masked key reaches no row."""
    q, k, v = _inputs((1, 2, 96, 64), (1, 2, 4096, 64), (1, 2, 4096, 64), dtype, seed=3)
    k[:, :, -1] = np.nan  # causal bottom-right: only the last query row keeps the last key
    options = {"causal": True}
    device = [cupy.asarray(a) for a in (q, k, v)]
    kept = [a.copy() for a in device]
    choice = launch_forward.choose(*device, _resolved(q, k, v, options))
    assert choice.key_splits > 1, choice
    golden_o, golden_lse = _golden(q, k, v, **options)
    out = cupy.full((1, 2, 96, 64), cupy.nan, dtype=dtype)
    lse_out = cupy.full((1, 2, 96), cupy.nan, dtype=np.float32)
    for _ in range(3):
        o, lse = tileattn.forward(*device, backend="gpu", return_lse=True, out=out,
                                  lse_out=lse_out, **options)
        assert o is out and lse is lse_out
        assert np.isnan(o.get()[:, :, -1]).all() and np.isnan(lse.get()[:, :, -1]).all()
        assert_attention_close(o.get()[:, :, :-1], golden_o[:, :, :-1], dtype, name="o")
        assert_attention_close(lse.get()[:, :, :-1], golden_lse[:, :, :-1], np.float32,
                               name="lse")
    for before, after in zip(kept, device):
        assert cupy.array_equal(before, after, equal_nan=True)
    line = describe(4096, 64, 64, np.dtype(dtype).name, _resolved(q, k, v, options), n_q=96,
                    heads=2)["forward"]
    assert "keys cut into" in line


def _golden_grads(do, q, k, v, o, lse, **options):
    as64 = [np.asarray(a).astype(np.float64) for a in (do, q, k, v, o)]
    return tileattn.backward(*as64, lse, backend="reference", **options)


@forced_cases
def test_forced_dq_shares_match_the_golden_model(family, options, splits, n_q, n_k,
                                                 head_dim, value_dim, kv_heads):
    """The dQ kernel over forced key shares (dK and dV as ever) against the golden
    gradients of the golden o."""
    from tileattn.gpu import launch_backward

    for dtype in _dtypes_of(family):
        q, k, v = _inputs((2, 4, n_q, head_dim), (2, kv_heads, n_k, head_dim),
                          (2, kv_heads, n_k, value_dim), dtype, seed=n_k + splits)
        do = np.random.default_rng(1).standard_normal((2, 4, n_q, value_dim)).astype(dtype)
        golden_o, golden_lse = _golden(q, k, v, **options)
        given_o = golden_o.astype(dtype)
        choice = _table_choice(family, q, k, v, options, backward=True)
        forced = Choice(family, choice.tiles, choice.note, key_splits=splits)
        grads = launch_backward.run(forced, *map(cupy.asarray, (do, q, k, v, given_o)),
                                    cupy.asarray(golden_lse.astype(_lse_dtype(dtype))),
                                    _resolved(q, k, v, options))
        expected = _golden_grads(do, q, k, v, given_o, golden_lse, **options)
        for name, grad, want in zip(("dq", "dk", "dv"), grads, expected):
            assert_attention_close(grad.get(), want, dtype, name=name)


@pytest.mark.gpu
@pytest.mark.skipif(GPU_MISSING is not None, reason=str(GPU_MISSING))
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_the_public_backward_splits_a_small_dq_grid_deterministically(dtype):
    """Two heads of 96 queries over 4096 keys: the dQ kernel's keys are cut into shares
    (info says so; float32 runs the single pass there, which has no dQ kernel; float64's,
    on sm_90's FP64 tensor cores, into double parts), the gradients match the golden
    model, and a repeated call (the cached plan) gives the same bits."""
    if np.dtype(dtype) == np.float64 and cupy.cuda.Device().compute_capability != "90":
        pytest.skip("float64's tensor-core backward needs an sm_90 GPU")
    q, k, v = _inputs((1, 2, 96, 64), (1, 2, 4096, 64), (1, 2, 4096, 64), dtype, seed=4)
    do = np.random.default_rng(2).standard_normal((1, 2, 96, 64)).astype(dtype)
    options = {"causal": True}
    line = describe(4096, 64, 64, np.dtype(dtype).name, _resolved(q, k, v, options), n_q=96,
                    heads=2)["backward"]
    if np.dtype(dtype) == np.float32:
        assert "SINGLE_PASS" in line and "dQ: keys cut into" not in line
    else:
        assert "dQ: keys cut into" in line
    device = [cupy.asarray(a) for a in (do, q, k, v)]
    o, lse = tileattn.forward(*device[1:], backend="gpu", return_lse=True, **options)
    first = tileattn.backward(*device, o, lse, backend="gpu", **options)
    again = tileattn.backward(*device, o, lse, backend="gpu", **options)
    golden_lse = _golden(q, k, v, **options)[1]
    expected = _golden_grads(do, q, k, v, o.get(), golden_lse, **options)
    for name, grad, repeat, want in zip(("dq", "dk", "dv"), first, again, expected):
        assert_attention_close(grad.get(), want, np.dtype(dtype), name=name)
        assert cupy.array_equal(grad, repeat)


def _paged_pools(k, v, lengths, page_size, rng):
    """k's and v's rows of each sequence in shuffled pages of NaN-filled pools
    ``(pages, heads, page, dim)``, and the block table (padded with -1)."""
    used = [-(-n // page_size) for n in lengths]
    order = rng.permutation(sum(used) + 2)
    table = np.full((len(lengths), max(used) + 1), -1, np.int32)
    pools = [np.full((len(order), a.shape[1], page_size, a.shape[3]), np.nan, a.dtype)
             for a in (k, v)]
    start = 0
    for b, n in enumerate(lengths):
        table[b, :used[b]] = order[start:start + used[b]]
        start += used[b]
        j = np.arange(n)
        for pool, array in zip(pools, (k, v)):
            pool[table[b, j // page_size], :, j % page_size] = np.swapaxes(array[b, :, :n], 0, 1)
    return pools, table


@pytest.mark.gpu
@pytest.mark.skipif(GPU_MISSING is not None, reason=str(GPU_MISSING))
@pytest.mark.parametrize("family", ["padded", "packed", "paged", "unchecked"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_variable_length_chunks_split_their_keys(family, dtype, monkeypatch):
    """A chunk of queries of two sequences over long caches (few query tiles: four blocks)
    cuts its keys into shares in every variable-length family; what lies past a
    sequence's keys (NaN) or in pages the table does not name reaches nothing, and rows of
    no sequence come out as o = 0, lse = -inf."""
    chosen, rule = [], launch_forward.key_shares
    monkeypatch.setattr(launch_forward, "key_shares",
                        lambda *arguments: chosen.append(rule(*arguments)) or chosen[-1])
    rng = np.random.default_rng(7)
    lengths_q, lengths_k = np.array([90, 50]), np.array([3000, 1700])
    q = rng.standard_normal((2, 2, 96, 64)).astype(dtype)
    k, v = (rng.standard_normal((2, 2, 3072, 64)).astype(dtype) for _ in range(2))
    for b, n in enumerate(lengths_k):
        k[b, :, n:] = v[b, :, n:] = np.nan
    options = {"causal": True}
    if family == "packed":
        cu_q, cu_k = np.array([0, 90, 140]), np.array([0, 3000, 4700])
        packed = [np.concatenate([a[b, :, :n] for b, n in enumerate(lengths)], axis=1)
                  for a, lengths in ((q, lengths_q), (k, lengths_k), (v, lengths_k))]
        arrays, keywords = packed, {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    elif family == "paged":
        (k_pool, v_pool), table = _paged_pools(k, v, lengths_k, 64, rng)
        arrays = [q, k_pool, v_pool]
        keywords = {"block_table": table, "seqlens_k": lengths_k, "seqlens_q": lengths_q}
    else:
        arrays = [q, k, v]
        keywords = {"seqlens_q": lengths_q, "seqlens_k": lengths_k}
    golden_o, golden_lse = tileattn.forward(*[a.astype(np.float64) for a in arrays],
                                            backend="reference", return_lse=True,
                                            **keywords, **options)
    device = [cupy.asarray(a) for a in arrays]
    if family == "unchecked":
        keywords = {name: cupy.asarray(a) for name, a in keywords.items()}
        keywords["check_lengths"] = False
    o, lse = tileattn.forward(*device, backend="gpu", return_lse=True, **keywords, **options)
    assert chosen and max(chosen) > 1, chosen
    assert_attention_close(o.get(), golden_o, np.dtype(dtype), name="o")
    assert_attention_close(lse.get(), golden_lse, np.float32, name="lse")
    if family != "packed":
        assert (o.get()[1, :, 50:] == 0).all() and (lse.get()[1, :, 50:] == -np.inf).all()
