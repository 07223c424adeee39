"""Each kernel of the default GPU backward timed alone, on FlashAttention's shapes.

    PYTHONPATH=. python3 bench/experiments/profile_gpu_backward.py [--dtype float16] [--n 1024,4096,16384]

Runs `tileattn.backward` once per shape (validated against the float64 golden model on a
small problem first), takes the launches it cached for that problem (D = rowsum(dO * o),
then the dQ kernel, then the dK/dV kernel) and times each one alone (CUDA events, median),
beside torch's FlashAttention-2 backward (forward+backward minus forward, same run). Tile
products per (query tile, key tile): dQ kernel 3 (S, dP, dQ), dK/dV kernel 4 (S^T, dP^T, dV,
dK); "product TFLOP/s" counts 2 * N * N * D FLOPs per product and head (halved causal), the
rate the tensor cores see, against which FA2 counts 5 products for the whole backward.
"""

from __future__ import annotations

import argparse
import os
import sys

import cupy

import tileattn
from tileattn.gpu import launch_backward, operands

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_gpu import Case, fa_functions, make_inputs, median_ms, validate_small  # noqa: E402

KERNELS = (("D", 0), ("dQ", 3), ("dK/dV", 4))  # name, tile products


def cached_backward_launches(q, k, v, do, o, lse, causal):
    """The launches `tileattn.backward` cached for this problem (the last backward plan)."""
    tileattn.backward(do, q, k, v, o, lse, backend="gpu", causal=causal)
    keys = [key for key in operands._PLANS if key[0] == "backward"]
    if not keys:
        raise RuntimeError("the backward cached no launches (not the Hopper path?)")
    return operands._PLANS[keys[-1]].launches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--n", default="1024,4096,16384")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--repetitions", type=int, default=10)
    args = parser.parse_args()
    print("| case | kernel | ms | share | product TFLOP/s | backward TFLOP/s | flash bwd TFLOP/s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for head_dim in map(int, args.head_dims.split(",")):
        for causal in (False, True):
            for n in map(int, args.n.split(",")):
                case = Case(args.dtype, 16384 // n, 2048 // head_dim, n, head_dim,
                            causal=causal, direction="backward")
                validate_small(case)
                q, k, v, do = make_inputs(case)
                o, lse = tileattn.forward(q, k, v, backend="gpu", return_lse=True,
                                          causal=causal)
                launches = cached_backward_launches(q, k, v, do, o, lse, causal)
                delta = launch_backward._new_delta(o)
                dq, dk, dv = launch_backward._outputs(q, k, v)
                arguments = ((do, o, delta), (q, k, v, do, lse, delta, dq),
                             (q, k, v, do, lse, delta, dk, dv, operands.empty(q.device.id,
                                                                              "float32")))
                times = [median_ms(lambda launch=launch, arrays=arrays: launch(*arrays),
                                   args.repetitions) for launch, arrays in zip(launches,
                                                                                arguments)]
                flash = fa_functions(case, q, k, v, do, nondeterministic=False).get("flash")
                flash_tflops = float("nan")
                if flash:
                    flash_ms = (median_ms(flash[1], args.repetitions)
                                - median_ms(flash[0], args.repetitions))
                    flash_tflops = case.flops / flash_ms / 1e9
                product_flops = case.flops / 2.5 / 2  # one product: half the forward
                for (name, products), ms in zip(KERNELS, times):
                    rate = f"{products * product_flops / ms / 1e9:.1f}" if products else "-"
                    print(f"| {case.name.replace('backward ', '')} | {name} | {ms:.3f} | "
                          f"{ms / sum(times):.0%} | {rate} | "
                          f"{case.flops / sum(times) / 1e9:.1f} | {flash_tflops:.1f} |",
                          flush=True)
                del q, k, v, do, o, lse, dq, dk, dv, delta
                cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
