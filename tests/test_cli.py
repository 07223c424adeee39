"""The command line: the main job a new user runs (``python -m tileattn check``), and every
argument of every subcommand with the values outsiders try.

A bad value gets exactly one line on stderr naming the argument, a non-zero exit and no
traceback, as the API rejects bad arguments; a run that checked or warmed up nothing fails.
Most cases call `tileattn.__main__.main` in this process (fast, and backends can be swapped
for fakes); a few run the real ``python -m tileattn`` to see what a user sees.
"""

from __future__ import annotations

import subprocess
import sys
import types

import numpy as np
import pytest

from tileattn import backends
from tileattn.__main__ import (INFO_MAX_SEQ_LEN, MAX_BATCH, MAX_HEAD_DIM, MAX_HEADS,
                               MAX_LENGTH, main)

NOT_POSITIVE = [("-5", "must be a positive integer, got -5"),
                ("0", "must be a positive integer, got 0"),
                ("abc", "must be a positive integer, got 'abc'"),
                ("1.5", "must be a positive integer, got '1.5'"),
                ("", "must be a positive integer, got ''")]
HUGE = str(10 ** 310)  # beyond a float: the reports' byte counts overflowed
# Each shape argument's maximum, and a value above it.
MAXIMA = {"--seq-len": MAX_LENGTH, "--heads": MAX_HEADS, "--head-dim": MAX_HEAD_DIM,
          "--batch": MAX_BATCH}
BAD_DTYPES = [(name, f"must be one of float16, bfloat16, float32, float64, got '{name}'")
              for name in ("float8", "int32", "FLOAT32", "")]


def shape_argument_cases(command):
    cases = []
    for flag in ("--seq-len", "--heads", "--head-dim", "--batch"):
        cases += [([command, flag, value], f"argument {flag}: {message}")
                  for value, message in NOT_POSITIVE]
        cases.append(([command, flag], f"argument {flag}: expected one argument"))
        cases += [([command, flag, value], f"argument {flag}: must be at most {MAXIMA[flag]}, "
                                           f"got {value}")
                  for value in (str(MAXIMA[flag] + 1), HUGE)]
    cases += [([command, "--dtype", value], f"argument --dtype: {message}")
              for value, message in BAD_DTYPES]
    cases.append(([command, "--dtype"], "argument --dtype: expected one argument"))
    cases.append(([command, "--no-causal=yes"],
                  "argument --no-causal: ignored explicit argument 'yes'"))
    cases.append(([command, "--frobnicate"], "unrecognized arguments: --frobnicate"))
    return cases


BAD_ARGUMENTS = (
    [([], "the following arguments are required: COMMAND"),
     (["frobnicate"], "invalid choice: 'frobnicate'")]
    + shape_argument_cases("check")
    + [(["check", "--backend", "nope"],
        "argument --backend: invalid choice: 'nope' (choose from 'reference', 'cpu', 'gpu')"),
       (["check", "--backend"], "argument --backend: expected one argument"),
       (["check", "--seq-len", "1000000"],
        "--seq-len 1000000 with --batch 1 --heads 4 --head-dim 64 needs about 256032.8 GB "
        "for the golden model"),
       (["check", "--head-dim", "65536", "--seq-len", "65536"], "GB for the golden model")]
    + shape_argument_cases("info")
    + [(["info", "--seq-len", str(INFO_MAX_SEQ_LEN + 1)],
        f"argument --seq-len: at most {INFO_MAX_SEQ_LEN}"),
       (["info", "--value-dim", "0"], "argument --value-dim: must be a positive integer, got 0"),
       (["info", "--value-dim", "x"], "argument --value-dim: must be a positive integer"),
       (["info", "--value-dim", HUGE], f"argument --value-dim: must be at most {MAX_HEAD_DIM}"),
       (["info", "--kv-heads", str(MAX_HEADS + 1)],
        f"argument --kv-heads: must be at most {MAX_HEADS}, got {MAX_HEADS + 1}"),
       # The hang: a GQA group of 2**31 - 1 heads walked for minutes.
       (["info", "--dtype", "float32", "--seq-len", "100", "--n-k", "100", "--heads",
         "2147483647", "--kv-heads", "1"], f"argument --heads: must be at most {MAX_HEADS}"),
       # Each within its own bound, together 2**32 query heads: info's planning allocated
       # a table of 32 GiB and died with a traceback.
       (["info", "--heads", str(MAX_HEADS), "--batch", str(MAX_BATCH), "--seq-len", "16"],
        "arguments --batch and --heads: their product at most 4194304 (info plans the call), "
        f"got {MAX_BATCH} x {MAX_HEADS} = {MAX_BATCH * MAX_HEADS}")]
    + [(["bench", "--backend", value], f"argument --backend: invalid choice: '{value}'")
       for value in ("nope", "reference", "auto")]
    + [(["bench", "--backend"], "argument --backend: expected one argument"),
       (["bench", "--quick=1"], "argument --quick: ignored explicit argument '1'"),
       (["bench", "--out"], "argument --out: expected one argument"),
       (["bench", "--out", "README.md"], "argument --out: 'README.md' exists and is not a folder"),
       (["bench", "--out", "/proc/no/such/folder"], "argument --out: cannot create"),
       (["bench", "--sizes"], "argument --sizes: expected at least one argument"),
       (["bench", "--head-dims"], "argument --head-dims: expected at least one argument"),
       (["bench", "--sizes", "2000000000"], "N=2000000000 (--sizes) with --batch 1, 8 heads"),
       (["bench", "--sizes", "1000000", "--head-dims", "64", "65536"],
        "D=65536 (--head-dims) needs about"),
       (["bench", "--sizes", "3", "--heads", "1", "--head-dims", "65536"],
        "the memory sweep (one head up to N=65536) at D=65536 (the first --head-dims) "
        "needs about"),
       (["bench", "--head-dims", "64", HUGE],
        f"argument --head-dims: must be at most {MAX_HEAD_DIM}"),
       (["bench", "--sizes", HUGE], f"argument --sizes: must be at most {MAX_LENGTH}"),
       (["bench", "--heads", HUGE], f"argument --heads: must be at most {MAX_HEADS}"),
       (["bench", "--batch", HUGE], f"argument --batch: must be at most {MAX_BATCH}"),
       (["bench", "--frobnicate"], "unrecognized arguments: --frobnicate")]
    + [(["bench", flag, "64", value], f"argument {flag}: {message}")
       for flag in ("--sizes", "--head-dims") for value, message in NOT_POSITIVE]
    + [(["bench", flag, value], f"argument {flag}: {message}")
       for flag in ("--heads", "--batch") for value, message in NOT_POSITIVE]
    + [(["bench", "--dtype", value], f"argument --dtype: {message}")
       for value, message in BAD_DTYPES]
    + [(["warmup", "--dtype", value], f"argument --dtype: {message}")
       for value, message in BAD_DTYPES]
    + [(["warmup", "--dtype"], "argument --dtype: expected one argument"),
       (["warmup", "--backend", "reference"],
        "argument --backend: invalid choice: 'reference' (choose from 'cpu', 'gpu')"),
       (["warmup", "--backend", "nope"], "argument --backend: invalid choice: 'nope'"),
       (["warmup", "--backend"], "argument --backend: expected one argument"),
       (["warmup", "--frobnicate"], "unrecognized arguments: --frobnicate")]
)


def run_main(argv, capsys):
    """``(exit status, stdout, stderr)`` of ``python -m tileattn *argv``, in this process."""
    try:
        status = main(argv)
    except SystemExit as exit_:
        status = exit_.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def assert_one_line_error(status, err, fragment, expected_status=2):
    assert status == expected_status, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("argv, fragment", BAD_ARGUMENTS,
                         ids=[" ".join(argv) or "no command" for argv, _ in BAD_ARGUMENTS])
def test_bad_arguments_get_one_line_and_exit_2(argv, fragment, capsys):
    status, out, err = run_main(argv, capsys)
    assert_one_line_error(status, err, fragment)
    assert out == ""


@pytest.mark.parametrize("command", ["check", "info", "bench", "warmup"])
def test_bfloat16_without_ml_dtypes_names_the_package(command, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes now fails
    status, _, err = run_main([command, "--dtype", "bfloat16"], capsys)
    assert_one_line_error(status, err, "argument --dtype: bfloat16 needs ml_dtypes, which is "
                                       "not installed: pip install ml_dtypes")


# --------------------------------------------------------------------------- backends


def make_unavailable(monkeypatch, name):
    """The backend `name` cannot run, as without its library."""
    entry = backends.BackendEntry(name, backends.REGISTRY[name].module, name,
                                  "not_a_module_tileattn_needs")
    monkeypatch.setitem(backends.REGISTRY, name, entry)
    monkeypatch.delitem(backends._loaded, name, raising=False)


def install_fake(monkeypatch, name, **attributes):
    """A loaded backend module `name` that has only `attributes` (and MEMORY = "host")."""
    module = types.SimpleNamespace(MEMORY="host", availability=lambda: None, **attributes)
    monkeypatch.setitem(backends._loaded, name, module)
    return module


MISSING = "needs not_a_module_tileattn_needs, which is not installed"


def test_check_of_a_named_backend_that_cannot_run_fails(monkeypatch, capsys):
    """It said "all backends within tolerance" and exited 0 having checked nothing."""
    make_unavailable(monkeypatch, "gpu")
    status, out, err = run_main(["check", "--backend", "gpu", "--seq-len", "16"], capsys)
    assert_one_line_error(status, err, f"backend='gpu' {MISSING}", expected_status=1)
    assert "within tolerance" not in out


def test_check_without_a_fast_backend_fails(monkeypatch, capsys):
    make_unavailable(monkeypatch, "cpu")
    make_unavailable(monkeypatch, "gpu")
    status, out, err = run_main(["check", "--seq-len", "16", "--heads", "1"], capsys)
    assert_one_line_error(status, err, "the check failed", expected_status=1)
    assert "reference" in out and "no fast backend (cpu, gpu) could run" in out
    assert "within tolerance" not in out


def test_check_of_the_golden_model_alone_fails(capsys):
    """README: check fails when no fast backend ran, named or not (it exited 0 having
    checked the golden model against itself)."""
    status, out, err = run_main(["check", "--backend", "reference", "--seq-len", "16",
                                 "--heads", "1"], capsys)
    assert_one_line_error(status, err, "the check failed", expected_status=1)
    assert "no fast backend (cpu, gpu) was named" in out
    assert "within tolerance" not in out


def test_bench_refused_for_its_sizes_creates_no_out_folder(tmp_path, capsys):
    out_folder = tmp_path / "new" / "results"
    status, _, err = run_main(["bench", "--backend", "cpu", "--out", str(out_folder),
                               "--sizes", "100000000"], capsys)
    assert_one_line_error(status, err, "N=100000000 (--sizes)")
    assert not (tmp_path / "new").exists()


def test_check_uses_the_values_given(capsys):
    """``--heads 0`` ran with 4 heads; each value must reach the check as given."""
    status, out, err = run_main(["check", "--seq-len", "24", "--heads", "1", "--batch", "2",
                                 "--head-dim", "8", "--dtype", "float64", "--no-causal",
                                 "--backend", "reference", "--backend", "cpu"], capsys)
    assert status == 0, out + err
    assert "q, k, v (2, 1, 24, 8) float64, causal=False" in out
    assert "all checked backends within tolerance: reference, cpu" in out


@pytest.mark.parametrize("argv", [["bench", "--backend", "gpu"], ["bench"]])
def test_bench_on_a_backend_that_cannot_run_fails(argv, monkeypatch, capsys):
    make_unavailable(monkeypatch, "gpu")
    make_unavailable(monkeypatch, "cpu")
    status, _, err = run_main(argv, capsys)
    name = "gpu" if "gpu" in argv else "cpu"
    assert_one_line_error(status, err, f"backend='{name}' {MISSING}", expected_status=1)


def test_bench_reports_a_failed_correctness_check_in_one_line(monkeypatch, capsys, tmp_path):
    import tileattn.benchmark

    def failing_check(**kwargs):
        return False

    monkeypatch.setattr(tileattn.benchmark, "run_check", failing_check)
    status, _, err = run_main(["bench", "--backend", "cpu", "--sizes", "16", "--out",
                               str(tmp_path)], capsys)
    assert_one_line_error(status, err, "RuntimeError: backend 'cpu' fails the correctness "
                                       "check at D=64", expected_status=1)


def test_info_reports_every_value_given(capsys):
    status, out, err = run_main(["info", "--seq-len", "1", "--heads", "3", "--batch", "2",
                                 "--head-dim", "1", "--dtype", "float16", "--no-causal"],
                                capsys)
    assert status == 0, err
    assert "q (2, 3, 1, 1), Nk=1, " in out and "float16, causal=False" in out
    status, out, err = run_main(["info", "--seq-len", "8", "--head-dim", "192",
                                 "--value-dim", "128"], capsys)
    assert status == 0, err
    assert "q (1, 8, 8, 192), Nk=8, Dv=128, " in out
    # the reference backend always runs, and serves variable-length and paged calls
    assert "variable-length and paged calls (seqlens_*, cu_seqlens_*, block_table): yes" in out
    status, out, err = run_main(["info", "--seq-len", "1", "--n-k", "131072", "--heads", "8",
                                 "--kv-heads", "1", "--dtype", "float16"], capsys)
    assert status == 0, err
    assert "q (1, 8, 1, 64), Nk=131072, Dv=64, Hkv=1, float16" in out


@pytest.mark.parametrize("arguments,path", [
    (["--seq-len", "64", "--n-k", "8192", "--heads", "32", "--kv-heads", "8"],
     "decode path (cpu/decode_kernel.py)"),
    (["--seq-len", "64", "--n-k", "8192", "--heads", "8"], "tiled forward"),
    (["--seq-len", "1", "--n-k", "4096"], "decode path (cpu/decode_kernel.py)"),
])
def test_info_names_the_cpu_forward_path(capsys, arguments, path):
    status, out, err = run_main(["info", *arguments], capsys)
    assert status == 0, err
    cpu_section = out.split("[cpu]")[1].split("\n\n")[0]
    assert f"forward kernel: {path}" in cpu_section, cpu_section


# --------------------------------------------------------------------------- warmup


def test_warmup_compiles_the_chosen_backends_with_a_progress_bar(monkeypatch, capsys):
    calls = []

    def warmup(dtypes=None, progress=None):
        calls.append(dtypes)
        for done in range(1, 4):
            progress(done, 3, f"kernel {done}")

    install_fake(monkeypatch, "cpu", warmup=warmup)
    status, out, err = run_main(["warmup", "--backend", "cpu", "--dtype", "float32",
                                 "--dtype", "float64"], capsys)
    assert status == 0, err
    assert calls == [(np.dtype("float32"), np.dtype("float64"))]
    assert "3/3 kernel 3" in err and "[" + "#" * 30 + "]" in err
    assert "cpu: ready for float32, float64" in out


def test_warmup_defaults_to_every_dtype_and_every_available_backend(monkeypatch, capsys):
    calls = {}
    install_fake(monkeypatch, "cpu", warmup=lambda dtypes=None, progress=None:
                 calls.setdefault("cpu", dtypes))
    install_fake(monkeypatch, "gpu")  # available, but has no warmup
    status, out, err = run_main(["warmup"], capsys)
    assert status == 0, err
    assert calls == {"cpu": None}
    assert "gpu: skipped: the gpu backend has no warmup in this version of tileattn" in out
    make_unavailable(monkeypatch, "gpu")
    assert run_main(["warmup"], capsys)[0] == 0


def test_warmup_of_a_backend_without_warmup_fails_with_a_clear_message(monkeypatch, capsys):
    install_fake(monkeypatch, "cpu")
    status, _, err = run_main(["warmup", "--backend", "cpu"], capsys)
    assert_one_line_error(status, err, "the cpu backend has no warmup in this version of "
                                       "tileattn: its kernels compile on first use",
                          expected_status=1)
    make_unavailable(monkeypatch, "gpu")
    status, _, err = run_main(["warmup"], capsys)
    assert_one_line_error(status, err, "nothing was warmed up", expected_status=1)


def test_warmup_of_a_backend_that_cannot_run_fails(monkeypatch, capsys):
    make_unavailable(monkeypatch, "cpu")
    status, _, err = run_main(["warmup", "--backend", "cpu"], capsys)
    assert_one_line_error(status, err, f"backend='cpu' {MISSING}", expected_status=1)
    make_unavailable(monkeypatch, "gpu")
    status, _, err = run_main(["warmup"], capsys)
    assert_one_line_error(status, err, "no backend that compiles kernels can run here",
                          expected_status=1)


# --------------------------------------------------------------------------- the real thing


def test_check_runs_and_reports_every_backend():
    result = subprocess.run(
        [sys.executable, "-m", "tileattn", "check", "--seq-len", "64", "--heads", "2"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all checked backends within tolerance: reference, cpu" in result.stdout
    for name in ("cpu", "gpu"):
        assert name in result.stdout


@pytest.mark.parametrize("argv, fragment, status", [
    (["check", "--backend", "nope"], "invalid choice: 'nope'", 2),
    (["info", "--head-dim", "0"], "argument --head-dim: must be a positive integer, got 0", 2),
    (["check", "--seq-len", "-5"], "argument --seq-len: must be a positive integer, got -5", 2),
    (["check", "--heads", "0"], "argument --heads: must be a positive integer, got 0", 2),
    (["check", "--backend", "gpu"], "backend='gpu'", 1),
    (["bench", "--backend", "gpu"], "backend='gpu'", 1),
])
def test_the_reported_crashes_are_one_line_errors(argv, fragment, status):
    if "gpu" in argv and backends.availability("gpu") is None:
        pytest.skip("a GPU is available here, so the GPU backend runs")
    result = subprocess.run([sys.executable, "-m", "tileattn", *argv], capture_output=True,
                            text=True, timeout=120)
    assert_one_line_error(result.returncode, result.stderr, fragment, expected_status=status)


def test_bench_runs_every_implementation_and_the_memory_probe_in_bfloat16():
    """`bench --dtype bfloat16` hands ml_dtypes arrays to the torch anchor (DLPack has no
    bfloat16 for them) and names the dtype to the memory probe's fresh process (where NumPy
    knows it only once ml_dtypes is imported); each of these ended in a traceback."""
    from tileattn import benchmark
    from tileattn.testing import bfloat16

    pytest.importorskip("numba")
    if bfloat16() is None:
        pytest.skip("needs ml_dtypes")
    dtype = bfloat16()
    inputs = benchmark._inputs("host", 1, 2, 16, 8, dtype)
    table = benchmark.implementations("cpu", "host")
    assert len(table) >= 2  # the naive anchor at least; torch SDPA where torch is installed
    for direction in ("forward", "forward+backward"):
        benchmark.check_agreement(table, "tileattn-cpu", inputs, True, direction, dtype)
    assert benchmark.host_peak_extra_bytes("tileattn-cpu", 64, 8, "bfloat16") >= 0
