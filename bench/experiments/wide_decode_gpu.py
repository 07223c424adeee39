"""Wide GQA decode (multi-head latent attention's absorbed decode: D = 576, Dv = 512, one K/V
head) folded into query rows of the mma.sync prefill (tiles.folded_choice) against the
CUDA-core decode kernel it replaces, calls back to back, float16, causal, one query row a
head and two (multi-token prediction: each row folded on its own).

    PYTHONPATH=. python3 bench/experiments/wide_decode_gpu.py [--warm-seconds 3] [--rounds 1]

The device first runs products for `--warm-seconds` (its clocks up; NOTES-gpu v37 saw the
small grids' times differ 1.5x between a cold and a warm machine), then the table
`--rounds` times.

Each line: B, Hq/Hkv, Nk, Nq | unfolded us (the decode kernel, or for 128 rows the prefill,
one row of each tile a head) | folded us, V and O whole (one launch) | folded us, V and O in column slices
(tiles.FOLD_VALUE_COLUMNS) | torch SDPA's efficient kernel us (K/V expanded to the query
heads as views; "-" without torch or where it refuses) | unfolded / best folded | GB/s of
K/V read by the fastest of ours | which one the dispatch picks. The results are compared
(max abs diff) before timing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import cupy
import numpy as np

import tileattn
from tileattn import gpu as gpu_backend
from tileattn.gpu import launch_forward, operands, tiles
from tileattn.options import AttentionOptions

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_timing import back_to_back_ms  # noqa: E402

# (B, Hq, Nk, Nq): one query row a head, and two (multi-token prediction, causal).
SHAPES = [(1, 16, 8192, 1), (2, 16, 8192, 1), (4, 16, 8192, 1), (8, 16, 8192, 1),
          (16, 16, 8192, 1), (1, 16, 65536, 1), (4, 16, 32768, 1), (8, 16, 32768, 1),
          (1, 128, 8192, 1), (4, 128, 8192, 1), (8, 128, 8192, 1), (1, 128, 32768, 1),
          (1, 128, 8192, 2), (4, 128, 8192, 2), (1, 128, 32768, 2)]


def timed(fold: bool, call, value_columns: int = tiles.FOLD_VALUE_COLUMNS):
    """The call unfolded (as before the fold: the decode kernel, or the prefill for more
    rows than it takes) or folded whatever its grid (V and O in slices of `value_columns`),
    and its microseconds back to back."""
    operands._PLANS.clear()  # the fold's decision is cached with the plans
    launch_forward.folds_group_rows = tiles.folds_group_rows if fold else (lambda *_: False)
    tiles.FOLD_MIN_WAVE = 0.0
    tiles.FOLD_VALUE_COLUMNS = value_columns
    result = call()
    return result, back_to_back_ms(call, 30) * 1e3


def torch_efficient_us(q, k, v) -> str:
    """torch SDPA's memory-efficient kernel on the same arrays, K/V expanded (views), causal
    aligned bottom-right (a mask) where there are several query rows."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return "-"
    tq, tk, tv = (torch.as_tensor(a, device="cuda") for a in (q, k, v))
    heads, n_q, n_k = tq.shape[1], tq.shape[2], tk.shape[2]
    tk, tv = (t.expand(-1, heads, -1, -1) for t in (tk, tv))
    mask = (None if n_q == 1 else torch.arange(n_k, device="cuda")[None, :]
            <= torch.arange(n_q, device="cuda")[:, None] + (n_k - n_q))
    try:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            def call():
                return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv,
                                                                        attn_mask=mask)
            call()
            return f"{back_to_back_ms(call, 30) * 1e3:.1f}"
    except RuntimeError as error:
        return f"- ({str(error).splitlines()[0][:40]})"


def warm(seconds: float) -> None:
    """Products on the device for `seconds`, so that the table does not start cold."""
    a = cupy.ones((4096, 4096), dtype=cupy.float16)
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        for _ in range(10):
            a @ a
        cupy.cuda.Device().synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm-seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    warm(args.warm_seconds)
    for _ in range(args.rounds):
        table()


def table() -> None:
    default, columns = tiles.FOLD_MIN_WAVE, tiles.FOLD_VALUE_COLUMNS
    print("B | Hq/Hkv | Nk | Nq | unfolded us | folded us, whole | folded us, sliced | "
          "torch efficient us | unfolded / best folded | GB/s (fastest) | picked")
    for batch, heads, n_k, n_q in SHAPES:
        rng = cupy.random.default_rng(0)
        q = rng.standard_normal((batch, heads, n_q, 576), dtype=cupy.float32).astype(cupy.float16)
        k = rng.standard_normal((batch, 1, n_k, 576), dtype=cupy.float32).astype(cupy.float16)
        v = rng.standard_normal((batch, 1, n_k, 512), dtype=cupy.float32).astype(cupy.float16)

        def call():
            return tileattn.forward(q, k, v, causal=True)

        plain, decode_us = timed(False, call)
        whole, whole_us = timed(True, call, 1 << 20)
        folded, folded_us = timed(True, call, columns)
        diff = max(float(abs(plain.astype(cupy.float32) - x.astype(cupy.float32)).max())
                   for x in (whole, folded))
        operands._PLANS.clear()
        launch_forward.folds_group_rows = tiles.folds_group_rows
        tiles.FOLD_MIN_WAVE, tiles.FOLD_VALUE_COLUMNS = default, columns
        anchor = torch_efficient_us(q, k, v)
        described = gpu_backend.describe(n_k, 576, 512, np.float16,
                                         AttentionOptions(causal=True, window_right=0),
                                         n_q=n_q, heads=heads, kv_heads=1,
                                         batch=batch)["forward"]
        picked = "folded" if "folded" in described else described.split(" ")[0]
        gigabytes = (k.nbytes + v.nbytes) / 1e9
        best = min(whole_us, folded_us)
        print(f"{batch} | {heads}/1 | {n_k} | {n_q} | {decode_us:.1f} | {whole_us:.1f} | "
              f"{folded_us:.1f} | {anchor} | {decode_us / best:.2f} | "
              f"{gigabytes / min(decode_us, best) * 1e6:.0f} | {picked} (diff {diff:.1e})",
              flush=True)
        del plain, whole, folded
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
