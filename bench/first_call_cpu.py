"""How long the CPU backend's first call takes: cold (compiling) and warm (cache loaded).

    PYTHONPATH=. python bench/first_call_cpu.py              # cold float32 and float64, then warm
    PYTHONPATH=. python bench/first_call_cpu.py --cold-runs 3 --dtypes float32

Cold: a fresh process with an empty Numba cache directory (``NUMBA_CACHE_DIR`` pointing at a
new temporary folder) runs one forward and two backwards of a small problem, one with a
single (batch, kv head) pair and one with two, which between them need every kernel the
dtype uses (also on versions that had a kernel per backward schedule), and reports the
seconds after ``import tileattn``. Warm: once the cache is filled, each later fresh process
runs one forward and one backward and reports how long that took, which is the cost of
loading the cached kernels. The tests check the causes (no kernel compiles in a second
process, the compile notice); this script measures the effects.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CALLS = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    import numpy as np
    import tileattn
    start = time.perf_counter()
    rng = np.random.default_rng(0)
    for heads in (1, 2):
        q = rng.standard_normal((1, heads, 64, 32)).astype({dtype!r})
        o, lse = tileattn.forward(q, q, q, backend="cpu", return_lse=True)
        tileattn.backward(o, q, q, q, o, lse, backend="cpu")
        if {warm_only!r}:
            break
    print(time.perf_counter() - start)
""")


def _seconds(dtype: str, cache_dir: str, warm_only: bool) -> float:
    code = _CALLS.format(root=str(ROOT), dtype=dtype, warm_only=warm_only)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env={**os.environ, "NUMBA_CACHE_DIR": cache_dir})
    return float(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    parser.add_argument("--cold-runs", type=int, default=1)
    parser.add_argument("--processes", type=int, default=5, help="warm processes")
    args = parser.parse_args(argv)
    for dtype in args.dtypes:
        cold = []
        for _ in range(args.cold_runs):
            with tempfile.TemporaryDirectory() as cache_dir:
                cold.append(_seconds(dtype, cache_dir, warm_only=False))
                warm = [_seconds(dtype, cache_dir, warm_only=True)
                        for _ in range(args.processes)]
        print(f"{dtype}: cold (empty cache) forward + backward: "
              f"{', '.join(f'{s:.1f}' for s in cold)} s; later processes' first call: "
              f"median {statistics.median(warm):.2f} s, max {max(warm):.2f} s over "
              f"{len(warm)}", flush=True)


if __name__ == "__main__":
    main()
