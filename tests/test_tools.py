"""``python -m tileattn info`` and ``bench``: they run and write what they promise."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tileattn import anchors, benchmark
from tileattn.__main__ import main
from tileattn.benchmark import (BenchResult, MemoryPoint, attention_flops, markdown_report,
                                memory_figure, naive_bytes, naive_skip_note, output_files,
                                run_bench)
from tileattn.testing import assert_attention_close


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


def test_bench_writes_json_markdown_and_plots(tmp_path, monkeypatch):
    monkeypatch.setattr(benchmark, "SETTLE_SECONDS", 0.0)  # only the files matter here
    result = run_bench(backend="cpu", sizes=[128], memory_sizes=[256], out=str(tmp_path),
                       head_dims=(16, 32),
                       heads=2, progress=False, print_fn=lambda *a: None)
    names = {m.implementation for m in result.measurements}
    assert {"tileattn-cpu", "numpy-naive"} <= names
    assert all(m.seconds and m.seconds > 0 for m in result.measurements)
    assert {m.head_dim for m in result.measurements} == {16, 32}
    assert {p.implementation for p in result.memory} == {"tileattn-cpu", "numpy-naive"}
    saved = json.loads((tmp_path / "bench-cpu.json").read_text())
    assert saved["backend"] == "cpu" and len(saved["measurements"]) == len(result.measurements)
    report = (tmp_path / "bench-cpu.md").read_text()
    assert report == markdown_report(result) + "\n" and "vs numpy-naive" in report
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "speed-cpu.png").stat().st_size > 1000
        assert (tmp_path / "memory-cpu.png").stat().st_size > 1000


def test_naive_skips_say_they_come_from_the_memory_model():
    """At N = 16384 the report said "out of memory" where 21 GB were free: the naive run
    was skipped by the model, and the note must say so, with the modelled bytes."""
    modelled = naive_bytes(1, 1, 16384, 4)
    assert naive_skip_note(modelled, 6 * modelled) is None
    assert naive_skip_note(modelled, 6_000_000_000) == (
        "not run: the memory model gives 6.4 GB (3 x 2.15 GB of N x N matrices), over the "
        "6.0 GB budget (a quarter of the memory); not measured")


def test_naive_numpy_anchor_computes_float16_in_float32():
    """NumPy's float16 matmul has no BLAS kernel (~0.5 GFLOP/s): bench's float16 memory sweep
    ran the naive anchor at N = 16384 for half an hour. On the host it computes float16 in
    float32 (and the memory model counts 4-byte N x N matrices), returning float16 arrays
    as close to the golden model as before; bfloat16 and the other dtypes stay as given."""
    import tileattn

    assert anchors.naive_dtype(True, np.float16) == np.float32
    assert anchors.naive_dtype(False, np.float16) == np.float16
    assert anchors.naive_dtype(True, np.float64) == np.float64
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 2, 40, 16)).astype(np.float16) for _ in range(4))
    o, probs = anchors.naive_forward(np, q, k, v, True)
    assert o.dtype == np.float16 and probs.dtype == np.float32
    results = anchors.naive_forward_backward(np, q, k, v, do, True)
    assert all(r.dtype == np.float16 for r in results)
    golden_o, lse = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)), causal=True,
                                     backend="reference", return_lse=True)
    golden = tileattn.backward(*(a.astype(np.float64) for a in (do, q, k, v, o)), lse,
                               causal=True, backend="reference")
    assert_attention_close(results[0], golden_o, np.float16, name="o")
    for name, got, want in zip(("dq", "dk", "dv"), results[1:], golden):
        assert_attention_close(got, want, np.float16, name=name)


def test_memory_plot_keeps_zero_megabytes():
    """A log axis dropped tileattn's 0 MB points; the axis is linear near 0 now."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    result = BenchResult("cpu", "test", "float32", 1, 1, [64], memory=[
        MemoryPoint("tileattn-cpu", 1024, 0, naive_bytes(1, 1, 1024, 4)),
        MemoryPoint("tileattn-cpu", 4096, 2_000_000, naive_bytes(1, 1, 4096, 4)),
        MemoryPoint("numpy-naive", 1024, 8_000_000, naive_bytes(1, 1, 1024, 4)),
        MemoryPoint("numpy-naive", 4096, None, naive_bytes(1, 1, 4096, 4), "not run: ...")])
    figure = memory_figure(result)
    ax = figure.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["tileattn-cpu (measured)"].get_ydata()) == [0.0, 2.0]
    assert list(lines["naive: not run, the model says it would not fit"].get_xdata()) == [4096]
    assert ax.get_yscale() == "symlog" and ax.get_ylim()[0] == 0
    assert "linear below" in ax.get_ylabel()

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
    # and so is MPI: tests/test_distributed_mpi.py starts mpiexec.
    assert "distributed]" in install_and_test[0]
    assert 'export CI="${CI:-true}"' in ci_lines


def test_the_readmes_bench_commands_write_the_files_the_readme_names(tmp_path, monkeypatch):
    """The README's docs/ came from ``python -m tileattn bench --backend cpu --out docs``;
    that command (here its quick variant, into a temporary folder) must write every file
    the README names as its output, and docs/ must hold just the files the README names
    (the benchmark's and the written documents)."""
    readme = (ROOT / "README.md").read_text()
    assert "`python -m tileattn bench --backend cpu --out docs`" in readme
    named = set(re.findall(r"docs/([\w.-]+\.(?:md|json|png))", readme))
    outputs = set(output_files("cpu").values())
    assert outputs <= named
    assert {path.name for path in (ROOT / "docs").iterdir()} == named
    monkeypatch.setattr(benchmark, "SETTLE_SECONDS", 0.0)  # only the files matter here
    # A budget that the naive run at the quick sweep's largest N (16384) exceeds.
    monkeypatch.setattr(benchmark, "_naive_budget", lambda memory: 1_000_000_000)
    out = tmp_path / "docs"
    assert main(["bench", "--backend", "cpu", "--quick", "--sizes", "64", "--out",
                 str(out)]) == 0
    assert {path.name for path in out.iterdir()} == outputs
    report = (out / "bench-cpu.md").read_text()
    assert "| 16384 | numpy-naive | — not run: the memory model gives 6.4 GB" in report
