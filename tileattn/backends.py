"""The backend registry: the one dispatch point between the API and the kernels.

A backend is a module that exposes

``MEMORY``
    ``"host"`` (NumPy arrays) or ``"cuda"`` (CuPy arrays).
``availability() -> str | None``
    ``None`` when it can run here, else the reason it cannot (shown by
    ``python -m tileattn info`` / ``check`` and in errors).
``forward(q, k, v, options) -> (o, lse)``
``backward(do, q, k, v, o, lse, options) -> (dq, dk, dv)``
    Over already-validated 4-D arrays ``q (B, Hq, Nq, D)``, ``k (B, Hkv, Nk, D)``,
    ``v (B, Hkv, Nk, Dv)``, ``do``/``o (B, Hq, Nq, Dv)``, ``lse (B, Hq, Nq)``, any strides, one
    dtype, with every axis non-empty (the API answers empty problems itself).
    ``options`` is a `tileattn.options.AttentionOptions`. Results: ``o`` in the input dtype,
    ``lse`` float32 (float64 for float64 inputs), gradients in the input dtype. Inputs are
    never written to.
``VARLEN`` (optional, default False)
    True when ``forward``/``backward`` serve variable-length and paged calls:
    ``options.varlen`` (a `tileattn.options.VarlenLayout`) is then set, its ``descriptors``
    say which rows and keys form each sequence, and for paged K/V ``k`` and ``v`` are the
    page pools ``(num_pages, Hkv, page_size, D)`` as the caller passed them (any strides).
    Padding rows must come back as ``o = 0``, ``lse = -inf``, ``dq = 0`` and padding keys
    as ``dk = dv = 0``. The API raises ``NotImplementedError`` for such calls on a backend
    without it.
``WRITES_OUT`` (optional, default False)
    True when ``forward`` also takes ``out=``, ``lse_out=`` and ``backward`` takes
    ``dq_out=``, ``dk_out=``, ``dv_out=`` (each None or omitted, or an array of the
    result's 4-D/3-D shape and dtype in the backend's memory, sharing no memory with an
    input, C-contiguous or, for a "bshd" call, the ``swapaxes(1, 2)`` view of a
    C-contiguous ``(B, N, H, D)`` buffer) and writes the results into them, returning those
    arrays. For the other backends the API copies their results into the caller's buffers.
``STRIDED_OUT`` (optional, default False)
    True when ``forward`` writes ``out=`` and ``backward`` writes ``dq_out=``, ``dk_out=``
    and ``dv_out=`` at any batch, head and row strides without a copy: the API then
    allocates a "bshd" call's o and gradients in the caller's ``(B, N, H, D)`` order and
    passes their views, so the caller gets C-contiguous results.

``clear_plans()`` (optional)
    Forgets whatever the backend planned or chose for earlier calls and keeps for the
    next call of the same signature. The plans are a function of the signature under the
    backend's policies, so only code that changes a policy needs this (tests and sweeps
    that force a schedule, a split count or a table row).

Optional, for ``python -m tileattn info``:

``hardware() -> dict[str, str]``
    The device and the cache or shared-memory sizes the backend detected.
``tile_sizes(n_q, n_k, head_dim, value_dim, dtype, query_heads=0, options=None, *,
kv_heads=None, batch=1) -> dict[str, Blocks | None]``
    The tiles each pass (``"forward"``, ``"backward"``) of a dense call of that shape runs,
    as the backend's dispatch chooses them (`query_heads`: B x Hq, 0 when not known;
    `options`: the mask and score options, none where omitted); None for a pass the
    backend does not serve at that shape.

Backend modules are imported only when chosen, so ``import tileattn`` loads neither Numba
nor CuPy.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class BackendEntry:
    name: str
    module: str
    extra: str | None  # the pip extra that installs what it needs
    requirement: str  # the top-level module that extra provides


REGISTRY: dict[str, BackendEntry] = {
    "reference": BackendEntry("reference", "tileattn.reference", None, "numpy"),
    "cpu": BackendEntry("cpu", "tileattn.cpu", "cpu", "numba"),
    "gpu": BackendEntry("gpu", "tileattn.gpu", "gpu", "cupy"),
}

_loaded: dict[str, ModuleType] = {}


class BackendUnavailableError(RuntimeError):
    """A backend was asked for that cannot run here; the message says why and how to fix it."""


def _missing_dependency(entry: BackendEntry) -> str | None:
    if importlib.util.find_spec(entry.requirement) is None:
        return (f"backend={entry.name!r} needs {entry.requirement}, which is not installed: "
                f"pip install 'tileattn[{entry.extra}]'")
    return None


def load(name: str) -> ModuleType:
    """Import and return a backend module, or raise `BackendUnavailableError`."""
    if name in _loaded:
        return _loaded[name]
    entry = REGISTRY[name]
    reason = _missing_dependency(entry)
    if reason is not None:
        raise BackendUnavailableError(reason)
    try:
        module = importlib.import_module(entry.module)
    except ImportError as error:
        raise BackendUnavailableError(
            f"backend={name!r} failed to import ({error}); "
            f"pip install 'tileattn[{entry.extra}]' installs what it needs") from error
    reason = module.availability()
    if reason is not None:
        raise BackendUnavailableError(f"backend={name!r} is not available: {reason}")
    _loaded[name] = module
    return module


def clear_plans() -> None:
    """`clear_plans` of every backend loaded so far (none is imported for it)."""
    for module in _loaded.values():
        clear = getattr(module, "clear_plans", None)
        if clear is not None:
            clear()


def availability(name: str) -> str | None:
    """``None`` if backend `name` can run here, else why not (never raises)."""
    try:
        load(name)
    except BackendUnavailableError as error:
        return str(error)
    return None


def available() -> list[str]:
    """Names of the backends that can run here."""
    return [name for name in REGISTRY if availability(name) is None]


def choose_auto(memory: str) -> str:
    """``backend="auto"``: the GPU backend for CUDA arrays, the CPU backend for host arrays.

    Never the golden model (``"reference"``): it holds N x N matrices, so at N = 8192 one
    head's forward took 2.1 GB and 6 s where the CPU backend takes 0.2 GB and 0.05 s. A fast
    backend that cannot run raises `BackendUnavailableError` naming the pip extra; the
    golden model runs only when asked for by name.
    """
    name = "gpu" if memory == "cuda" else "cpu"
    reason = availability(name)
    if reason is not None:
        arrays = "CuPy (GPU)" if memory == "cuda" else "host (NumPy)"
        raise BackendUnavailableError(
            f"backend='auto' has no fast backend for {arrays} arrays: {reason}. (The O(N^2) "
            "NumPy golden model runs only when asked for by name: backend='reference'.)")
    return name
