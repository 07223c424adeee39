"""The backward in both layouts on the GPU: does writing "bshd" gradients in the caller's
order (strided rows, STRIDED_OUT) cost the kernels anything?

    python3 bench/experiments/layout_backward_gpu.py [--quick]

For FlashAttention's shapes (batch * N = 16k tokens, hidden 2048; also GQA 16/4 at D = 128),
times `tileattn.backward` back to back on the same numbers held "bhsd" (contiguous
gradients) and "bshd" (C-contiguous (B, N, H, D) inputs and gradients, the layout
flash-attn and the JAX adapter use), after checking that both give the same bits.
"""

from __future__ import annotations

import argparse
import os
import sys

import cupy
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import tileattn  # noqa: E402
from gpu_timing import back_to_back_ms  # noqa: E402


def row(dtype, head_dim: int, length: int, causal: bool, kv_heads: int | None):
    heads, batch = 2048 // head_dim, max(1, 16384 // length)
    kv_heads = kv_heads or heads
    rng = np.random.default_rng(0)
    q, do = (cupy.asarray(rng.standard_normal((batch, heads, length, head_dim)), dtype=dtype)
             for _ in range(2))
    k, v = (cupy.asarray(rng.standard_normal((batch, kv_heads, length, head_dim)), dtype=dtype)
            for _ in range(2))
    o, lse = tileattn.forward(q, k, v, causal=causal, return_lse=True)
    sequence_first = [cupy.ascontiguousarray(a.swapaxes(1, 2)) for a in (do, q, k, v, o)]
    heads_first = tileattn.backward(do, q, k, v, o, lse, causal=causal)
    in_callers_order = tileattn.backward(*sequence_first, lse, causal=causal, layout="bshd")
    for name, a, b in zip(("dq", "dk", "dv"), heads_first, in_callers_order):
        assert b.flags.c_contiguous, name
        assert bool((cupy.ascontiguousarray(b.swapaxes(1, 2)).view(np.uint16)
                     == a.view(np.uint16)).all()), name
    repetitions = 20 if length <= 4096 else 8
    bhsd = back_to_back_ms(lambda: tileattn.backward(do, q, k, v, o, lse, causal=causal),
                           repetitions)
    bshd = back_to_back_ms(lambda: tileattn.backward(*sequence_first, lse, causal=causal,
                                                     layout="bshd"), repetitions)
    flops = 2.5 * 4 * batch * heads * length * length * head_dim / (2 if causal else 1)
    print(f"| {np.dtype(dtype).name} | {head_dim} | {heads}/{kv_heads} | {length} | {causal} | "
          f"{bhsd:.3f} | {bshd:.3f} | {bshd / bhsd:.3f} | {flops / bshd / 1e9:.0f} |",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 1k and 4k only")
    args = parser.parse_args()
    print(f"# {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print("| dtype | D | Hq/Hkv | N | causal | bhsd ms | bshd ms | bshd / bhsd | bshd TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for length in (1024, 4096) if args.quick else (1024, 4096, 16384):
        for head_dim, kv_heads in ((64, None), (128, None), (128, 4), (96, None)):
            for causal in (False, True):
                row(cupy.float16, head_dim, length, causal, kv_heads)


if __name__ == "__main__":
    main()
