"""The CPU decode forward (`tileattn.cpu.decode`): splits, GQA groups, masks and options
against the float64 golden model, and the dispatch that sends decode shapes to it."""

from __future__ import annotations

import numpy as np
import pytest

numba = pytest.importorskip("numba")

import tileattn  # noqa: E402
from tileattn.options import UNLIMITED, AttentionOptions  # noqa: E402
from tileattn.testing import assert_attention_close, bfloat16  # noqa: E402

cpu = pytest.importorskip("tileattn.cpu")

from tileattn.cpu import decode, threads  # noqa: E402

N_KEYS = 203  # not a multiple of any split size below, nor of the 32-key tiles


def _inputs(batch, n_q_heads, n_kv_heads, n_q, n_k, head_dim=16, value_dim=16,
            dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((batch, n_q_heads, n_q, head_dim), (batch, n_kv_heads, n_k, head_dim),
              (batch, n_kv_heads, n_k, value_dim))
    return tuple(rng.standard_normal(shape).astype(dtype) for shape in shapes)


def _golden(q, k, v, **options):
    q64, k64, v64 = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    return tileattn.forward(q64, k64, v64, backend="reference", return_lse=True, **options)


def _decode(q, k, v, n_splits, *, window_left=UNLIMITED, window_right=UNLIMITED, block_k=32):
    """The decode path itself with `n_splits` forced (float32 arrays)."""
    options = AttentionOptions(window_left=window_left, window_right=window_right,
                               scale=1.0 / np.sqrt(q.shape[-1]), block_k=block_k)
    arrays = tuple(cpu._read_only(x, np.dtype(np.float32)) for x in (q, k, v))
    return decode.forward(*arrays, options, cpu._option_scalars(options, *q.shape[:2]),
                          cpu._kernel_lock, cpu.Sequences(q, k, options), n_splits=n_splits)


MASKS = {"none": ({}, (UNLIMITED, UNLIMITED)),
         "causal": ({"causal": True}, (UNLIMITED, 0)),
         "window": ({"window": (40, 3)}, (40, 3))}


@pytest.mark.parametrize("n_splits", [1, 2, 3, 7])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("n_q", [1, 5, 16, 17, decode.MAX_QUERY_ROWS])
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_every_split_count_matches_the_golden_model(n_splits, heads, n_q, mask):
    q, k, v = _inputs(2, *heads, n_q, N_KEYS, seed=n_q)
    options, (window_left, window_right) = MASKS[mask]
    out, lse = _decode(q, k, v, n_splits, window_left=window_left, window_right=window_right)
    expected_out, expected_lse = _golden(q, k, v, **options)
    assert_attention_close(out, expected_out, np.float32, name="out")
    assert_attention_close(lse, expected_lse, np.float32, name="lse")


@pytest.mark.parametrize("lengths", ["dense", "padded"])
def test_one_split_finishes_its_rows_with_the_bits_of_the_merge(lengths):
    """A call of one key split finishes its rows in the decode kernel, with neither partial
    arrays nor the merge kernel: the same bits as the merge of that split's partial state,
    rows with a NaN, an infinity or no kept key (0 and -inf) and padding rows included."""
    from tileattn.validation import validate

    q, k, v = _inputs(3, 4, 2, 5, 60, seed=9)
    k[0, 0, 50, 1] = np.nan  # reaches the rows of batch 0, kv head 0 that keep key 50
    v[1, 1, 55, :] = v[2, 1, 5, :] = np.inf  # the first kept when dense, the other padded
    # Padded: sequence 1's rows keep no key, and rows past each length are padding.
    varlen = None if lengths == "dense" else {"seqlens_q": np.array([5, 2, 3]),
                                              "seqlens_k": np.array([60, 0, 10])}
    options = validate(q, k, v, causal=True, window=(12, None), scale=None, softcap=None,
                       alibi_slopes=None, dropout_p=0.0, seed=None, block_q=None, block_k=16,
                       deterministic=True, varlen=varlen).options
    arrays = tuple(cpu._read_only(x, np.dtype(np.float32)) for x in (q, k, v))
    shape = cpu.Sequences(q, k, options)
    scalars = cpu._option_scalars(options, len(shape.descriptors), q.shape[1])
    out, lse = decode.forward(*arrays, options, scalars, cpu._kernel_lock, shape, n_splits=1)
    sizing = decode.plan(*arrays, options, shape, n_splits=1)
    partials = (np.zeros((1,) + out.shape, np.float32),
                np.full((1,) + lse.shape, -np.inf, np.float32),
                np.zeros((1,) + lse.shape, np.float32))
    merged = np.zeros_like(out), np.full_like(lse, -np.inf)
    kernels = decode._kernels()
    threads.run(kernels.decode_kernel, 1, *arrays, *partials, *merged, shape.descriptors,
                shape.block_table, shape.page_size, shape.slots_outer, *scalars,
                sizing.block_k, sizing.split_size, 0)
    kernels.merge_kernel(*partials, *merged)
    assert out.tobytes() == merged[0].tobytes() and lse.tobytes() == merged[1].tobytes()
    assert np.isnan(lse).any() and np.isinf(out).any() and np.isfinite(lse).any()
    assert np.isneginf(lse).any() == (lengths == "padded")


@pytest.mark.parametrize("n_splits", [1, 3])
def test_rows_that_keep_no_key_give_zero_and_minus_infinity(n_splits):
    # Causal with Nq > Nk: the first 3 of 8 rows keep nothing (bottom-right alignment).
    q, k, v = _inputs(1, 2, 1, 8, 5)
    out, lse = _decode(q, k, v, n_splits, window_right=0)
    assert np.all(out[:, :, :3] == 0) and np.all(lse[:, :, :3] == -np.inf)
    expected_out, expected_lse = _golden(q, k, v, causal=True)
    assert_attention_close(out, expected_out, np.float32, name="out")
    assert_attention_close(lse, expected_lse, np.float32, name="lse")


@pytest.mark.parametrize("n_q", [4, 17, decode.MAX_QUERY_ROWS])
def test_non_finite_keys_outside_every_rows_window_change_nothing(decode_calls, n_q):
    """NaN and inf in K and V at the three keys before any row's window (in a key tile the
    window cuts, so they are loaded) reach no output: the plain-loop products (up to
    MAX_LOOP_ROWS rows) and the BLAS ones alike leave them out."""
    q, k, v = _inputs(1, 4, 4, n_q, N_KEYS, seed=n_q)
    first = N_KEYS - n_q - 40  # row 0 keeps keys first .. N_KEYS - n_q, row i i more
    assert first % 32 >= 3     # the poisoned keys share the first kept key's tile
    k[:, :, first - 3:first], v[:, :, first - 2], v[:, :, first - 1] = np.nan, np.inf, -np.inf
    options = {"window": (40, 0)}
    out, lse = tileattn.forward(q, k, v, backend="cpu", return_lse=True, block_k=32,
                                **options)
    assert decode_calls == [q.shape]
    expected_out, expected_lse = _golden(q, k, v, **options)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert_attention_close(out, expected_out, np.float32, name="out")
    assert_attention_close(lse, expected_lse, np.float32, name="lse")


@pytest.mark.parametrize("n_k", [0, 1])
def test_an_empty_or_single_key_cache(n_k):
    q, k, v = _inputs(1, 4, 2, 3, n_k)
    out, lse = tileattn.forward(q, k, v, backend="cpu", return_lse=True)
    expected_out, expected_lse = _golden(q, k, v)
    assert_attention_close(out, expected_out, np.float32, name="out")
    assert_attention_close(lse, expected_lse, np.float32, name="lse")


OPTIONS = {
    "softcap": {"softcap": 2.0, "causal": True},
    "alibi": {"alibi_slopes": np.linspace(0.1, 0.8, 4), "causal": True},
    "dropout": {"dropout_p": 0.3, "seed": 11, "window": (60, 2)},
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_options_through_the_dispatch(name):
    q, k, v = _inputs(2, 4, 2, 6, N_KEYS, value_dim=24)
    out, lse = tileattn.forward(q, k, v, backend="cpu", return_lse=True, block_k=32,
                                **OPTIONS[name])
    expected_out, expected_lse = _golden(q, k, v, **OPTIONS[name])
    assert_attention_close(out, expected_out, np.float32, name="out")
    assert_attention_close(lse, expected_lse, np.float32, name="lse")


@pytest.mark.parametrize("dtype", [np.float64, np.float16, bfloat16()], ids=str)
def test_input_dtypes(dtype):
    q, k, v = _inputs(1, 4, 1, 2, N_KEYS, value_dim=8, dtype=dtype)
    out, lse = tileattn.forward(q, k, v, backend="cpu", return_lse=True, causal=True)
    assert out.dtype == dtype
    expected_out, expected_lse = _golden(q, k, v, causal=True)
    assert_attention_close(out, expected_out, dtype, name="out")
    assert_attention_close(lse, expected_lse, dtype, name="lse")


@pytest.fixture
def decode_calls(monkeypatch):
    """The query shapes of the calls that took the decode path."""
    calls = []
    decode_forward = decode.forward

    def recording_forward(*args, **kwargs):
        calls.append(args[0].shape)
        return decode_forward(*args, **kwargs)

    monkeypatch.setattr(decode, "forward", recording_forward)
    return calls


SHORT = decode.SHORT_KEYS


@pytest.mark.parametrize("heads,n_q,n_k,dtype,takes", [
    ((4, 2), 1, SHORT, np.float32, True),
    ((4, 2), decode.MAX_QUERY_ROWS, SHORT + 1, np.float32, True),
    ((4, 2), decode.MAX_QUERY_ROWS + 1, SHORT + 1, np.float32, False),
    # Over short keys, float32 and float64 take the forward kernel from 4 rows (MHA) or
    # 16 (GQA); 16-bit inputs stay on the decode, which reads them as they are.
    ((4, 4), 3, SHORT, np.float32, True),
    ((4, 4), 4, SHORT, np.float32, False),
    ((4, 4), 4, SHORT + 1, np.float32, True),
    ((4, 2), 15, SHORT, np.float32, True),
    ((4, 2), 16, SHORT, np.float32, False),
    ((4, 4), 16, SHORT, np.float64, False),
    ((4, 4), 16, SHORT, np.float16, True),
])
def test_decode_shapes_take_the_decode_path(decode_calls, heads, n_q, n_k, dtype, takes):
    q, k, v = _inputs(1, *heads, n_q, n_k, dtype=dtype)
    out, lse = tileattn.forward(q, k, v, backend="cpu", return_lse=True)
    assert decode_calls == ([q.shape] if takes else [])
    expected_out, expected_lse = _golden(q, k, v)
    assert_attention_close(out, expected_out, dtype, name="out")
    assert_attention_close(lse, expected_lse, dtype, name="lse")


@pytest.mark.parametrize("heads,n_q,n_k,takes", [
    ((8, 2), 64, 512, True),      # GQA, 256 packed rows, 8 keys a row
    ((8, 2), 64, 511, False),     # fewer keys than 8 a row: the forward kernel
    ((8, 1), 129, 8192, False),   # 1032 packed rows: over MAX_GROUP_ROWS
    ((8, 1), 128, 8192, True),
    ((4, 4), 17, 8192, True),     # MHA up to MAX_QUERY_ROWS: the decode path's loops
    ((4, 4), decode.MAX_QUERY_ROWS + 1, 8192, False),  # beyond: the forward kernel
])
def test_gqa_calls_with_more_rows_take_the_decode_path_while_the_group_fits(
        decode_calls, heads, n_q, n_k, takes):
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, heads[0], n_q, 16)).astype(np.float32)
    k, v = (rng.standard_normal((1, heads[1], n_k, 16)).astype(np.float32) for _ in range(2))
    out, lse = tileattn.forward(q, k, v, backend="cpu", return_lse=True, causal=True)
    assert decode_calls == ([q.shape] if takes else [])
    expected_out, expected_lse = _golden(q, k, v, causal=True)
    assert_attention_close(out, expected_out, np.float32, name="out")
    assert_attention_close(lse, expected_lse, np.float32, name="lse")


def test_split_count_fills_the_threads_but_keeps_splits_a_tile_long():
    assert decode.split_count(1, 65536, 512, 2) == 8
    assert decode.split_count(32, 65536, 512, 2) == 1
    assert decode.split_count(1, 700, 512, 16) == 2
    assert decode.split_count(1, 0, 512, 16) == 1


def test_threads_follow_the_cache_bytes_not_only_the_flops():
    """An MHA step does ~0.5 FLOP a byte of K/V: its thread count counts the bytes
    (`decode.BYTE_COST`), so a 33 MB cache takes two threads where its 17 MFLOP alone
    would keep one."""
    q, k, v = (np.zeros((1, 8, n, 128), np.float32) for n in (1, 4096, 4096))
    options = AttentionOptions(scale=0.1)
    arrays = tuple(cpu._read_only(x, np.dtype(np.float32)) for x in (q, k, v))
    sizing = decode.plan(*arrays, options, cpu.Sequences(q, k, options))
    assert 2 * 8 * 4096 * 256 < 2 * threads.FLOPS_PER_THREAD  # one thread by FLOPs
    assert sizing.n_workers == min(2, numba.get_num_threads())


def test_plain_loop_products_count_three_times_for_the_threads():
    """Packed rows few enough for the kernel's plain-loop products run at about a third of
    the rate `threads.FLOPS_PER_THREAD` assumes (`decode.LOOP_FLOP_COST`): MQA 8/1 over 8192
    keys (33 MFLOP, one thread by FLOPs) takes three threads where the machine has them."""
    q, k, v = (np.zeros((1, h, n, 128), np.float32) for h, n in ((8, 1), (1, 8192), (1, 8192)))
    options = AttentionOptions(scale=0.1)
    arrays = tuple(cpu._read_only(x, np.dtype(np.float32)) for x in (q, k, v))
    sizing = decode.plan(*arrays, options, cpu.Sequences(q, k, options))
    flops = 2 * 8 * 8192 * 256
    assert flops < 2 * threads.FLOPS_PER_THREAD
    assert 3 * threads.FLOPS_PER_THREAD <= decode.LOOP_FLOP_COST * flops
    assert decode.BYTE_COST * 8192 * 256 * 4 < 2 * threads.FLOPS_PER_THREAD
    assert sizing.n_workers == min(3, numba.get_num_threads())
