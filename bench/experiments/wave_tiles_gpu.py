"""How the Hopper forward's tiles fare on grids of a few waves: small batches and head
counts (B = 1 inference prefill), short query blocks over long keys (a prefill chunk after a
cache), where the table's 192-row tiles can leave most of a last wave idle.

    PYTHONPATH=. python3 bench/experiments/wave_tiles_gpu.py [--dims 64,128]

Each line: the shape, the tiles the forward chooses and their grid in waves of resident
blocks, then ms per candidate (back to back, median of 3 runs of 20 calls:
gpu_timing.back_to_back_ms); the best is starred.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import cupy
import numpy as np

from tileattn.gpu import launch_forward
from tileattn.gpu.tiles import WgmmaTiles
from tileattn.validation import validate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_timing import back_to_back_ms  # noqa: E402

CANDIDATES = {
    64: [WgmmaTiles(192, 128, 2), WgmmaTiles(128, 128, 2, 2), WgmmaTiles(128, 64, 2, 2),
         WgmmaTiles(256, 64, 2)],
    128: [WgmmaTiles(192, 128, 2), WgmmaTiles(128, 64, 2, 2), WgmmaTiles(256, 64, 2),
          WgmmaTiles(128, 128, 2)],
}
SHAPES = [(1, heads, n, n) for heads in (8, 16, 32) for n in (1024, 2048, 4096, 8192)] + [
    (4, 16, 512, 8704), (2, 16, 1024, 16384), (1, 32, 2048, 32768)]
DEFAULTS = dict(window=None, scale=None, softcap=None, alibi_slopes=None, dropout_p=0.0,
                seed=None, block_q=None, block_k=None, deterministic=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="64,128")
    args = parser.parse_args()
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    rng = np.random.default_rng(0)
    for dim in map(int, args.dims.split(",")):
        for batch, heads, n_q, n_k in SHAPES:
            heads = heads * 128 // dim if dim < 128 else heads
            q = cupy.asarray(rng.standard_normal((batch, heads, n_q, dim)), cupy.float16)
            k = cupy.asarray(rng.standard_normal((batch, heads, n_k, dim)), cupy.float16)
            o, lse = cupy.empty_like(q), cupy.empty((batch, heads, n_q), cupy.float32)
            for causal in (False, True):
                options = validate(q, k, k, causal=causal, **DEFAULTS).options
                table = launch_forward.choose(q, k, k, options).tiles
                blocks = batch * heads * math.ceil(n_q / table.block_q)
                waves = blocks / (sms * table.blocks_per_sm)
                cells = []
                for tiles in CANDIDATES[dim]:
                    try:
                        cells.append(back_to_back_ms(lambda: launch_forward.forward_wgmma(
                            q, k, k, o, lse, options, tiles), 20))
                    except Exception:  # noqa: BLE001 (a candidate that does not build)
                        cells.append(float("nan"))
                best = int(np.nanargmin(cells))
                shown = " | ".join(f"{c:.3f}{'*' if i == best else ''}"
                                   for i, c in enumerate(cells))
                print(f"D{dim} B{batch} H{heads} Nq{n_q} Nk{n_k} {'causal' if causal else 'full'}"
                      f" | table {table.block_q}x{table.block_k}x{table.stages}"
                      f"/{table.blocks_per_sm} {waves:.2f} waves | {shown}", flush=True)
        print("candidates:", ", ".join(f"{t.block_q}x{t.block_k}x{t.stages}/{t.blocks_per_sm}"
                                       for t in CANDIDATES[dim]))


if __name__ == "__main__":
    main()
