"""A kernel change against a git revision, in one process: the package as it is in the working
tree beside the package at `--base` (default HEAD), each call timed back to back in
interleaved rounds, and their outputs compared bit for bit.

    PYTHONPATH=. python3 bench/experiments/ab_trees_gpu.py [--base HEAD~1 | --base-dir DIR] \\
        [--shapes 'B4 H16/16 Nq4096 Nk4096 D128 float16 causal' ...] [--backward] \\
        [--rounds 4] [--calls 20]

The device machine's copy of the working tree has no git history: there, pass
`--base-dir DIR`, a folder holding the base revision's `tileattn/` that travels with the
tree as an untracked folder (made beforehand by ``mkdir DIR && git archive REV tileattn |
tar -x -C DIR``).

Why one process: two processes of the same tree timed the same D 256 forward 5-8 % apart on
the H200 (bench/NOTES-gpu.md, v56), more than most kernel changes move it. The base is
`git archive BASE tileattn` unpacked into a temporary folder as the package `tileattn_base`
(its relative imports carry over; `backends.py` names its backend modules, which are renamed
too), so both packages, their plan caches and their kernels live side by side. A shape is
'B<batch> H<q heads>/<kv heads> Nq<rows> Nk<keys> D<head dim> <dtype> [causal]'.
Each line: base and new ms (min over the rounds), new's TFLOP/s (FlashAttention's count;
--backward: forward + backward, 3.5x the forward's), new / base speed, and whether the
outputs (and with --backward the gradients) are the same bits.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "bench"))

SHAPES = ["B4 H16/16 Nq4096 Nk4096 D128 float16", "B4 H16/16 Nq4096 Nk4096 D128 float16 causal",
          "B4 H32/32 Nq4096 Nk4096 D64 float16", "B4 H8/8 Nq4096 Nk4096 D256 float16 causal",
          "B16 H16/16 Nq1024 Nk1024 D128 float16", "B4 H16/16 Nq4096 Nk4096 D80 float16",
          "B4 H16/16 Nq4096 Nk4096 D128 float32", "B8 H32/8 Nq1 Nk32768 D128 float16",
          "B8 H8/1 Nq8 Nk131072 D128 float16"]


def base_package(revision: str, folder: str, base_dir: str | None = None) -> str:
    """Unpacks `revision`'s tileattn (or copies `base_dir`'s) into `folder` as
    tileattn_base; returns the folder."""
    if base_dir is not None:
        shutil.copytree(os.path.join(base_dir, "tileattn"), os.path.join(folder, "tileattn"))
    else:
        archive = subprocess.run(["git", "-C", ROOT, "archive", revision, "tileattn"],
                                 check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(folder)
    os.rename(os.path.join(folder, "tileattn"), os.path.join(folder, "tileattn_base"))
    backends = os.path.join(folder, "tileattn_base", "backends.py")
    text = open(backends).read()
    for module in ("reference", "cpu", "gpu"):
        text = text.replace(f'"tileattn.{module}"', f'"tileattn_base.{module}"')
    open(backends, "w").write(text)
    return folder


def parse_shape(text: str):
    fields = text.split()
    batch, heads, n_q, n_k, dim, dtype = fields[:6]
    hq, hkv = heads[1:].split("/")
    return (int(batch[1:]), int(hq), int(hkv), int(n_q[2:]), int(n_k[2:]), int(dim[1:]),
            dtype, "causal" in fields[6:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="the git revision to compare against")
    parser.add_argument("--base-dir", default=None,
                        help="a folder holding the base's tileattn/ (where there is no git)")
    parser.add_argument("--shapes", nargs="*", default=SHAPES)
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=20, help="calls back to back a round")
    args = parser.parse_args()

    import cupy

    from gpu_timing import back_to_back_ms

    folder = base_package(args.base, tempfile.mkdtemp(prefix="ab_trees_"), args.base_dir)
    sys.path.insert(0, folder)
    sys.path.insert(0, ROOT)
    import tileattn
    import tileattn_base

    print(f"# {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}: new "
          f"{os.path.dirname(tileattn.__file__)} against {args.base_dir or args.base} "
          f"({'forward + backward' if args.backward else 'forward'}, back to back, min of "
          f"{args.rounds} interleaved rounds)", flush=True)
    rng = cupy.random.default_rng(0)
    for text in args.shapes:
        batch, hq, hkv, n_q, n_k, dim, dtype, causal = parse_shape(text)
        q, do = (rng.standard_normal((batch, hq, n_q, dim), dtype=cupy.float32).astype(dtype)
                 for _ in range(2))
        k, v = (rng.standard_normal((batch, hkv, n_k, dim), dtype=cupy.float32).astype(dtype)
                for _ in range(2))

        def step(library):
            if not args.backward:
                return (library.forward(q, k, v, causal=causal, backend="gpu"),)
            o, lse = library.forward(q, k, v, causal=causal, backend="gpu", return_lse=True)
            return (o,) + tuple(library.backward(do, q, k, v, o, lse, causal=causal,
                                                 backend="gpu"))

        calls = {"base": lambda: step(tileattn_base), "new": lambda: step(tileattn)}
        same = all(bool(cupy.array_equal(a, b))
                   for a, b in zip(calls["base"](), calls["new"]()))
        times = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                times[name].append(back_to_back_ms(call, args.calls, rounds=1))
        flops = 4 * batch * hq * n_q * n_k * dim / (2 if causal else 1)
        flops *= 3.5 if args.backward else 1
        base, new = min(times["base"]), min(times["new"])
        print(f"{text}: base {base:.4f} new {new:.4f} ms ({flops / new / 1e9:.0f} TFLOP/s), "
              f"new / base speed {base / new:.3f}, same bits {same}", flush=True)
        del q, k, v, do
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
