"""Every kernel launch the GPU launchers make, checked against the kernel's own C signature
on a stand-in for CuPy, no GPU needed (bench/experiments/launch_signatures_cpu.py): the
argument count, pointers where the kernel takes pointers, and each scalar's width and type.
A launcher passing one argument too few, or an int where a kernel takes an i64, misreads
every later parameter on a GPU; CI catches it here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "bench", "experiments",
                      "launch_signatures_cpu.py")


def test_every_gpu_launch_matches_its_kernel_signature():
    if shutil.which("g++") is None:
        pytest.skip("g++ (the checker preprocesses the kernels with it) is not installed")
    # Its own process: the checker puts a CuPy stand-in into sys.modules.
    result = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, (result.stdout[-4000:], result.stderr[-4000:])
    assert "all passed" in result.stdout
    assert result.stdout.count("\nok ") >= 20, result.stdout
