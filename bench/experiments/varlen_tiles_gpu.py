"""Tiles for packed causal batches: the wgmma forward's and backward's candidate tiles on
bench_gpu_varlen.py's packed batch (32 sequences of 128..8192 tokens, seeded, Hq = Hkv = 16,
D = 128) against one dense sequence of the same total length, kernels alone (host tile
tables built once, calls back to back).

    PYTHONPATH=. python3 bench/experiments/varlen_tiles_gpu.py [--dtype float16] [--full]
        [--backward]

Each line: tiles | packed ms, TFLOP/s | dense ms, TFLOP/s | packed rate / dense rate (the
issue's target is >= 0.9 against the dense sequence at its own best tiles, the last line).
"""

from __future__ import annotations

import argparse
import os
import sys

import cupy

from tileattn.gpu import launch_backward, launch_forward
from tileattn.gpu.tiles import WgmmaBackwardTiles, WgmmaTiles
from tileattn.gpu.varlen import Sequences
from tileattn.validation import validate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import bench_gpu_varlen  # noqa: E402
from bench_gpu_varlen import HEAD_DIM, HEADS, make_packed_batch, parse_args  # noqa: E402

bench_gpu_varlen.cupy = cupy  # the benchmark imports CuPy in its main(), which is not run
from gpu_timing import back_to_back_ms  # noqa: E402

CALLS = 10
FORWARD = [WgmmaTiles(192, 128, 2), WgmmaTiles(128, 128, 2, 2), WgmmaTiles(128, 64, 2, 2),
           WgmmaTiles(128, 64, 3, 2), WgmmaTiles(256, 64, 2), WgmmaTiles(192, 64, 3),
           WgmmaTiles(128, 128, 2), WgmmaTiles(64, 128, 2, 2)]
BACKWARD = [WgmmaBackwardTiles(dq, dkdv, stages) for dq, dkdv, stages in (
    ((192, 64), (128, 64), 2), ((192, 64), (128, 64), 3), ((128, 64), (128, 64), 2),
    ((128, 64), (128, 64), 3), ((192, 64), (64, 64), 2), ((128, 64), (64, 64), 3),
    ((64, 64), (128, 64), 2), ((192, 64), (192, 64), 2))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--full", action="store_true", help="no causal mask")
    parser.add_argument("--backward", action="store_true", help="the backward's tiles too")
    parser.add_argument("--forward-tiles", default=None,
                        help="comma-separated indices of the forward candidates to time")
    args = parser.parse_args()
    causal = not args.full
    batch = make_packed_batch(parse_args(["--dtype", args.dtype]), args.dtype)
    lengths, cu_seqlens, total = batch.lengths, batch.cu_seqlens, batch.total
    packed = [batch.q, batch.k, batch.v, batch.do]
    dense = [a[None] for a in packed]
    defaults = dict(causal=causal, window=None, scale=None, softcap=None, alibi_slopes=None,
                    dropout_p=0.0, seed=None, block_q=None, block_k=None, deterministic=True)
    varlen = {"cu_seqlens_q": cu_seqlens, "cu_seqlens_k": cu_seqlens}
    packed_problem = validate(*packed[:3], varlen=varlen, **defaults)
    dense_problem = validate(*dense[:3], **defaults)
    packed_options, dense_options = packed_problem.options, dense_problem.options
    pq, pk, pv = (packed_problem.tensors[n] for n in "qkv")  # (1, H, T, D) views
    dq_, dk_, dv_ = (dense_problem.tensors[n] for n in "qkv")
    sequences = Sequences(pq, pk, packed_options, forward=True)
    kept = float(sum(int(n) ** 2 for n in lengths)) / (2 if causal else 1)
    dense_kept = float(total) ** 2 / (2 if causal else 1)
    flops = 4.0 * HEADS * HEAD_DIM * kept
    dense_flops = 4.0 * HEADS * HEAD_DIM * dense_kept
    print(f"{args.dtype}, {'causal' if causal else 'full'}, {total} tokens in 32 sequences")
    choice = launch_forward.choose(pq, pk, pv, packed_options, sequences)
    rule = launch_forward._varlen_shares(choice, pq, packed_options, sequences)
    blocks = len(sequences.tiles(choice.tiles.block_q)) * HEADS
    print(f"table: {choice}, key shares {rule(blocks) if callable(rule) else rule}")

    def row(name, packed_call, dense_call, factor):
        try:
            p = back_to_back_ms(packed_call, CALLS)
            d = back_to_back_ms(dense_call, CALLS)
        except Exception as error:  # noqa: BLE001 (a candidate that does not fit)
            print(f"{name}: failed: {str(error).splitlines()[0][:90]}", flush=True)
            return None
        pr, dr = factor * flops / p / 1e9, factor * dense_flops / d / 1e9
        print(f"{name} | {p:.3f} ms {pr:.0f} | {d:.3f} ms {dr:.0f} | {pr / dr:.3f}",
              flush=True)
        return pr, dr

    o, lse = cupy.empty_like(pq), cupy.empty((1, HEADS, total), cupy.float32)
    od, lsed = cupy.empty_like(dq_), cupy.empty((1, HEADS, total), cupy.float32)
    best_dense = 0.0
    chosen = (FORWARD if args.forward_tiles is None else
              [FORWARD[int(i)] for i in args.forward_tiles.split(",") if i])
    for tiles in chosen:
        rates = row(f"forward {tiles}", lambda: launch_forward.forward_wgmma(
            pq, pk, pv, o, lse, packed_options, tiles, sequences),
            lambda: launch_forward.forward_wgmma(dq_, dk_, dv_, od, lsed, dense_options, tiles),
            1.0)
        best_dense = max(best_dense, rates[1] if rates else 0.0)
    import tileattn

    rates = row("forward, tileattn.forward", lambda: tileattn.forward(
        *packed[:3], causal=causal, backend="gpu", **varlen),
        lambda: tileattn.forward(*dense[:3], causal=causal, backend="gpu"), 1.0)
    print(f"forward: packed (table) / best dense {rates[0] / best_dense:.3f}")
    if not args.backward:
        return
    o, lse = tileattn.forward(*packed[:3], causal=causal, backend="gpu", return_lse=True,
                              **varlen)
    od, lsed = tileattn.forward(*dense[:3], causal=causal, backend="gpu", return_lse=True)
    packed_back = validate(*packed[:3], do=packed[3], o=o, lse=lse, varlen=varlen, **defaults)
    dense_back = validate(*dense[:3], do=dense[3], o=od, lse=lsed, **defaults)
    pb = [packed_back.tensors[n] for n in ("do", "q", "k", "v", "o", "lse")]
    db = [dense_back.tensors[n] for n in ("do", "q", "k", "v", "o", "lse")]
    back_sequences = Sequences(pb[1], pb[2], packed_back.options)
    best_dense = 0.0
    for tiles in BACKWARD:
        rates = row(f"backward {tiles}", lambda: launch_backward.backward_wgmma(
            *pb, packed_back.options, tiles, sequences=back_sequences),
            lambda: launch_backward.backward_wgmma(*db, dense_back.options, tiles), 2.5)
        best_dense = max(best_dense, rates[1] if rates else 0.0)
    rates = row("backward, tileattn.backward", lambda: tileattn.backward(
        packed[3], *packed[:3], o, lse, causal=causal, backend="gpu", **varlen),
        lambda: tileattn.backward(dense[3], *dense[:3], od, lsed, causal=causal,
                                  backend="gpu"), 2.5)
    print(f"backward: packed (table) / best dense {rates[0] / best_dense:.3f}")


if __name__ == "__main__":
    main()
