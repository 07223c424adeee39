"""``python -m tileattn info`` and ``bench``: they run and write what they promise."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

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
