"""Compiling the CUDA sources with NVRTC (through `cupy.RawModule`), memoised per device.

Each kernel source is specialised by ``-D`` defines (dtype, head dims, tile sizes, option
switches) and compiled once per ``(device, source, defines)``. The shared header is spliced
into the source text instead of being found through ``-I``: CuPy's on-disk cache is keyed by
the source text and options, so an edit of the header then invalidates the cached binaries.
"""

from __future__ import annotations

import importlib.resources
import re
import threading
from functools import lru_cache

import cupy

_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_]+\.cuh)"\s*$', re.MULTILINE)
_lock = threading.Lock()
_modules: dict[tuple, cupy.RawModule] = {}
_kernels: dict[tuple, cupy.RawKernel] = {}


@lru_cache(maxsize=None)
def source(name: str) -> str:
    """The text of a ``.cu`` file of this package with its local headers spliced in."""
    text = importlib.resources.files(__package__).joinpath(name).read_text()
    if name.endswith(".cuh"):
        # Spliced into a .cu file, the guard would be "#pragma once in main file".
        text = text.replace("#pragma once\n", "", 1)
    return _INCLUDE.sub(lambda match: source(match.group(1)), text)


def kernel(source_name: str, entry: str, defines: tuple[tuple[str, object], ...],
           shared_bytes: int = 0) -> cupy.RawKernel:
    """The compiled kernel `entry` of `source_name` for the current device.

    `defines` is a sorted tuple of ``(NAME, value)`` pairs; `shared_bytes` raises the
    kernel's dynamic shared-memory limit when a launch needs more than the default 48 KiB.
    """
    module_key = (cupy.cuda.Device().id, source_name, defines)
    with _lock:
        function = _kernels.get(module_key + (entry,))
        if function is None:
            module = _modules.get(module_key)
            if module is None:
                # One module holds every entry point of a source (forward and backward),
                # so a training step compiles each configuration once.
                options = ("-std=c++17",) + tuple(f"-D{name}={value}" for name, value in defines)
                module = cupy.RawModule(code=source(source_name), options=options)
                _modules[module_key] = module
            function = module.get_function(entry)
            _kernels[module_key + (entry,)] = function
        if shared_bytes > 48 * 1024 and function.max_dynamic_shared_size_bytes < shared_bytes:
            function.max_dynamic_shared_size_bytes = shared_bytes
    return function


def compiled_count() -> int:
    """How many modules (configurations) have been compiled in this process."""
    return len(_modules)
