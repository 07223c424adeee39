"""Whether the tensor cores read only the top 19 bits of a TF32 operand, and what leaving
the split's small part unmasked saves (tf32.cuh, TF32_MASK_SMALL).

    PYTHONPATH=. python3 bench/experiments/tf32_split_gpu.py --mask-small 1 --out masked
        [--dims 64,128] [--no-timings | --no-results]
    PYTHONPATH=. python3 bench/experiments/tf32_split_gpu.py --mask-small 0 --out raw
    PYTHONPATH=. python3 bench/experiments/tf32_split_gpu.py --compare masked raw

One process per setting (launch plans are cached per call signature, so both settings
cannot share one); `--out` is a prefix, each run adds its own file, and `--compare` reads
every file of each prefix (runs split by dims and by --no-timings / --no-results compile
in parallel, then time one at a time). Each run computes float32 forwards and default (deterministic)
backwards at D 64, 128, 160, 192 and 256, causal and not, on ordinary inputs, on inputs of
large magnitude and on inputs holding inf and NaN, saves every result, and times the
forward and the backward at B 4, N 4096 (hidden 2048). `--compare` says whether every
result is the same bits under both settings (it is where the tensor cores ignore the low
13 bits of a TF32 operand) and prints the two timings side by side.
"""

from __future__ import annotations

import argparse
import os
import sys

import cupy
import numpy as np

import tileattn
from tileattn.gpu import _compile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_gpu import median_ms  # noqa: E402

DIMS = (64, 128, 160, 192, 256)
TF32_SOURCES = ("attention_tf32_forward.cu", "attention_mma_backward.cu")


def _with_mask_define(mask_small: int):
    """Compile every 3xTF32 kernel with TF32_MASK_SMALL = `mask_small`."""
    compile_kernel = _compile.kernel

    def kernel(source_name, entry, defines, shared_bytes=0, arch=None):
        if source_name in TF32_SOURCES:
            defines = tuple(sorted(defines + (("TF32_MASK_SMALL", mask_small),)))
        return compile_kernel(source_name, entry, defines, shared_bytes, arch)

    _compile.kernel = kernel


def _inputs(kind: str, head_dim: int, seed: int):
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((1, 2, 300, head_dim)).astype(np.float32)
                   for _ in range(4))
    if kind == "large":
        q *= 40.0
        k *= 3.0
    elif kind == "non-finite":
        k[0, 1, 17, 3] = np.inf
        v[0, 0, 200, 5] = -np.inf
        q[0, 0, 5, 1] = np.nan
    return [cupy.asarray(a) for a in (q, k, v, do)]


def results(dims) -> dict[str, np.ndarray]:
    saved = {}
    for head_dim in dims:
        for causal in (False, True):
            for kind in ("ordinary", "large", "non-finite"):
                q, k, v, do = _inputs(kind, head_dim, head_dim)
                o, lse = tileattn.forward(q, k, v, backend="gpu", causal=causal,
                                          return_lse=True)
                grads = tileattn.backward(do, q, k, v, o, lse, backend="gpu", causal=causal)
                for name, array in zip(("o", "lse", "dq", "dk", "dv"), (o, lse) + grads):
                    saved[f"{head_dim}-{causal}-{kind}-{name}"] = array.get()
    return saved


def timings(dims, repetitions: int) -> dict[str, np.ndarray]:
    saved = {}
    for head_dim in dims:
        heads = 2048 // head_dim
        rng = cupy.random.default_rng(0)
        q, k, v, do = (rng.standard_normal((4, heads, 4096, head_dim), dtype=cupy.float32)
                       for _ in range(4))
        for causal in (False, True):
            o, lse = tileattn.forward(q, k, v, backend="gpu", causal=causal, return_lse=True)
            forward = median_ms(lambda: tileattn.forward(q, k, v, backend="gpu",
                                                         causal=causal), repetitions)
            backward = median_ms(lambda: tileattn.backward(do, q, k, v, o, lse, backend="gpu",
                                                           causal=causal), repetitions)
            saved[f"time-{head_dim}-{causal}"] = np.array([forward, backward])
    return saved


def _load(prefix: str) -> dict[str, np.ndarray]:
    directory, stem = os.path.split(prefix)
    merged = {}
    for name in sorted(os.listdir(directory or ".")):
        if name.startswith(stem + "-") and name.endswith(".npz"):
            with np.load(os.path.join(directory, name)) as saved:
                merged.update({key: saved[key] for key in saved.files})
    return merged


def compare(first_prefix: str, second_prefix: str) -> int:
    first, second = _load(first_prefix), _load(second_prefix)
    names = [name for name in first if not name.startswith("time-") and name in second]
    differing = [name for name in names
                 if not np.array_equal(first[name], second[name], equal_nan=True)]
    compared = len(names)
    print(f"{compared - len(differing)} of {compared} results the same bits"
          + (f"; differing: {', '.join(differing[:12])}" if differing else ""))
    print("| D | causal | forward ms (first / second) | backward ms (first / second) |")
    print("| --- | --- | --- | --- |")
    for name in first:
        if name.startswith("time-") and name in second:
            _, head_dim, causal = name.split("-")
            (f1, b1), (f2, b2) = first[name], second[name]
            print(f"| {head_dim} | {causal} | {f1:.2f} / {f2:.2f} ({f2 / f1:.3f}) "
                  f"| {b1:.2f} / {b2:.2f} ({b2 / b1:.3f}) |")
    return int(bool(differing))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mask-small", type=int, choices=(0, 1))
    parser.add_argument("--out")
    parser.add_argument("--repetitions", type=int, default=10)
    parser.add_argument("--dims", default=",".join(map(str, DIMS)))
    parser.add_argument("--no-timings", action="store_true")
    parser.add_argument("--no-results", action="store_true")
    parser.add_argument("--compare", nargs=2)
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    _with_mask_define(args.mask_small)
    dims = [int(d) for d in args.dims.split(",")]
    saved = {} if args.no_results else results(dims)
    if not args.no_timings:
        saved.update(timings(dims, args.repetitions))
    parts = ("" if args.no_results else "r") + ("" if args.no_timings else "t")
    path = f"{args.out}-{parts}-{args.dims.replace(',', '_')}.npz"
    np.savez(path, **saved)
    print(f"saved {len(saved)} arrays to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
