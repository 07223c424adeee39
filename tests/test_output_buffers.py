"""``out=`` / ``lse_out=`` of `tileattn.forward` and ``dq_out=`` ... of `tileattn.backward`:
results written into the caller's buffers equal the ordinary results, on every backend, and
a buffer the kernels could not write safely raises a ValueError naming it."""

from __future__ import annotations

import numpy as np
import pytest

import tileattn
from tileattn.testing import assert_attention_close

OPTIONS = dict(causal=True, softcap=4.0, alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4]))


def problem(dtype=np.float32, layout="bhsd", n_q=12, n_k=10):
    rng = np.random.default_rng(0)
    shapes = [(2, 4, n_q, 8), (2, 2, n_k, 8), (2, 2, n_k, 6), (2, 4, n_q, 6)]
    q, k, v, do = (rng.standard_normal(s).astype(dtype) for s in shapes)
    if layout == "bshd":
        q, k, v, do = (np.ascontiguousarray(a.swapaxes(1, 2)) for a in (q, k, v, do))
    return q, k, v, do


def empty_like_result(backend, shape, dtype, layout):
    """A NaN-filled buffer in `backend`'s memory, laid out as tileattn's own results are:
    C-contiguous, or with "bshd" the swapaxes(-3, -2) view of a C-contiguous
    (batch, heads, seqlen, dim) buffer."""
    if layout == "bshd":
        swapped = shape[:-3] + (shape[-2], shape[-3], shape[-1])
        return backend.to_memory(np.full(swapped, np.nan, dtype)).swapaxes(-3, -2)
    return backend.to_memory(np.full(shape, np.nan, dtype))


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forward_and_backward_write_into_the_given_buffers(backend, dtype, layout):
    q, k, v, do = problem(dtype, layout)
    options = dict(OPTIONS, layout=layout)
    o, lse = backend.forward(q, k, v, return_lse=True, **options)
    grads = backend.backward(do, q, k, v, o, lse, **options)

    out = empty_like_result(backend, o.shape, dtype, layout)
    lse_out = np.full(lse.shape, np.nan, lse.dtype)
    o_given, lse_given = backend.forward(q, k, v, return_lse=True, out=out, lse_out=lse_out,
                                         **options)
    np.testing.assert_array_equal(o_given, o)
    np.testing.assert_array_equal(lse_given, lse)
    buffers = [empty_like_result(backend, a.shape, dtype, layout) for a in (q, k, v)]
    given = backend.backward(do, q, k, v, o, lse, dq_out=buffers[0], dk_out=buffers[1],
                             dv_out=buffers[2], **options)
    for name, ours, theirs in zip("qkv", given, grads):
        np.testing.assert_array_equal(ours, theirs, err_msg=f"d{name}")
    if backend.memory == "host":  # the buffers themselves come back, filled
        assert o_given is out and lse_given is lse_out
        assert all(ours is buffer for ours, buffer in zip(given, buffers))

    golden_o = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                backend="reference", **options)
    assert_attention_close(o_given, golden_o, dtype, name="o")


def test_forward_writes_only_the_buffer_it_is_given(backend):
    q, k, v, _ = problem()
    o, lse = backend.forward(q, k, v, return_lse=True)
    lse_out = np.full(lse.shape, np.nan, lse.dtype)
    o_new, lse_given = backend.forward(q, k, v, return_lse=True, lse_out=lse_out)
    np.testing.assert_array_equal(o_new, o)
    np.testing.assert_array_equal(lse_given, lse)


def test_empty_problem_fills_the_buffers(backend):
    """Nk = 0: no row keeps a key, so o = 0 and lse = -inf, written into the buffers; the
    gradients are 0."""
    q, k, v, do = problem(n_k=0)
    out = np.full((2, 4, 12, 6), np.nan, np.float32)
    lse_out = np.full((2, 4, 12), np.nan, np.float32)
    o, lse = backend.forward(q, k, v, return_lse=True, out=out, lse_out=lse_out)
    np.testing.assert_array_equal(o, np.zeros_like(out))
    np.testing.assert_array_equal(lse, np.full_like(lse_out, -np.inf))
    dq_out = np.full(q.shape, np.nan, np.float32)
    dq, _, _ = backend.backward(do, q, k, v, o, lse, dq_out=dq_out)
    np.testing.assert_array_equal(dq, np.zeros_like(q))


def test_torch_tensors_as_buffers():
    torch = pytest.importorskip("torch")
    q, k, v, _ = (torch.from_numpy(a) for a in problem())
    out = torch.empty((2, 4, 12, 6))
    o = tileattn.forward(q, k, v, out=out, **OPTIONS)
    assert o is out
    np.testing.assert_array_equal(out.numpy(), tileattn.forward(q, k, v, **OPTIONS).numpy())


def _bad_buffers():
    q, k, v, _ = problem()
    o_shape, lse_shape = (2, 4, 12, 6), (2, 4, 12)
    read_only = np.empty(o_shape, np.float32)
    read_only.flags.writeable = False
    shared = np.empty(2 * 4 * 12 * 7, np.float32)
    return (q, k, v), [
        (dict(out=np.empty((2, 4, 12, 8), np.float32)),
         r"out must have shape \(2, 4, 12, 6\), got \(2, 4, 12, 8\)"),
        (dict(out=np.empty(o_shape, np.float64)),
         "out must have dtype float32, got float64"),
        (dict(lse_out=np.empty(lse_shape, np.float64)),
         "lse_out must have dtype float32, got float64"),
        (dict(out=np.empty((2, 4, 6, 12), np.float32).swapaxes(-1, -2)),
         r"out must be C-contiguous, got strides"),
        (dict(out=read_only), "out must be writeable"),
        (dict(lse_out=np.empty((2, 4, 24), np.float32)[..., ::2]),
         "lse_out must be C-contiguous"),
        (dict(out=shared[:2 * 4 * 12 * 6].reshape(o_shape),
              lse_out=shared[-2 * 4 * 12:].reshape(lse_shape)), None),
        (dict(out=shared[:2 * 4 * 12 * 6].reshape(o_shape),
              lse_out=shared[2 * 4 * 12 * 6 - 8:][:2 * 4 * 12].reshape(lse_shape)),
         "out must not share memory with lse_out"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_buffers()[1])))
def test_bad_forward_buffers_raise_naming_them(case):
    (q, k, v), cases = _bad_buffers()
    buffers, message = cases[case]
    if message is None:  # the neighbouring, non-overlapping halves of one buffer are fine
        o = tileattn.forward(q, k, v, backend="reference", **buffers)
        assert o is buffers["out"]
        return
    with pytest.raises(ValueError, match=message):
        tileattn.forward(q, k, v, backend="reference", **buffers)


def test_buffers_must_not_alias_inputs():
    q, k, v, _ = problem(n_k=12)
    k = np.repeat(k, 2, axis=1)  # 4 kv heads and Dv = D: o and dk have q's shape
    v = k.copy()
    o, lse = tileattn.forward(q, k, v, backend="reference", return_lse=True)
    with pytest.raises(ValueError, match="out must not share memory with q"):
        tileattn.forward(q, k, v, backend="reference", out=q)
    with pytest.raises(ValueError, match="dk_out must not share memory with q"):
        tileattn.backward(o, q, k, v, o, lse, backend="reference", dk_out=q)
    overlapping = np.empty(q.size + 8, np.float32)  # two buffers 8 elements apart
    with pytest.raises(ValueError, match="dq_out must not share memory with dk_out"):
        tileattn.backward(o, q, k, v, o, lse, backend="reference",
                          dq_out=overlapping[:q.size].reshape(q.shape),
                          dk_out=overlapping[8:].reshape(q.shape))


@pytest.mark.parametrize("backend_name", ["reference", "cpu"])
def test_buffers_that_would_lose_the_results_or_overwrite_an_input_are_refused(backend_name):
    """A list (converted to a new array, which would take the results), a buffer over the
    bytes of an input in another byte order, or over the lengths or the slopes: each is
    refused by name, and the inputs stay as they were."""
    if backend_name == "cpu":
        pytest.importorskip("numba")
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 2, 8, 16))
    with pytest.raises(TypeError, match="out must be a NumPy, CuPy or torch array"):
        tileattn.forward(q, q, q, backend=backend_name, out=np.zeros(q.shape).tolist())
    raw = np.zeros(q.nbytes, np.uint8)
    swapped = raw.view(">f8").reshape(q.shape)
    swapped[...] = q
    with pytest.raises(ValueError, match="out must not share memory with q"):
        tileattn.forward(swapped, q, q, backend=backend_name,
                         out=raw.view("<f8").reshape(q.shape))
    np.testing.assert_array_equal(swapped, q)
    batched = rng.standard_normal((2, 1, 4, 2))
    out = np.zeros(batched.shape)
    lengths = out.reshape(-1)[:2].view(np.int64)
    lengths[:] = [3, 4]
    with pytest.raises(ValueError, match="out must not share memory with seqlens_k"):
        tileattn.forward(batched, batched, batched, seqlens_k=lengths, backend=backend_name,
                         out=out)
    np.testing.assert_array_equal(lengths, [3, 4])
    lse_out = np.zeros((1, 2, 8))
    slopes = lse_out.reshape(-1)[:2]
    slopes[:] = [0.5, 0.25]
    with pytest.raises(ValueError, match="lse_out must not share memory with alibi_slopes"):
        tileattn.forward(q, q, q, alibi_slopes=slopes, backend=backend_name, return_lse=True,
                         lse_out=lse_out)
    np.testing.assert_array_equal(slopes, [0.5, 0.25])


def test_a_buffer_in_the_gaps_of_a_strided_input_is_taken():
    """Byte bounds that overlap but no shared byte: lse_out between q's rows."""
    whole = np.random.default_rng(0).standard_normal((2, 2, 8, 16)).astype(np.float32)
    q, kv = whole[:, :1], np.ones((2, 1, 8, 16), np.float32)
    lse_out = whole[0, 1].reshape(-1)[:16].reshape(2, 1, 8)
    assert not np.shares_memory(q, lse_out)
    o, lse = tileattn.forward(q, kv, kv, backend="reference", return_lse=True,
                              lse_out=lse_out)
    assert lse is lse_out
    want = tileattn.forward(np.ascontiguousarray(q), kv, kv, backend="reference",
                            return_lse=True)[1]
    np.testing.assert_array_equal(lse, want)


def test_torch_tensors_off_the_cpu_and_cuda_are_named():
    torch = pytest.importorskip("torch")
    q = np.ones((1, 1, 4, 8))
    with pytest.raises(ValueError, match="torch tensors must be on the CPU or a CUDA device"):
        tileattn.forward(q, q, q, backend="reference",
                         out=torch.empty(q.shape, dtype=torch.float64, device="meta"))


@pytest.mark.parametrize("order", ["callers", "heads first"])
def test_bshd_buffers_may_be_contiguous_in_either_order(backend, order):
    """With layout="bshd" a buffer may be C-contiguous as the caller holds it
    ``(batch, seqlen, heads, dim)``, flash-attn's order, or the swapaxes view of a
    ``(batch, heads, seqlen, dim)`` buffer; either way it holds the result."""
    q, k, v, do = problem(layout="bshd")
    options = dict(OPTIONS, layout="bshd")
    o, lse = backend.forward(q, k, v, return_lse=True, **options)
    grads = backend.backward(do, q, k, v, o, lse, **options)

    def buffer(shape):
        if order == "callers":
            return backend.to_memory(np.full(shape, np.nan, np.float32))
        return empty_like_result(backend, shape, np.float32, "bshd")
    out = buffer(o.shape)
    o_given = backend.forward(q, k, v, out=out, **options)
    np.testing.assert_array_equal(o_given, o)
    np.testing.assert_array_equal(backend.to_host(out), o)
    buffers = [buffer(a.shape) for a in (q, k, v)]
    given = backend.backward(do, q, k, v, o, lse, dq_out=buffers[0], dk_out=buffers[1],
                             dv_out=buffers[2], **options)
    for name, ours, theirs, held in zip("qkv", given, grads, buffers):
        np.testing.assert_array_equal(ours, theirs, err_msg=f"d{name}")
        np.testing.assert_array_equal(backend.to_host(held), theirs, err_msg=f"d{name}")


def test_bshd_buffer_contiguous_in_neither_order_is_refused():
    q, k, v, _ = problem(layout="bshd")
    with pytest.raises(ValueError, match=r"out must be C-contiguous in its own \(\*batch, N, "
                                         r"H, D\) order or in \(\*batch, H, N, D\) order"):
        tileattn.forward(q, k, v, layout="bshd", backend="reference",
                         out=np.empty((2, 12, 8, 6), np.float32)[:, :, ::2])


def test_gpu_kernels_write_into_cupy_buffers():
    """The GPU backend takes the buffers as its outputs (WRITES_OUT): the very arrays come
    back, holding what a call without buffers returns."""
    from tileattn import backends

    reason = backends.availability("gpu")
    if reason is not None:
        pytest.skip(reason)
    import cupy

    assert backends.load("gpu").WRITES_OUT
    q, k, v, do = (cupy.asarray(a) for a in problem())
    o, lse = tileattn.forward(q, k, v, return_lse=True, **OPTIONS)
    grads = tileattn.backward(do, q, k, v, o, lse, **OPTIONS)
    out, lse_out = cupy.full(o.shape, cupy.nan, o.dtype), cupy.full(lse.shape, cupy.nan,
                                                                     lse.dtype)
    o_given, lse_given = tileattn.forward(q, k, v, return_lse=True, out=out, lse_out=lse_out,
                                          **OPTIONS)
    assert o_given is out and lse_given is lse_out
    cupy.testing.assert_array_equal(out, o)
    cupy.testing.assert_array_equal(lse_out, lse)
    buffers = [cupy.full(a.shape, cupy.nan, a.dtype) for a in (q, k, v)]
    given = tileattn.backward(do, q, k, v, o, lse, dq_out=buffers[0], dk_out=buffers[1],
                              dv_out=buffers[2], **OPTIONS)
    for name, ours, buffer, theirs in zip("qkv", given, buffers, grads):
        assert ours is buffer
        cupy.testing.assert_array_equal(ours, theirs, err_msg=f"d{name}")
    odd_offset = cupy.empty(out.size + 1, out.dtype)[1:].reshape(out.shape)
    with pytest.raises(ValueError, match="out must start at an address aligned to two "
                                         "elements"):
        tileattn.forward(q, k, v, out=odd_offset, **OPTIONS)
