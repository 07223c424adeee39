"""``python -m tileattn info`` and ``bench``: they run and write what they promise."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from tileattn import anchors
from tileattn.benchmark import attention_flops, markdown_report, run_bench


def test_info_lists_backends_blocks_and_traffic():
    result = subprocess.run([sys.executable, "-m", "tileattn", "info", "--seq-len", "2048"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    for expected in ("[reference] available", "[gpu]", "[cpu] available", "block_q=",
                     "forward : naive", "backward: naive"):
        assert expected in result.stdout, expected


def test_flop_count_is_flash_attentions():
    assert attention_flops(1, 1, 4, 4, 2, causal=False) == 4 * 4 * 4 * 2
    assert attention_flops(2, 3, 8, 8, 4, causal=True, with_backward=True) == \
        4 * 2 * 3 * 8 * 8 * 4 * 0.5 * 3.5


def test_naive_anchor_is_attention():
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((2, 16, 8)) for _ in range(4))
    import tileattn

    o, lse = tileattn.forward(q, k, v, causal=True, backend="reference", return_lse=True)
    naive_o, dq, dk, dv = anchors.naive_forward_backward(np, q, k, v, do, causal=True)
    np.testing.assert_allclose(naive_o, o, rtol=1e-12)
    golden = tileattn.backward(do, q, k, v, o, lse, causal=True, backend="reference")
    for ours, want in zip((dq, dk, dv), golden):
        np.testing.assert_allclose(ours, want, rtol=1e-10, atol=1e-12)


def test_bench_writes_json_markdown_and_plots(tmp_path):
    result = run_bench(backend="cpu", sizes=[128], memory_sizes=[256], out=str(tmp_path),
                       head_dims=(16, 32),
                       heads=2, progress=False, print_fn=lambda *a: None)
    names = {m.implementation for m in result.measurements}
    assert {"tileattn-cpu", "numpy-naive"} <= names
    assert all(m.seconds and m.seconds > 0 for m in result.measurements)
    assert {m.head_dim for m in result.measurements} == {16, 32}
    assert {p.implementation for p in result.memory} == {"tileattn-cpu", "numpy-naive"}
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["backend"] == "cpu" and len(saved["measurements"]) == len(result.measurements)
    report = (tmp_path / "results.md").read_text()
    assert report == markdown_report(result) + "\n" and "vs numpy-naive" in report
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "speed.png").stat().st_size > 1000
        assert (tmp_path / "memory.png").stat().st_size > 1000


ROOT = Path(__file__).parents[1]


def readme_commands(section: str) -> list:
    """The ```bash blocks of one README section, each as a list of its lines."""
    text = (ROOT / "README.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return [block.strip().splitlines() for block in re.findall(r"```bash\n(.*?)```", body,
                                                                re.S)]


def test_ci_runs_the_readmes_test_command():
    """Quickstart's second command is what CI runs, character for character; the first
    installs tileattn and runs the main job."""
    install_and_check, install_and_test = readme_commands("Quickstart")
    assert install_and_check == ["pip install . && python -m tileattn check"]
    assert len(install_and_test) == 1 and "python -m pytest" in install_and_test[0]
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert ci_lines[-1] == install_and_test[0]
    # The adapters' libraries are part of it: their tests must run in CI, not skip.
    assert "torch==2.13.0" in install_and_test[0] and "jax" in install_and_test[0]
    assert 'export CI="${CI:-true}"' in ci_lines
