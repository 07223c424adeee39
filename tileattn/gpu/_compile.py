"""Compiling the CUDA sources with NVRTC (through `cupy.RawModule`), memoised per device.

Each kernel source is specialised by ``-D`` defines (dtype, head dims, tile sizes, option
switches) and compiled once per ``(device, source, defines)``. The shared header is spliced
into the source text instead of being found through ``-I``: CuPy's on-disk cache is keyed by
the source text and options, so an edit of the header then invalidates the cached binaries.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
import re
import tempfile
import threading
from functools import lru_cache

_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_]+\.cuh)"\s*$', re.MULTILINE)
_lock = threading.Lock()
_modules: dict[tuple, object] = {}  # cupy.RawModule per (device, source, defines)
_kernels: dict[tuple, object] = {}  # cupy.RawKernel per (device, source, defines, entry)
_opted_in: dict[tuple, int] = {}  # the dynamic shared memory each kernel was raised to


@lru_cache(maxsize=None)
def source(name: str) -> str:
    """The text of a ``.cu`` file of this package with its local headers spliced in, each
    header once (the splice drops ``#pragma once``, which NVRTC would reject in a main file)."""
    return _splice(name, set())


def _splice(name: str, spliced: set[str]) -> str:
    text = importlib.resources.files(__package__).joinpath(name).read_text()
    if name.endswith(".cuh"):
        text = text.replace("#pragma once\n", "", 1)

    def header(match):
        included = match.group(1)
        if included in spliced:
            return ""
        spliced.add(included)
        return _splice(included, spliced)

    return _INCLUDE.sub(header, text)


def kernel(source_name: str, entry: str, defines: tuple[tuple[str, object], ...],
           shared_bytes: int = 0, arch: str | None = None):
    """The compiled kernel `entry` of `source_name` for the current device.

    `defines` is a sorted tuple of ``(NAME, value)`` pairs; `shared_bytes` raises the
    kernel's dynamic shared-memory limit when a launch needs more than the default 48 KiB.
    `arch` (e.g. ``"90a"``) names a target CuPy's compiler cannot select: CuPy appends its
    own ``-arch=sm_XY`` (no ``a`` suffix, so no wgmma) to every compile, so such sources
    are compiled through NVRTC directly (`_arch_specific_module`).
    """
    import cupy

    module_key = (cupy.cuda.Device().id, source_name, defines, arch)
    with _lock:
        function = _kernels.get(module_key + (entry,))
        if function is None:
            module = _modules.get(module_key)
            if module is None:
                # One module holds every entry point of a source (forward and backward),
                # so a training step compiles each configuration once.
                options = ("-std=c++17",) + tuple(f"-D{name}={value}" for name, value in defines)
                if arch is None:
                    module = cupy.RawModule(code=source(source_name), options=options)
                else:
                    module = _arch_specific_module(source(source_name), options, arch)
                _modules[module_key] = module
            function = module.get_function(entry)
            _kernels[module_key + (entry,)] = function
        if shared_bytes > 48 * 1024 and _opted_in.get(module_key + (entry,), 0) < shared_bytes:
            # Set once per kernel instead of read and compared on every call: each read is a
            # driver call of host time, and one failed inside a JAX callback with
            # CUDA_ERROR_FUNCTION_NOT_LOADED (bench/NOTES-gpu.md, v18).
            function.max_dynamic_shared_size_bytes = shared_bytes
            _opted_in[module_key + (entry,)] = shared_bytes
    return function


def _arch_specific_module(code: str, options: tuple[str, ...], arch: str):
    """`code` compiled by NVRTC for ``sm_<arch>``, cached on disk as a cubin beside CuPy's
    own kernel cache (keyed by source, options and NVRTC version), loaded as a RawModule."""
    import cupy
    from cupy.cuda import nvrtc

    # CuPy compiles with -ftz=true by default; the arch-specific kernels match the others.
    options = options + ("-ftz=true", f"-arch=sm_{arch}")
    key = hashlib.sha256(repr((code, options, nvrtc.getVersion())).encode()).hexdigest()
    cache_dir = os.path.join(os.environ.get("CUPY_CACHE_DIR",
                                            os.path.expanduser("~/.cupy/kernel_cache")),
                             "tileattn")
    path = os.path.join(cache_dir, f"{key}.cubin")
    if not os.path.exists(path):
        program = nvrtc.createProgram(code, "tileattn.cu", (), ())
        try:
            try:
                nvrtc.compileProgram(program, options)
            except nvrtc.NVRTCError as error:
                raise RuntimeError(f"NVRTC could not compile for sm_{arch} with {options}:\n"
                                   f"{nvrtc.getProgramLog(program)}") from error
            cubin = nvrtc.getCUBIN(program)
        finally:
            nvrtc.destroyProgram(program)
        os.makedirs(cache_dir, exist_ok=True)
        # Written whole, then renamed: a concurrent process never loads half a file.
        with tempfile.NamedTemporaryFile(dir=cache_dir, delete=False) as partial:
            partial.write(cubin)
        os.replace(partial.name, path)
    return cupy.RawModule(path=path)


def compiled_count() -> int:
    """How many modules (configurations) have been compiled in this process."""
    return len(_modules)
