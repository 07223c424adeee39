"""The float32 backward alone, in each of its modes, beside torch's efficient backward.

    PYTHONPATH=. python3 bench/experiments/float32_backward_modes_gpu.py [--dims 128,256]
        [--n 4096] [--heads 16:16,16:2,16:1] [--once] [--modes "single pass,..."]
        [--causal both|yes|no]

Per (D, causal, Hq:Hkv): the backward of a forward computed once, timed alone (CUDA
events, median, L2 not flushed: the inputs exceed it): tileattn's two kernels
(deterministic=True), the single pass in arrival order (deterministic=False, forced on
where the launcher would take two kernels for a GQA group cut over blocks), the single
pass in turns (deterministic, ORDERED), what deterministic=False runs by default, and torch's efficient backward (autograd.grad on a
kept graph; GQA on K/V repeated per query head). Heads scale with a hidden size of 2048
(Hq = 16 at D = 128), batch x N = 16k. `--once` runs each mode once, for a profiler
(ncu's --kernel-name ``regex:dkdv|cutlassB``; bench/NOTES-gpu.md v41).
"""

from __future__ import annotations

import argparse
import os
import sys

import cupy

import tileattn
from tileattn.gpu import launch_backward
from tileattn.gpu import tiles as tile_tables
from tileattn.gpu.operands import problem_of
from tileattn.validation import validate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_gpu import median_ms  # noqa: E402

try:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # pragma: no cover - the timings then lack torch's column
    torch = None


def _options(q, k, v, causal, deterministic):
    """The AttentionOptions the API would pass the backend."""
    return validate(q, k, v, causal=causal, window=None, scale=None, softcap=None,
                    alibi_slopes=None, dropout_p=0.0, seed=None, block_q=None, block_k=None,
                    deterministic=deterministic).options


def modes(q, k, v, do, causal):
    """name -> a callable running that backward once."""
    o, lse = tileattn.forward(q, k, v, backend="gpu", return_lse=True, causal=causal)
    nd = _options(q, k, v, causal, False)
    choice = tile_tables.choose_backward(problem_of(q, k, v, nd))
    result = {
        "two kernels": lambda: tileattn.backward(do, q, k, v, o, lse, backend="gpu",
                                                 causal=causal),
        "nd default": lambda: tileattn.backward(do, q, k, v, o, lse, backend="gpu",
                                                causal=causal, deterministic=False),
    }
    if choice.family == "tf32" and choice.tiles.serves_single_pass:
        result["single pass"] = lambda: launch_backward.backward_mma(
            do, q, k, v, o, lse, nd, choice.tiles, single_pass=True)
        result["single pass in turns"] = lambda: launch_backward.backward_mma(
            do, q, k, v, o, lse, _options(q, k, v, causal, True), choice.tiles,
            single_pass=True)
    if torch is not None:
        # GQA: K/V repeated per query head, as a torch user would (its efficient kernel
        # takes equal head counts only).
        group = q.shape[1] // k.shape[1]
        tq, tk, tv = (torch.from_dlpack(a) for a in (q, k, v))
        tk, tv = (t.repeat_interleave(group, dim=1) for t in (tk, tv))
        tq, tk, tv = (t.detach().requires_grad_() for t in (tq, tk, tv))
        tdo = torch.from_dlpack(do)
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        result["torch efficient"] = lambda: torch.autograd.grad(out, (tq, tk, tv), tdo,
                                                                retain_graph=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="128,256")
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--heads", default="16:16", help="Hq:Hkv pairs; Hq scales as 2048 / D")
    parser.add_argument("--repetitions", type=int, default=10)
    parser.add_argument("--once", action="store_true")
    parser.add_argument("--modes", default=None, help="comma list of the modes to run")
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    args = parser.parse_args()
    print("| D | causal | Hq:Hkv | " + "mode | ms | TFLOP/s |")
    print("| --- | --- | --- | --- | ---: | ---: |")
    for head_dim in map(int, args.dims.split(",")):
        for pair in args.heads.split(","):
            q_heads, kv_heads = map(int, pair.split(":"))
            scale = (2048 // head_dim) / 16
            q_heads, kv_heads = max(1, int(q_heads * scale)), max(1, int(kv_heads * scale))
            batch = max(1, 16384 // args.n)
            cupy.random.seed(0)
            q = cupy.random.standard_normal((batch, q_heads, args.n, head_dim), "float32")
            k, v = (cupy.random.standard_normal((batch, kv_heads, args.n, head_dim), "float32")
                    for _ in range(2))
            do = cupy.random.standard_normal(q.shape, "float32")
            for causal in {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]:
                flops = 2.5 * 4 * batch * q_heads * args.n * args.n * head_dim
                flops /= 2 if causal else 1
                for name, function in modes(q, k, v, do, causal).items():
                    if args.modes and name not in args.modes.split(","):
                        continue
                    if args.once:
                        function()
                        cupy.cuda.Device().synchronize()
                        continue
                    ms = median_ms(function, args.repetitions)
                    print(f"| {head_dim} | {causal} | {q_heads}:{kv_heads} | {name} | "
                          f"{ms:.3f} | {flops / ms / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
