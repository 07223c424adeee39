"""CPU benchmark for issue 3: tileattn backend="cpu" beside torch SDPA and naive NumPy.

    PYTHONPATH=. python bench/bench_cpu.py                 # N in 1024..8192, causal and not
    PYTHONPATH=. python bench/bench_cpu.py --rounds 7 --out bench/results/cpu
    PYTHONPATH=. python bench/bench_cpu.py --sizes 4096 --block-q 128 --block-k 512
    PYTHONPATH=. python bench/bench_cpu.py --busy-core     # one core taken by another process

The issue's configuration (fp32, B=1, H=8, D=64) of `tileattn.benchmark.run_bench`, which
is also ``python -m tileattn bench``: correctness against the golden model and against each
anchor on the benchmark problem first, then the implementations take turns (best of
`--rounds`, with a pause before each call so OpenBLAS's spinning threads from the previous
call do not steal cores), GFLOP/s with FlashAttention's FLOP count, and the ratio to each
anchor. The memory figure of the issue (N = 65536, causal forward + backward) is
bench/memory_cpu.py.

``--busy-core`` (sizes default to 256-2048) is the shared-machine case instead: each size
is checked against the golden model, then timed with tileattn's own thread count and with
one thread, taking turns (median of `--rounds`), first as the machine is and then while a
second process spins on one core. A parallel kernel whose idle threads spin instead of
sleeping, or that wakes threads for too little work, shows up as "own / one thread" far
above 1 in the second half.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import numpy as np

ISSUE_SIZES = [1024, 2048, 4096, 8192]
BUSY_CORE_SIZES = [256, 512, 1024, 2048]


def _busy_core_problem(n, heads, head_dim, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, heads, n, head_dim)).astype(np.float32) for _ in range(4)]


def _check_against_golden(q, k, v, do):
    import tileattn
    from tileattn.testing import assert_attention_close

    as64 = [a.astype(np.float64) for a in (q, k, v, do)]
    o, lse = tileattn.forward(q, k, v, backend="cpu", return_lse=True)
    golden_o, golden_lse = tileattn.forward(*as64[:3], backend="reference", return_lse=True)
    assert_attention_close(o, golden_o, np.float32, name="o")
    grads = tileattn.backward(do, q, k, v, o, lse, backend="cpu")
    golden = tileattn.backward(as64[3], *as64[:3], o.astype(np.float64), golden_lse,
                               backend="reference")
    for name, grad, want in zip(("dq", "dk", "dv"), grads, golden):
        assert_attention_close(grad, want, np.float32, name=name)


def _median_ms_in_turns(functions: dict, rounds: int) -> dict:
    """name -> (numba thread setting, callable); each runs once untimed, then in turns."""
    import numba

    times = {name: [] for name in functions}
    for _ in range(rounds + 1):
        for name, (n_threads, function) in functions.items():
            numba.set_num_threads(n_threads)
            start = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(values[1:]) for name, values in times.items()}


def busy_core(sizes, rounds, heads, head_dim):
    """The table of ``--busy-core``: milliseconds per call, own thread count and one thread."""
    import numba

    import tileattn

    all_threads = numba.config.NUMBA_NUM_THREADS
    problems = {n: _busy_core_problem(n, heads, head_dim) for n in sizes}
    for q, k, v, do in problems.values():
        _check_against_golden(q, k, v, do)
    print(f"B=1, H={heads}, D={head_dim}, float32, non-causal; up to {all_threads} threads; "
          f"median of {rounds} calls in turns")
    print("| other core | N | pass | own threads (ms) | one thread (ms) | own / one |")
    print("|---|---|---|---|---|---|")
    for other in ("as it is", "busy"):
        burner = None
        if other == "busy":
            burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(0.5)
        try:
            for n, (q, k, v, do) in problems.items():
                o, lse = tileattn.forward(q, k, v, backend="cpu", return_lse=True)

                def run_forward():
                    tileattn.forward(q, k, v, backend="cpu")

                def run_forward_backward():
                    o, lse = tileattn.forward(q, k, v, backend="cpu", return_lse=True)
                    tileattn.backward(do, q, k, v, o, lse, backend="cpu")

                for label, function in (("forward", run_forward),
                                        ("forward+backward", run_forward_backward)):
                    ms = _median_ms_in_turns({"own": (all_threads, function),
                                              "one": (1, function)}, rounds)
                    print(f"| {other} | {n} | {label} | {ms['own']:.2f} | {ms['one']:.2f} | "
                          f"{ms['own'] / ms['one']:.2f} |", flush=True)
        finally:
            if burner is not None:
                burner.kill()
                burner.wait()
    numba.set_num_threads(all_threads)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-q", type=int)
    parser.add_argument("--block-k", type=int)
    parser.add_argument("--busy-core", action="store_true",
                        help="time small and mid sizes while another process takes one core")
    parser.add_argument("--out", help="folder for bench-cpu.json, bench-cpu.md, speed-cpu.png "
                                      "and memory-cpu.png")
    args = parser.parse_args(argv)
    if args.busy_core:
        busy_core(args.sizes or BUSY_CORE_SIZES, args.rounds or 15, args.heads, args.head_dim)
        return
    from tileattn.benchmark import run_bench

    blocks = {key: value for key, value in (("block_q", args.block_q),
                                            ("block_k", args.block_k)) if value}
    run_bench(backend="cpu", sizes=args.sizes or ISSUE_SIZES, rounds=args.rounds or 5,
              heads=args.heads, head_dims=args.head_dim, blocks=blocks, memory_sizes=[],
              out=args.out)


if __name__ == "__main__":
    main()
