"""The main job a new user runs: ``python -m tileattn check``."""

from __future__ import annotations

import subprocess
import sys


def test_check_runs_and_reports_every_backend():
    result = subprocess.run(
        [sys.executable, "-m", "tileattn", "check", "--seq-len", "64", "--heads", "2"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "reference" in result.stdout and "all backends within tolerance" in result.stdout
    for name in ("cpu", "gpu"):
        assert name in result.stdout


def test_check_rejects_unknown_command():
    result = subprocess.run([sys.executable, "-m", "tileattn", "frobnicate"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "invalid choice" in result.stderr
