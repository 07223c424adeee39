"""Keep BLAS single-threaded while the kernels run.

The kernels call ``np.dot`` (BLAS gemm, through SciPy's BLAS, which Numba uses) from every
thread that runs them (`threads`). A threaded BLAS would start its own threads inside each of
ours: on the development machine that halved the forward speed (58 against 118 GFLOP/s,
bench/NOTES-cpu.md). threadpoolctl limits the BLAS behind SciPy to one thread for the call
and restores it after (NumPy's own BLAS, a separate library in the wheels, is left alone);
without threadpoolctl the kernels still run, only slower.
"""

from __future__ import annotations

import contextlib
import functools
import os


@functools.cache
def _controller():
    try:
        import threadpoolctl
    except ImportError:
        return None
    # The controller sees only libraries already loaded; Numba loads SciPy's BLAS lazily.
    import scipy
    import scipy.linalg.cython_blas  # noqa: F401

    blas = threadpoolctl.ThreadpoolController().select(user_api="blas")
    # Only the BLAS that SciPy (hence Numba's np.dot) calls: the thread count is global to a
    # library, and NumPy's own BLAS may be running a product on another thread meanwhile.
    # Where one library serves both (e.g. conda), limiting it is the only option.
    scipy_dir = os.path.dirname(os.path.dirname(scipy.__file__))
    scipy_own = [lib.filepath for lib in blas.lib_controllers
                 if "scipy" in os.path.basename(os.path.dirname(lib.filepath))
                 and not os.path.basename(os.path.dirname(lib.filepath)).startswith("numpy")
                 and lib.filepath.startswith(scipy_dir)]
    if scipy_own:
        return blas.select(filepath=scipy_own)
    return blas


def _setter(library):
    """A function that sets `library`'s thread count from whichever thread calls it.

    threadpoolctl (3.6 and later) lets one Python thread only, the first to set it, change
    a pthreads OpenBLAS's process-wide count, and ignores the others without a word: a call
    from any other thread (a server's worker, a thread pool) would run its products on the
    threaded BLAS inside the kernels' own threads, at about half the speed, and round them
    differently from the same call on the main thread (sgemm's threaded and serial drivers
    sum in different orders). Its unguarded setter is used where it has one; the calls it
    guards against racing are serialised by the kernels' lock here."""
    if (getattr(library, "internal_api", None) == "openblas"
            and getattr(library, "threading_layer", None) != "openmp"):
        return getattr(library, "_real_set_num_threads", library.set_num_threads)
    return library.set_num_threads


class _OneThread:
    """SciPy's BLAS libraries at one thread inside the block, each restored after to what
    it had. threadpoolctl's own ``limit`` first gathers every library's full description
    (about 10 us a call, a tenth of a small forward's host time, and decode steps are
    small); this asks each library its thread count alone and sets only those above one."""

    def __init__(self, counters):
        self._counters = counters  # (getter, setter) pairs, one per library
        self._restore = []

    def __enter__(self):
        self._restore = []
        for get_num_threads, set_num_threads in self._counters:
            threads = get_num_threads()
            if threads != 1:
                set_num_threads(1)
                self._restore.append((set_num_threads, threads))
        return self

    def __exit__(self, *exc_info):
        for set_num_threads, threads in self._restore:
            set_num_threads(threads)
        self._restore = []
        return False


@functools.cache
def _libraries() -> tuple:
    """SciPy's BLAS controllers, each with `_setter`'s setter; empty without threadpoolctl."""
    controller = _controller()
    return () if controller is None else tuple(
        (library, _setter(library)) for library in controller.lib_controllers)


@functools.cache
def _counters() -> tuple:
    """A ``(get_num_threads, set_num_threads)`` pair per library of `_libraries`: for a
    pthreads OpenBLAS, its own C functions, which threadpoolctl's methods call after
    looking them up again at each call (a ctypes call ~0.3 us, a method ~1 us on the
    2-core development host; the limit costs a get and two sets per kernel call); for
    the others, threadpoolctl's getter and `_setter`'s setter."""
    counters = []
    for library, set_num_threads in _libraries():
        functions = (library.get_num_threads, set_num_threads)
        symbol = getattr(library, "_get_symbol", None)
        if set_num_threads == getattr(library, "_real_set_num_threads", None) and symbol:
            own = symbol("openblas_get_num_threads"), symbol("openblas_set_num_threads")
            if None not in own:
                functions = own
        counters.append(functions)
    return tuple(counters)


def single_threaded():
    """Context manager: SciPy's BLAS limited to one thread (or nothing, if it cannot)."""
    counters = _counters()
    if not counters:
        return contextlib.nullcontext()
    return _OneThread(counters)
