"""CPU benchmark for issue 3: tileattn backend="cpu" beside torch SDPA and naive NumPy.

    PYTHONPATH=. python bench/bench_cpu.py                 # N in 1024..8192, causal and not
    PYTHONPATH=. python bench/bench_cpu.py --rounds 7 --out bench/results/cpu
    PYTHONPATH=. python bench/bench_cpu.py --sizes 4096 --block-q 128 --block-k 512

The issue's configuration (fp32, B=1, H=8, D=64) of `tileattn.benchmark.run_bench`, which
is also ``python -m tileattn bench``: correctness against the golden model and against each
anchor on the benchmark problem first, then the implementations take turns (best of
`--rounds`, with a pause before each call so OpenBLAS's spinning threads from the previous
call do not steal cores), GFLOP/s with FlashAttention's FLOP count, and the ratio to each
anchor. The memory figure of the issue (N = 65536, causal forward + backward) is
bench/memory_cpu.py.
"""

from __future__ import annotations

import argparse

from tileattn.benchmark import run_bench

ISSUE_SIZES = [1024, 2048, 4096, 8192]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=ISSUE_SIZES)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-q", type=int)
    parser.add_argument("--block-k", type=int)
    parser.add_argument("--out", help="folder for results.json, results.md and plots")
    args = parser.parse_args(argv)
    blocks = {key: value for key, value in (("block_q", args.block_q),
                                            ("block_k", args.block_k)) if value}
    run_bench(backend="cpu", sizes=args.sizes, rounds=args.rounds, heads=args.heads,
              head_dims=args.head_dim, blocks=blocks, memory_sizes=[], out=args.out)


if __name__ == "__main__":
    main()
