"""Ring attention's error on the GPU, split by output: the simulated ring and one device,
each against a float64 computation of the same (already rounded) inputs (the GPU's float64
kernels), in multiples of the dtype's tolerance.

    python3 bench/experiments/ring_accuracy_gpu.py [--seqlen 16384] [--heads 32 8] [--ranks 2]
    python3 bench/experiments/ring_accuracy_gpu.py --dtype float16 --seqlen 131072 --no-ring

`bench_ring.py --check` compares the ring with one device directly; this tells which of the
two carries the error, and in which output.
"""

from __future__ import annotations

import argparse

import cupy
import numpy as np

import tileattn
import tileattn.distributed as td
from tileattn.distributed.layouts import from_float, to_float
from tileattn.testing import attention_error, bfloat16

NAMES = ("o", "lse", "dq", "dk", "dv")


def errors_against(got, want, dtype, shard=None):
    result = {}
    for name, mine, truth in zip(NAMES, got, want):
        if shard is not None:
            truth = shard(truth, -1 if name == "lse" else -2)
        result[name] = attention_error(cupy.asnumpy(to_float(mine, np.float32)),
                                       cupy.asnumpy(truth), dtype, lse_magnitude=1.0)
    return result


def one_device(arrays, causal, backend):
    o, lse = tileattn.forward(*arrays[:3], causal=causal, return_lse=True, backend=backend)
    return (o, lse, *tileattn.backward(arrays[3], *arrays[:3], o, lse, causal=causal,
                                       backend=backend))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, nargs="+", default=[16384])
    parser.add_argument("--heads", type=int, nargs=2, default=[32, 8])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--backend", default="gpu")
    parser.add_argument("--sink", type=float, default=0.0,
                        help="give key 0 about this score against every query (an attention "
                             "sink: one large term, then many small ones)")
    parser.add_argument("--no-ring", action="store_true", help="one device only")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                        default="float32")
    args = parser.parse_args()
    dtype = bfloat16() if args.dtype == "bfloat16" else np.dtype(args.dtype)
    for n in args.seqlen:
        rng = cupy.random.default_rng(0)
        shapes = [(1, args.heads[0], n, args.head_dim), (1, args.heads[1], n, args.head_dim),
                  (1, args.heads[1], n, args.head_dim), (1, args.heads[0], n, args.head_dim)]
        whole = [rng.standard_normal(shape, dtype=np.float32) for shape in shapes]
        if args.sink:
            # q_i = noise + b u and k_0 = b u for a unit u: q_i . k_0 / sqrt(D) ~ b^2 / sqrt(D).
            u = rng.standard_normal(args.head_dim, dtype=np.float32)
            b = np.float32(np.sqrt(args.sink * np.sqrt(args.head_dim)))
            u *= b / cupy.linalg.norm(u)
            whole[0] += u
            whole[1][:, :, 0] = u
        whole = [from_float(a, dtype) for a in whole]
        wide = [to_float(a, np.float64) for a in whole]
        for causal in (False, True):
            truth = one_device(wide, causal, args.backend)
            single = errors_against(one_device(whole, causal, args.backend), truth, dtype)
            print(f"N {n} causal {causal} one device: "
                  + " ".join(f"{k} {v:.3g}" for k, v in single.items()), flush=True)
            for layout in () if args.no_ring else td.LAYOUTS:
                def rank(group):
                    local = [td.shard(a, group, layout=layout) for a in whole]
                    o, lse = td.forward(*local[:3], group=group, layout=layout,
                                        causal=causal, return_lse=True, backend=args.backend)
                    grads = td.backward(local[3], *local[:3], o, lse, group=group,
                                        layout=layout, causal=causal, backend=args.backend)
                    cupy.cuda.get_current_stream().synchronize()
                    return errors_against(
                        (o, lse, *grads), truth, dtype,
                        lambda a, axis: td.shard(a, group, layout=layout, axis=axis))

                per_rank = td.simulate(args.ranks, rank, device=0)
                worst = {k: max(r[k] for r in per_rank) for k in NAMES}
                print(f"N {n} causal {causal} ring {args.ranks} {layout}: "
                      + " ".join(f"{k} {v:.3g}" for k, v in worst.items())
                      + "   per rank dq/dk: "
                      + " ".join(f"{r['dq']:.3g}/{r['dk']:.3g}" for r in per_rank),
                      flush=True)
            del truth
            cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
