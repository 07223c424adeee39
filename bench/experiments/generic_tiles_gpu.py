"""The CUDA-core generic kernels' tile capacity against its shared-memory target: what float64
would gain from bigger tiles.

    PYTHONPATH=. python3 bench/experiments/generic_tiles_gpu.py [--dims 64,128,256]
        [--n 4096] [--targets 48,96,160,220]

`launch_forward.GENERIC_SHARED_TARGET` (48 KiB) sizes the generic kernels' tiles: 64 x 64
halved until every kernel's shared memory fits it, down to 16 x 16. In float64 at D = 128
that is 16 x 16 (every block of 16 query rows reads all of K and V, one barrier per 16
keys), where torch's math backend runs cuBLAS on the FP64 tensor cores (NOTES-gpu v51:
0.26x / 0.15x it forward / forward + backward at B4 H16 N4k). For each target the sweep
prints the capacity the rule gives, checks forward and gradients against the float64
golden model on a small problem of that configuration, then times the forward and the
forward + backward (calls back to back) at batch x N = 16k tokens, hidden about 2048,
beside torch's math backend where torch is installed.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 2)[0])  # bench/, for gpu_timing


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="64,128,256")
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--targets", default="48,96,160,220", help="KiB, comma-separated")
    parser.add_argument("--repetitions", type=int, default=3)
    args = parser.parse_args(argv)

    import cupy

    import tileattn
    from gpu_timing import back_to_back_ms
    from tileattn.gpu import launch_forward, operands
    from tileattn.testing import assert_attention_close
    from tileattn.validation import validate

    limit = operands.shared_memory_limit(cupy.cuda.Device().id)
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        have_torch = torch.cuda.is_available()
    except ImportError:
        have_torch = False
    dtype = np.dtype(np.float64)
    print(f"# {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, float64, "
          f"generic kernels, ms back to back, shared memory limit {limit // 1024} KiB")
    print("| D | causal | target KiB | capacity | forward | fwd+bwd | torch math fwd | "
          "torch math fwd+bwd |")
    print("|---:|---|---:|---|---:|---:|---:|---:|")
    for dim in map(int, args.dims.split(",")):
        heads, batch = max(1, round(2048 / dim)), max(1, 16384 // args.n)
        rng = np.random.default_rng(0)
        host = [rng.standard_normal((batch, heads, args.n, dim)).astype(dtype)
                for _ in range(4)]
        q, k, v, do = (cupy.asarray(a) for a in host)
        small = [a[:1, :2, :300].copy() for a in host]
        for causal in (False, True):
            anchors = ["-", "-"]
            if have_torch:
                tq, tk, tv, tdo = (torch.from_dlpack(a) for a in (q, k, v, do))

                def math(grad, tq=tq, tk=tk, tv=tv, tdo=tdo, causal=causal):
                    operands_ = [t.detach().requires_grad_(grad) for t in (tq, tk, tv)]
                    with sdpa_kernel(SDPBackend.MATH):
                        out = F.scaled_dot_product_attention(*operands_, is_causal=causal)
                    if grad:
                        out.backward(tdo)

                anchors = [f"{back_to_back_ms(lambda g=g: math(g), args.repetitions):.2f}"
                           for g in (False, True)]
            for target in map(int, args.targets.split(",")):
                if target * 1024 > limit:
                    continue
                launch_forward.GENERIC_SHARED_TARGET = target * 1024
                operands._PLANS.clear()
                operands._SEQUENCE_PLANS.clear()
                options = validate(q, k, v, causal=causal, window=None, scale=None,
                                   softcap=None, alibi_slopes=None, dropout_p=0.0, seed=None,
                                   block_q=None, block_k=None, deterministic=True).options
                capacity = launch_forward.GenericConfig.for_problem(
                    dtype, dim, dim, options).capacity
                try:
                    _check(tileattn, assert_attention_close, small, causal)
                except Exception as error:  # a capacity the device or compiler refuses
                    print(f"| {dim} | {causal} | {target} | {capacity} | "
                          f"{type(error).__name__}: {str(error)[:80]} | | | |")
                    continue

                def forward():
                    return tileattn.forward(q, k, v, causal=causal, return_lse=True,
                                            backend="gpu")

                def forward_backward():
                    o, lse = forward()
                    tileattn.backward(do, q, k, v, o, lse, causal=causal, backend="gpu")

                times = [back_to_back_ms(f, args.repetitions) for f in (forward,
                                                                       forward_backward)]
                print(f"| {dim} | {causal} | {target} | {capacity.block_q} x "
                      f"{capacity.block_k} | {times[0]:.2f} | {times[1]:.2f} | "
                      f"{anchors[0]} | {anchors[1]} |", flush=True)


def _check(tileattn, assert_attention_close, host, causal: bool) -> None:
    """Forward and gradients of the generic kernels at the current target against the
    float64 golden model."""
    import cupy

    q, k, v, do = (cupy.asarray(a) for a in host)
    o, lse = tileattn.forward(q, k, v, causal=causal, return_lse=True, backend="gpu")
    grads = tileattn.backward(do, q, k, v, o, lse, causal=causal, backend="gpu")
    wide = [a.astype(np.float64) for a in host]
    o64, lse64 = tileattn.forward(*wide[:3], causal=causal, return_lse=True,
                                  backend="reference")
    grads64 = tileattn.backward(wide[3], *wide[:3], o.get().astype(np.float64), lse64,
                                causal=causal, backend="reference")
    for name, got, want in zip(("o", "dq", "dk", "dv"), (o, *grads), (o64, *grads64)):
        assert_attention_close(got.get(), want, host[0].dtype, name=name)


if __name__ == "__main__":
    main()
