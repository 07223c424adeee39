"""Host time of small CPU calls, layer by layer: what a decode step pays beyond its kernels.

    PYTHONPATH=. python3 bench/experiments/overhead_cpu.py [--calls 1000] [--rounds 15]

For each shape (float32, 2 threads allowed; the decode path takes them all), times back to
back calls of each layer of `tileattn.forward`, one layer inside the next: the whole call,
the remembered validation (`problem_cache.remembered_problem`), the dispatch to the backend
(`api.run_forward`), the CPU backend (`cpu.forward`), the decode launcher with its plan
kept (`decode.forward`) and the kernels alone (`threads.run` of the decode kernel, and the
merge where the call has more than one key split); then `tileattn.backward`, and torch's
`scaled_dot_product_attention` on the same arrays. The layers run in turn within each
round, so all see the same load; the table gives the median and the best round in
microseconds a call (this shared host's other load moves single rounds by 1.5x). Results
are checked against the float64 golden model first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import tileattn
from tileattn import api, cpu, problem_cache
from tileattn.cpu import decode, threads
from tileattn.testing import assert_attention_close

SHAPES = {  # name: (q shape, k and v shape)
    "B1 H1 Nq1 Nk16 D64": ((1, 1, 1, 64), (1, 1, 16, 64)),
    "B1 H8 Nq1 Nk256 D64": ((1, 8, 1, 64), (1, 8, 256, 64)),
    "B1 H8 Nq1 Nk512 D128": ((1, 8, 1, 128), (1, 8, 512, 128)),
    "B1 H8 N16 D64": ((1, 8, 16, 64), (1, 8, 16, 64)),
}
OPTIONS = (False, None, None, None, None, 0.0, None, None, None, True)  # OPTION_NAMES order


def _layers(q, k, v) -> dict:
    """Each layer of a forward of these arrays as a callable, outermost first."""
    problem = problem_cache.remembered_problem((q, k, v), OPTIONS)
    tensors, options = problem.tensors, problem.options
    cpu.forward(tensors["q"], tensors["k"], tensors["v"], options)
    dtype = np.dtype(np.float32)
    plan = next(plan for key, plan in cpu._FORWARD_PLANS.items() if key[0] is options)
    q_c, k_c, v_c = (cpu._read_only(tensors[name], dtype) for name in "qkv")
    layers = {
        "tileattn.forward": lambda: tileattn.forward(q, k, v, backend="cpu"),
        "remembered_problem": lambda: problem_cache.remembered_problem((q, k, v), OPTIONS),
        "api.run_forward": lambda: api.run_forward(problem, "cpu"),
        "cpu.forward": lambda: cpu.forward(tensors["q"], tensors["k"], tensors["v"],
                                           options),
    }
    if plan.decode is None:
        return layers
    sizing, shape = plan.decode, plan.shape
    layers["decode.forward"] = lambda: decode.forward(q_c, k_c, v_c, options, plan.scalars,
                                                      cpu._kernel_lock, shape, sizing=sizing)
    decode_kernel, merge_kernel = decode._kernels().decode_kernel, decode._kernels().merge_kernel
    out, lse = decode.forward(q_c, k_c, v_c, options, plan.scalars, cpu._kernel_lock, shape,
                              sizing=sizing)
    rows = lse.shape
    partials = (decode._NO_PARTIALS[dtype] if sizing.n_splits == 1 else
                (np.empty((sizing.n_splits,) + out.shape, dtype),
                 np.empty((sizing.n_splits,) + rows, dtype),
                 np.empty((sizing.n_splits,) + rows, dtype)))

    def kernels():
        threads.run(decode_kernel, sizing.n_workers, q_c, k_c, v_c, *partials, out, lse,
                    shape.descriptors, shape.block_table, shape.page_size, shape.slots_outer,
                    *plan.scalars, sizing.block_k, sizing.split_size, 0)
        if sizing.n_splits > 1:
            merge_kernel(*partials, out, lse)

    layers["kernels"] = kernels
    return layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000, help="calls a round (1000)")
    parser.add_argument("--rounds", type=int, default=15, help="rounds (15)")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        torch = None
    else:
        torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    print(f"threads allowed: {threads.allowed()}; us a call, median (best round)")
    for name, (q_shape, kv_shape) in SHAPES.items():
        q, k, v = (rng.standard_normal(shape, dtype=np.float32)
                   for shape in (q_shape, kv_shape, kv_shape))
        o, lse = tileattn.forward(q, k, v, backend="cpu", return_lse=True)
        golden = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                  backend="reference", return_lse=True)
        assert_attention_close(o, golden[0], np.float32, name="o")
        assert_attention_close(lse, golden[1], np.float32, name="lse")
        do = rng.standard_normal(o.shape, dtype=np.float32)
        layers = _layers(q, k, v)
        layers["tileattn.backward"] = lambda: tileattn.backward(do, q, k, v, o, lse,
                                                                backend="cpu")
        if torch is not None:
            tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
            sdpa = torch.nn.functional.scaled_dot_product_attention
            layers["torch sdpa"] = lambda: sdpa(tq, tk, tv)
        times = {layer: [] for layer in layers}
        for function in layers.values():
            for _ in range(50):
                function()
        for _ in range(args.rounds):
            for layer, function in layers.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    function()
                times[layer].append((time.perf_counter() - start) / args.calls * 1e6)
        print(f"\n{name}")
        for layer, samples in times.items():
            print(f"  {layer:20s} {statistics.median(samples):7.1f} ({min(samples):6.1f})")


if __name__ == "__main__":
    main()
