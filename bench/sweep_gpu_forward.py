"""Sweep of the tensor-core forward's tiles and warp layouts, beside torch's flash forward.

    PYTHONPATH=. python3 bench/sweep_gpu_forward.py [--dtype float16] [--n 4096]

For D = 64 (B = 4, H = 32) and D = 128 (B = 4, H = 16), causal and not: every query tile
(64, 128) x key tile (32, 64, 128) x warp layout (16 rows with Q in registers, 32 rows with
Q in registers, 32 rows re-reading Q from shared memory). Each configuration is first
checked against the float64 golden model on a small problem with every option on, then
timed on the large one (CUDA events, median). Prints TFLOP/s and the ratio to torch's
FlashAttention-2 forward measured in the same run; the winners go into
`_launch.MMA_DEFAULT_BLOCKS` / `MMA_DEFAULT_LAYOUTS`.
"""

from __future__ import annotations

import argparse
import itertools

import cupy
import numpy as np

import tileattn
from tileattn.gpu import _launch
from tileattn.options import Blocks
from tileattn.testing import assert_attention_close
from tileattn.validation import validate

from bench_gpu import Case, fa_functions, make_inputs, median_ms

LAYOUTS = [_launch.WarpLayout(16, True), _launch.WarpLayout(32, True),
           _launch.WarpLayout(32, False)]
EVERY_OPTION = dict(causal=False, window=(64, 64), scale=None, softcap=5.0,
                    alibi_slopes=np.linspace(0.1, 0.4, 4), dropout_p=0.1, seed=7,
                    block_q=None, block_k=None, deterministic=True)


def sweep_arguments(description: str, wgmma_flag: bool = False):
    """The command line the sweeps share (`wgmma_flag`: the backward sweep's --wgmma)."""
    parser = argparse.ArgumentParser(description=description)
    if wgmma_flag:
        parser.add_argument("--wgmma", action="store_true",
                            help="sweep the Hopper (wgmma) kernels instead of mma.sync's")
        parser.add_argument("--alternatives", action="store_true",
                            help="--wgmma: also the mma.sync kernels and the single passes")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--repetitions", type=int, default=10)
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--block-q", default="",
                        help="only these query tiles (comma-separated; default all)")
    return parser.parse_args()


def plain_options(q, k, v, causal: bool):
    """The AttentionOptions of a benchmark problem: default scale, causal or not."""
    return validate(q, k, v, **{**EVERY_OPTION, "window": None, "softcap": None,
                                "alibi_slopes": None, "dropout_p": 0.0, "seed": None,
                                "causal": causal}).options


def run(q, k, v, options, blocks, layout):
    o = cupy.empty(q.shape, dtype=q.dtype)
    lse = cupy.empty(q.shape[:3], dtype=cupy.float32)
    _launch.forward_tensor_core(q, k, v, o, lse, options, blocks, layout)
    return o, lse


def golden_forward(dtype, head_dim):
    """``((q, k, v), options, (o, lse))``: a small problem with every option on (GQA, ends
    inside tiles), its AttentionOptions, and the golden model's answer."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 4, n, head_dim)).astype(dtype) for n in (200, 263, 263))
    problem = validate(q, k, v, **EVERY_OPTION)
    golden = [x.astype(np.float64) for x in (q, k, v)]
    options = {key: value for key, value in EVERY_OPTION.items() if key != "deterministic"}
    return (q, k, v), problem.options, tileattn.forward(*golden, backend="reference",
                                                        return_lse=True, **options)


def check(dtype, head_dim, *configuration, forward=None):
    """`forward(q, k, v, options, *configuration) -> (o, lse)` (by default this sweep's
    `run`) against the golden model on `golden_forward`'s problem."""
    (q, k, v), options, (want_o, want_lse) = golden_forward(dtype, head_dim)
    o, lse = (forward or run)(*map(cupy.asarray, (q, k, v)), options, *configuration)
    assert_attention_close(o.get(), want_o, q.dtype, name="o")
    assert_attention_close(lse.get(), want_lse, np.float32, name="lse")


def main() -> None:
    args = sweep_arguments(__doc__.splitlines()[0])
    rows = []
    for head_dim in map(int, args.head_dims.split(",")):
        heads = 2048 // head_dim
        for causal in (False, True):
            case = Case(args.dtype, 16384 // args.n, heads, args.n, head_dim, causal=causal)
            q, k, v, do = make_inputs(case)
            flash = fa_functions(case, q, k, v, do).get("flash")
            flash_tflops = case.flops / median_ms(flash[0], args.repetitions) / 1e9 \
                if flash else float("nan")
            options = plain_options(q, k, v, causal)
            for block_q, block_k, layout in itertools.product(
                    _launch.MMA_BLOCK_Q, _launch.MMA_BLOCK_K, LAYOUTS):
                blocks = Blocks(block_q, block_k)
                if block_q % layout.rows:
                    continue
                if not causal:
                    check(np.dtype(args.dtype), head_dim, blocks, layout)
                ms = median_ms(lambda q=q, k=k, v=v, blocks=blocks, layout=layout: run(
                    q, k, v, options, blocks, layout),
                    args.repetitions)
                tflops = case.flops / ms / 1e9
                rows.append((case.name, block_q, block_k, layout.rows,
                             layout.q_in_registers, tflops, tflops / flash_tflops))
                print(f"{case.name:<40} {block_q:4d}x{block_k:<4d} rows {layout.rows} "
                      f"q_regs {int(layout.q_in_registers)}: {tflops:6.1f} TFLOP/s "
                      f"({tflops / flash_tflops:.2f}x flash {flash_tflops:.1f})", flush=True)
            del q, k, v, do
            cupy.get_default_memory_pool().free_all_blocks()
    print("\n| case | tiles | warp rows | Q in registers | TFLOP/s | / flash |")
    print("| --- | --- | ---: | --- | ---: | ---: |")
    for name, block_q, block_k, warp_rows, q_regs, tflops, ratio in rows:
        print(f"| {name} | {block_q}x{block_k} | {warp_rows} | {'yes' if q_regs else 'no'} | "
              f"{tflops:.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
