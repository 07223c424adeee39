"""Numba's disk cache of the kernels, flushed when a source they are compiled from changes.

Numba keys a ``cache=True`` kernel's entries on its own file (modification time and size)
and its own bytecode. The kernels inline helpers from other files (vector_math.py's exp2
and tanh, tiles.py's masks, the dropout hash): a change there left the old machine code in
use, silently. With an editable install that happens after a ``git pull`` that touches
only a helper, and in development after any edit of one.

So each kernel module, once its kernels are defined, calls `flush_if_stale`: a stamp file
beside Numba's index records a digest of every source the kernels compile from, and a
kernel whose stamp is missing or differs has its index emptied (Numba then compiles it
again at its first call and saves the new code) before anything loads from it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent.parent
# Every file whose functions or constants the kernels compile in: the CPU backend's modules
# and the package's dropout hash constants and descriptor columns.
_SOURCES = (tuple(sorted((_PACKAGE / "cpu").glob("*.py")))
            + (_PACKAGE / "dropout.py", _PACKAGE / "options.py"))
_STAMP_SUFFIX = ".tileattn-sources"

_digest: str | None = None


def sources_digest() -> str:
    """SHA-256 over the kernels' source files, names and contents (computed once)."""
    global _digest
    if _digest is None:
        digest = hashlib.sha256()
        for path in _SOURCES:
            digest.update(path.name.encode() + b"\0")
            try:
                digest.update(path.read_bytes())
            except OSError:  # a file an unusual install left out: it then counts as empty
                pass
            digest.update(b"\0")
        _digest = digest.hexdigest()
    return _digest


def flush_if_stale(*kernels) -> None:
    """Empty the disk-cache index of each Numba dispatcher in `kernels` whose stamp does not
    record the current sources, then write the stamp. Never raises: a cache that cannot
    be read or written is Numba's to handle (it compiles in memory)."""
    for kernel in kernels:
        cache = getattr(kernel, "_cache", None)
        directory = getattr(cache, "cache_path", None)
        function = getattr(kernel, "py_func", None)
        if directory is None or function is None or not hasattr(cache, "flush"):
            continue
        stamp = Path(directory) / f"{function.__module__}.{function.__qualname__}{_STAMP_SUFFIX}"
        try:
            if stamp.read_text() == sources_digest():
                continue
        except OSError:
            pass
        try:
            cache.flush()
            partial = stamp.with_name(f"{stamp.name}.{os.getpid()}")
            partial.write_text(sources_digest())
            os.replace(partial, stamp)
        except OSError:
            pass
