"""The CPU benchmark scripts added with the ring and the variable-length work: each mode
runs and says what it found (bench/bench_ring.py on simulated CPU ranks,
bench/bench_cpu_varlen.py), and a bad argument gets a one-line error, not a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench"
TINY = ["--simulate", "2", "--heads", "2", "--head-dim", "16"]


def bench(*args: str, script: str = "bench_ring.py") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True,
                          text=True, timeout=300, check=False)


def test_scaling_prints_a_row_per_length_and_causality():
    result = bench(*TINY, "--seqlens", "256", "512", "--layout", "contiguous")
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines()
            if line.startswith(("| 256 |", "| 512 |"))]
    assert len(rows) == 4, result.stdout
    assert "eff fwd+bwd" in result.stdout and "peak mem / rank" in result.stdout
    assert "cast s" in result.stdout and "(exposed of shifts)" in result.stdout
    assert all(" of " in row for row in rows)  # "hidden (exposed of shifts s)" measured


def test_no_hidden_skips_the_shifts_and_leaves_the_hidden_columns_empty():
    result = bench(*TINY, "--seqlens", "256", "--causal", "yes", "--no-hidden",
                   "--no-baseline")
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith("| 256 |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[2] == "—" and cells[4] == "—"  # no t(1) without the baseline
    assert cells[10].startswith("—") and cells[11].startswith("—"), row


def test_check_mode_compares_every_layout_and_exits_zero_when_exact():
    result = bench(*TINY, "--check", "--check-seqlen", "256", "--check-dtypes", "float64")
    assert result.returncode == 0, result.stderr
    assert "check: 0 failures" in result.stdout
    for layout in ("contiguous", "zigzag"):
        assert f"float64 {layout} causal=True" in result.stdout


def test_reach_mode_reports_the_longest_length():
    result = bench(*TINY, "--reach", "--reach-start", "256", "--reach-stop", "512")
    assert result.returncode == 0, result.stderr
    assert "reach: longest N = 512" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--simulate", "0"], "--simulate must be at least 1, got 0"),
    (["--simulate", "2", "--seqlens", "255"],
     "N = 255 does not split into the 4 chunks of layout='zigzag' on 2 ranks"),
    (["--heads", "3", "--kv-heads", "2"], "--heads (3) must be a multiple of --kv-heads (2)"),
    (["--dtype", "float8"], "unknown dtype 'float8'"),
    (["--seqlens", "0"], "--seqlens must be at least 1 each"),
    (["--reach", "--reach-start", "8", "--reach-stop", "4"], "--reach-start (8) exceeds"),
    (["--layout", "bogus"], "invalid choice: 'bogus'"),
])
def test_bad_arguments_get_one_line_errors(args, message):
    result = bench(*args)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_varlen_benchmark_runs_on_one_small_sequence():
    result = bench("--sequences", "1", "--heads", "1", "--head-dim", "8",
                   script="bench_cpu_varlen.py")
    assert result.returncode == 0, result.stderr
    assert "| causal | packed |" in result.stdout
    assert "ratio to contiguous" in result.stdout


@pytest.mark.parametrize("name", ["--sequences", "--heads", "--head-dim"])
def test_varlen_benchmark_refuses_non_positive_sizes(name):
    result = bench(name, "0", script="bench_cpu_varlen.py")
    assert result.returncode == 2
    assert f"{name} must be at least 1, got 0" in result.stderr
    assert "Traceback" not in result.stderr


def test_cliff_sweep_checks_and_times_each_case_and_names_its_anchor():
    result = bench("--quick", "--only", "softcap", "--rounds", "1", "--pause", "0",
                   "--no-torch", script="sweep_cliffs_cpu.py")
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| softcap |")
            or line.startswith("| causal softcap |")]
    assert len(rows) == 4, result.stdout  # two cases, fwd and fwd+bwd
    assert all("| no option |" in row for row in rows)
    assert "0 cases outside the float32 tolerance" in result.stdout


@pytest.mark.parametrize("argument", [["--rounds", "0"], ["--pause", "-1"],
                                      ["--threads", "0"], ["--bogus"]])
def test_cliff_sweep_rejects_a_bad_argument_in_one_line(argument):
    result = bench(*argument, script="sweep_cliffs_cpu.py")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "error:" in result.stderr


def _gpu_sweep_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("sweep_cliffs_gpu",
                                                  BENCH / "sweep_cliffs_gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_gpu_cliff_sweep_cases_have_consistent_shapes_and_options():
    """Every case of the GPU sweep (which runs on the device only) at full size and at the
    check's size: whole GQA groups, one ALiBi slope per query head, and a positive FLOP
    count."""
    sweep = _gpu_sweep_module()
    listed = sweep.cases(False, ["float16", "bfloat16"]) + sweep.cases(True, ["float32"])
    assert len({(case.name, case.dtype) for case in listed}) == len(listed)
    for case in listed:
        for scale_down in (1, 8):
            q, k, v, do = case.shapes(scale_down)
            heads_axis = 2 if case.bshd else 1
            assert q[heads_axis] % k[heads_axis] == 0 and k == v[:3] + (case.head_dim,)
            assert do[3] == v[3] == case.value_dim
            slopes = case.call_options(scale_down).get("alibi_slopes")
            assert slopes is None or slopes.shape == (q[heads_axis],)
        assert case.flops(True) == 3.5 * case.flops(False) > 0


@pytest.mark.parametrize("argument", [["--workers", "0"], ["--dtypes", "float8"],
                                      ["--bogus"]])
def test_gpu_cliff_sweep_rejects_a_bad_argument_in_one_line(argument):
    result = bench(*argument, script="sweep_cliffs_gpu.py")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "error:" in result.stderr


def test_gpu_cliff_sweep_without_cupy_says_so_in_one_line():
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed")
    except ImportError:
        pass
    result = bench("--quick", "--dtypes", "float64", script="sweep_cliffs_gpu.py")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "needs CuPy" in result.stderr


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cpu_decode_bench_takes_a_16_bit_cache(dtype):
    """bench_cpu_decode.py --dtype: both libraries get the cache in that dtype, each
    validated against the golden model at the dtype's tolerance before it is timed, at
    each head dim of --head-dim."""
    pytest.importorskip("torch")
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    result = bench("--threads", "1", "--batch", "1", "--nk", "1024", "--nq", "1",
                   "--repeats", "1", "--dtype", dtype, "--head-dim", "40", "128",
                   script="bench_cpu_decode.py")
    assert result.returncode == 0, result.stderr
    assert f"threads 1, {dtype}" in result.stdout
    rows = result.stdout.splitlines()
    assert sum(line.startswith("| 40 | 1 |") for line in rows) == 3
    assert sum(line.startswith("| 128 | 1 |") for line in rows) == 3


def test_the_ab_tool_runs_a_revision_beside_the_working_tree(tmp_path):
    """bench/experiments/ab_trees_gpu.py: the base revision's package imports as
    tileattn_base beside tileattn, and its backends are its own modules."""
    if subprocess.run(["git", "-C", str(BENCH.parent), "rev-parse", "HEAD"],
                      capture_output=True, check=False).returncode != 0:
        pytest.skip("not a git checkout")
    code = f"""
import sys
sys.path.insert(0, {str(BENCH / 'experiments')!r})
import ab_trees_gpu
sys.path.insert(0, ab_trees_gpu.base_package("HEAD", {str(tmp_path)!r}))
import numpy as np, tileattn, tileattn_base
q = np.random.default_rng(0).standard_normal((1, 2, 40, 16)).astype(np.float32)
new = tileattn.forward(q, q, q, causal=True, backend="cpu")
base = tileattn_base.forward(q, q, q, causal=True, backend="cpu")
assert tileattn_base.__file__.startswith({str(tmp_path)!r}), tileattn_base.__file__
assert "tileattn_base.cpu" in sys.modules, "the base ran the working tree's backend"
from tileattn.testing import assert_attention_close
assert_attention_close(base, new, np.float32)
print(ab_trees_gpu.parse_shape("B4 H8/1 Nq8 Nk4096 D128 float16 causal"))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=600, check=False, cwd=BENCH.parent)
    assert result.returncode == 0, result.stderr
    assert "(4, 8, 1, 8, 4096, 128, 'float16', True)" in result.stdout
