"""Sweep of the tensor-core backward's tiles (owned rows x streamed rows per kernel).

    PYTHONPATH=. python3 bench/sweep_gpu_backward.py [--dtype float16] [--n 4096]

For D = 64 (B = 4, H = 32) and D = 128 (B = 4, H = 16), causal and not: each kernel's tiles
(owned 64 or 128 rows x streamed 32, 64 or 128 rows) are varied while the other kernel keeps
its default (`_launch.MMA_BACKWARD_TILES`). Each configuration is first checked against the
float64 golden model on a small problem with every option on, then the whole backward is
timed on the large one (CUDA events, median) beside torch's FlashAttention-2 backward
(derived as forward+backward minus forward, measured in the same run).
"""

from __future__ import annotations

import itertools

import cupy
import numpy as np

import tileattn
from tileattn.gpu import _launch
from tileattn.testing import assert_attention_close
from tileattn.validation import validate

from bench_gpu import Case, fa_functions, make_inputs, median_ms
from sweep_gpu_forward import EVERY_OPTION, plain_options, sweep_arguments

OWNED, STREAMED = (64, 128), (32, 64, 128)


def check(dtype, head_dim, tiles):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 4, n, head_dim)).astype(dtype) for n in (200, 263, 263))
    do = rng.standard_normal(q.shape).astype(dtype)
    options = {key: value for key, value in EVERY_OPTION.items() if key != "deterministic"}
    o, lse = tileattn.forward(*map(cupy.asarray, (q, k, v)), backend="gpu", return_lse=True,
                              **options)
    grads = _launch.backward_tensor_core(*map(cupy.asarray, (do, q, k, v)), lse,
                                         validate(q, k, v, **EVERY_OPTION).options, tiles)
    golden = [x.astype(np.float64) for x in (do, q, k, v)]
    want_o, want_lse = tileattn.forward(*golden[1:], backend="reference", return_lse=True,
                                        **options)
    wanted = tileattn.backward(*golden, want_o, want_lse, backend="reference", **options)
    for name, grad, want in zip(("dq", "dk", "dv"), grads, wanted):
        assert_attention_close(grad.get(), want, dtype, name=name)


def main() -> None:
    args = sweep_arguments(__doc__.splitlines()[0])
    rows = []
    for head_dim in map(int, args.head_dims.split(",")):
        heads = 2048 // head_dim
        default = _launch.MMA_BACKWARD_TILES[head_dim]
        candidates = [dict(default, dq=tile) for tile in itertools.product(OWNED, STREAMED)]
        candidates += [dict(default, dkdv=tile) for tile in itertools.product(OWNED, STREAMED)
                       if tile != default["dkdv"]]
        for causal in (False, True):
            case = Case(args.dtype, 16384 // args.n, heads, args.n, head_dim, causal=causal,
                        direction="backward")
            q, k, v, do = make_inputs(case)
            flash = fa_functions(case, q, k, v, do).get("flash")
            if flash:
                flash_ms = median_ms(flash[1], args.repetitions) - median_ms(
                    flash[0], args.repetitions)
                flash_tflops = case.flops / flash_ms / 1e9
            else:
                flash_tflops = float("nan")
            options = plain_options(q, k, v, causal)
            o, lse = tileattn.forward(q, k, v, backend="gpu", return_lse=True, causal=causal)
            for tiles in candidates:
                if not causal:
                    check(np.dtype(args.dtype), head_dim, tiles)
                ms = median_ms(lambda arrays=(do, q, k, v, lse), tiles=tiles:
                               _launch.backward_tensor_core(*arrays, options, tiles),
                               args.repetitions)
                tflops = case.flops / ms / 1e9
                rows.append((case.name, tiles["dq"], tiles["dkdv"], ms, tflops,
                             tflops / flash_tflops))
                print(f"{case.name:<42} dq {tiles['dq']} dkdv {tiles['dkdv']}: {ms:7.3f} ms "
                      f"{tflops:6.1f} TFLOP/s ({tflops / flash_tflops:.2f}x flash "
                      f"{flash_tflops:.1f})", flush=True)
            del q, k, v, do, o, lse
            cupy.get_default_memory_pool().free_all_blocks()
    print("\n| case | dQ tiles | dK/dV tiles | ms | TFLOP/s | / flash |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for name, dq, dkdv, ms, tflops, ratio in rows:
        print(f"| {name} | {dq[0]}x{dq[1]} | {dkdv[0]}x{dkdv[1]} | {ms:.3f} | {tflops:.1f} | "
              f"{ratio:.2f} |")


if __name__ == "__main__":
    main()
