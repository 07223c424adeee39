"""The API boundary: every bad input named in SPEC's Errors section, dispatch, and imports."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tileattn
from tileattn import backends


def arrays(q_shape=(2, 4, 8, 16), k_shape=(2, 2, 10, 16), v_shape=(2, 2, 10, 8),
           dtype=np.float32):
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal(s).astype(dtype) for s in (q_shape, k_shape, v_shape))


def assert_raises(error, match, *args, **kwargs):
    """Forward and backward must both reject the input, before running anything."""
    q, k, v = args
    kwargs.setdefault("backend", "reference")
    with pytest.raises(error, match=match):
        tileattn.forward(q, k, v, **kwargs)
    if q.ndim >= 2 and k.ndim == q.ndim:
        shape = q.shape[:-1] + (v.shape[-1],)
        do = np.ones(shape, q.dtype if q.dtype.kind == "f" else np.float32)
        lse = np.zeros(shape[:-1], np.float32)
        with pytest.raises(error, match=match):
            tileattn.backward(do, q, k, v, do, lse, **kwargs)


@pytest.mark.parametrize("shapes, match", [
    (((2, 4, 8, 16), (2, 2, 10, 12), (2, 2, 10, 8)), r"k head dim must equal q head dim D=16, got 12"),
    (((2, 4, 8, 16), (3, 2, 10, 16), (3, 2, 10, 8)), r"k batch dimensions must equal q's \(2,\), got \(3,\)"),
    (((2, 4, 8, 16), (2, 2, 10, 16), (2, 3, 10, 8)), r"v heads must equal k heads Hkv=2, got 3"),
    (((2, 4, 8, 16), (2, 2, 10, 16), (2, 2, 11, 8)), r"v sequence length must equal k's Nk=10, got 11"),
    (((2, 3, 8, 16), (2, 2, 10, 16), (2, 2, 10, 8)), r"Hq % Hkv == 0\), got Hq=3, Hkv=2"),
    (((2, 4, 8, 16), (2, 10, 16), (2, 2, 10, 8)), r"k.ndim must equal q.ndim \(4\), got k shape \(2, 10, 16\)"),
    (((16,), (16,), (16,)), r"q must have at least 2 dimensions"),
    (((2, 4, 8, 0), (2, 2, 10, 0), (2, 2, 10, 8)), r"q head dim D must be positive, got D=0"),
])
def test_shape_errors_name_argument_and_values(shapes, match):
    assert_raises(ValueError, match, *arrays(*shapes))


@pytest.mark.parametrize("dtype, match", [
    (np.int32, r"q must have a floating dtype .* got dtype int32"),
    (np.complex64, r"q must have a floating dtype .* got dtype complex64"),
])
def test_integer_and_complex_dtypes_are_rejected(dtype, match):
    q, k, v = (np.ones((3, 4), dtype) for _ in range(3))
    with pytest.raises(TypeError, match=match):
        tileattn.forward(q, k, v)


def test_mixed_dtypes_are_rejected():
    q, k, v = arrays()
    with pytest.raises(TypeError, match=r"k.dtype must equal q.dtype \(float32\), got float64"):
        tileattn.forward(q, k.astype(np.float64), v)


@pytest.mark.parametrize("name", ["q", "k", "v", "do", "out", "dk_out"])
def test_numpy_masked_arrays_are_refused_by_name(name):
    """A masked array's mask would be dropped without a word (a masked key still attended
    to): every array argument refuses one, before anything runs."""
    q, k, v = arrays()
    o, lse = tileattn.forward(q, k, v, return_lse=True, backend="cpu")
    given = dict(q=q, k=k, v=v, do=np.ones_like(o), out=np.empty_like(o),
                 dk_out=np.empty_like(k))
    given[name] = np.ma.masked_array(given[name], mask=np.zeros(given[name].shape, bool))
    untouched = {key: np.array(value) for key, value in given.items()}
    match = rf"{name} is a NumPy masked array, whose mask tileattn does not read"
    for backend in ("cpu", "reference"):
        with pytest.raises(TypeError, match=match):
            if name in ("do", "dk_out"):
                tileattn.backward(given["do"], given["q"], given["k"], given["v"], o, lse,
                                  backend=backend, dk_out=given["dk_out"])
            else:
                tileattn.forward(given["q"], given["k"], given["v"], out=given["out"],
                                 backend=backend)
    for key, value in given.items():
        if key not in ("out", "dk_out"):
            np.testing.assert_array_equal(np.asarray(value), untouched[key])


@pytest.mark.parametrize("kwargs, error, match", [
    ({"dropout_p": 1.0, "seed": 0}, ValueError, r"dropout_p must be in \[0, 1\), got 1.0"),
    ({"dropout_p": -0.1, "seed": 0}, ValueError, r"dropout_p must be in \[0, 1\), got -0.1"),
    ({"dropout_p": 0.1}, ValueError, r"seed must be an int when dropout_p > 0"),
    ({"dropout_p": 0.1, "seed": -1}, ValueError, r"seed must be >= 0, got -1"),
    ({"dropout_p": 0.1, "seed": 2**64}, ValueError, r"seed must be < 2\*\*64"),
    ({"dropout_p": 0.1, "seed": 1.5}, TypeError, r"seed must be an int, got 1.5"),
    ({"softcap": -1.0}, ValueError, r"softcap must be >= 0 .* got -1.0"),
    ({"softcap": float("inf")}, ValueError, r"softcap must be finite, got inf"),
    ({"scale": float("nan")}, ValueError, r"scale must be finite, got nan"),
    ({"scale": "big"}, TypeError, r"scale must be a real number, got 'big'"),
    ({"block_q": 0}, ValueError, r"block_q must be >= 1, got 0"),
    ({"block_k": -3}, ValueError, r"block_k must be >= 1, got -3"),
    ({"block_k": 2.0}, TypeError, r"block_k must be an int, got 2.0"),
    ({"block_q": True}, TypeError, r"block_q must be an int, got True"),
    ({"window": (1, 2, 3)}, ValueError, r"window must be None or a pair \(left, right\), got \(1, 2, 3\)"),
    ({"window": 5}, ValueError, r"window must be None or a pair .* got 5"),
    ({"window": (1.5, 0)}, TypeError, r"window left must be an int or None, got 1.5"),
    ({"causal": "yes"}, TypeError, r"causal must be a bool, got 'yes'"),
    ({"alibi_slopes": np.ones(3)}, ValueError, r"alibi_slopes must have shape \(Hq,\) = \(4,\) or \(\*batch, Hq\) = \(2, 4\), got \(3,\)"),
    ({"alibi_slopes": np.ones(4, complex)}, TypeError, r"alibi_slopes must be real numbers"),
    ({"backend": "tpu"}, ValueError, r"backend must be one of \('auto', 'reference', 'cpu', 'gpu'\), got 'tpu'"),
])
def test_option_errors_name_argument_and_values(kwargs, error, match):
    assert_raises(error, match, *arrays(), **kwargs)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_return_lse_must_be_a_bool(value):
    """A truthy string or number is not taken for True (``return_lse="no"`` would be)."""
    with pytest.raises(TypeError, match=f"return_lse must be a bool, got {value!r}"):
        tileattn.forward(*arrays(), backend="reference", return_lse=value)
    o, lse = tileattn.forward(*arrays(), backend="reference", return_lse=np.bool_(True))
    assert lse.shape == o.shape[:-1]


def test_backward_shape_errors():
    q, k, v = arrays()
    o, lse = tileattn.forward(q, k, v, backend="reference", return_lse=True)
    with pytest.raises(ValueError, match=r"do must have shape \(2, 4, 8, 8\), got \(2, 4, 8, 7\)"):
        tileattn.backward(o[..., :7], q, k, v, o, lse, backend="reference")
    with pytest.raises(ValueError, match=r"lse must have shape \(2, 4, 8\), got \(2, 4\)"):
        tileattn.backward(o, q, k, v, o, lse[..., 0], backend="reference")
    with pytest.raises(TypeError, match=r"do.dtype must equal q.dtype \(float32\), got float64"):
        tileattn.backward(o.astype(np.float64), q, k, v, o, lse, backend="reference")


def test_gpu_backend_without_gpu_names_the_extra_or_the_reason():
    if backends.availability("gpu") is None:
        pytest.skip("a GPU is available here")
    with pytest.raises(tileattn.BackendUnavailableError, match=r"backend='gpu'"):
        tileattn.forward(*arrays(), backend="gpu")


def test_missing_dependency_names_the_pip_extra(monkeypatch):
    entry = backends.BackendEntry("cpu", "tileattn.cpu", "cpu", "not_a_module_tileattn_needs")
    monkeypatch.setitem(backends.REGISTRY, "cpu", entry)
    monkeypatch.delitem(backends._loaded, "cpu", raising=False)
    with pytest.raises(tileattn.BackendUnavailableError,
                       match=r"needs not_a_module_tileattn_needs, which is not installed: "
                             r"pip install 'tileattn\[cpu\]'"):
        tileattn.forward(*arrays(), backend="cpu")


def test_errors_leave_inputs_untouched():
    q, k, v = arrays()
    before = [a.copy() for a in (q, k, v)]
    with pytest.raises(ValueError):
        tileattn.forward(q, k, v, block_q=0)
    for a, b in zip((q, k, v), before):
        np.testing.assert_array_equal(a, b)


def test_auto_picks_the_cpu_backend_for_host_arrays():
    o = tileattn.forward(*arrays())
    assert o.shape == (2, 4, 8, 8)
    assert backends.choose_auto("host") == "cpu"


def _cpu_backend_missing(monkeypatch):
    """Make the CPU backend unavailable as it is without Numba, and the golden model fail
    the test if anything runs it."""
    entry = backends.BackendEntry("cpu", "tileattn.cpu", "cpu", "not_a_module_tileattn_needs")
    monkeypatch.setitem(backends.REGISTRY, "cpu", entry)
    monkeypatch.delitem(backends._loaded, "cpu", raising=False)
    reference = backends.load("reference")

    def golden_model_must_not_run(*args):
        raise AssertionError("backend='auto' ran the O(N^2) golden model")

    monkeypatch.setattr(reference, "forward", golden_model_must_not_run)
    monkeypatch.setattr(reference, "backward", golden_model_must_not_run)


def test_auto_never_falls_back_to_the_golden_model(monkeypatch):
    _cpu_backend_missing(monkeypatch)
    q, k, v = arrays()
    expected = (r"backend='auto' has no fast backend for host \(NumPy\) arrays: "
                r"backend='cpu' needs not_a_module_tileattn_needs, which is not installed: "
                r"pip install 'tileattn\[cpu\]'.*backend='reference'")
    with pytest.raises(tileattn.BackendUnavailableError, match=expected):
        tileattn.forward(q, k, v)
    o = np.zeros((2, 4, 8, 8), np.float32)
    with pytest.raises(tileattn.BackendUnavailableError, match=expected):
        tileattn.backward(o, q, k, v, o, np.zeros((2, 4, 8), np.float32))
    with pytest.raises(tileattn.BackendUnavailableError, match=expected):
        backends.choose_auto("host")


def test_auto_without_numba_raises_and_names_the_extra():
    """The real thing, in a fresh process where ``import numba`` fails."""
    code = ("import sys; sys.modules['numba'] = None\n"
            "import numpy as np, tileattn\n"
            "q = np.ones((1, 1, 4, 8), np.float32)\n"
            "try:\n"
            "    tileattn.forward(q, q, q)\n"
            "except tileattn.BackendUnavailableError as error:\n"
            "    print('raised:', error)\n"
            "print('available:', [n for n in tileattn.available() if n != 'gpu'])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert "raised: backend='auto' has no fast backend" in result.stdout
    assert "pip install 'tileattn[cpu]'" in result.stdout
    assert "available: ['reference']" in result.stdout  # (and 'gpu' on a GPU machine)


def test_a_plain_install_includes_the_cpu_backend():
    """numba, scipy and threadpoolctl are plain dependencies; the `cpu` extra stays as an
    alias for old install commands."""
    tomllib = pytest.importorskip("tomllib")
    with open(Path(__file__).parents[1] / "pyproject.toml", "rb") as handle:
        project = tomllib.load(handle)["project"]
    names = {re.split(r"[<>=\[]", requirement)[0] for requirement in project["dependencies"]}
    assert {"numpy", "numba", "scipy", "threadpoolctl"} <= names
    assert set(project["optional-dependencies"]["cpu"]) <= set(project["dependencies"])


def test_list_inputs_are_accepted_as_host_arrays():
    q = [[0.0, 1.0], [1.0, 0.0]]
    o = tileattn.forward(np.asarray(q), q, q, backend="reference")
    assert o.shape == (2, 2)


def test_import_loads_neither_numba_nor_cupy():
    code = ("import sys, tileattn, tileattn.testing; "
            "print(sorted(m for m in ('numba', 'cupy', 'torch', 'jax') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"


def test_mixing_numpy_and_cupy_arrays_is_rejected():
    cupy = pytest.importorskip("cupy")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("CuPy is installed but finds no GPU")
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"same device, got q on host, k on cuda, v on host"):
        tileattn.forward(q, cupy.asarray(k), v)
