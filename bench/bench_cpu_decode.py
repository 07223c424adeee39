"""CPU decode forward against torch SDPA: a few query rows against a long K/V cache.

    python bench/bench_cpu_decode.py --threads 2
    python bench/bench_cpu_decode.py --threads 2 --batch 1 --nk 8192 32768 [--dtype bfloat16]
    python bench/bench_cpu_decode.py --threads 2 --batch 1 --nk 8192 --head-dim 32 80 256

Each configuration is first validated against the float64 golden model on the same batch,
heads and query rows with a short cache (the full one in float64 would not fit in memory),
for tileattn and for torch; then both are timed on the full cache, taking turns, each call
after a short pause, and the median of the repeats is reported. Causal rows use
bottom-right alignment (SPEC), which torch gets as `causal_lower_right`. Prints a markdown
table: ratio = torch time / tileattn time (> 1: tileattn faster) and the GB/s of K and V
each reads (every kept key once per kv head). ``--forward-kernel`` times the forward
kernel instead of the decode path (the path before session 5), for before/after tables.
``--dtype`` float16 or bfloat16 gives both libraries the cache in that dtype (torch SDPA
then computes in it; tileattn widens each key tile to float32 as it reads it).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import numba
import numpy as np
import torch
from torch.nn.attention.bias import causal_lower_right

import tileattn
import tileattn.cpu.decode
from tileattn.testing import assert_attention_close

HEADS = ((32, 32), (32, 8), (8, 1))
HEAD_DIMS = (128,)
VALIDATION_KEYS = 1000  # not a multiple of any tile or split size
SETTLE_SECONDS = 0.2
"""Pause before each timed call, so one library's spinning worker threads (torch's OpenMP)
do not slow the other's call, as in `bench_cpu_head_dims.py`."""


def _tileattn(q, k, v, causal):
    return tileattn.forward(q, k, v, causal=causal, backend="cpu")


def _as_torch(array):
    if array.dtype.name == "bfloat16":  # NumPy's bfloat16 is ml_dtypes': move the bits
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _torch(q, k, v, causal):
    tq, tk, tv = (_as_torch(x) for x in (q, k, v))
    mask = causal_lower_right(q.shape[2], k.shape[2]) if causal else None
    with torch.no_grad():
        o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask,
                                                             enable_gqa=True)
    return o.float().numpy() if o.dtype == torch.bfloat16 else o.numpy()


def _inputs(rng, batch, n_q_heads, n_kv_heads, n_q, n_k, head_dim, dtype):
    def normal(heads, rows):
        return rng.standard_normal((batch, heads, rows, head_dim),
                                   dtype=np.float32).astype(dtype)
    return normal(n_q_heads, n_q), normal(n_kv_heads, n_k), normal(n_kv_heads, n_k)


def _validate(rng, batch, n_q_heads, n_kv_heads, n_q, causal, head_dim, dtype):
    q, k, v = _inputs(rng, batch, n_q_heads, n_kv_heads, n_q, VALIDATION_KEYS, head_dim,
                      dtype)
    expected = tileattn.forward(*(x.astype(np.float64) for x in (q, k, v)), causal=causal,
                                backend="reference")
    ours = _tileattn(q, k, v, causal).astype(np.float32)
    assert_attention_close(ours, expected, dtype, name="tileattn")
    assert_attention_close(_torch(q, k, v, causal), expected, dtype, name="torch")


def _seconds(function, *args):
    time.sleep(SETTLE_SECONDS)
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--nk", type=int, nargs="+", default=[8192, 32768, 65536])
    parser.add_argument("--nq", type=int, nargs="+", default=[1, 8],
                        help="query rows; more than 1 runs causal (speculative decoding)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--head-dim", type=int, nargs="+", default=list(HEAD_DIMS),
                        help="head dims (D = Dv) to sweep")
    parser.add_argument("--forward-kernel", action="store_true",
                        help="time the forward kernel instead of the decode path")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                        default="float32", help="of q, k and v, for both libraries")
    args = parser.parse_args()
    if args.dtype == "bfloat16":
        from tileattn.arrays import bfloat16_dtype

        dtype = bfloat16_dtype()
    else:
        dtype = np.dtype(args.dtype)
    numba.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    if args.forward_kernel:
        tileattn.cpu.decode.MAX_QUERY_ROWS = tileattn.cpu.decode.MAX_GROUP_ROWS = 0
    rng = np.random.default_rng(0)
    path = "forward kernel" if args.forward_kernel else "decode path"
    print(f"threads {args.threads}, {args.dtype}, tileattn {path}\n")
    print("| D | B | Hq | Hkv | Nq | Nk | tileattn ms | torch ms | ratio | tileattn GB/s | "
          "torch GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for head_dim, batch in itertools.product(args.head_dim, args.batch):
        for n_q_heads, n_kv_heads in HEADS:
            for n_q in args.nq:
                causal = n_q > 1
                _validate(rng, batch, n_q_heads, n_kv_heads, n_q, causal, head_dim, dtype)
                for n_k in args.nk:
                    q, k, v = _inputs(rng, batch, n_q_heads, n_kv_heads, n_q, n_k, head_dim,
                                      dtype)
                    for function in (_tileattn, _torch):  # warm: compile, first touch
                        function(q, k, v, causal)
                    ours, theirs = [], []
                    for _ in range(args.repeats):
                        ours.append(_seconds(_tileattn, q, k, v, causal))
                        theirs.append(_seconds(_torch, q, k, v, causal))
                    ours_s, theirs_s = statistics.median(ours), statistics.median(theirs)
                    gigabytes = (k.nbytes + v.nbytes) / 1e9
                    print(f"| {head_dim} | {batch} | {n_q_heads} | {n_kv_heads} | {n_q} | {n_k} | "
                          f"{ours_s * 1e3:.2f} | {theirs_s * 1e3:.2f} | "
                          f"{theirs_s / ours_s:.2f} | {gigabytes / ours_s:.1f} | "
                          f"{gigabytes / theirs_s:.1f} |", flush=True)
                    del q, k, v


if __name__ == "__main__":
    main()
