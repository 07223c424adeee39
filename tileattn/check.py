"""``python -m tileattn check``: every available backend against the golden model, timed.

Runs forward and backward on one random problem with each backend that can run here,
compares every output with the float64 golden model using the tolerances of
`tileattn.testing`, and prints the errors (as a fraction of what the tolerance allows) and
the times. Exits non-zero if any backend is out of tolerance, if a backend named with
``--backend`` cannot run, or if no fast backend (CPU or GPU) ran at all: the golden model
checked against itself checks nothing.
"""

from __future__ import annotations

import os
import time

import numpy as np

from . import backends
from .api import backward, forward
from .testing import attention_error


# A check's golden forward + backward peaked at 4.8-5.8 float64 (B, H, N, N) matrices at
# once (measured at N = 1024 and 2048); the model allows 8.
GOLDEN_MODEL_MATRICES = 8


def golden_model_bytes(batch: int, heads: int, seq_len: int, head_dim: int) -> int:
    """Memory the golden model needs for one check: N x N float64 matrices per head, and
    the (B, H, N, D) float64 inputs, outputs and gradients."""
    heads_total = batch * heads
    return 8 * (GOLDEN_MODEL_MATRICES * heads_total * seq_len ** 2
                + 16 * heads_total * seq_len * head_dim)


def available_memory_bytes() -> int:
    """Memory a new allocation can get here: MemAvailable on Linux, else the RAM size."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _timed(function, repeats: int):
    """Best-of-`repeats` wall time (the first call also compiles, so it is run once first)."""
    result = function()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - start)
    return result, best


def _to_backend_memory(memory: str, arrays):
    if memory != "cuda":
        return arrays
    import cupy

    return tuple(cupy.asarray(a) for a in arrays)


def _to_host(array):
    return array if isinstance(array, np.ndarray) else array.get()


def _synchronised(function, memory):
    if memory != "cuda":
        return function

    def run():
        import cupy

        result = function()
        cupy.cuda.get_current_stream().synchronize()
        return result

    return run


def run_check(*, batch=1, heads=4, seq_len=512, head_dim=64, dtype="float32", causal=True,
              repeats=3, names=None, print_fn=print) -> bool:
    """Compare each backend with the golden model; returns True when all are within tolerance."""
    rng = np.random.default_rng(0)
    dtype = np.dtype(dtype)
    shape = (batch, heads, seq_len, head_dim)
    q, k, v, do = (rng.standard_normal(shape).astype(dtype) for _ in range(4))
    options = dict(causal=causal)
    flops = 4 * batch * heads * seq_len * seq_len * head_dim * (0.5 if causal else 1.0)

    golden_inputs = [a.astype(np.float64) for a in (q, k, v, do)]
    start = time.perf_counter()
    golden_o, golden_lse = forward(*golden_inputs[:3], **options, backend="reference",
                                   return_lse=True)
    golden_grads = backward(golden_inputs[3], *golden_inputs[:3], golden_o, golden_lse,
                            **options, backend="reference")
    golden_seconds = time.perf_counter() - start

    print_fn(f"tileattn check: q, k, v {shape} {dtype.name}, causal={causal}; golden model "
             f"(NumPy float64, materialises P) took {golden_seconds * 1e3:.0f} ms for forward "
             "and backward")
    print_fn("errors are the worst |actual - golden| as a fraction of the dtype's tolerance "
             "(<= 1 passes)\n")
    header = (f"{'backend':<10} {'o':>8} {'lse':>8} {'dq':>8} {'dk':>8} {'dv':>8} "
              f"{'fwd ms':>9} {'bwd ms':>9} {'fwd GFLOP/s':>12} {'status':>7}")
    print_fn(header)
    print_fn("-" * len(header))
    all_ok = True
    checked = []
    for name in names or list(backends.REGISTRY):
        reason = backends.availability(name)
        if reason is not None:
            if names:  # asked for by name: not checking it is a failure
                all_ok = False
                print_fn(f"{name:<10} FAIL: {reason}")
            else:
                print_fn(f"{name:<10} skipped: {reason}")
            continue
        memory = backends.load(name).MEMORY
        q_, k_, v_, do_ = _to_backend_memory(memory, (q, k, v, do))
        (o, lse), fwd_seconds = _timed(_synchronised(
            lambda: forward(q_, k_, v_, **options, backend=name, return_lse=True), memory),
            repeats)
        (dq_, dk_, dv_), bwd_seconds = _timed(_synchronised(
            lambda: backward(do_, q_, k_, v_, o, lse, **options, backend=name), memory),
            repeats)
        # The backward is judged against the golden gradients for the o it was given
        # (SPEC: D = rowsum(do * o)).
        golden_grads = backward(golden_inputs[3], *golden_inputs[:3],
                                _to_host(o).astype(np.float64), golden_lse, **options,
                                backend="reference")
        errors = [attention_error(_to_host(a), b, dtype) for a, b in zip(
            (o, lse, dq_, dk_, dv_), (golden_o, golden_lse, *golden_grads))]
        ok = all(e <= 1.0 for e in errors)
        all_ok &= ok
        checked.append(name)
        print_fn(f"{name:<10} " + " ".join(f"{e:8.3f}" for e in errors)
                 + f" {fwd_seconds * 1e3:9.2f} {bwd_seconds * 1e3:9.2f}"
                 f" {flops / fwd_seconds / 1e9:12.1f} {'ok' if ok else 'FAIL':>7}")
    # README: a check fails when no fast backend ran, named or not: the golden model
    # checked against itself tells nothing.
    if not set(checked) - {"reference"}:
        all_ok = False
        why = "was named (--backend)" if names else "could run"
        print_fn(f"\nno fast backend (cpu, gpu) {why}: the golden model was only checked "
                 "against itself")
    print_fn(f"\nall checked backends within tolerance: {', '.join(checked)}" if all_ok
             else "\nCHECK FAILED")
    return all_ok
