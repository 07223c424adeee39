"""Shared fixtures: the `backend` fixture runs one test body against every backend.

Backends that cannot run here are skipped with the reason, except the CPU backend when
Numba is installed: then it must work, and an import failure fails the test.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import tileattn
from tileattn import backends

# JAX takes 75 % of the GPU's memory at its first use unless told otherwise; with pytest-xdist
# one worker's JAX would starve every other worker's CuPy, torch and JAX (they fail with out
# of memory). Set before any test imports JAX.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Kernels compile on first use (Numba, NVRTC), so no per-example deadline. The "ci" profile
# is the default; TILEATTN_HYPOTHESIS_PROFILE=thorough runs ten times more examples, and
# "device" a third as many, for GPU runs under a time limit (each drawn option set is a
# kernel compile there).
settings.register_profile("ci", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=600, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.data_too_large])
settings.register_profile("device", max_examples=20, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.data_too_large])
settings.load_profile(os.environ.get("TILEATTN_HYPOTHESIS_PROFILE", "ci"))


class BackendUnderTest:
    """Calls `tileattn.forward`/`backward` with one backend, moving NumPy arrays to its memory
    and the results back, so test bodies are written once in NumPy."""

    def __init__(self, name: str):
        self.name = name
        self.memory = backends.load(name).MEMORY

    def to_memory(self, value):
        if self.memory == "cuda" and isinstance(value, np.ndarray):
            import cupy

            return cupy.asarray(value)
        return value

    @staticmethod
    def to_host(value):
        return value.get() if hasattr(value, "get") and not isinstance(value, np.ndarray) \
            else value

    def _options(self, options):
        return {key: self.to_memory(value) for key, value in options.items()}

    def forward(self, q, k, v, **options):
        result = tileattn.forward(self.to_memory(q), self.to_memory(k), self.to_memory(v),
                                  backend=self.name, **self._options(options))
        if isinstance(result, tuple):
            return tuple(self.to_host(r) for r in result)
        return self.to_host(result)

    def backward(self, do, q, k, v, o, lse, **options):
        arrays = (self.to_memory(a) for a in (do, q, k, v, o, lse))
        result = tileattn.backward(*arrays, backend=self.name, **self._options(options))
        return tuple(self.to_host(r) for r in result)

    def __repr__(self):
        return f"BackendUnderTest({self.name!r})"


def _skip_reason(name: str) -> str | None:
    reason = backends.availability(name)
    if reason is None:
        return None
    if name == "cpu" and importlib.util.find_spec("numba") is not None:
        pytest.fail(f"numba is installed but the CPU backend cannot run: {reason}")
    return reason


@pytest.fixture(params=list(backends.REGISTRY), scope="session")
def backend(request) -> BackendUnderTest:
    reason = _skip_reason(request.param)
    if reason is not None:
        pytest.skip(reason)
    return BackendUnderTest(request.param)


def _clear_plans() -> None:
    backends.clear_plans()
    adapter = sys.modules.get("tileattn.torch")
    if adapter is not None:
        adapter._REPLAYS.clear()
    adapter = sys.modules.get("tileattn.jax")
    if adapter is not None:  # its passes' callbacks, made under the policies of their time
        adapter._pass.cache_clear()


@pytest.fixture(autouse=True)
def _plans_under_the_tests_own_policies(request):
    """Plans are kept per call signature and made under the backends' policies (schedules,
    split counts, table rows). A test that monkeypatches one of them must not run a plan
    an earlier test left for the same signature, nor leave its own to later tests: plans
    are forgotten before and after every test that uses `monkeypatch`."""
    if "monkeypatch" not in request.fixturenames:
        yield
        return
    _clear_plans()
    yield
    _clear_plans()
