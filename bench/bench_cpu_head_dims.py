"""tileattn's CPU backend against torch SDPA (CPU) across head dims, including Dv != D.

    PYTHONPATH=. python bench/bench_cpu_head_dims.py                  # 2 threads, every shape
    PYTHONPATH=. python bench/bench_cpu_head_dims.py --threads 16 --repeats 7
    PYTHONPATH=. python bench/bench_cpu_head_dims.py --dims 80 96 --sizes 1024

float32, B=1, H=8 (both cores busy with heads), N in {1024, 4096}, causal and not, head dims
D = Dv in {32, 40, 80, 96, 160, 192, 256} and (D, Dv) in {(192, 128), (128, 64)}. First every
(D, Dv, causal) is checked against the float64 golden model at N = 1024, forward and
backward, at the tolerances of `tileattn.testing`. Then tileattn and
``torch.nn.functional.scaled_dot_product_attention`` take turns on the same inputs with the
same thread count (``numba.set_num_threads`` / ``torch.set_num_threads``), each call after a
short pause so one library's spinning worker threads do not slow the other's call, and
the median of `--repeats` counts. GFLOP/s use FlashAttention's count: forward
``2 B H Nq Nk (D + Dv)`` (``4 B H N^2 D`` when Dv = D), halved when causal; backward 2.5x the
forward. "ratio" is torch's time over tileattn's (> 1: tileattn faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

HEAD_DIMS = [(32, 32), (40, 40), (80, 80), (96, 96), (160, 160), (192, 192), (256, 256),
             (192, 128), (128, 64)]
SIZES = [1024, 4096]
SETTLE_SECONDS = 0.2
VALIDATION_N = 1024


def flops(heads, n, head_dim, value_dim, causal, with_backward):
    forward = 2.0 * heads * n * n * (head_dim + value_dim) * (0.5 if causal else 1.0)
    return forward * (3.5 if with_backward else 1.0)


def _inputs(heads, n, head_dim, value_dim, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(1, heads, n, head_dim)] * 2 + [(1, heads, n, value_dim)] * 2
    return [rng.standard_normal(shape).astype(np.float32) for shape in shapes]


def validate(heads, head_dim, value_dim, causal):
    """tileattn's forward and backward against the float64 golden model."""
    import tileattn
    from tileattn.testing import assert_attention_close

    q, k, v, do = _inputs(heads, VALIDATION_N, head_dim, value_dim, seed=1)
    as64 = [a.astype(np.float64) for a in (q, k, v, do)]
    o, lse = tileattn.forward(q, k, v, causal=causal, backend="cpu", return_lse=True)
    golden_o, golden_lse = tileattn.forward(*as64[:3], causal=causal, backend="reference",
                                            return_lse=True)
    assert_attention_close(o, golden_o, np.float32, name="o")
    assert_attention_close(lse, golden_lse, np.float32, name="lse")
    grads = tileattn.backward(do, q, k, v, o, lse, causal=causal, backend="cpu")
    golden = tileattn.backward(as64[3], *as64[:3], o.astype(np.float64), golden_lse,
                               causal=causal, backend="reference")
    for name, grad, want in zip(("dq", "dk", "dv"), grads, golden):
        assert_attention_close(grad, want, np.float32, name=name)


def implementations(q, k, v, do, causal):
    """name -> (forward, forward+backward) callables on the same inputs."""
    import torch

    import tileattn

    def ours_forward():
        tileattn.forward(q, k, v, causal=causal, backend="cpu")

    def ours_forward_backward():
        o, lse = tileattn.forward(q, k, v, causal=causal, backend="cpu", return_lse=True)
        tileattn.backward(do, q, k, v, o, lse, causal=causal, backend="cpu")

    tq, tk, tv, tdo = (torch.from_numpy(a) for a in (q, k, v, do))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def torch_forward():
        with torch.no_grad():
            sdpa(tq, tk, tv, is_causal=causal)

    def torch_forward_backward():
        leaves = [t.detach().requires_grad_() for t in (tq, tk, tv)]
        torch.autograd.grad(sdpa(*leaves, is_causal=causal), leaves, tdo)

    return {"tileattn": (ours_forward, ours_forward_backward),
            "torch": (torch_forward, torch_forward_backward)}


def median_seconds_in_turns(functions: dict, repeats: int) -> dict:
    times = {name: [] for name in functions}
    for function in functions.values():
        function()
    for _ in range(repeats):
        for name, function in functions.items():
            time.sleep(SETTLE_SECONDS)
            start = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    parser.add_argument("--dims", type=int, nargs="+",
                        help="D = Dv values to run (default: the table's, with the Dv != D pairs)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--skip-validation", action="store_true")
    args = parser.parse_args(argv)

    import numba
    import torch

    numba.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    dims = [(d, d) for d in args.dims] if args.dims else HEAD_DIMS
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    if not args.skip_validation:
        for head_dim, value_dim in dims:
            for causal in causals:
                validate(args.heads, head_dim, value_dim, causal)
        print(f"validated against the golden model at N = {VALIDATION_N}", flush=True)

    print(f"float32, B=1, H={args.heads}, {args.threads} threads, median of {args.repeats}")
    print("| D | Dv | N | causal | pass | tileattn ms | torch ms | tileattn GFLOP/s "
          "| torch GFLOP/s | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for head_dim, value_dim in dims:
        for n in args.sizes:
            q, k, v, do = _inputs(args.heads, n, head_dim, value_dim)
            for causal in causals:
                table = implementations(q, k, v, do, causal)
                for index, label in enumerate(("forward", "forward+backward")):
                    seconds = median_seconds_in_turns(
                        {name: pair[index] for name, pair in table.items()}, args.repeats)
                    work = flops(args.heads, n, head_dim, value_dim, causal, index == 1)
                    ours, theirs = seconds["tileattn"], seconds["torch"]
                    print(f"| {head_dim} | {value_dim} | {n} | {'yes' if causal else 'no'} "
                          f"| {label} | {1e3 * ours:.1f} | {1e3 * theirs:.1f} "
                          f"| {work / ours / 1e9:.1f} | {work / theirs / 1e9:.1f} "
                          f"| {theirs / ours:.2f} |", flush=True)


if __name__ == "__main__":
    main()
