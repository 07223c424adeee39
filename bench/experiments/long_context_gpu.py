"""One head, N = 1,048,576, D = 128, float16: forward and backward on the GPU (issue 5).

    PYTHONPATH=. python3 bench/experiments/long_context_gpu.py [--n 1048576] [--causal] [--rows 4]

Reports the time of the forward and of the backward (CUDA events, after a warm-up on a
small problem so no compile is timed), TFLOP/s with FlashAttention's FLOP count, and the peak
GPU memory the two calls hold beyond their inputs and outputs (a CuPy memory hook on every
pool allocation; a materialised score matrix would take 2 TB at this N). Correctness: for a
few query rows, o and dq against a float64 CuPy computation of those rows over all keys.
"""

from __future__ import annotations

import argparse
import math

import cupy
import numpy as np

import tileattn
from tileattn.benchmark import cuda_peak_bytes_hook


def timed(function):
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    result = function()
    stop.record()
    stop.synchronize()
    return result, cupy.cuda.get_elapsed_time(start, stop) / 1e3


def rows_in_float64(q, k, v, do, rows, causal):
    """o and dq of the given query rows, exactly (float64, over every key)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    k64, v64 = k[0, 0].astype(cupy.float64), v[0, 0].astype(cupy.float64)
    n = k64.shape[0]
    outs, grads = [], []
    for row in rows:
        s = scale * (k64 @ q[0, 0, row].astype(cupy.float64))
        if causal:
            s[row + 1:] = -cupy.inf
        p = cupy.exp(s - s.max())
        p /= p.sum()
        o = p @ v64
        dp = v64 @ do[0, 0, row].astype(cupy.float64)
        ds = p * (dp - dp @ p)
        outs.append(o)
        grads.append(scale * (ds @ k64))
        del s, p, dp, ds
    assert n == k.shape[2]
    return cupy.stack(outs), cupy.stack(grads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1 << 20)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--deterministic", type=int, default=1)
    parser.add_argument("--rows", type=int, default=4)
    args = parser.parse_args()
    n, d, causal = args.n, args.head_dim, args.causal
    # Warm-up on a small problem: compiles the kernels of this configuration.
    small = [cupy.random.standard_normal((1, 1, 256, d), dtype=cupy.float32).astype(cupy.float16)
             for _ in range(4)]
    o, lse = tileattn.forward(*small[:3], causal=causal, backend="gpu", return_lse=True)
    tileattn.backward(small[3], *small[:3], o, lse, causal=causal, backend="gpu",
                      deterministic=bool(args.deterministic))
    cupy.random.seed(0)
    q, k, v, do = (cupy.random.standard_normal((1, 1, n, d), dtype=cupy.float32)
                   .astype(cupy.float16) for _ in range(4))
    inputs = sum(a.nbytes for a in (q, k, v, do))
    cupy.cuda.Device().synchronize()
    with cuda_peak_bytes_hook() as hook:
        (o, lse), forward_s = timed(lambda: tileattn.forward(
            q, k, v, causal=causal, backend="gpu", return_lse=True))
        (dq, dk, dv), backward_s = timed(lambda: tileattn.backward(
            do, q, k, v, o, lse, causal=causal, backend="gpu",
            deterministic=bool(args.deterministic)))
    outputs = sum(a.nbytes for a in (o, lse, dq, dk, dv))
    flops = 4 * n * n * d / (2 if causal else 1)
    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print(f"one head, N={n}, D={d}, float16, causal={causal}, "
          f"deterministic={bool(args.deterministic)}")
    print(f"forward  {forward_s:8.3f} s  {flops / forward_s / 1e12:6.1f} TFLOP/s")
    print(f"backward {backward_s:8.3f} s  {2.5 * flops / backward_s / 1e12:6.1f} TFLOP/s")
    print(f"forward+backward {forward_s + backward_s:.3f} s; inputs {inputs / 2**20:.0f} MiB, "
          f"outputs {outputs / 2**20:.0f} MiB, peak beyond inputs and outputs "
          f"{max(0, hook.peak - outputs) / 2**20:.1f} MiB "
          f"(a float32 score matrix: {4 * n * n / 2**40:.1f} TiB)")
    finite = all(bool(cupy.isfinite(a).all()) for a in (o, lse, dq, dk, dv))
    rows = np.linspace(0, n - 1, args.rows).astype(int).tolist()
    want_o, want_dq = rows_in_float64(q, k, v, do, rows, causal)

    def relative(actual, expected):
        return float(cupy.linalg.norm(actual.astype(cupy.float64) - expected)
                     / cupy.linalg.norm(expected))
    print(f"all outputs finite: {finite}; rows {rows}: o relative error "
          f"{relative(o[0, 0, rows], want_o):.1e}, dq relative error "
          f"{relative(dq[0, 0, rows], want_dq):.1e}")


if __name__ == "__main__":
    main()
