"""`tileattn.api.replay`: a validated GPU call run again on new device addresses (what the
JAX adapter's callbacks do from their second call on). A replay must give bit for bit what
a fresh call on the same arrays gives, for every kind of cached plan (one kernel, split
keys and their merge, the decode kernels, the backward's kernels with their scratch, GQA
group sums and the redo of flagged key blocks), and refuse what it cannot serve."""

from __future__ import annotations

import numpy as np
import pytest

from tileattn import api, backends
from tileattn.testing import bfloat16

GPU_MISSING = backends.availability("gpu")
pytestmark = pytest.mark.skipif(GPU_MISSING is not None, reason=str(GPU_MISSING))

if GPU_MISSING is None:
    import cupy

# name: (B, Hq, Hkv, Nq, Nk, D, dtype, options)
FORWARD_CASES = {
    "one kernel": (2, 4, 4, 256, 256, 64, "float16", dict(causal=True)),
    "split keys": (1, 2, 2, 64, 4096, 128, "float16", dict(causal=True)),
    "decode": (2, 8, 2, 1, 1024, 128, "bfloat16", dict()),
    "float32": (1, 4, 2, 192, 320, 96, "float32", dict(window=(64, 0))),
    "bshd": (2, 4, 2, 200, 300, 64, "float16", dict(causal=True, layout="bshd")),
}
BACKWARD_CASES = {
    "one kernel each": (2, 4, 4, 256, 256, 64, "float16", dict(causal=True)),
    "query tail redo": (1, 4, 2, 200, 256, 128, "bfloat16", dict()),
    "group sums": (1, 8, 1, 256, 256, 64, "float16", dict(causal=True)),
    "split dq": (1, 2, 2, 64, 4096, 128, "float16", dict()),
    "bshd": (2, 4, 2, 128, 192, 64, "float16", dict(layout="bshd", softcap=20.0)),
    "bshd, gradients in the caller's order": (1, 8, 1, 256, 256, 64, "float16",
                                              dict(layout="bshd", causal=True)),
}
# Cases whose buffers are C-contiguous in the caller's "bshd" order (flash-attn's, and
# what the JAX adapter declares), written at those strides: GQA group sums into them.
CALLER_ORDER = {"bshd, gradients in the caller's order"}


def _dtype(name: str):
    if name != "bfloat16":
        return np.dtype(name)
    if bfloat16() is None:
        pytest.skip("ml_dtypes is not installed")
    return bfloat16()


def _arrays(shape, dtype, seed, layout):
    batch, hq, hkv, n_q, n_k, dim = shape
    dtype = _dtype(dtype)
    rng = np.random.default_rng(seed)
    shapes = [(batch, hq, n_q, dim), (batch, hkv, n_k, dim), (batch, hkv, n_k, dim),
              (batch, hq, n_q, dim)]
    arrays = [cupy.asarray(rng.standard_normal(s).astype(dtype)) for s in shapes]
    if layout == "bshd":  # the caller's (B, N, H, D) arrays, contiguous in that order
        arrays = [cupy.ascontiguousarray(a.swapaxes(1, 2)) for a in arrays]
    return arrays


def _empty_like_results(shapes, dtypes, layout, caller_order=False):
    """NaN-filled output buffers (every bit set), bshd: a swapaxes view of a contiguous
    bhsd buffer, or with `caller_order` contiguous as `shapes` say; lse (B, H, N)."""
    outputs = []
    for shape, dtype in zip(shapes, dtypes):
        heads_first = layout == "bshd" and len(shape) == 4 and not caller_order
        buffer = cupy.empty((shape[0], shape[2], shape[1], shape[3]) if heads_first else shape,
                            dtype)
        buffer.view(np.uint8).fill(255)
        outputs.append(buffer.swapaxes(1, 2) if heads_first else buffer)
    return outputs


def _assert_identical(got, want):
    """Bit for bit (a NaN left in `got` where `want` has a number fails)."""
    def bits(array):
        return np.ascontiguousarray(cupy.asnumpy(array)).view(np.uint8)
    np.testing.assert_array_equal(bits(got), bits(want))


def _case(case):
    batch, hq, hkv, n_q, n_k, dim, dtype, options = case
    return (batch, hq, hkv, n_q, n_k, dim), dtype, dict(options)


@pytest.mark.parametrize("name", FORWARD_CASES)
def test_a_forward_replay_gives_what_a_fresh_call_gives(name):
    shape, dtype, options = _case(FORWARD_CASES[name])
    layout = options.get("layout", "bhsd")
    q, k, v, _ = _arrays(shape, dtype, 0, layout)
    o, lse = api.forward(q, k, v, return_lse=True, **options)
    out, lse_out = _empty_like_results([o.shape, lse.shape], [o.dtype, lse.dtype], layout)
    api.forward(q, k, v, out=out, lse_out=lse_out, **options)
    replay = api.replay("forward", (q, k, v), out=out, lse_out=lse_out, **options)
    assert replay is not None
    new_q, new_k, new_v, _ = _arrays(shape, dtype, 1, layout)
    new_out, new_lse = _empty_like_results([o.shape, lse.shape], [o.dtype, lse.dtype], layout)
    assert replay(*(a.data.ptr for a in (new_q, new_k, new_v, new_out, new_lse)))
    want_o, want_lse = api.forward(new_q, new_k, new_v, return_lse=True, **options)
    _assert_identical(new_out, want_o)
    _assert_identical(new_lse, want_lse)


@pytest.mark.parametrize("name", BACKWARD_CASES)
def test_a_backward_replay_gives_what_a_fresh_call_gives(name):
    shape, dtype, options = _case(BACKWARD_CASES[name])
    layout = options.get("layout", "bhsd")

    def problem(seed):
        q, k, v, do = _arrays(shape, dtype, seed, layout)
        o, lse = api.forward(q, k, v, return_lse=True, **options)
        return do, q, k, v, o, lse

    arrays = problem(0)
    grads = api.backward(*arrays, **options)
    caller_order = name in CALLER_ORDER
    buffers = _empty_like_results([g.shape for g in grads], [g.dtype for g in grads], layout,
                                  caller_order)
    given = dict(zip(("dq_out", "dk_out", "dv_out"), buffers))
    api.backward(*arrays, **options, **given)
    replay = api.replay("backward", arrays, **options, **given)
    if replay is None:
        pytest.skip("this device's backward family keeps no plan to replay (wgmma does)")
    new = problem(1)
    outputs = _empty_like_results([g.shape for g in grads], [g.dtype for g in grads], layout,
                                  caller_order)
    assert replay(*(a.data.ptr for a in new + tuple(outputs)))
    for got, want in zip(outputs, api.backward(*new, **options)):
        _assert_identical(got, want)
    # The scratch is the replay's own: a second replay on other arrays is as exact.
    again = problem(2)
    assert replay(*(a.data.ptr for a in again + tuple(outputs)))
    for got, want in zip(outputs, api.backward(*again, **options)):
        _assert_identical(got, want)


def test_a_replay_refuses_misaligned_addresses_and_other_streams():
    shape, dtype, options = _case(FORWARD_CASES["one kernel"])
    q, k, v, _ = _arrays(shape, dtype, 0, "bhsd")
    o, lse = api.forward(q, k, v, return_lse=True, **options)
    api.forward(q, k, v, out=o, lse_out=lse, **options)
    replay = api.replay("forward", (q, k, v), out=o, lse_out=lse, **options)
    before = o.copy()
    assert not replay(q.data.ptr + 2, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr)
    with cupy.cuda.Stream():
        assert not replay(q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr)
    _assert_identical(o, before)  # nothing ran


def test_no_replay_where_no_plan_is_kept():
    shape, dtype, options = _case(FORWARD_CASES["one kernel"])
    q, k, v, _ = _arrays(shape, dtype, 0, "bhsd")
    slopes = np.linspace(0.1, 0.4, shape[1])
    o, lse = api.forward(q, k, v, return_lse=True, alibi_slopes=slopes)
    assert api.replay("forward", (q, k, v), out=o, lse_out=lse, alibi_slopes=slopes) is None
    host = [cupy.asnumpy(a) for a in (q, k, v)]
    assert api.replay("forward", tuple(host), backend="cpu") is None
