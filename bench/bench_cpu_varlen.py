"""CPU benchmark: variable-length and paged attention against the same work laid out dense.

    python bench/bench_cpu_varlen.py [--sequences 16] [--heads 4] [--head-dim 64]

Packed training batch: `--sequences` sequences with lengths drawn (seeded) from 64 to 1024,
float32, causal and not, forward and forward+backward, timed three ways on the same data:

* ``packed``: one `tileattn.forward(..., cu_seqlens_q=..., cu_seqlens_k=...)` call;
* ``padded-dense``: every sequence padded to the longest and run as a dense batch (what a
  user without variable lengths does; its padding work is wasted);
* ``one-dense``: one dense sequence of the same total length, for the rate alone (its
  causal mask covers more pairs, so only GFLOP/s compare).

GFLOP/s count the real tokens' kept pairs only (the packed call's work; for one-dense, its
own kept pairs), so "rate / one-dense" is the cost of raggedness. Paged decode: 4
requests of 1 new row against 4k cached keys in pages of 16, 64 and 256 (a shuffled pool
stored ``(num_pages, page_size, Hkv, D)``), against the same keys contiguous.

Every variant is checked against the golden model (`tileattn.reference_varlen`) on its
first sequences before anything is timed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import tileattn
from tileattn import reference_varlen as rv
from tileattn.testing import assert_attention_close


def best_of(function, repeats: int = 5) -> float:
    function()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


def kept_pairs(lengths, causal: bool) -> int:
    return int(sum(n * (n + 1) // 2 if causal else n * n for n in lengths))


def packed_rows(args):
    rng = np.random.default_rng(0)
    lengths = rng.integers(64, 1025, size=args.sequences)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    total, longest = int(cu[-1]), int(lengths.max())
    h, d = args.heads, args.head_dim
    q, k, v, do = (rng.standard_normal((h, total, d)).astype(np.float32) for _ in range(4))
    padded = [np.zeros((args.sequences, h, longest, d), np.float32) for _ in range(4)]
    for s, n in enumerate(lengths):
        for dense, packed in zip(padded, (q, k, v, do)):
            dense[s, :, :n] = packed[:, cu[s]:cu[s + 1]]
    one = [a[None] for a in (q, k, v, do)]
    rows = []
    for causal in (False, True):
        options = {"causal": causal, "backend": "cpu"}
        lengths_kw = {"cu_seqlens_q": cu, "cu_seqlens_k": cu}
        # correctness first: the packed call against the golden model on (up to) three
        # sequences
        checked = min(3, len(lengths))
        part = slice(0, int(cu[checked]))
        o = tileattn.forward(q[:, part], k[:, part], v[:, part],
                             cu_seqlens_q=cu[:checked + 1], cu_seqlens_k=cu[:checked + 1],
                             causal=causal, backend="cpu")
        expected, _ = rv.forward_packed(*(a[:, part].astype(np.float64) for a in (q, k, v)),
                                        cu[:checked + 1], cu[:checked + 1], causal=causal)
        assert_attention_close(o, expected, np.float32, name="packed o")
        flops = 4.0 * h * d * kept_pairs(lengths, causal)
        one_flops = 4.0 * h * d * kept_pairs([total], causal)

        def train(arrays, **keywords):
            o, lse = tileattn.forward(*arrays[:3], return_lse=True, **keywords)
            tileattn.backward(arrays[3], *arrays[:3], o, lse, **keywords)

        for name, arrays, keywords, work in (("packed", (q, k, v, do), lengths_kw, flops),
                                             ("padded-dense", padded, {}, flops),
                                             ("one-dense", one, {}, one_flops)):
            forward_s = best_of(lambda: tileattn.forward(*arrays[:3], **keywords, **options))
            train_s = best_of(lambda: train(arrays, **keywords, **options), 3)
            rows.append((causal, name, forward_s, train_s, work))
    return lengths, rows


def paged_rows(args):
    rng = np.random.default_rng(1)
    batch, n_q_heads, n_kv_heads, d, n_k = 4, 32, 8, 128, 4096
    q = rng.standard_normal((batch, n_q_heads, 1, d)).astype(np.float32)
    k = rng.standard_normal((batch, n_kv_heads, n_k, d)).astype(np.float32)
    v = rng.standard_normal((batch, n_kv_heads, n_k, d)).astype(np.float32)
    seqlens = np.full(batch, n_k)
    contiguous = best_of(lambda: tileattn.forward(q, k, v, backend="cpu"), 20)
    rows = []
    for page_size in (16, 64, 256):
        pages = n_k // page_size
        order = rng.permutation(batch * pages)
        table = order.reshape(batch, pages)
        pools = []
        for array in (k, v):
            stored = np.empty((batch * pages, page_size, n_kv_heads, d), np.float32)
            stored[table.reshape(-1)] = array.reshape(batch, n_kv_heads, pages, page_size,
                                                      d).transpose(0, 2, 3, 1, 4).reshape(
                batch * pages, page_size, n_kv_heads, d)
            pools.append(stored.transpose(0, 2, 1, 3))
        lengths = {"block_table": table, "seqlens_k": seqlens}
        timed = []
        # vLLM's (num_pages, page_size, Hkv, D) passed as a transposed view, and a pool
        # stored (num_pages, Hkv, page_size, D)
        for layout_pools in (pools, [np.ascontiguousarray(pool) for pool in pools]):
            o = tileattn.forward(q, *layout_pools, backend="cpu", **lengths)
            expected, _ = rv.forward_padded(*(a[:1].astype(np.float64) for a in (q, k, v)))
            assert_attention_close(o[:1], expected, np.float32, name="paged o")
            timed.append(best_of(lambda p=layout_pools: tileattn.forward(
                q, *p, backend="cpu", **lengths), 20))
        rows.append((page_size, *timed, contiguous))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    for name in ("sequences", "heads", "head_dim"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got "
                         f"{getattr(args, name)}")
    lengths, rows = packed_rows(args)
    print(f"packed: {args.sequences} sequences, lengths {lengths.min()}-{lengths.max()} "
          f"(total {lengths.sum()}), H={args.heads}, D={args.head_dim}, float32")
    print("| mask | layout | forward ms | GFLOP/s | rate / one-dense | fwd+bwd ms | GFLOP/s | "
          "rate / one-dense |")
    print("|---|---|---|---|---|---|---|---|")
    for causal in (False, True):
        mine = [r for r in rows if r[0] == causal]
        _, _, one_forward, one_train, one_flops = mine[-1]
        for _, name, forward_s, train_s, flops in mine:
            forward_rate, train_rate = flops / forward_s, 3.5 * flops / train_s
            print(f"| {'causal' if causal else 'full'} | {name} | {forward_s * 1e3:.1f} | "
                  f"{forward_rate / 1e9:.1f} | {forward_rate / (one_flops / one_forward):.2f} | "
                  f"{train_s * 1e3:.1f} | {train_rate / 1e9:.1f} | "
                  f"{train_rate / (3.5 * one_flops / one_train):.2f} |")
    print("\npaged decode: B=4, Hq=32, Hkv=8, D=128, 1 row against 4096 keys, float32")
    print("| page size | paged ms, (pages, page_size, Hkv, D) | ratio to contiguous | "
          "paged ms, (pages, Hkv, page_size, D) | ratio | contiguous ms |")
    print("|---|---|---|---|---|---|")
    for page_size, slots_outer, heads_outer, contiguous in paged_rows(args):
        print(f"| {page_size} | {slots_outer * 1e3:.2f} | {slots_outer / contiguous:.2f} | "
              f"{heads_outer * 1e3:.2f} | {heads_outer / contiguous:.2f} | "
              f"{contiguous * 1e3:.2f} |")


if __name__ == "__main__":
    main()
