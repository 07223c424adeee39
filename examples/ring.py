"""Ring attention over MPI on the CPU: one sequence split across the ranks.

    pip install '.[distributed]'
    mpiexec -n 2 python examples/ring.py            # any number of ranks; -n 1 works too

Every rank builds the same random q, k, v (the same seed), keeps its zigzag shard, and runs
`td.forward` and `td.backward`; the results are gathered and compared with one process's
`tileattn.forward`/`backward` on the whole arrays. Prints the error and the times.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import tileattn
import tileattn.distributed as td
from tileattn.testing import attention_error


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layout", choices=td.LAYOUTS, default="zigzag")
    parser.add_argument("--backend", default="auto", help="auto (the CPU backend), cpu, reference")
    args = parser.parse_args()

    group = td.init()
    rng = np.random.default_rng(0)  # the same arrays on every rank
    shape = (1, args.heads, args.seq_len, args.head_dim)
    q, k, v, do = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
    q_local, k_local, v_local, do_local = (td.shard(a, group, layout=args.layout)
                                           for a in (q, k, v, do))
    options = {"causal": True, "backend": args.backend}

    for _ in range(2):  # the first run loads (or compiles) the kernels; the second is timed
        start = time.perf_counter()
        o, lse = td.forward(q_local, k_local, v_local, group=group, layout=args.layout,
                            return_lse=True, **options)
        forward_s = time.perf_counter() - start
        start = time.perf_counter()
        dq, dk, dv = td.backward(do_local, q_local, k_local, v_local, o, lse, group=group,
                                 layout=args.layout, **options)
        backward_s = time.perf_counter() - start

    gathered = [td.unshard(a, group, layout=args.layout) for a in (o, dq, dk, dv)]
    if group.rank == 0:
        for _ in range(2):
            start = time.perf_counter()
            o_one, lse_one = tileattn.forward(q, k, v, return_lse=True, **options)
            grads_one = tileattn.backward(do, q, k, v, o_one, lse_one, **options)
            one_s = time.perf_counter() - start
        wants = (o_one, *grads_one)
        errors = [float(np.max(np.abs(got - want))) for got, want in zip(gathered, wants)]
        # As multiples of the float32 tolerance of tileattn.testing (<= 1 passes).
        worst = max(attention_error(got, want, np.float32) for got, want in zip(gathered, wants))
        print(f"{group.size} ranks, N = {args.seq_len}, {args.heads} heads of D = "
              f"{args.head_dim}, float32, causal, layout={args.layout}")
        print("max |error| vs one process: " + ", ".join(
            f"{name} {error:.2e}" for name, error in zip(("o", "dq", "dk", "dv"), errors)))
        print(f"ring forward {forward_s:.3f} s, backward {backward_s:.3f} s; "
              f"one process forward + backward {one_s:.3f} s", flush=True)
        if worst > 1:
            raise SystemExit(f"out of tolerance: {worst:.3g}x the float32 tolerance")
        print(f"within tolerance ({worst:.3g}x the float32 tolerance)")


if __name__ == "__main__":
    main()
