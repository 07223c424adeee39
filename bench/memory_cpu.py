"""Peak host memory of tileattn's CPU backend beyond its inputs and outputs (issue 3).

    PYTHONPATH=. python bench/memory_cpu.py                  # one head, N = 65536, D = 64
    PYTHONPATH=. python bench/memory_cpu.py --n 16384 --no-causal

One causal forward + backward in a fresh process, measured by
`tileattn.benchmark.host_peak_extra_bytes` (resident high-water mark after a warm-up, minus
the resident size before the call, minus o, lse, dq, dk and dv). A materialised score
matrix at N = 65536 would take 16 GiB in float32.
"""

from __future__ import annotations

import argparse

from tileattn.benchmark import host_peak_extra_bytes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=65536)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--no-causal", action="store_true")
    args = parser.parse_args(argv)
    extra = host_peak_extra_bytes("tileattn-cpu", args.n, args.head_dim,
                                  causal=not args.no_causal)
    inputs = 4 * args.n * args.head_dim * 4
    print(f"N={args.n} D={args.head_dim} causal={not args.no_causal}: inputs "
          f"{inputs / 2**20:.1f} MiB, extra peak beyond inputs and outputs "
          f"{extra / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
