"""The GQA decodes' folds (wide heads, and many packed rows at D <= 256) on a stand-in for
CuPy, no GPU needed (bench/experiments/fold_views_cpu.py): the launcher's views of q, o and
lse as rows of one head, each query row's keys, the value slices and the cached second call, with the golden
model in place of the kernels, which also check their contract with the launcher (no mask
left, contiguous rows, a contiguous lse). The GPU runs the same path in test_gpu_decode.py;
CI runs this one."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "bench", "experiments",
                      "fold_views_cpu.py")


def test_wide_decode_fold_matches_the_golden_model_on_a_cupy_standin():
    # Its own process: the script puts a CuPy stand-in into sys.modules.
    result = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, (result.stdout[-4000:], result.stderr[-4000:])
    assert "all passed" in result.stdout
    assert result.stdout.count("\nok ") + result.stdout.startswith("ok ") == 32, result.stdout
