"""The CUDA-core generic kernels' tile capacity in float64: what bigger tiles would gain.

    PYTHONPATH=. python3 bench/experiments/generic_tiles_gpu.py [--dims 64,128,256]
        [--n 4096] [--blocks 16x16,16x32,32x32,32x64,64x32,64x64]

`launch_forward.GenericConfig.for_problem` takes a tile capacity per direction from
`GENERIC_CAPACITIES` (this sweep's results; before it, one capacity for every kernel sized
to 48 KiB: 16 x 16 in float64 from D 64, 0.26x / 0.15x torch's math backend forward /
forward + backward at B4 H16 N4k D 128, NOTES-gpu v51), where torch's math backend runs
cuBLAS on the FP64 tensor cores. For each capacity forced here (forward and
backward alike; one that a kernel's shared memory does not fit on this device is
reported for that direction), the forward and the forward + backward are checked against
the float64 golden model on a small problem, then timed (calls back to back) at batch x N
= 16k tokens, hidden about 2048, causal and not, beside torch's math backend where torch
is installed. The best forward and the best backward capacity per head dim are what a
rule per direction would take.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 2)[0])  # bench/, for gpu_timing


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="64,128,256")
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--blocks", default="16x16,16x32,32x32,32x64,64x32,64x64",
                        help="block_q x block_k capacities, comma-separated")
    parser.add_argument("--repetitions", type=int, default=3)
    args = parser.parse_args(argv)
    capacities = [tuple(map(int, b.split("x"))) for b in args.blocks.split(",")]

    import cupy

    import tileattn
    from gpu_timing import back_to_back_ms
    from tileattn.gpu import clear_plans, launch_forward
    from tileattn.options import Blocks

    original = launch_forward.GenericConfig.for_problem.__func__
    forced = {"capacity": None}

    def for_problem(cls, dtype, head_dim, value_dim, options, direction, shared_limit=None):
        config = original(cls, dtype, head_dim, value_dim, options, direction, shared_limit)
        if forced["capacity"] is None:
            return config
        return dataclasses.replace(config, capacity=Blocks(*forced["capacity"]))

    launch_forward.GenericConfig.for_problem = classmethod(for_problem)
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        have_torch = torch.cuda.is_available()
    except ImportError:
        have_torch = False
    print(f"# {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, float64, generic "
          f"kernels, ms back to back, the table's capacity first")
    print("| D | causal | capacity | forward | fwd+bwd | torch math fwd | torch math fwd+bwd |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for dim in map(int, args.dims.split(",")):
        heads, batch = max(1, round(2048 / dim)), max(1, 16384 // args.n)
        rng = np.random.default_rng(0)
        host = [rng.standard_normal((batch, heads, args.n, dim)) for _ in range(4)]
        q, k, v, do = (cupy.asarray(a) for a in host)
        small = [a[:1, :2, :300].copy() for a in host]
        for causal in (False, True):
            anchors = ["-", "-"]
            if have_torch:
                tq, tk, tv, tdo = (torch.from_dlpack(a) for a in (q, k, v, do))

                def math(grad, causal=causal):
                    leaves = [t.detach().requires_grad_(grad) for t in (tq, tk, tv)]
                    with sdpa_kernel(SDPBackend.MATH):
                        out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
                    if grad:
                        out.backward(tdo)

                anchors = [f"{back_to_back_ms(lambda g=g: math(g), args.repetitions):.2f}"
                           for g in (False, True)]
            for capacity in [None] + capacities:
                forced["capacity"] = capacity
                clear_plans()
                label = "table" if capacity is None else "{} x {}".format(*capacity)

                def forward():
                    return tileattn.forward(q, k, v, causal=causal, return_lse=True,
                                            backend="gpu")

                def forward_backward():
                    o, lse = forward()
                    tileattn.backward(do, q, k, v, o, lse, causal=causal, backend="gpu")

                cells = []
                for direction, call in (("forward", forward), ("backward", forward_backward)):
                    try:
                        _check(tileattn, small, causal, direction)
                        cells.append(f"{back_to_back_ms(call, args.repetitions):.2f}")
                    except ValueError as error:  # the capacity's shared memory does not fit
                        cells.append(f"does not fit ({str(error)[:40]})")
                print(f"| {dim} | {causal} | {label} | {cells[0]} | {cells[1]} | "
                      f"{anchors[0]} | {anchors[1]} |", flush=True)


def _check(tileattn, host, causal: bool, direction: str) -> None:
    """The forward (and for "backward" the gradients) at the forced capacity against the
    float64 golden model."""
    import cupy

    from tileattn.testing import assert_attention_close

    q, k, v, do = (cupy.asarray(a) for a in host)
    o, lse = tileattn.forward(q, k, v, causal=causal, return_lse=True, backend="gpu")
    o64, lse64 = tileattn.forward(*host[:3], causal=causal, return_lse=True,
                                  backend="reference")
    assert_attention_close(o.get(), o64, np.float64, name="o")
    if direction == "backward":
        grads = tileattn.backward(do, q, k, v, o, lse, causal=causal, backend="gpu")
        grads64 = tileattn.backward(host[3], *host[:3], o.get(), lse64, causal=causal,
                                    backend="reference")
        for name, got, want in zip(("dq", "dk", "dv"), grads, grads64):
            assert_attention_close(got.get(), want, np.float64, name=name)


if __name__ == "__main__":
    main()
