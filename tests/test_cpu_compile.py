"""The CPU backend's compiling: the notice before a long compile, and `warmup`.

Cheap on purpose: the notice is checked on a one-line stand-in kernel (compiling the real
ones again costs seconds), and `warmup` runs on kernels that this test session compiles
or loads anyway.
"""

from __future__ import annotations

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from tileattn import backends  # noqa: E402

cpu = backends.load("cpu")

from tileattn.cpu.compile_notice import NOTICE  # noqa: E402


def forward_kernel(x):
    """A stand-in with the forward kernel's name and package, for the notice's filter."""
    return x + 1


forward_kernel.__module__ = "tileattn.cpu.stand_in"


def not_a_kernel(x):
    return x + 1


def test_the_notice_comes_only_when_a_kernel_is_not_cached(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))
    x = np.zeros(3, np.float32)
    numba.njit(cache=True)(forward_kernel)(x)
    notice = capsys.readouterr().err
    assert notice.startswith("tileattn: compiling the CPU forward kernel for float32")
    assert notice.count("\n") == 1 and str(tmp_path) in notice
    numba.njit(cache=True)(forward_kernel)(x)  # a new dispatcher, loaded from the disk cache
    numba.njit(not_a_kernel)(x)
    with NOTICE.silenced():
        numba.njit(forward_kernel)(x.astype(np.float64))
    assert capsys.readouterr().err == ""


def test_warmup_compiles_each_kernel_dtype_once_and_reports_progress(capsys):
    steps = []
    cpu.warmup(dtypes=["float32", np.float16], progress=lambda *step: steps.append(step))
    assert steps == [(1, 3, "forward float32"), (2, 3, "decode float32"),
                     (3, 3, "backward float32")]
    steps.clear()
    cpu.warmup(progress=lambda *step: steps.append(step))
    assert [label for _, _, label in steps] == [
        "forward float32", "decode float32", "backward float32",
        "forward float64", "decode float64", "backward float64"]
    assert [(done, total) for done, total, _ in steps] == [(i, 6) for i in range(1, 7)]
    assert "tileattn: compiling" not in capsys.readouterr().err
    from tileattn.cpu.backward_kernel import backward_kernel
    from tileattn.cpu.decode_kernel import decode_kernel
    from tileattn.cpu.forward_kernel import forward_kernel as real_forward_kernel

    # one signature per compute dtype: what a later call of any dtype finds compiled
    assert (len(real_forward_kernel.signatures) == len(decode_kernel.signatures)
            == len(backward_kernel.signatures) == 2)


def test_warmup_names_a_dtype_it_cannot_compile():
    with pytest.raises(ValueError, match="int32"):
        cpu.warmup(dtypes=["int32"])
