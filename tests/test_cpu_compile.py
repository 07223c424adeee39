"""The CPU backend's compiling: the notice before a long compile, `warmup`, and the disk
cache flushed when a kernel source changes.

Cheap on purpose: the notice is checked on a one-line stand-in kernel (compiling the real
ones again costs seconds), and `warmup` runs on kernels that this test session compiles
or loads anyway.
"""

from __future__ import annotations

from pathlib import Path

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
    assert steps == [(1, 4, "forward float32"), (2, 4, "decode float32"),
                     (3, 4, "backward float32"), (4, 4, "decode 16-bit")]
    steps.clear()
    cpu.warmup(dtypes="float32", progress=lambda *step: steps.append(step))
    assert [label for _, _, label in steps] == [
        "forward float32", "decode float32", "backward float32"]
    steps.clear()
    cpu.warmup(progress=lambda *step: steps.append(step))
    # bfloat16's backward on pair products is a kernel of its own where the CPU has them.
    pairs = ["backward bfloat16"] if cpu.BF16_PAIR_PRODUCTS else []
    assert [label for _, _, label in steps] == [
        "forward float32", "decode float32", "backward float32",
        "forward float64", "decode float64", "backward float64", "decode 16-bit"] + pairs
    total = 7 + len(pairs)
    assert [(done, steps_in) for done, steps_in, _ in steps] == [
        (i, total) for i in range(1, total + 1)]
    assert "tileattn: compiling" not in capsys.readouterr().err
    from tileattn.cpu.backward_kernel import backward_kernel
    from tileattn.cpu.decode_kernel import decode_kernel
    from tileattn.cpu.forward_kernel import forward_kernel as real_forward_kernel

    # one signature per compute dtype (and the decode's over 16-bit K and V; the tiled
    # kernels' with bfloat16's pair products): what a later call of any dtype finds compiled
    assert len(decode_kernel.signatures) == 3
    assert (len(real_forward_kernel.signatures) == len(backward_kernel.signatures)
            == 2 + len(pairs))


def test_warmup_names_a_dtype_it_cannot_compile():
    with pytest.raises(ValueError, match="int32"):
        cpu.warmup(dtypes=["int32"])


def cached_stand_in(x):
    """A kernel stand-in for the disk cache's flush."""
    return x * 2


def test_a_changed_source_flushes_the_kernels_disk_cache(monkeypatch, tmp_path):
    """Numba keys a cached kernel on its own file and bytecode only; `flush_if_stale` drops
    its entries when any source the kernels compile from changed (a stamp beside the
    cache), so no kernel runs machine code built from old helpers."""
    from tileattn.cpu import kernel_cache

    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))
    x = np.zeros(3, np.float32)

    def loaded_from_disk(flush_first: bool) -> bool:
        kernel = numba.njit(cache=True)(cached_stand_in)  # a new dispatcher, as a new process
        if flush_first:
            kernel_cache.flush_if_stale(kernel)
        kernel(x)
        return kernel.stats.cache_hits.get(kernel.signatures[0], 0) > 0

    assert not loaded_from_disk(False)  # compiled and saved
    assert loaded_from_disk(False)
    assert not loaded_from_disk(True)  # no stamp yet: flushed, compiled again, stamped
    assert loaded_from_disk(True)  # the same sources: kept
    stamps = list(tmp_path.rglob("*" + kernel_cache._STAMP_SUFFIX))
    assert len(stamps) == 1 and stamps[0].read_text() == kernel_cache.sources_digest()
    monkeypatch.setattr(kernel_cache, "_digest", "0" * 64)  # a helper changed
    assert not loaded_from_disk(True)
    assert loaded_from_disk(True)
    assert stamps[0].read_text() == "0" * 64


def test_the_real_kernels_are_stamped_with_their_sources():
    from tileattn.cpu import kernel_cache
    from tileattn.cpu.backward_kernel import backward_kernel
    from tileattn.cpu.decode_kernel import decode_kernel
    from tileattn.cpu.forward_kernel import forward_kernel

    for kernel in (forward_kernel, backward_kernel, decode_kernel):
        stamp = (Path(kernel._cache.cache_path)
                 / f"{kernel.py_func.__module__}.{kernel.py_func.__qualname__}"
                   f"{kernel_cache._STAMP_SUFFIX}")
        assert stamp.read_text() == kernel_cache.sources_digest()
    names = {path.name for path in kernel_cache._SOURCES}
    assert {"vector_math.py", "tiles.py", "forward_kernel.py", "dropout.py",
            "options.py"} <= names
