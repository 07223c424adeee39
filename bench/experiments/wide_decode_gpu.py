"""Wide GQA decode (multi-head latent attention's absorbed decode: D = 576, Dv = 512, one K/V
head) folded into query rows of the mma.sync prefill (tiles.folded_choice) against the
CUDA-core decode kernel it replaces, calls back to back, float16, one query row a head.

    PYTHONPATH=. python3 bench/experiments/wide_decode_gpu.py

Each line: B, Hq/Hkv, Nk | unfolded us (the decode kernel, or for 128 rows the prefill one
row a head) | folded us (the prefill's choice) | unfolded / folded | GB/s of K/V read by the
faster | which one the dispatch picks. The two
results are compared (max abs diff) before timing.
"""

from __future__ import annotations

import os
import sys

import cupy
import numpy as np

import tileattn
from tileattn import gpu as gpu_backend
from tileattn.gpu import launch_forward, operands, tiles

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_timing import back_to_back_ms  # noqa: E402

SHAPES = [(1, 16, 8192), (2, 16, 8192), (4, 16, 8192), (8, 16, 8192), (16, 16, 8192),
          (1, 16, 65536), (4, 16, 32768), (8, 16, 32768), (1, 128, 8192), (4, 128, 8192),
          (8, 128, 8192), (1, 128, 32768)]


def timed(fold: bool, call):
    """The call unfolded (as before the fold: the decode kernel, or the prefill for more
    rows than it takes) or folded whatever its grid, and its microseconds back to back."""
    operands._PLANS.clear()  # the fold's decision is cached with the plans
    launch_forward.folds_group_rows = tiles.folds_group_rows if fold else (lambda *_: False)
    tiles.FOLD_MIN_WAVE = 0.0
    result = call()
    return result, back_to_back_ms(call, 30) * 1e3


def main() -> None:
    default = tiles.FOLD_MIN_WAVE
    print("B | Hq/Hkv | Nk | unfolded us | folded us | decode / folded | GB/s (faster) | picked")
    for batch, heads, n_k in SHAPES:
        rng = cupy.random.default_rng(0)
        q = rng.standard_normal((batch, heads, 1, 576), dtype=cupy.float32).astype(cupy.float16)
        k = rng.standard_normal((batch, 1, n_k, 576), dtype=cupy.float32).astype(cupy.float16)
        v = rng.standard_normal((batch, 1, n_k, 512), dtype=cupy.float32).astype(cupy.float16)

        def call():
            return tileattn.forward(q, k, v, causal=True)

        plain, decode_us = timed(False, call)
        folded, folded_us = timed(True, call)
        diff = float(abs(plain.astype(cupy.float32) - folded.astype(cupy.float32)).max())
        operands._PLANS.clear()
        launch_forward.folds_group_rows = tiles.folds_group_rows
        tiles.FOLD_MIN_WAVE = default
        described = gpu_backend.describe(n_k, 576, 512, np.float16, n_q=1, heads=heads,
                                         kv_heads=1, batch=batch)["forward"]
        picked = "folded" if "folded" in described else described.split(" ")[0]
        gigabytes = (k.nbytes + v.nbytes) / 1e9
        print(f"{batch} | {heads}/1 | {n_k} | {decode_us:.1f} | {folded_us:.1f} | "
              f"{decode_us / folded_us:.2f} | {gigabytes / min(decode_us, folded_us) * 1e6:.0f}"
              f" | {picked} (diff {diff:.1e})", flush=True)
        del plain, folded
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
