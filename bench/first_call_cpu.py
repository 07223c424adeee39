"""Time of a fresh process's first CPU-backend call once Numba's on-disk cache is warm (issue 3).

    PYTHONPATH=. python bench/first_call_cpu.py            # median of 5 fresh processes

The first process compiles (unless the cache is already warm) and is not counted; each later one
imports tileattn, runs one forward and one backward on a small problem and reports how long that
call took, which is the cost of loading the cached kernels. The test suite checks the cause
(no kernel compiles in a second process); this script measures the effect.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_FIRST_CALL = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    import numpy as np
    import tileattn
    q = np.random.default_rng(0).standard_normal((1, 2, 64, 32)).astype(np.float32)
    start = time.perf_counter()
    o, lse = tileattn.forward(q, q, q, backend="cpu", return_lse=True)
    tileattn.backward(o, q, q, q, o, lse, backend="cpu")
    print(time.perf_counter() - start)
""")


def first_call_seconds() -> float:
    done = subprocess.run([sys.executable, "-c", _FIRST_CALL.format(root=str(ROOT))],
                          capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=5)
    args = parser.parse_args(argv)
    cold = first_call_seconds()
    warm = [first_call_seconds() for _ in range(args.processes)]
    print(f"first process (may compile): {cold:.2f} s")
    print(f"later processes, first call: median {statistics.median(warm):.2f} s, "
          f"max {max(warm):.2f} s over {len(warm)}")


if __name__ == "__main__":
    main()
