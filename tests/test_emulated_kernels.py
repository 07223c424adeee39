"""Tensor-core kernels run on the CPU under emulation of the CUDA built-ins, no GPU needed
(bench/experiments/emulate_mma_cpu.py: the kernels' own source, warp-wide PTX computed by
meaning), against the float64 golden model."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "bench", "experiments",
                      "emulate_mma_cpu.py")


def _gxx_major() -> int:
    """g++'s major version, 0 where it is missing (the emulation needs C++20's barriers)."""
    if shutil.which("g++") is None:
        return 0
    version = subprocess.run(["g++", "-dumpfullversion", "-dumpversion"], capture_output=True,
                             text=True).stdout
    match = re.match(r"(\d+)", version)
    return int(match.group(1)) if match else 0


def _emulation(*arguments: str) -> str:
    """emulate_mma_cpu.py's output for `arguments`, which must end "all passed"; skips where
    g++ 12 or ml_dtypes (the emulation's 16-bit inputs) is missing."""
    if _gxx_major() < 12:
        pytest.skip("the emulation needs g++ 12 or later")
    pytest.importorskip("ml_dtypes")
    result = subprocess.run([sys.executable, SCRIPT, *arguments], capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, (result.stdout[-4000:], result.stderr[-4000:])
    assert "all passed" in result.stdout
    return result.stdout


def test_single_pass_in_turns_under_emulation():
    """The backward's single pass (--single-pass --quick): a banded float16 GQA case and an
    unbanded float32 one, each in arrival order, in turns (ORDERED: the float32 default's
    protocol), into a slot per key block (DQ_PARTS), and the last two into (B, N, H, D)
    gradients too. The emulation runs its blocks one after another, taking their tickets in
    that order, so a turn ranked out of order hangs here: the subprocess's timeout turns
    that into a failure."""
    output = _emulation("--single-pass", "--quick")
    # in turns and in a slot per key block: each case into (B, H, N, D) and into
    # (B, N, H, D) gradients
    assert output.count("\nok backward single pass in turns") == 4, output
    assert output.count("\nok backward single pass in parts") == 4, output
    assert output.count("gradients (B, N, H, D)") == 4, output


def test_paged_decode_under_emulation():
    """The tensor-core decode over paged K/V (--paged-decode): pages of 1 to 256 keys in
    either pool order, stages swizzled, whole-tile pages copied as dense ones, and each
    case again with paired page rows (a row's address from its pair's), whose three cases
    take that path at D 64, 128 and 256."""
    lines = _emulation("--paged-decode").splitlines()
    assert sum(line.startswith("ok paged decode") for line in lines) == 30, lines
    assert sum(line.endswith("paired page rows") for line in lines) == 10, lines


def test_decode_merges_under_emulation():
    """The split-KV decode's two merge kernels (bench/experiments/emulate_decode_cpu.py
    --merges): a block per (row, 32 columns) over 140 splits of two rows, and a warp per row
    over 3 and 33 splits of up to 288 rows, a NaN-and-Inf case among them, each with o
    contiguous and in (B, N, H, Dv)."""
    if _gxx_major() < 12:
        pytest.skip("the emulation needs g++ 12 or later")
    pytest.importorskip("ml_dtypes")
    script = os.path.join(os.path.dirname(SCRIPT), "emulate_decode_cpu.py")
    result = subprocess.run([sys.executable, script, "--merges"], capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, (result.stdout[-4000:], result.stderr[-4000:])
    assert "all passed" in result.stdout
    assert result.stdout.count("\nok ") + result.stdout.startswith("ok ") == 10, result.stdout


def test_float32_forwards_under_emulation():
    """The 3xTF32 forwards (bench/experiments/emulate_mma_cpu.py --tf32): mma.sync, and the
    Hopper kernel on wgmma, whose descriptors, swizzle and operand orders the emulation
    reads as the hardware does, each with o contiguous and in (B, N, H, Dv)."""
    assert _emulation("--tf32").count("Tf32WgmmaTiles") == 10


def test_16_bit_hopper_kernels_under_emulation():
    """The 16-bit forward and backward on wgmma (bench/experiments/emulate_mma_cpu.py
    --wgmma): one to three warpgroups, two and three stages, 32-, 64- and 128-byte swizzles,
    Dv != D, every score option, GQA, a band, the forward's overlapped schedule (OVERLAP),
    dK and dV in one launch and in two, outputs contiguous and in (B, N, H, D). The
    emulation reads the descriptors (K-major and MN-major operands) and the register A
    operand as the hardware does, and runs each wgmma group only at its wait (an
    accumulator touched or an operand overwritten before it shows), the forward with
    cp.async copies landing at their wait and again at issue (a buffer refilled under a
    pending product shows)."""
    output = _emulation("--wgmma")
    assert output.count("ok wgmma ") == 40, output  # copies landing at the wait and at issue
    assert output.count("overlap=True") == 20, output
    assert output.count("ok backward ") == 6, output


def test_float64_kernels_under_emulation():
    """float64 on FP64 tensor cores (bench/experiments/emulate_mma_cpu.py --f64): the forward
    (attention_tf32_forward.cu with IS_FLOAT64) and the backward's two kernels
    (attention_mma_backward.cu with IS_FLOAT64), every score option, odd and unequal head
    dims, GQA, NaN at places a band hides, outputs contiguous and in (B, N, H, D), at
    float64's tolerance."""
    output = _emulation("--f64")
    assert output.count("ok f64 float64") == 12, output
    assert output.count("ok backward float64") == 10, output


def test_folded_gqa_decodes_through_the_launcher_under_emulation():
    """GQA decodes of 64 packed rows at D <= 256 folded onto the wgmma forward
    (bench/experiments/emulate_mma_cpu.py --fold-decode, tiles.FOLD_DECODE_ENABLED forced
    on): one causal query row, one under a window whose cut-off keys hold NaN and inf,
    several unmasked rows at once, first
    and cached calls, the kernels emulated; "bshd" arrays with several rows decline the
    fold (their heads' rows are not consecutive); rows copied in 8-byte pieces build no
    overlapped tiles, and the D 128 folds of <= 64 rows build overlapped ones."""
    output = _emulation("--fold-decode")
    assert output.count("ok launcher") == 24, output
    assert output.count("declines the fold") == 4, output


def test_float64_key_shares_through_the_launcher_under_emulation():
    """float64's forward over few query tiles through `launch_forward.forward` (dispatch's
    key shares, double partials, split_keys_merge.cu in double) on a CuPy stand-in whose
    kernels are the emulation (bench/experiments/emulate_mma_cpu.py --f64-shares)."""
    assert _emulation("--f64-shares").count("ok launcher key shares") == 4
