"""Where one dense call's time goes, kernel by kernel: forward and backward of each shape
through `tileattn.forward` / `tileattn.backward` (the table's choices), every launch timed
by CUDA events (kernel_timer_gpu.py), beside torch SDPA's flash backend's whole calls.

    PYTHONPATH=. python3 bench/experiments/call_kernels_gpu.py \\
        --shape 1,32,32,1,65536,128 --shape 4,16,16,100,8192,128:causal [--dtype float16]

A shape is B,Hq,Hkv,Nq,Nk,D[,Dv], optionally followed by ":causal". Each line: pass |
kernel | grid | ms; then the kernels' sum, the whole call (from an idle device: host
time before the first launch included) and torch flash's call (back to back, median).
"""

from __future__ import annotations

import argparse
import os
import sys

import cupy

import tileattn

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from kernel_timer_gpu import profile  # noqa: E402


def parse_shape(text: str) -> tuple[tuple[int, ...], bool]:
    dims, _, flag = text.partition(":")
    numbers = tuple(int(x) for x in dims.split(","))
    if len(numbers) == 6:
        numbers += (numbers[5],)
    if len(numbers) != 7 or flag not in ("", "causal"):
        raise SystemExit(f"--shape {text!r}: B,Hq,Hkv,Nq,Nk,D[,Dv][:causal]")
    return numbers, flag == "causal"


def torch_flash_ms(arrays, causal: bool, backward: bool) -> float | None:
    """torch flash's whole call, back to back, or None where torch or the shape is not."""
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right
    except ImportError:
        return None
    q, k, v, do = (torch.as_tensor(a, device="cuda") for a in arrays)
    if q.shape[-1] != v.shape[-1]:
        return None
    q.requires_grad_(backward), k.requires_grad_(backward), v.requires_grad_(backward)
    mask = (causal_lower_right(q.shape[2], k.shape[2]) if causal and q.shape[2] != k.shape[2]
            else None)

    def call():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                enable_gqa=q.shape[1] != k.shape[1])
            if backward:
                torch.autograd.grad(o, (q, k, v), do)
    try:
        call()
    except RuntimeError:
        return None
    from gpu_timing import back_to_back_ms
    return back_to_back_ms(call, repetitions=10, rounds=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", required=True)
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    rng = cupy.random.default_rng(0)
    for text in args.shape:
        (b, hq, hkv, nq, nk, d, dv), causal = parse_shape(text)
        shapes = [(b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, dv), (b, hq, nq, dv)]
        arrays = [rng.standard_normal(s, dtype=cupy.float32).astype(args.dtype)
                  for s in shapes]
        q, k, v, do = arrays
        o, lse = tileattn.forward(q, k, v, causal=causal, backend="gpu", return_lse=True)
        calls = {
            "forward": lambda: tileattn.forward(q, k, v, causal=causal, backend="gpu"),
            "backward": lambda: tileattn.backward(do, q, k, v, o, lse, causal=causal,
                                                  backend="gpu"),
        }
        print(f"## {text} {args.dtype}")
        print("| pass | kernel | grid | ms |")
        print("| --- | --- | ---: | ---: |")
        for name, call in calls.items():
            kernels, whole = profile(call, args.calls)
            for (kernel, grid), ms in sorted(kernels.items(), key=lambda item: -item[1]):
                print(f"| {name} | {kernel} | {grid} | {ms:.3f} |")
            print(f"| {name} | kernels' sum | | {sum(kernels.values()):.3f} |")
            print(f"| {name} | whole call | | {whole:.3f} |")
        for backward in (False, True):
            ms = torch_flash_ms(arrays, causal, backward)
            label = "fwd+bwd" if backward else "forward"
            print(f"| torch flash {label} | whole call, back to back | | "
                  f"{'n/a' if ms is None else f'{ms:.3f}'} |", flush=True)


if __name__ == "__main__":
    main()
