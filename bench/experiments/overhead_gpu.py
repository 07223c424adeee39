"""Host time per call of the GPU backend: what a small problem pays beyond its kernels.

    PYTHONPATH=. python3 bench/experiments/overhead_gpu.py [--decode]

Times `tileattn.forward` / `tileattn.backward` (backend="gpu") on a problem small enough
that the kernels take a few microseconds, as wall time per call over many calls (the
launches queue asynchronously, so this is the host's cost), then prints a profile of the
forward's calls. At FlashAttention's N = 1k benchmark shapes the forward's kernel takes
0.3-0.6 ms, so every 0.1 ms here is 15-30 % of such a call. ``--decode`` times a decode step
instead (B 1, Hq 8, Hkv 1, Nq 1, Nk 512, D 64: the split-KV kernel and its merge);
``--varlen`` a packed call (8 sequences of 128 rows, Hq 2, D 64, causal, forward and
backward) and a paged decode step (B 8, Hq 32, Hkv 8, page 64, 512 keys each, lengths
unchecked), with host NumPy lengths and tables, then with CuPy int32 ones (which stay on the
device), beside a dense step of 64 keys.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import cupy
import numpy as np

import tileattn


def per_call_us(function, calls: int = 200, rounds: int = 5) -> float:
    """Host microseconds a call: the best of `rounds` rounds of `calls` calls queued back to
    back from an idle device. A round stays below the driver's queue of pending launches
    (about a thousand): past it each launch waits for one to finish, and the figure
    would be the kernels' device time instead."""
    best = float("inf")
    function()
    for _ in range(rounds):
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            function()
        best = min(best, time.perf_counter() - start)
    cupy.cuda.Device().synchronize()
    return best / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode", action="store_true", help="a decode step's shape")
    parser.add_argument("--varlen", action="store_true",
                        help="packed and paged calls instead of dense ones")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    if args.varlen:
        return varlen(rng)
    if args.decode:
        shapes = ((1, 8, 1, 64), (1, 1, 512, 64), (1, 1, 512, 64), (1, 8, 1, 64))
    else:
        shapes = ((1, 2, 128, 64),) * 4
    q, k, v, do = (cupy.asarray(rng.standard_normal(shape).astype(np.float16))
                   for shape in shapes)
    o, lse = tileattn.forward(q, k, v, backend="gpu", causal=True, return_lse=True)
    forward = lambda: tileattn.forward(q, k, v, backend="gpu", causal=True)  # noqa: E731
    backward = lambda: tileattn.backward(do, q, k, v, o, lse, backend="gpu",  # noqa: E731
                                         causal=True)
    print(f"forward : {per_call_us(forward):7.1f} us per call (host)")
    print(f"backward: {per_call_us(backward):7.1f} us per call (host)")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(500):
        forward()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(30)


def varlen(rng) -> None:
    cu = np.arange(9, dtype=np.int64) * 128
    q, k, v, do = (cupy.asarray(rng.standard_normal((2, 1024, 64)).astype(np.float16))
                   for _ in range(4))
    lengths = {"cu_seqlens_q": cu, "cu_seqlens_k": cu}
    o, lse = tileattn.forward(q, k, v, backend="gpu", causal=True, return_lse=True, **lengths)
    packed = lambda: tileattn.forward(q, k, v, backend="gpu", causal=True,  # noqa: E731
                                      **lengths)
    packed_backward = lambda: tileattn.backward(do, q, k, v, o, lse,  # noqa: E731
                                                backend="gpu", causal=True, **lengths)
    pool = cupy.asarray(rng.standard_normal((64, 8, 64, 128)).astype(np.float16))
    step_q = cupy.asarray(rng.standard_normal((8, 32, 1, 128)).astype(np.float16))
    paged_lengths = {"block_table": rng.permutation(64).reshape(8, 8),
                     "seqlens_k": np.full(8, 512), "check_lengths": False}
    paged = lambda: tileattn.forward(step_q, pool, pool, backend="gpu",  # noqa: E731
                                     **paged_lengths)
    device_lengths = {"block_table": cupy.asarray(paged_lengths["block_table"], np.int32),
                      "seqlens_k": cupy.asarray(paged_lengths["seqlens_k"], np.int32),
                      "check_lengths": False}
    paged_device = lambda: tileattn.forward(step_q, pool, pool, backend="gpu",  # noqa: E731
                                            **device_lengths)
    dense_step = lambda: tileattn.forward(step_q, pool[:8].reshape(8, 8, 64, 128),  # noqa
                                          pool[:8].reshape(8, 8, 64, 128), backend="gpu")
    print(f"packed forward : {per_call_us(packed, 500):7.1f} us per call (host)")
    print(f"packed backward: {per_call_us(packed_backward, 500):7.1f} us per call (host)")
    print(f"paged decode   : {per_call_us(paged, 500):7.1f} us per call (host)")
    print(f"paged decode, device int32 lengths and table: {per_call_us(paged_device, 500):7.1f}"
          f" us per call (host)")
    print(f"dense decode step of the same shape (64 keys): {per_call_us(dense_step, 500):7.1f}"
          f" us per call (host)")
    for name, function in (("packed forward", packed), ("paged decode", paged),
                           ("paged decode, device tables", paged_device)):
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(200):
            function()
        profile.disable()
        print(f"== {name}")
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
