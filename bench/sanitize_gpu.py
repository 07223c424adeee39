"""A small, representative workload for compute-sanitizer: every kernel of the GPU backend.

    compute-sanitizer --tool memcheck  python3 bench/sanitize_gpu.py [--decode-only | --varlen-only
                                                | --redo-only | --split-only | --float32-only]
    compute-sanitizer --tool racecheck python3 bench/sanitize_gpu.py [--decode-only | --varlen-only
                                                | --redo-only | --split-only | --float32-only]

`--float32-only`: the dense float32 cases alone (3xTF32 forwards and the default backward,
the single pass in turns where it serves).

Sizes are small (the sanitizer slows kernels down a hundredfold) but ragged, so every
kernel sees partial tiles, fully masked rows, GQA and each option switch. Each case is also
checked against the float64 golden model, so a clean run is a correct one too.
"""

from __future__ import annotations

import sys

import cupy
import numpy as np

import tileattn
from tileattn.gpu import launch_backward, launch_forward, tiles
from tileattn.gpu.launch_decode import decode_shape, forward_decode
from tileattn.gpu.operands import problem_of
from tileattn.testing import assert_attention_close, bfloat16
from tileattn.validation import validate

CASES = [
    # (dtype, (B, Hq, Hkv, Nq, Nk, D, Dv), options)
    ("float16", (1, 4, 2, 70, 150, 64, 64),
     dict(causal=True, window=(40, None), dropout_p=0.2, seed=11)),
    ("float16", (1, 2, 1, 130, 90, 128, 128),
     dict(softcap=4.0, alibi_slopes=np.array([0.2, 0.3]), window=(30, 10))),
    ("float16", (1, 2, 2, 40, 40, 64, 64), dict(block_q=64, block_k=32)),
    # the single-pass backward (dQ by atomics), with GQA and a ragged last tile
    ("float16", (1, 4, 2, 70, 150, 64, 64),
     dict(causal=True, dropout_p=0.2, seed=5, deterministic=False)),
    ("float16", (1, 2, 1, 130, 90, 128, 128), dict(softcap=4.0, deterministic=False)),
    ("float32", (2, 4, 2, 70, 150, 64, 64),
     dict(causal=True, window=(40, None), dropout_p=0.2, seed=11)),
    ("float32", (1, 2, 1, 130, 90, 128, 128), dict(softcap=4.0, window=(30, 10))),
    ("float32", (1, 2, 1, 33, 47, 96, 40),
     dict(softcap=4.0, alibi_slopes=np.array([0.2, 0.3]), block_q=7, block_k=13)),
    ("float64", (1, 2, 2, 20, 25, 256, 256), dict(causal=True)),
    # head dims padded in shared memory, Dv != D, dK and dV in two kernels, narrow copies
    ("float16", (1, 4, 2, 70, 150, 80, 80), dict(causal=True, dropout_p=0.2, seed=3)),
    ("bfloat16", (1, 2, 1, 130, 90, 40, 40), dict(window=(30, 10), softcap=4.0)),
    ("float16", (1, 2, 2, 70, 100, 192, 128), dict(causal=True)),
    ("float16", (1, 2, 1, 70, 100, 256, 256), dict(alibi_slopes=np.array([0.2, 0.3]))),
    ("float16", (1, 2, 2, 50, 77, 100, 100), dict(causal=True)),
    ("float16", (1, 2, 2, 50, 77, 33, 33), dict(window=(20, 5))),
    ("float32", (1, 2, 1, 70, 100, 160, 160), dict(causal=True, softcap=3.0)),
    ("float32", (1, 2, 2, 50, 77, 36, 100), dict(window=(30, 10))),
    # float32 MHA (no GQA group to cut): the single pass, its dQ in turns by default and in
    # arrival order with deterministic=False
    ("float32", (1, 2, 2, 70, 150, 64, 64), dict(causal=True, dropout_p=0.2, seed=7)),
    ("float32", (2, 2, 2, 100, 90, 128, 128), dict(window=(30, 10), softcap=3.0)),
    ("float32", (1, 2, 2, 100, 90, 128, 128), dict(causal=True, deterministic=False)),
    # warp pairs at D 192 and 256, in turns (the default)
    ("float32", (1, 2, 2, 60, 90, 192, 192), {}),
    ("float32", (1, 2, 2, 70, 100, 256, 256), dict(causal=True)),
]

MMA_LAYOUTS = [tiles.MmaTiles(128, 64, 32, False), tiles.MmaTiles(128, 64, 32, True)]


def main() -> int:
    # Without CuPy's pool every array is its own cudaMalloc, so memcheck sees a read past
    # the end of an array instead of landing silently in a neighbouring pool block.
    cupy.cuda.set_allocator(None)
    rng = np.random.default_rng(0)
    if "--decode-only" in sys.argv[1:]:
        return decode_cases(rng)
    if "--varlen-only" in sys.argv[1:]:
        return varlen_cases(rng)
    if "--redo-only" in sys.argv[1:]:
        return redo_cases(rng)
    if "--split-only" in sys.argv[1:]:
        return split_cases(rng)
    float32_only = "--float32-only" in sys.argv[1:]
    for dtype, (batch, hq, hkv, nq, nk, d, dv), options in CASES:
        if float32_only and dtype != "float32":
            continue
        options = dict(options)
        deterministic = options.pop("deterministic", True)
        dtype = bfloat16() if dtype == "bfloat16" else np.dtype(dtype)
        q = rng.standard_normal((batch, hq, nq, d)).astype(dtype)
        k = rng.standard_normal((batch, hkv, nk, d)).astype(dtype)
        v = rng.standard_normal((batch, hkv, nk, dv)).astype(dtype)
        do = rng.standard_normal((batch, hq, nq, dv)).astype(dtype)
        dq_, dk_, dv_ = (cupy.asarray(a) for a in (q, k, v))
        o, lse = tileattn.forward(dq_, dk_, dv_, backend="gpu", return_lse=True, **options)
        grads = tileattn.backward(cupy.asarray(do), dq_, dk_, dv_, o, lse, backend="gpu",
                                  deterministic=deterministic, **options)
        cupy.cuda.Device().synchronize()
        golden_o, golden_lse = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                                backend="reference", return_lse=True, **options)
        golden = _golden_grads(do, q, k, v, o, golden_lse, **options)
        assert_attention_close(o.get(), golden_o, q.dtype, name="o")
        for name, grad, want in zip(("dq", "dk", "dv"), grads, golden):
            assert_attention_close(grad.get(), want, q.dtype, name=name)
        problem = problem_of(dq_, dk_, dv_, _resolved(q, k, v, options))
        forward, backward = tiles.choose_forward(problem), tiles.choose_backward(problem)
        print(f"ok {dtype} {(batch, hq, hkv, nq, nk, d, dv)} {sorted(options)} "
              f"forward={forward.family} {forward.tiles} backward={backward.family} "
              f"{backward.tiles}{'' if deterministic else ' (deterministic=False)'}")
    if float32_only:
        return float32_non_finite_values(rng)
    for dtype in ("float16", "float32"):  # D from rows the vector kernel cannot read
        q, k, v, do = (rng.standard_normal((1, 2, 70, 64)).astype(dtype) for _ in range(4))
        device = [cupy.asarray(a) for a in (q, k, v)]
        o, lse = tileattn.forward(*device, backend="gpu", return_lse=True, causal=True)
        padded = cupy.zeros(do.shape[:-1] + (65,), dtype=dtype)  # rows 65 elements apart
        padded[..., 1:] = cupy.asarray(do)
        grads = tileattn.backward(padded[..., 1:], *device, o, lse, backend="gpu", causal=True)
        golden = _golden_grads(do, q, k, v, o, lse, causal=True)
        for name, grad, want in zip(("dq", "dk", "dv"), grads, golden):
            assert_attention_close(grad.get(), want, q.dtype, name=name)
        print(f"ok {dtype} backward with a strided dO (D by one warp per row)")
    for layout in MMA_LAYOUTS:  # the mma.sync forward's layouts that no default uses
        q, k, v = (rng.standard_normal((1, 2, n, 128)).astype(np.float16) for n in (70, 150, 150))
        options = dict(causal=True, softcap=4.0, dropout_p=0.2, seed=3)
        o, _ = launch_forward.run(tiles.Choice("mma", layout), *map(cupy.asarray, (q, k, v)),
                                  _resolved(q, k, v, options))
        golden_o, _ = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                       backend="reference", return_lse=True, **options)
        assert_attention_close(o.get(), golden_o, q.dtype, name="o")
        print(f"ok float16 D=128 mma.sync forward, warps of {layout.warp_rows} rows, "
              f"Q in registers: {layout.q_in_registers}")
    for options in ({}, {"causal": True}):  # the single pass taking turns (deterministic)
        q, k, v, do = (rng.standard_normal((1, 4, n, 64)).astype(np.float16)
                       for n in (130, 200, 200, 130))
        k, v = k[:, :2], v[:, :2]
        device = [cupy.asarray(a) for a in (do, q, k, v)]
        o, lse = tileattn.forward(*device[1:], backend="gpu", return_lse=True, **options)
        grads = launch_backward.backward_mma(*device, o, lse, _resolved(q, k, v, options),
                                             SINGLE_PASS_TILES["mma"][64], single_pass=True)
        golden = _golden_grads(do, q, k, v, o, lse, **options)
        for name, grad, want in zip(("dq", "dk", "dv"), grads, golden):
            assert_attention_close(grad.get(), want, q.dtype, name=name)
        print(f"ok float16 D=64 ordered single-pass backward {sorted(options)}")
    for head_dim in (64, 128):  # single passes that no default takes on Hopper
        q, k, v, do = (rng.standard_normal((1, 4, n, head_dim)).astype(np.float16)
                       for n in (130, 200, 200, 130))
        k, v = k[:, :2], v[:, :2]
        options = dict(causal=True, dropout_p=0.2, seed=9)
        device = [cupy.asarray(a) for a in (do, q, k, v)]
        o, lse = tileattn.forward(*device[1:], backend="gpu", return_lse=True, **options)
        resolved = _resolved(q, k, v, {**options, "deterministic": False})
        backwards = {"mma.sync": launch_backward.backward_mma}
        if cupy.cuda.Device().compute_capability == "90":
            backwards["wgmma"] = launch_backward.backward_wgmma
        golden = _golden_grads(do, q, k, v, o, lse, **options)
        for name, backward in backwards.items():
            family = "wgmma" if name == "wgmma" else "mma"
            grads = backward(*device, o, lse, resolved, SINGLE_PASS_TILES[family][head_dim],
                             single_pass=True)
            for grad_name, grad, want in zip(("dq", "dk", "dv"), grads, golden):
                assert_attention_close(grad.get(), want, q.dtype, name=grad_name)
            print(f"ok float16 D={head_dim} {name} single-pass backward (dQ added in arrival order)")
    decode_cases(rng)
    redo_cases(rng)
    split_cases(rng)
    return varlen_cases(rng)


def split_cases(rng) -> int:
    """Split-KV prefill (SPLIT_KEYS) with forced shares, more than some tiles have key tiles
    (empty shares): the forward and the dQ kernel of each tensor-core family, and a paged
    forward whose rule is forced to cut (partials of rows no sequence owns)."""
    for dtype, family in (("float16", "wgmma"), ("float16", "mma"), ("float32", "tf32")):
        if family == "wgmma" and cupy.cuda.Device().compute_capability != "90":
            continue
        q, do = (rng.standard_normal((1, 4, 70, 64)).astype(dtype) for _ in range(2))
        k, v = (rng.standard_normal((1, 2, 300, 64)).astype(dtype) for _ in range(2))
        options = dict(causal=True, window=(200, None), softcap=4.0)
        resolved = _resolved(q, k, v, options)
        device = [cupy.asarray(a) for a in (do, q, k, v)]
        problem = problem_of(*device[1:], resolved)
        forward, backward = tiles.choose_forward(problem), tiles.choose_backward(problem)
        if family != "wgmma":  # the family's first table row for these dims
            table = (tiles.MMA_FORWARD, tiles.MMA_BACKWARD) if family == "mma" else (
                tiles.TF32_FORWARD, tiles.TF32_BACKWARD)
            widths = tiles.Widths.of(problem, 8 if family == "tf32" else 16)
            forward, backward = (tiles.Choice(family, next(
                r.tiles for r in rows if r.when.matches(problem, widths))) for rows in table)
        o, lse = launch_forward.run(tiles.Choice(family, forward.tiles, key_splits=5),
                                    *device[1:], resolved)
        grads = launch_backward.run(tiles.Choice(family, backward.tiles, key_splits=5),
                                    *device, o, lse, resolved)
        cupy.cuda.Device().synchronize()
        golden_o, golden_lse = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                                backend="reference", return_lse=True, **options)
        assert_attention_close(o.get(), golden_o, q.dtype, name="o")
        golden = _golden_grads(do, q, k, v, o, golden_lse, **options)
        for name, grad, want in zip(("dq", "dk", "dv"), grads, golden):
            assert_attention_close(grad.get(), want, q.dtype, name=name)
        print(f"ok {dtype} {family} forward and dQ in 5 key shares")
    rule = launch_forward.key_shares
    launch_forward.key_shares = lambda *_: 3
    try:
        q = rng.standard_normal((2, 2, 40, 64)).astype(np.float16)
        k, v = (rng.standard_normal((8, 2, 16, 64)).astype(np.float16) for _ in range(2))
        table = np.array([[3, 0, 5, -1], [7, 2, -1, -1]], np.int32)
        lengths = dict(seqlens_q=np.array([40, 9]), seqlens_k=np.array([44, 20]))
        o, lse = tileattn.forward(*map(cupy.asarray, (q, k, v)), backend="gpu",
                                  return_lse=True, causal=True, block_table=table, **lengths)
        golden_o, golden_lse = tileattn.forward(q.astype(np.float64), k.astype(np.float64),
                                                v.astype(np.float64), backend="reference",
                                                return_lse=True, causal=True,
                                                block_table=table, **lengths)
        assert_attention_close(o.get(), golden_o, np.dtype(np.float16), name="o")
        assert_attention_close(lse.get(), golden_lse, np.float32, name="lse")
        print("ok float16 paged forward in 3 key shares")
    finally:
        launch_forward.key_shares = rule
    return 0


def redo_cases(rng) -> int:
    """An infinite key that every query scores -inf, beside a partial last query tile: the
    16-bit dK/dV kernels flag its block and attention_backward_dkdv_redo computes the block
    again (`--redo-only`: these alone)."""
    for dtype, options, single_pass in (("float16", {}, False),
                                        ("bfloat16", {"window": (40, 10)}, False),
                                        ("float16", {"causal": True}, True)):
        dtype = bfloat16() if dtype == "bfloat16" else np.dtype(dtype)
        q, k, v, do = (rng.standard_normal(shape).astype(dtype) for shape in
                       ((2, 4, 70, 64), (2, 2, 150, 64), (2, 2, 150, 64), (2, 4, 70, 64)))
        q[..., 0] = -np.abs(q[..., 0]) - np.asarray(0.1, dtype)
        k[1, 1, 140, 0] = np.inf
        device = [cupy.asarray(a) for a in (q, k, v, do)]
        o, lse = tileattn.forward(*device[:3], backend="gpu", return_lse=True, **options)
        if single_pass:  # the mma.sync single pass (its dK/dV kernel flags too)
            _, dk, dv = launch_backward.backward_mma(
                device[3], *device[:3], o, lse, _resolved(q, k, v, options),
                SINGLE_PASS_TILES["mma"][64], single_pass=True)
        else:
            _, dk, dv = tileattn.backward(device[3], *device[:3], o, lse, backend="gpu",
                                          **options)
        golden = _golden_grads(do, q, k, v, o, lse, **options)
        for name, grad, want in (("dk", dk, golden[1]), ("dv", dv, golden[2])):
            assert_attention_close(grad.get(), want, q.dtype, name=name)
        assert not cupy.any(dk[1, 1, 140]) and not cupy.any(dv[1, 1, 140])
        print(f"ok {dtype} {sorted(options)} {'mma.sync single pass' if single_pass else ''} "
              "an infinite key beside a query tail (redo)")
    return 0


def float32_non_finite_values(rng) -> int:
    """inf and NaN in V at keys that a causal band masks for some rows: the float32 forwards
    (wgmma and mma.sync where the device has both) zero them for the tensor cores and add
    the kept rows' products on CUDA cores."""
    for d in (64, 128):
        q, k, v = (rng.standard_normal((1, 2, n, d)).astype(np.float32) for n in (90, 90, 90))
        v[0, 0, 70, 3] = np.inf
        v[0, 1, 40, :] = np.nan
        options = dict(causal=True)
        device = [cupy.asarray(a) for a in (q, k, v)]
        resolved = _resolved(q, k, v, options)
        choices = {tiles.choose_forward(problem_of(*device, resolved)),
                   tiles.Choice("tf32", tiles.Tf32Tiles(128, 64, 16))}
        golden_o, _ = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                       backend="reference", return_lse=True, **options)
        for choice in choices:
            o, _ = launch_forward.run(choice, *device, resolved)
            assert_attention_close(o.get(), golden_o, np.float32, name="o")
            print(f"ok float32 D={d} non-finite V at masked keys, {choice.tiles}")
    return 0


def varlen_cases(rng) -> int:
    """Variable-length and paged calls (`--varlen-only`: these alone): the tile tables of
    every family, padding full of NaN that no kernel may read, empty sequences, pages in
    shuffled order in both pool layouts, unchecked lengths past their axes."""
    for dtype, family, options in VARLEN_CASES:
        dtype = bfloat16() if dtype == "bfloat16" else np.dtype(dtype)
        q, k, v, do, lengths = _varlen_problem(rng, dtype, family)
        device = [cupy.asarray(a) for a in (q, k, v, do)]
        o, lse = tileattn.forward(*device[:3], backend="gpu", return_lse=True, **lengths,
                                  **options)
        host = [a.astype(np.float64) for a in (q, k, v, do)]
        golden_o, golden_lse = tileattn.forward(*host[:3], backend="reference",
                                                return_lse=True, **lengths, **options)
        assert_attention_close(o.get(), golden_o, dtype, name="o")
        assert_attention_close(lse.get(), golden_lse, dtype, name="lse")
        if family != "paged":
            grads = tileattn.backward(device[3], *device[:3], o, lse, backend="gpu",
                                      **lengths, **options)
            golden = tileattn.backward(host[3], *host[:3], o.get().astype(np.float64),
                                       lse.get(), backend="reference", **lengths, **options)
            for name, grad, want in zip(("dq", "dk", "dv"), grads, golden):
                assert_attention_close(grad.get(), want, dtype, name=name)
        print(f"ok {dtype} {family} {sorted(options)} variable-length")
    q, k, v, _, lengths = _varlen_problem(rng, np.dtype(np.float16), "paged")
    wild = {"seqlens_k": np.array([10**6, 7, -3]), "block_table": lengths["block_table"] + 50}
    tileattn.forward(*map(cupy.asarray, (q, k, v)), backend="gpu", check_lengths=False, **wild)
    cupy.cuda.Device().synchronize()
    print("ok float16 paged, unchecked lengths and page ids out of range (clamped)")
    return 0


# (dtype, family, options): packed with an empty sequence and GQA, padded with a window,
# paged at pages of 16 (page-major pool) and 64.
VARLEN_CASES = [
    ("float16", "packed", dict(causal=True, dropout_p=0.2, seed=3)),
    ("float32", "padded", dict(window=(20, 5), softcap=3.0)),
    ("float32", "packed", dict(causal=True)),
    ("float32", "paged", dict(window=(30, 0))),
    ("bfloat16", "padded", dict(causal=True, alibi_slopes=np.array([0.2, 0.3, 0.4, 0.5]))),
    ("float64", "packed", dict(causal=True)),
    ("float16", "paged", dict(causal=True)),
]


def _varlen_problem(rng, dtype, family, rows=(70, 0, 33), keys=(150, 40, 90), heads=(4, 2)):
    """Arrays (NaN wherever no sequence reaches) and the length keywords of one call: 3
    sequences of (Hq, Hkv) `heads`, D 64, `rows` queries and `keys` keys."""
    rows, keys = np.array(rows), np.array(keys)
    n_q, n_k, d = int(rows.max()), int(keys.max()), 64
    n_q_heads, n_kv_heads = heads

    def normal(shape):
        return rng.standard_normal(shape).astype(dtype)

    if family == "packed":
        cu_q, cu_k = np.concatenate([[0], np.cumsum(rows)]), np.concatenate([[0], np.cumsum(keys)])
        q, do = normal((n_q_heads, cu_q[-1], d)), normal((n_q_heads, cu_q[-1], d))
        k, v = normal((n_kv_heads, cu_k[-1], d)), normal((n_kv_heads, cu_k[-1], d))
        return q, k, v, do, {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    q, do = normal((3, n_q_heads, n_q, d)), normal((3, n_q_heads, n_q, d))
    for b, n in enumerate(rows):
        q[b, :, n:] = do[b, :, n:] = np.nan
    if family == "padded":
        k, v = normal((3, n_kv_heads, n_k, d)), normal((3, n_kv_heads, n_k, d))
        for b, n in enumerate(keys):
            k[b, :, n:] = v[b, :, n:] = np.nan
        return q, k, v, do, {"seqlens_q": rows, "seqlens_k": keys}
    page = 16
    pages = -(-keys // page)
    order = rng.permutation(int(pages.sum()) + 2)
    table = np.full((3, int(pages.max())), -1, np.int64)
    stored = np.full((len(order), page, n_kv_heads, d), np.nan, dtype)  # page-major, as vLLM stores
    first = 0
    for b in range(3):
        table[b, :pages[b]] = order[first:first + pages[b]]
        first += pages[b]
        for j in range(keys[b]):
            stored[table[b, j // page], j % page] = normal((n_kv_heads, d))
    pool = stored.transpose(0, 2, 1, 3)
    return q, pool, pool, do, {"seqlens_q": rows, "seqlens_k": keys, "block_table": table}


def decode_cases(rng) -> int:
    """The split-KV decode kernel and its merge with forced splits (`--decode-only`: these
    alone, a minute under each tool)."""
    for dtype, (batch, hq, hkv, nq, nk, d, dv), options, splits, *kernel in DECODE_CASES:
        dtype = bfloat16() if dtype == "bfloat16" else np.dtype(dtype)
        q = rng.standard_normal((batch, hq, nq, d)).astype(dtype)
        k = rng.standard_normal((batch, hkv, nk, d)).astype(dtype)
        v = rng.standard_normal((batch, hkv, nk, dv)).astype(dtype)
        if options is _NON_FINITE_V:
            v[:, :, 458, 3] = np.inf  # kept by query row 0 only, in a stage the window cuts
        device = [cupy.asarray(a) for a in (q, k, v)]
        resolved = _resolved(q, k, v, options)
        make_tiles = tiles.decode_mma_tiles if kernel else tiles.decode_tiles
        config = make_tiles(problem_of(*device, resolved),
                            decode_shape(device[0], device[1], resolved), splits=splits)
        o = cupy.empty((batch, hq, nq, dv), dtype=dtype)
        lse = cupy.empty((batch, hq, nq), dtype=np.float64 if dtype == np.float64 else np.float32)
        forward_decode(*device, o, lse, resolved, config)
        golden_o, golden_lse = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                                backend="reference", return_lse=True, **options)
        assert_attention_close(o.get(), golden_o, q.dtype, name="o")
        assert_attention_close(lse.get(), golden_lse, q.dtype, name="lse")
        print(f"ok {dtype} {(batch, hq, hkv, nq, nk, d, dv)} {sorted(options)} decode {config}")
    # Paged decode (pages of 16 in shuffled order, NaN in every slot no sequence holds): the
    # tensor-core kernel's row offsets staged in its stages, one and two query rows; then the
    # same over device tables, unchecked, with lengths past the table's capacity and page
    # ids outside the pool (the offsets' clamp: nothing may be read past the pools).
    q, k, v, _, lengths = _varlen_problem(rng, np.dtype(np.float16), "paged", rows=(1, 2, 1),
                                          keys=(700, 333, 290), heads=(8, 2))
    for options in ({}, {"causal": True},
                    {"causal": True, "alibi_slopes": np.linspace(0.05, 0.5, 8)}):
        o, lse = tileattn.forward(*map(cupy.asarray, (q, k, v)), backend="gpu",
                                  return_lse=True, **lengths, **options)
        golden_o, golden_lse = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                                backend="reference", return_lse=True,
                                                **lengths, **options)
        assert_attention_close(o.get(), golden_o, np.float16, name="o")
        assert_attention_close(lse.get(), golden_lse, np.float16, name="lse")
        print(f"ok float16 paged decode (pages of 16) {sorted(options)}")
    table = lengths["block_table"].astype(np.int64)
    table[0, 1], table[1, 0], table[2, -1] = -4, 10**12, table.max() + 50
    tileattn.forward(*map(cupy.asarray, (np.nan_to_num(q), k, v)), backend="gpu",
                     check_lengths=False, seqlens_q=cupy.asarray(lengths["seqlens_q"]),
                     seqlens_k=cupy.asarray(np.array([10**6, 333, -3], np.int32)),
                     block_table=cupy.asarray(table))
    cupy.cuda.Device().synchronize()
    print("ok float16 paged decode, device tables unchecked: page ids out of range (clamped)")
    return 0


# Split-KV decode (attention_decode.cu) with forced splits: the merge, splits with no key
# tile, band-edge tiles, narrow copies (D = 33), float64, 32 packed rows on 256 threads; then
# the tensor-core kernel (attention_decode_mma.cu, a fifth field): a cut stage with a
# non-finite V (its scan and zeroing), two row tiles, odd dims, D = 256, splits merged by
# the last block of each group (3 and 16 splits) and by the merge kernel (4 and 100: past
# its early loads), ALiBi's slope per packed row, 24 narrow rows in two row warps (16 keys
# a warp, 3 stages) and 64 rows in four.
_NON_FINITE_V = dict(causal=True, window=(40, None))
DECODE_CASES = [
    ("float16", (1, 8, 2, 3, 300, 64, 64), dict(causal=True, softcap=2.0), 3, "tensor_cores"),
    ("bfloat16", (2, 16, 1, 2, 500, 128, 128), _NON_FINITE_V, 4, "tensor_cores"),
    ("float16", (2, 4, 1, 2, 70, 33, 40), dict(window=(20, 3)), 16, "tensor_cores"),
    ("float16", (1, 8, 1, 1, 900, 256, 256), {}, 1, "tensor_cores"),
    ("float16", (1, 8, 1, 1, 9000, 64, 64), dict(causal=True), 100, "tensor_cores"),
    ("float16", (1, 16, 2, 3, 400, 64, 64), dict(causal=True), 3, "tensor_cores"),
    ("bfloat16", (1, 8, 1, 8, 600, 128, 128), {}, 2, "tensor_cores"),
    ("bfloat16", (2, 16, 2, 2, 500, 128, 128),
     dict(causal=True, alibi_slopes=np.linspace(0.05, 0.5, 16)), 3, "tensor_cores"),
    ("float16", (1, 8, 2, 3, 300, 64, 64), dict(causal=True, dropout_p=0.2, seed=4), 3),
    ("float16", (2, 4, 1, 2, 70, 33, 40), dict(window=(20, 3), softcap=3.0), 16),
    ("bfloat16", (1, 4, 4, 1, 200, 128, 128),
     dict(alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4])), 1),
    ("float64", (1, 2, 1, 4, 90, 256, 256), dict(causal=True), 2),
    ("float32", (1, 8, 1, 4, 150, 80, 24), dict(causal=True), 5),
]


def _golden_grads(do, q, k, v, o, lse, **options):
    """The golden dq, dk, dv for the `o` (and `lse`, host or device) the GPU backward was
    given (SPEC: D = rowsum(do * o))."""
    host = [cupy.asnumpy(a).astype(np.float64) for a in (do, q, k, v, o)]
    return tileattn.backward(*host, cupy.asnumpy(lse), backend="reference", **options)


# The single pass's tiles: the two-kernel defaults of D = 64 and 128.
SINGLE_PASS_TILES = {
    "mma": {64: tiles.MmaBackwardTiles((64, 64), (128, 64)),
            128: tiles.MmaBackwardTiles((128, 128), (128, 64))},
    "wgmma": {64: tiles.WgmmaBackwardTiles((192, 64), (192, 64), 2),
              128: tiles.WgmmaBackwardTiles((192, 64), (128, 64), 3)},
}


def _resolved(q, k, v, options):
    """The AttentionOptions the API would pass a backend for these keyword options."""
    defaults = dict(causal=False, window=None, scale=None, softcap=None, alibi_slopes=None,
                    dropout_p=0.0, seed=None, block_q=None, block_k=None, deterministic=True)
    return validate(q, k, v, **{**defaults, **options}).options


if __name__ == "__main__":
    sys.exit(main())
