"""The float32 forward on wgmma (attention_tf32_wgmma_forward.cu) against the mma.sync one
(attention_tf32_forward.cu): the same scores, float32 accuracy, and speed.

    PYTHONPATH=. python3 bench/experiments/tf32_wgmma_forward_gpu.py [--dims 64,128]
        [--no-timings] [--repetitions 10]

For each D, causal or not, on ordinary inputs, scores of large magnitude (q x 40, k x 3) and
inputs holding inf and NaN (B 1, Hq 4 over Hkv 2, Nq 300, Nk 333), both kernels run and are
checked against the float64 golden model; the line says how many lse values are the same
bits in both (the backward recomputes P = exp(S - lse) with mma.sync, so a dominant key's P
is 1 only where the forward's scores are those of mma.sync), and the worst o error of each
in units of float32's tolerance. Then both kernels, and torch's efficient kernel where torch
is installed, are timed at B 4, N 4096, hidden 2048 (back to back, median).
"""

from __future__ import annotations

import argparse
import os
import sys

import cupy
import numpy as np

import tileattn
from tileattn.gpu import launch_forward, tiles
from tileattn.gpu.operands import problem_of
from tileattn.testing import attention_error
from tileattn.validation import validate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_gpu import median_ms  # noqa: E402


def _options(q, k, v, causal: bool):
    return validate(q, k, v, causal=causal, window=None, scale=None, softcap=None,
                    alibi_slopes=None, dropout_p=0.0, seed=None, block_q=None, block_k=None,
                    deterministic=True).options


def _choices(q, k, v, options):
    """(wgmma, mma.sync) choices of the tf32 family for this problem (wgmma on 64 x 16
    tiles where its table has no row)."""
    problem = problem_of(q, k, v, options)
    widths = tiles.Widths.of(problem, 8)
    new = next((row.tiles for row in tiles.TF32_WGMMA_FORWARD
                if row.when.matches(problem, widths)), tiles.Tf32WgmmaTiles(64, 16))
    old = next(row for row in tiles.TF32_FORWARD if row.when.matches(problem, widths)
               and row.tiles.shared_bytes(widths) <= problem.shared_limit)
    return tiles.Choice("tf32", new), tiles.Choice("tf32", old.tiles)


def _inputs(kind: str, head_dim: int, seed: int):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 4, 300, head_dim)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 333, head_dim)).astype(np.float32) for _ in range(2))
    if kind == "large":
        q *= 40.0
        k *= 3.0
    elif kind == "non-finite":
        k[0, 1, 17, 3] = np.inf
        v[0, 0, 200, 5] = -np.inf
        v[0, 1, 320, 0] = np.nan
        q[0, 0, 5, 1] = np.nan
    return q, k, v


def check(dims) -> int:
    failures = 0
    for head_dim in dims:
        for causal in (False, True):
            for kind in ("ordinary", "large", "non-finite"):
                q, k, v = _inputs(kind, head_dim, head_dim)
                options = _options(q, k, v, causal)
                golden_o, golden_lse = tileattn.forward(
                    *(a.astype(np.float64) for a in (q, k, v)), backend="reference",
                    causal=causal, return_lse=True)
                device = [cupy.asarray(a) for a in (q, k, v)]
                new, old = _choices(*device, options)
                (o_new, lse_new), (o_old, lse_old) = (
                    [a.get() for a in launch_forward.run(c, *device, options)] for c in (new, old))
                same = np.sum((lse_new.view(np.uint32) == lse_old.view(np.uint32))
                              | (np.isnan(lse_new) & np.isnan(lse_old)))
                units = [attention_error(o, golden_o, np.float32) for o in (o_new, o_old)]
                lse_units = [attention_error(x, golden_lse, np.float32) for x in (lse_new, lse_old)]
                # Large scores cost both kernels the same (lse's own rounding): a failure is
                # worse than the mma.sync kernel, or beyond the tolerance where it is within.
                bad = any(new > max(1.0, 1.01 * old)
                          for new, old in ((units[0], units[1]), (lse_units[0], lse_units[1])))
                failures += bad
                print(f"{'FAIL' if bad else 'ok  '} D{head_dim} {'causal' if causal else 'full  '}"
                      f" {kind:10s} lse same bits {same}/{lse_new.size}; o error "
                      f"{units[0]:.3f} / {units[1]:.3f}, lse {lse_units[0]:.3f} / "
                      f"{lse_units[1]:.3f} (wgmma / mma.sync, tolerance units)", flush=True)
    return failures


def _torch_efficient(q, k, v, causal):
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    tq, tk, tv = (torch.as_tensor(a, device="cuda") for a in (q, k, v))

    def call():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    return call


def _timing_inputs(head_dim: int):
    """q, k, v at B 4, N 4096, hidden 2048 (H = 2048 / D), and a forward's FLOPs by causal."""
    heads = max(1, 2048 // head_dim)
    rng = cupy.random.default_rng(0)
    q, k, v = (rng.standard_normal((4, heads, 4096, head_dim), dtype=cupy.float32)
               for _ in range(3))
    return (q, k, v), lambda causal: 4 * 4 * heads * 4096 * 4096 * head_dim / (1 + causal)


def _time_choice(choice, q, k, v, options, repetitions: int) -> float:
    """ms a call of `choice`'s cached launch (its outputs allocated once)."""
    o, lse = launch_forward.run(choice, q, k, v, options)
    launch = launch_forward.launch(choice, q, k, v, o, lse, options)
    return median_ms(lambda: launch(q, k, v, o, lse), repetitions)


def tile_timings(head_dim: int, shapes, repetitions: int) -> None:
    """The wgmma forward at D = Dv = head_dim on each (block_q, block_k) of `shapes`."""
    (q, k, v), flops = _timing_inputs(head_dim)
    for causal in (False, True):
        options = _options(q, k, v, causal)
        for block_q, block_k in shapes:
            choice = tiles.Choice("tf32", tiles.Tf32WgmmaTiles(block_q, block_k))
            ms = _time_choice(choice, q, k, v, options, repetitions)
            print(f"D{head_dim} {'causal' if causal else 'full'} {block_q}x{block_k}: "
                  f"{ms:.2f} ms, {flops(causal) / ms / 1e9:.1f} TFLOP/s", flush=True)


def timings(dims, repetitions: int) -> None:
    print("| D | causal | wgmma ms | mma.sync ms | torch efficient ms | wgmma TFLOP/s | "
          "wgmma / mma.sync | wgmma / torch |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for head_dim in dims:
        (q, k, v), flops = _timing_inputs(head_dim)
        for causal in (False, True):
            options = _options(q, k, v, causal)
            times = [_time_choice(choice, q, k, v, options, repetitions)
                     for choice in _choices(q, k, v, options)]
            torch_call = _torch_efficient(q, k, v, causal)
            torch_ms = median_ms(torch_call, repetitions) if torch_call else float("nan")
            print(f"| {head_dim} | {causal} | {times[0]:.2f} | {times[1]:.2f} | {torch_ms:.2f} | "
                  f"{flops(causal) / times[0] / 1e9:.1f} | {times[1] / times[0]:.2f} | "
                  f"{torch_ms / times[0]:.2f} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--repetitions", type=int, default=10)
    parser.add_argument("--no-timings", action="store_true")
    parser.add_argument("--no-checks", action="store_true")
    parser.add_argument("--tiles", default="",
                        help="time these BQxBK wgmma tiles at each D instead (e.g. 64x32,64x16)")
    args = parser.parse_args()
    dims = [int(d) for d in args.dims.split(",")]
    if args.tiles:
        shapes = [tuple(map(int, t.split("x"))) for t in args.tiles.split(",")]
        for head_dim in dims:
            tile_timings(head_dim, shapes, args.repetitions)
        return 0
    failures = 0 if args.no_checks else check(dims)
    if not args.no_timings:
        timings(dims, args.repetitions)
    return int(failures > 0)


if __name__ == "__main__":
    sys.exit(main())
