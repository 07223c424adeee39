"""One line on stderr just before a kernel compiles, so a first call's pause has a reason.

A kernel compiles on its first use per dtype (seconds; bench/first_call_cpu.py measures it)
and is then cached on disk, so later processes load it in a fraction of a second. Numba
fires its ``numba:compile`` event only after the on-disk cache missed, right before it
compiles: listening to it says exactly when the wait is real. Helpers compiled inside a
kernel's compile nest inside its event and say nothing.
"""

from __future__ import annotations

import contextlib
import sys
import threading

from numba.core import event, types

LONG_COMPILES = {"forward_kernel": "forward", "backward_kernel": "backward"}
"""The kernels whose compile takes seconds (the row-terms kernel takes a fraction of one)."""


class _Notice(event.Listener):
    def __init__(self):
        self._local = threading.local()
        self._silenced = 0

    def on_start(self, ev):
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        dispatcher = ev.data["dispatcher"]
        name = dispatcher.py_func.__name__
        if depth or self._silenced or name not in LONG_COMPILES \
                or not dispatcher.py_func.__module__.startswith("tileattn.cpu"):
            return
        args = ev.data["args"]
        dtype = args[0].dtype
        if len(args) > 2 and args[-2] != types.none:  # the tiled kernels' `pairs`
            dtype = "bfloat16 (its products in bfloat16)"
        # Numba keeps the cache object private; its path is public on it.
        cache = getattr(dispatcher, "_cache", None)
        where = getattr(cache, "cache_path", None) or "Numba's cache directory"
        sys.stderr.write(
            f"tileattn: compiling the CPU {LONG_COMPILES[name]} kernel for {dtype}: first use "
            f"with this tileattn and Numba, so it takes seconds, once; later runs load it from "
            f"{where} ('python -m tileattn warmup' compiles every kernel ahead)\n")
        sys.stderr.flush()

    def on_end(self, ev):
        self._local.depth -= 1

    @contextlib.contextmanager
    def silenced(self):
        self._silenced += 1
        try:
            yield
        finally:
            self._silenced -= 1


NOTICE = _Notice()
event.register("numba:compile", NOTICE)
