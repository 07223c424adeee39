"""Peak host memory of tileattn's CPU backend beyond its inputs and outputs (issue 3).

    PYTHONPATH=. python bench/memory_cpu.py                  # one head, N = 65536, D = 64
    PYTHONPATH=. python bench/memory_cpu.py --n 16384 --no-causal

Each measurement runs in a fresh process. After the inputs exist and a small warm-up call
has loaded the kernels (and let BLAS set up its buffers), the process's resident-memory
high-water mark is reset (Linux: ``/proc/self/clear_refs``), the forward and backward run,
and the new high-water mark minus the resident size before the call and minus the bytes of
the results (o, lse, dq, dk, dv) is the extra memory the call needed. tracemalloc cannot
see allocations made inside Numba kernels, so this counts pages instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {root!r})
    import numpy as np
    import tileattn

    def status(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(field + " not in /proc/self/status")

    n, head_dim, causal = {n}, {head_dim}, {causal}
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 1, n, head_dim), dtype=np.float32)
                   for _ in range(4))
    small = [a[:, :, :1024] for a in (q, k, v, do)]
    o, lse = tileattn.forward(*small[:3], causal=causal, backend="cpu", return_lse=True)
    tileattn.backward(small[3], *small[:3], o, lse, causal=causal, backend="cpu")
    del o, lse
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark VmHWM to the current resident size
    before = status("VmRSS")
    o, lse = tileattn.forward(q, k, v, causal=causal, backend="cpu", return_lse=True)
    grads = tileattn.backward(do, q, k, v, o, lse, causal=causal, backend="cpu")
    peak = status("VmHWM")
    results = o.nbytes + lse.nbytes + sum(g.nbytes for g in grads)
    print(json.dumps({{"n": n, "head_dim": head_dim, "causal": causal,
                      "inputs_bytes": 4 * q.nbytes, "results_bytes": results,
                      "peak_minus_before_bytes": peak - before,
                      "extra_bytes": peak - before - results}}))
""")


def measure(n: int, head_dim: int, causal: bool) -> dict:
    code = _PROBE.format(root=ROOT, n=n, head_dim=head_dim, causal=causal)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=3600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=65536)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--out", help="directory for memory.json")
    args = parser.parse_args(argv)
    result = measure(args.n, args.head_dim, not args.no_causal)
    mib = 1024**2
    print(f"N={result['n']} D={result['head_dim']} causal={result['causal']}: "
          f"inputs {result['inputs_bytes'] / mib:.1f} MiB, results "
          f"{result['results_bytes'] / mib:.1f} MiB, extra peak "
          f"{result['extra_bytes'] / mib:.1f} MiB")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "memory.json"), "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
