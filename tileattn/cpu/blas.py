"""Keep BLAS single-threaded while the kernels run.

The kernels call ``np.dot`` (BLAS gemm, through SciPy's BLAS, which Numba uses) from every
thread of a parallel loop. A threaded BLAS would start its own threads inside each of
ours: on the development machine that halved the forward speed (58 against 118 GFLOP/s,
bench/NOTES-cpu.md). threadpoolctl limits the BLAS behind SciPy to one thread for the call
and restores it after; without threadpoolctl the kernels still run, only slower.
"""

from __future__ import annotations

import contextlib
import functools


@functools.cache
def _controller():
    try:
        import threadpoolctl
    except ImportError:
        return None
    # The controller sees only libraries already loaded; Numba loads SciPy's BLAS lazily.
    import scipy.linalg.cython_blas  # noqa: F401

    return threadpoolctl.ThreadpoolController()


def single_threaded():
    """Context manager: BLAS libraries limited to one thread (or nothing, if it cannot)."""
    controller = _controller()
    if controller is None:
        return contextlib.nullcontext()
    return controller.limit(limits=1, user_api="blas")
