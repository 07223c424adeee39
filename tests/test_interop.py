"""Results come back in the caller's array library; autograd adapters for torch and JAX.

Each test skips when its library is not installed, except in CI (``CI`` set), whose test
command installs both (CPU builds): there a missing one fails the test instead, so the
adapters cannot go untested unnoticed.
"""

from __future__ import annotations

import importlib
import os
import warnings

import numpy as np
import pytest


def require(name: str):
    """The module `name`; skips the test without it, fails it in CI."""
    if os.environ.get("CI"):
        return importlib.import_module(name)
    return pytest.importorskip(name)

import tileattn
from tileattn.testing import assert_attention_close


def numpy_problem(shape_q=(2, 4, 12, 8), shape_kv=(2, 2, 12, 8), seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s).astype(np.float32) for s in (shape_q, shape_kv, shape_kv))


OPTIONS = dict(causal=True, softcap=4.0, alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4]),
               window=(5, None))


def golden(q, k, v, do):
    o, lse = tileattn.forward(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                              backend="reference", return_lse=True, **OPTIONS)
    grads = tileattn.backward(do.astype(np.float64), q.astype(np.float64),
                              k.astype(np.float64), v.astype(np.float64), o, lse,
                              backend="reference", **OPTIONS)
    return o, grads


def test_torch_tensors_in_torch_tensors_out():
    torch = require("torch")
    q, k, v = (torch.from_numpy(a) for a in numpy_problem())
    o, lse = tileattn.forward(q, k, v, return_lse=True, **OPTIONS)
    assert isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    expected, _ = golden(q.numpy(), k.numpy(), v.numpy(), np.ones(o.shape, np.float32))
    assert_attention_close(o.numpy(), expected, np.float32)


def test_torch_bfloat16_round_trips():
    torch = require("torch")
    require("ml_dtypes")
    q, k, v = (torch.from_numpy(a).to(torch.bfloat16) for a in numpy_problem())
    o = tileattn.forward(q, k, v)
    assert o.dtype == torch.bfloat16 and o.shape == (2, 4, 12, 8)


def test_torch_lazily_negated_or_conjugated_tensors_are_read_as_their_values():
    """A float tensor with torch's negative bit (``z.conj().imag``) or a conjugated complex
    one holds ordinary values that .numpy() and DLPack refuse to read as they lie: the API
    and the adapter read them resolved, with the same results as plain copies."""
    torch = require("torch")
    from tileattn.torch import attention

    arrays = numpy_problem()
    lazy = [torch.complex(torch.zeros_like(t), -t).conj().imag
            for t in (torch.from_numpy(a) for a in arrays)]
    assert all(t.is_neg() for t in lazy)
    expected, _ = golden(*arrays, np.ones((2, 4, 12, 8), np.float32))
    for function in (tileattn.forward, attention):
        o = function(*lazy, **OPTIONS)
        assert_attention_close(o.numpy(), expected, np.float32)


def test_torch_dtypes_without_a_numpy_counterpart_are_refused_by_name():
    torch = require("torch")
    from tileattn.torch import attention

    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8 dtypes")
    q, k, v = (torch.from_numpy(a) for a in numpy_problem())
    q8 = q.to(torch.float8_e4m3fn)
    for function in (tileattn.forward, attention):
        with pytest.raises(TypeError, match=r"^q: a torch tensor of dtype torch.float8_e4m3fn "
                                            r"has no NumPy counterpart; tileattn takes float16"):
            function(q8, k, v)


def test_torch_autograd_matches_golden_gradients():
    torch = require("torch")
    from tileattn.torch import attention

    arrays = numpy_problem()
    q, k, v = (torch.from_numpy(a).requires_grad_() for a in arrays)
    o = attention(q, k, v, **OPTIONS)
    do = torch.from_numpy(np.random.default_rng(1).standard_normal(o.shape).astype(np.float32))
    o.backward(do)
    expected_o, expected_grads = golden(*arrays, do.numpy())
    assert_attention_close(o.detach().numpy(), expected_o, np.float32)
    for name, tensor, want in zip("qkv", (q, k, v), expected_grads):
        assert_attention_close(tensor.grad.numpy(), want, np.float32, name=f"d{name}")


def test_torch_inference_records_no_graph_and_training_does():
    """Without gradients to take (no tensor requires one, or under no_grad) the adapter runs
    the forward with no autograd node; with one, the output has a node. Same values."""
    torch = require("torch")
    from tileattn.torch import attention

    arrays = numpy_problem(seed=4)
    expected, _ = golden(*arrays, np.ones((2, 4, 12, 8), np.float32))
    plain = [torch.from_numpy(a) for a in arrays]
    trained = [torch.from_numpy(a).requires_grad_() for a in arrays]
    with torch.no_grad():
        under_no_grad = attention(*trained, **OPTIONS)
    for o in (attention(*plain, **OPTIONS), under_no_grad):
        assert o.grad_fn is None and not o.requires_grad
        assert_attention_close(o.numpy(), expected, np.float32)
    o = attention(*trained, **OPTIONS)
    assert o.grad_fn is not None
    assert_attention_close(o.detach().numpy(), expected, np.float32)


def test_torch_autograd_agrees_with_torch_sdpa():
    torch = require("torch")
    from tileattn.torch import attention

    q, k, v = (torch.from_numpy(a).double().requires_grad_() for a in numpy_problem(
        shape_kv=(2, 4, 12, 8)))
    ours = attention(q, k, v, causal=True)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(ours, theirs)
    grads_ours = torch.autograd.grad(ours.sum(), (q, k, v))
    grads_theirs = torch.autograd.grad(theirs.sum(), (q, k, v))
    for a, b in zip(grads_ours, grads_theirs):
        torch.testing.assert_close(a, b)


def test_torch_autograd_reads_flash_attn_layout():
    """layout="bshd": the same o and gradients as the (batch, heads, seqlen, dim) call,
    transposed, to the bit."""
    torch = require("torch")
    from tileattn.torch import attention

    arrays = numpy_problem()
    do = torch.from_numpy(np.random.default_rng(3).standard_normal((2, 4, 12, 8))
                          .astype(np.float32))
    heads_first = [torch.from_numpy(a).requires_grad_() for a in arrays]
    sequence_first = [torch.from_numpy(a).transpose(1, 2).contiguous().requires_grad_()
                      for a in arrays]
    o = attention(*heads_first, **OPTIONS)
    o.backward(do)
    o_bshd = attention(*sequence_first, layout="bshd", **OPTIONS)
    assert o_bshd.shape == (2, 12, 4, 8)
    o_bshd.backward(do.transpose(1, 2))
    assert torch.equal(o_bshd, o.transpose(1, 2))
    for name, ours, theirs in zip("qkv", sequence_first, heads_first):
        assert torch.equal(ours.grad, theirs.grad.transpose(1, 2)), f"d{name}"


def test_jax_grad_reads_flash_attn_layout():
    jax = require("jax")
    from tileattn.jax import attention

    arrays = numpy_problem()
    do = np.random.default_rng(4).standard_normal((2, 4, 12, 8)).astype(np.float32)

    def loss(layout, do):
        return jax.jit(lambda q, k, v: jax.numpy.sum(
            attention(q, k, v, layout=layout, **OPTIONS) * do))

    heads_first = [jax.numpy.asarray(a) for a in arrays]
    sequence_first = [jax.numpy.asarray(a.swapaxes(1, 2)) for a in arrays]
    grads = jax.grad(loss("bhsd", do), argnums=(0, 1, 2))(*heads_first)
    grads_bshd = jax.grad(loss("bshd", do.swapaxes(1, 2)), argnums=(0, 1, 2))(*sequence_first)
    o = attention(*heads_first, **OPTIONS)
    o_bshd = attention(*sequence_first, layout="bshd", **OPTIONS)
    np.testing.assert_array_equal(np.asarray(o_bshd), np.asarray(o).swapaxes(1, 2))
    for name, ours, theirs in zip("qkv", grads_bshd, grads):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs).swapaxes(1, 2),
                                      err_msg=f"d{name}")
    with pytest.raises(ValueError, match=r"layout must be 'bhsd' .* got 'sbhd'"):
        attention(*sequence_first, layout="sbhd")


def test_jax_arrays_in_jax_arrays_out():
    jax = require("jax")
    q, k, v = (jax.numpy.asarray(a) for a in numpy_problem())
    o = tileattn.forward(q, k, v, **OPTIONS)
    assert isinstance(o, jax.Array)
    expected, _ = golden(*numpy_problem(), np.ones(o.shape, np.float32))
    assert_attention_close(np.asarray(o), expected, np.float32)


def test_jax_grad_under_jit_matches_golden_gradients():
    jax = require("jax")
    from tileattn.jax import attention

    arrays = numpy_problem()
    do = np.random.default_rng(2).standard_normal((2, 4, 12, 8)).astype(np.float32)

    @jax.jit
    def loss(q, k, v):
        return jax.numpy.sum(attention(q, k, v, **OPTIONS) * do)

    grads = jax.grad(loss, argnums=(0, 1, 2))(*(jax.numpy.asarray(a) for a in arrays))
    expected_o, expected_grads = golden(*arrays, do)
    o = attention(*(jax.numpy.asarray(a) for a in arrays), **OPTIONS)
    assert_attention_close(np.asarray(o), expected_o, np.float32)
    for name, grad, want in zip("qkv", grads, expected_grads):
        assert_attention_close(np.asarray(grad), want, np.float32, name=f"d{name}")


def test_dlpack_only_arrays_are_accepted():
    class DLPackOnly:
        """An array from an unknown library that speaks only the DLPack protocol."""

        def __init__(self, array):
            self._array = array

        def __dlpack__(self, **kwargs):
            return self._array.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self._array.__dlpack_device__()

    q, k, v = numpy_problem()
    o = tileattn.forward(DLPackOnly(q), DLPackOnly(k), DLPackOnly(v), backend="reference")
    assert isinstance(o, np.ndarray)
    np.testing.assert_array_equal(o, tileattn.forward(q, k, v, backend="reference"))


def _gpu_or_skip():
    from tileattn import backends

    reason = backends.availability("gpu")
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16", "float32"])
def test_torch_cuda_tensors_stay_on_the_gpu_and_train(dtype_name):
    torch = require("torch")
    _gpu_or_skip()
    from tileattn.torch import attention

    arrays = numpy_problem(shape_q=(2, 4, 80, 64), shape_kv=(2, 2, 80, 64))
    dtype = getattr(torch, dtype_name)
    q, k, v = (torch.from_numpy(a).to("cuda", dtype).requires_grad_() for a in arrays)
    o = attention(q, k, v, **OPTIONS)
    assert o.device.type == "cuda" and o.dtype == dtype
    do = torch.randn_like(o)
    o.backward(do)
    host = [t.detach().float().cpu().numpy() for t in (q, k, v, do)]
    expected_o, expected_grads = golden(*host)
    tolerance_dtype = np.float32 if dtype_name == "float32" else (
        np.float16 if dtype_name == "float16" else require("ml_dtypes").bfloat16)
    assert_attention_close(o.detach().float().cpu().numpy(), expected_o, tolerance_dtype)
    for name, tensor, want in zip("qkv", (q, k, v), expected_grads):
        assert tensor.grad.device.type == "cuda"
        assert_attention_close(tensor.grad.float().cpu().numpy(), want, tolerance_dtype,
                               name=f"d{name}")


def test_jax_gpu_arrays_come_back_as_jax_arrays():
    jax = require("jax")
    _gpu_or_skip()
    if not any(d.platform in ("gpu", "cuda") for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    arrays = numpy_problem()
    q, k, v = (jax.device_put(a, jax.devices("gpu")[0]) for a in arrays)
    o = tileattn.forward(q, k, v, **OPTIONS)
    assert isinstance(o, jax.Array) and o.devices() == q.devices()
    expected, _ = golden(*arrays, np.ones((2, 4, 12, 8), np.float32))
    assert_attention_close(np.asarray(o), expected, np.float32)


# --------------------------------------------------------------------------- torch.compile


COMPILE_CASES = {
    "masks-softcap-alibi-tensor": dict(causal=True, softcap=4.0, window=(5, None),
                                       alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4])),
    # a seed in the upper half of [0, 2**64) travels through torch's int64 as a negative int
    "dropout-high-seed-scale-list-slopes": dict(dropout_p=0.25, seed=2**64 - 7, scale=0.5,
                                                alibi_slopes=[0.3, 0.0, 0.1, 0.2]),
    "bshd-window-blocks": dict(layout="bshd", window=(3, 2), block_q=5, block_k=4),
}


def golden_with(arrays, do, options):
    """o and (dq, dk, dv) of the float64 golden model for the adapters' options."""
    options = dict(options)
    if options.get("alibi_slopes") is not None:
        options["alibi_slopes"] = np.asarray(options["alibi_slopes"])
    as64 = [np.asarray(a, np.float64) for a in arrays]
    do64 = np.asarray(do, np.float64)
    o, lse = tileattn.forward(*as64, backend="reference", return_lse=True, **options)
    return o, tileattn.backward(do64, *as64, o, lse, backend="reference", **options)


def _torch_o_and_grads(function, arrays, do, torch):
    tensors = [torch.from_numpy(a).requires_grad_() for a in arrays]
    o = function(*tensors)
    o.backward(torch.from_numpy(do))
    return o.detach().numpy(), [t.grad.numpy() for t in tensors]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", sorted(COMPILE_CASES))
def test_torch_compile_fullgraph_matches_eager_and_golden(case, dtype):
    """torch.compile(fullgraph=True) traces the custom ops without a graph break (fullgraph
    raises on one) and gives eager's o and gradients, which match the golden model."""
    torch = require("torch")
    from tileattn.torch import attention

    options = COMPILE_CASES[case]
    arrays = [a.astype(dtype) for a in numpy_problem(shape_q=(2, 4, 12, 8),
                                                     shape_kv=(2, 2, 10, 8))]
    if options.get("layout") == "bshd":
        arrays = [np.ascontiguousarray(a.swapaxes(1, 2)) for a in arrays]
    o_shape = arrays[0].shape
    do = np.random.default_rng(5).standard_normal(o_shape).astype(dtype)
    expected_o, expected_grads = golden_with(arrays, do, options)

    def function(q, k, v):
        return attention(q, k, v, **options)

    eager_o, eager_grads = _torch_o_and_grads(function, arrays, do, torch)
    assert_attention_close(eager_o, expected_o, dtype, name="eager o")
    for name, grad, want in zip("qkv", eager_grads, expected_grads):
        assert_attention_close(grad, want, dtype, name=f"eager d{name}")
    for compile_backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        compiled = torch.compile(function, fullgraph=True, backend=compile_backend)
        o, grads = _torch_o_and_grads(compiled, arrays, do, torch)
        np.testing.assert_array_equal(o, eager_o, err_msg=compile_backend)
        for name, grad, want in zip("qkv", grads, eager_grads):
            np.testing.assert_array_equal(grad, want, err_msg=f"{compile_backend} d{name}")


def test_torch_compile_default_backend_matches_golden():
    """The README's spelling, torch.compile's default (inductor) backend (about 3 s here
    when its cache is cold)."""
    torch = require("torch")
    from tileattn.torch import attention

    options = COMPILE_CASES["masks-softcap-alibi-tensor"]
    arrays = numpy_problem()
    do = np.random.default_rng(10).standard_normal((2, 4, 12, 8)).astype(np.float32)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: attention(q, k, v, **options), fullgraph=True)
    o, grads = _torch_o_and_grads(compiled, arrays, do, torch)
    expected_o, expected_grads = golden_with(arrays, do, options)
    assert_attention_close(o, expected_o, np.float32)
    for name, grad, want in zip("qkv", grads, expected_grads):
        assert_attention_close(grad, want, np.float32, name=f"d{name}")


def test_torch_compiled_graph_holds_the_tileattn_ops():
    """Each pass is one tileattn operator in the traced graph (no graph break, no DLPack)."""
    torch = require("torch")
    from tileattn.torch import attention

    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    q, k, v = (torch.from_numpy(a).requires_grad_() for a in numpy_problem())
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: attention(q, k, v, causal=True).sum(),
                             fullgraph=True, backend=record)
    compiled(q, k, v).backward()
    assert len(graphs) == 1
    targets = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert torch.ops.tileattn.forward in targets
    assert q.grad is not None and q.grad.shape == q.shape


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_torch_library_opcheck_passes(layout, dtype):
    """torch's own checks of the ops: schema (no input mutated), fake (meta) shapes, dtypes
    and strides equal the real ones, autograd registration, AOT dispatch with dynamic
    shapes."""
    torch = require("torch")
    import tileattn.torch  # noqa: F401  (registers torch.ops.tileattn)

    arrays = numpy_problem(shape_q=(2, 4, 6, 8), shape_kv=(2, 2, 7, 8))
    q, k, v = (torch.from_numpy(a.astype(dtype)) for a in arrays)
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    slopes = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    options = (True, [4, -1], None, 3.0, slopes, 0.1, 3, None, None, "auto", layout, True)
    o, lse = torch.ops.tileattn.forward(q, k, v, *options)
    assert lse.dtype == (torch.float64 if dtype == np.float64 else torch.float32)
    do = torch.ones_like(o)
    trainable = tuple(t.detach().requires_grad_() for t in (q, k, v))
    # The backward op has no autograd formula of its own (no double backward), so it is
    # checked on tensors that do not require grad.
    for op, args in ((torch.ops.tileattn.forward.default, (q, k, v) + options),
                     (torch.ops.tileattn.forward.default, trainable + options),
                     (torch.ops.tileattn.backward.default, (do, q, k, v, o, lse) + options)):
        results = torch.library.opcheck(op, args)
        assert set(results.values()) == {"SUCCESS"}, results


def test_torch_second_derivative_is_refused_by_name():
    """Eager calls run outside the dispatcher (a torch.autograd.Function); under
    create_graph=True their backward is the op, so a second derivative raises torch's error
    naming tileattn.backward, as in compiled code, instead of a silent zero."""
    torch = require("torch")
    from tileattn.torch import attention

    q, k, v = (torch.from_numpy(a).double().requires_grad_() for a in numpy_problem())
    (dq,) = torch.autograd.grad(attention(q, k, v, causal=True).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="tileattn.backward"):
        torch.autograd.grad(dq.sum(), q)


def test_jax_eager_calls_of_one_signature_reuse_their_pass():
    """Eager calls (no jit) made a new callback object each, whose primitive JAX then
    compiled anew (~12-18 ms a call): calls of one signature now share the pass (and so
    JAX's compiled computation); other key lengths get their own, and every result is the
    golden model's."""
    jax = require("jax")
    from tileattn import jax as adapter

    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 2, 8, 16)).astype(np.float32)
    adapter._pass.cache_clear()
    for n_k in (100, 100, 200, 100):
        k, v = (rng.standard_normal((1, 2, n_k, 16)).astype(np.float32) for _ in range(2))
        o = adapter.attention(*(jax.numpy.asarray(a) for a in (q, k, v)), causal=True)
        expected = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)), causal=True,
                                    backend="reference")
        assert_attention_close(np.asarray(o), expected, np.float32)
    info = adapter._pass.cache_info()
    assert (info.misses, info.hits) == (2, 2)


def test_jax_second_derivative_is_refused_by_name():
    """A gradient of a gradient or a Hessian differentiates the passes themselves: a
    NotImplementedError naming tileattn.jax.attention (JAX's own message said only that
    callbacks do not support JVP), while a first gradient, under jit and vmap too, is
    unchanged."""
    jax = require("jax")
    from tileattn.jax import attention

    q, k, v = (jax.numpy.asarray(a) for a in numpy_problem())

    def loss(q):
        return attention(q, k, v, causal=True).sum()

    first = jax.jit(jax.grad(loss))(q)
    assert first.shape == q.shape and bool(jax.numpy.isfinite(first).all())
    message = "tileattn.jax.attention has no second derivative"
    with pytest.raises(NotImplementedError, match=message):
        jax.grad(lambda q: jax.grad(loss)(q).sum())(q)
    small = [jax.numpy.asarray(a) for a in numpy_problem((1, 1, 3, 8), (1, 1, 3, 8))]
    with pytest.raises(NotImplementedError, match=message):
        jax.hessian(lambda q: attention(q, *small[1:]).sum())(small[0])


def test_torch_func_vmap_equals_the_loop():
    """torch.func.vmap over `attention` (a batch axis torch adds) loops over that axis
    (the Function's vmap rule): the same bits as calls in a Python loop."""
    torch = require("torch")
    from tileattn.torch import attention

    q, k, v = (torch.from_numpy(a) for a in numpy_problem())
    batched = torch.func.vmap(lambda q_: attention(q_, k[0], v[0], causal=True))(q)
    looped = torch.stack([attention(q[i], k[0], v[0], causal=True) for i in range(len(q))])
    assert torch.equal(batched, looped)


def test_torch_func_gradients_equal_the_golden_model():
    """torch.func.grad, vjp, vmap of grad and grad of vmap give the golden model's
    gradients (GQA and every score option, as `golden`), and jacrev the golden model's
    Jacobian by central differences; a second derivative is refused by name."""
    torch = require("torch")
    from tileattn.torch import attention

    q, k, v = numpy_problem()
    do = np.random.default_rng(5).standard_normal(q.shape).astype(np.float32)
    _, want = golden(q, k, v, do)
    q, k, v, do = (torch.from_numpy(a).double() for a in (q, k, v, do))
    options = {**OPTIONS, "alibi_slopes": torch.from_numpy(OPTIONS["alibi_slopes"])}

    def loss(q_, k_, v_, do_):
        return (attention(q_, k_, v_, **options) * do_).sum()

    def check(grads, label):
        for name, grad, expected in zip(("dq", "dk", "dv"), grads, want):
            assert_attention_close(grad.numpy(), expected, np.float64, name=f"{label} {name}")

    check(torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v, do), "grad")
    o, pullback = torch.func.vjp(lambda *qkv: attention(*qkv, **options), q, k, v)
    check(pullback(do), "vjp")
    # The batch axis taken by vmap: each element is a (heads, rows, dim) problem.
    per_element = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))(q, k, v, do)
    check(per_element, "vmap(grad)")
    check(torch.func.grad(lambda *qkv: (torch.func.vmap(
        lambda *x: attention(*x, **options))(*qkv) * do).sum(), argnums=(0, 1, 2))(q, k, v),
        "grad(vmap)")

    small = [t[:1, :2, :3, :4].clone() for t in (q, k[:, :1], v[:, :1])]
    jacobian = torch.func.jacrev(lambda q_: attention(q_, *small[1:], causal=True))(small[0])
    step = 1e-6
    for index in np.ndindex(*small[0].shape):
        shift = torch.zeros_like(small[0])
        shift[index] = step
        plus, minus = (tileattn.forward(*(t.numpy() for t in (small[0] + s, *small[1:])),
                                        causal=True, backend="reference")
                       for s in (shift, -shift))
        np.testing.assert_allclose(jacobian[(...,) + index].numpy(),
                                   (plus - minus) / (2 * step), atol=1e-8)

    with pytest.raises(RuntimeError, match="tileattn.backward has no derivative"):
        torch.func.grad(lambda q_: torch.func.grad(loss)(q_, k, v, do).sum())(q)


def test_torch_func_edges():
    """vmap over an empty axis, or over only the slopes or the lengths; forward mode and
    torch's legacy batched gradients refused by an error, never a zero tangent."""
    torch = require("torch")
    from tileattn.torch import attention

    q, k, v = (torch.from_numpy(a).double() for a in numpy_problem())
    empty = torch.func.vmap(lambda q_: attention(q_, k[0], v[0]))(q[:0])
    assert empty.shape == (0,) + q.shape[1:]
    grads = torch.func.vmap(torch.func.grad(lambda q_: attention(q_, k[0], v[0]).sum()))(q[:0])
    assert grads.shape == (0,) + q.shape[1:]
    slopes = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.0, 0.2, 0.1]], dtype=torch.float64)
    by_slopes = torch.func.vmap(lambda s: attention(q[0], k[0], v[0], alibi_slopes=s))(slopes)
    for index, s in enumerate(slopes):
        assert torch.equal(by_slopes[index], attention(q[0], k[0], v[0], alibi_slopes=s))
    lengths = torch.tensor([[5], [12]])
    by_lengths = torch.func.vmap(lambda n: attention(q[:1], k[:1], v[:1], seqlens_k=n))(lengths)
    for index, n in enumerate(lengths):
        assert torch.equal(by_lengths[index], attention(q[:1], k[:1], v[:1], seqlens_k=n))
    with pytest.raises(NotImplementedError, match="jvp"):
        torch.func.linearize(lambda q_: attention(q_, k, v), q)[1](q)
    with pytest.raises(NotImplementedError, match="jvp"):
        torch.func.jvp(lambda q_: attention(q_, k, v), (q,), (q,))
    trainable = q.clone().requires_grad_()
    o = attention(trainable, k, v)
    with pytest.raises(NotImplementedError, match="legacy vmap"):
        torch.autograd.grad(o, trainable, torch.ones((2,) + o.shape, dtype=o.dtype),
                            is_grads_batched=True)


@pytest.mark.parametrize("options, error, message", [
    (dict(alibi_slopes=np.array([0.1 + 1j, 0.2, 0.3, 0.4])), TypeError,
     "alibi_slopes must be real numbers, got dtype complex128"),
    (dict(alibi_slopes=[True, False, True, False]), TypeError,
     "alibi_slopes must be real numbers, got dtype bool"),
    (dict(alibi_slopes="abcd"), TypeError, "alibi_slopes must be an array of numbers"),
    (dict(seqlens_k=[1, None]), TypeError, "seqlens_k must be an array of numbers"),
    (dict(seqlens_k=[[1], [2, 3]]), TypeError, "seqlens_k must be an array of numbers"),
])
def test_torch_adapter_names_bad_slopes_and_lengths(options, error, message):
    """Slopes and lengths are checked before torch's conversion would cast complex or bool
    slopes or fail without naming the argument."""
    torch = require("torch")
    from tileattn.torch import attention

    q, k, v = (torch.from_numpy(a) for a in numpy_problem())
    with pytest.raises(error, match=message):
        attention(q, k, v, **options)


def test_torch_slopes_that_would_be_differentiated_are_refused():
    """tileattn has no gradient for ALiBi slopes: slopes that require one (eagerly, or as
    an argument torch.func.grad differentiates) raise, where torch would read zeros."""
    torch = require("torch")
    from tileattn.torch import attention

    q, k, v = (torch.from_numpy(a).double() for a in numpy_problem())
    slopes = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    with pytest.raises(ValueError, match="alibi_slopes get no gradient"):
        attention(q.requires_grad_(), k, v, alibi_slopes=slopes.clone().requires_grad_())
    with pytest.raises(ValueError, match="alibi_slopes get no gradient"):
        torch.func.grad(lambda s: attention(q.detach(), k, v, alibi_slopes=s).sum())(slopes)
    with torch.no_grad():  # nothing to differentiate: served
        attention(q, k, v, alibi_slopes=slopes.clone().requires_grad_())


def test_torch_seed_is_checked_before_the_op():
    torch = require("torch")
    from tileattn.torch import attention

    q, k, v = (torch.from_numpy(a) for a in numpy_problem())
    with pytest.raises(ValueError, match=r"seed must be < 2\*\*64, got 18446744073709551616"):
        attention(q, k, v, dropout_p=0.1, seed=2**64)
    with pytest.raises(ValueError, match="seed must be >= 0, got -1"):
        attention(q, k, v, dropout_p=0.1, seed=-1)


def test_torch_cuda_runs_on_torch_current_stream(monkeypatch):
    """CUDA tensors run tileattn on torch's current stream (here a non-default one), so
    its kernels are ordered with the caller's torch work; results match the golden model."""
    torch = require("torch")
    _gpu_or_skip()
    import cupy

    import tileattn.torch as adapter

    seen_streams = []
    original_forward, original_backward = adapter.api.forward, adapter.api.backward

    def recording(original):
        def call(*args, **kwargs):
            seen_streams.append(cupy.cuda.get_current_stream().ptr)
            return original(*args, **kwargs)
        return call

    monkeypatch.setattr(adapter.api, "forward", recording(original_forward))
    monkeypatch.setattr(adapter.api, "backward", recording(original_backward))
    arrays = numpy_problem(shape_q=(2, 4, 80, 64), shape_kv=(2, 2, 80, 64))
    do = np.random.default_rng(6).standard_normal((2, 4, 80, 64)).astype(np.float32)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        # made on the stream just before the call: read too early on another stream
        q, k, v = (torch.from_numpy(a).cuda().mul(1.0).requires_grad_() for a in arrays)
        o = adapter.attention(q, k, v, **OPTIONS)
        o.backward(torch.from_numpy(do).cuda())
    stream.synchronize()
    assert seen_streams == [stream.cuda_stream] * 2
    assert stream.cuda_stream != torch.cuda.default_stream().cuda_stream
    expected_o, expected_grads = golden(*arrays, do)
    assert_attention_close(o.detach().cpu().numpy(), expected_o, np.float32)
    for name, tensor, want in zip("qkv", (q, k, v), expected_grads):
        assert_attention_close(tensor.grad.cpu().numpy(), want, np.float32, name=f"d{name}")


REPLAY_OPTIONS = dict(causal=True, softcap=20.0, window=(48, None))


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_torch_repeated_cuda_calls_replay_what_direct_calls_compute(layout):
    """From the second call of a signature on, the adapter replays its launches
    (`api.replay`) into new tensors: bit for bit what `tileattn.forward`/`backward` give
    on the same tensors, on a side stream too, with new inputs each step."""
    torch = require("torch")
    _gpu_or_skip()
    import tileattn.torch as adapter

    shape_q, shape_kv = ((2, 96, 4, 64), (2, 96, 2, 64)) if layout == "bshd" else (
        (2, 4, 96, 64), (2, 2, 96, 64))
    options = dict(REPLAY_OPTIONS, layout=layout)
    stream = torch.cuda.Stream()
    for step, on_side_stream in enumerate((False, False, False, True, True)):
        context = torch.cuda.stream(stream) if on_side_stream else torch.cuda.stream(None)
        with context:
            arrays = numpy_problem(shape_q, shape_kv, seed=step)
            q, k, v = (torch.from_numpy(a).to("cuda", torch.float16).requires_grad_()
                       for a in arrays)
            do = torch.randn(shape_q, device="cuda", dtype=torch.float16)
            o = adapter.attention(q, k, v, **options)
            o.backward(do)
            want_o, lse = tileattn.forward(q.detach(), k.detach(), v.detach(),
                                           return_lse=True, **options)
            want = tileattn.backward(do, q.detach(), k.detach(), v.detach(), want_o, lse,
                                     **options)
        torch.cuda.synchronize()
        assert torch.equal(o.detach(), want_o)
        for tensor, grad in zip((q, k, v), want):
            assert torch.equal(tensor.grad, grad)
    replays = [signature[0] for (signature, _stream), entry in adapter._REPLAYS.items()
               if entry and signature[1][10] == layout]
    assert replays.count("forward") == 2 and replays.count("backward") == 2  # two streams


def test_torch_cuda_graph_captures_a_training_step():
    """A forward and backward captured in a torch CUDA graph replay like eager calls on new
    inputs: the passes run on the capture stream, their scratch from torch's allocator."""
    torch = require("torch")
    _gpu_or_skip()
    from tileattn.torch import attention

    def tensors(seed):
        arrays = numpy_problem((2, 4, 128, 64), (2, 2, 128, 64), seed=seed)
        do = np.random.default_rng(seed + 10).standard_normal((2, 4, 128, 64))
        return [torch.from_numpy(a).to("cuda", torch.bfloat16) for a in arrays + (do,)]

    q, k, v, do = (t.requires_grad_(i < 3) for i, t in enumerate(tensors(0)))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            q.grad = k.grad = v.grad = None
            attention(q, k, v, **REPLAY_OPTIONS).backward(do)
    torch.cuda.current_stream().wait_stream(side)
    q.grad = k.grad = v.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_o = attention(q, k, v, **REPLAY_OPTIONS)
        captured_o.backward(do)
    for seed in (1, 2):
        with torch.no_grad():
            for static, new in zip((q, k, v, do), tensors(seed)):
                static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        fresh = [t.detach().clone().requires_grad_(i < 3) for i, t in enumerate((q, k, v, do))]
        o = attention(*fresh[:3], **REPLAY_OPTIONS)
        o.backward(fresh[3])
        assert torch.equal(captured_o, o.detach())
        for static, eager in zip((q, k, v), fresh):
            assert torch.equal(static.grad, eager.grad)


# --------------------------------------------------------------------------- jax.vmap


VMAP_CASES = {
    "masks-per-batch-slopes": dict(causal=True, window=(6, None),
                                   alibi_slopes=np.arange(1, 9).reshape(2, 4) / 16),
    # dropout under vmap drops, for each element, what the unbatched call drops
    "dropout": dict(dropout_p=0.3, seed=11, softcap=3.0),
    "bshd": dict(layout="bshd", causal=True),
}


@pytest.fixture(params=["pure_callback", "buffer_callback"])
def jax_pass_kind(request, monkeypatch):
    """Both ways the JAX adapter runs a pass: buffer_callback (XLA's buffers, the default
    wherever JAX has it) and pure_callback (host copies, the fallback)."""
    jax = require("jax")
    import tileattn.jax as adapter

    use_buffers = request.param == "buffer_callback"
    if use_buffers and adapter._buffer_callback is None:
        pytest.skip("this JAX has no jax.experimental.buffer_callback")
    monkeypatch.setattr(adapter, "_use_buffers", lambda backend: use_buffers)
    return jax


@pytest.mark.parametrize("case", sorted(VMAP_CASES))
def test_jax_vmap_equals_the_loop_and_golden(case, jax_pass_kind):
    jax = jax_pass_kind
    from tileattn.jax import attention

    options = VMAP_CASES[case]
    rng = np.random.default_rng(7)
    shapes = [(3, 2, 4, 9, 8), (3, 2, 2, 11, 8), (3, 2, 2, 11, 8), (3, 2, 4, 9, 8)]
    q, k, v, do = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    if options.get("layout") == "bshd":
        q, k, v, do = (np.ascontiguousarray(a.swapaxes(-3, -2)) for a in (q, k, v, do))

    def loss(q, k, v, do):
        return jax.numpy.sum(attention(q, k, v, **options) * do)

    o = jax.jit(jax.vmap(lambda q, k, v: attention(q, k, v, **options)))(q, k, v)
    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v, do)
    for index in range(3):
        want_o, want_grads = golden_with((q[index], k[index], v[index]), do[index], options)
        looped = attention(q[index], k[index], v[index], **options)
        assert_attention_close(np.asarray(looped), want_o, np.float32, name="loop o")
        assert_attention_close(np.asarray(o[index]), want_o, np.float32, name="vmap o")
        for name, grad, want in zip("qkv", grads, want_grads):
            assert_attention_close(np.asarray(grad[index]), want, np.float32,
                                   name=f"vmap d{name}")


def test_jax_vmap_over_single_head_queries_only(jax_pass_kind):
    """(N, D) arrays, vmapped over q alone (k and v shared): the vmapped axis must not be
    read as heads, or the slope of the one head would not fit."""
    jax = jax_pass_kind
    from tileattn.jax import attention

    rng = np.random.default_rng(8)
    q = rng.standard_normal((4, 7, 8)).astype(np.float32)
    k, v = (rng.standard_normal((10, 8)).astype(np.float32) for _ in range(2))
    options = dict(causal=True, alibi_slopes=[0.25])
    o = jax.vmap(lambda q: attention(q, k, v, **options))(q)
    grads = jax.grad(lambda q, k: jax.numpy.sum(
        jax.vmap(lambda q: attention(q, k, v, **options))(q)), argnums=(0, 1))(q, k)
    dk = np.zeros((10, 8))
    for index in range(4):
        want_o, (want_dq, want_dk, _) = golden_with((q[index], k, v), np.ones((7, 8)),
                                                    options)
        assert_attention_close(np.asarray(o[index]), want_o, np.float32)
        assert_attention_close(np.asarray(grads[0][index]), want_dq, np.float32, name="dq")
        dk += want_dk
    assert_attention_close(np.asarray(grads[1]), dk, np.float32, name="dk summed over vmap")


def test_jax_without_buffer_callback_warns_once_and_runs_on_the_host(monkeypatch):
    require("jax")
    import tileattn.jax as adapter

    monkeypatch.setattr(adapter, "_buffer_callback", None)
    monkeypatch.setattr(adapter.jax, "default_backend", lambda: "gpu")
    adapter._warn_no_buffer_callback.cache_clear()
    q, k, v = numpy_problem()
    with pytest.warns(RuntimeWarning, match="copied to the host and back"):
        o = adapter.attention(q, k, v, **OPTIONS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adapter.attention(q, k, v, causal=True)
    expected, _ = golden(q, k, v, np.ones(o.shape, np.float32))
    assert_attention_close(np.asarray(o), expected, np.float32)
    adapter._warn_no_buffer_callback.cache_clear()


def test_jax_on_the_cpu_runs_in_xla_buffers_without_host_copies(monkeypatch):
    """Where JAX has buffer_callback the CPU passes use it too: pure_callback's copies cost
    0.6-1.2 ms a call (tileattn/jax.py). jit, grad and the golden model agree."""
    jax = require("jax")
    import tileattn.jax as adapter

    if adapter._buffer_callback is None or jax.default_backend() != "cpu":
        pytest.skip("needs a JAX with buffer_callback on the CPU")

    def no_pure_callback(*args, **kwargs):
        raise AssertionError("pure_callback was called")

    monkeypatch.setattr(adapter.jax, "pure_callback", no_pure_callback)
    q, k, v = numpy_problem()
    do = np.random.default_rng(12).standard_normal(q.shape).astype(np.float32)
    o = jax.jit(lambda a, b, c: adapter.attention(a, b, c, **OPTIONS))(q, k, v)
    grads = jax.jit(jax.grad(
        lambda a, b, c: (adapter.attention(a, b, c, **OPTIONS) * do).sum(),
        argnums=(0, 1, 2)))(q, k, v)
    expected_o, expected_grads = golden(q, k, v, do)
    assert_attention_close(np.asarray(o), expected_o, np.float32)
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected_grads):
        assert_attention_close(np.asarray(got), want, np.float32, name=name)
    assert adapter._use_buffers("cpu")  # host buffers serve backend="cpu" here


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_jax_16_bit_arrays_through_the_adapter_match_the_golden_model(dtype_name):
    """16-bit arrays through whichever callback the adapter takes (NumPy's DLPack has no
    bfloat16, so the host buffers are viewed through `np.asarray`)."""
    jax = require("jax")
    import jax.numpy as jnp

    import tileattn.jax as adapter

    dtype = getattr(jnp, dtype_name)
    q, k, v = (jnp.asarray(a, dtype=dtype) for a in numpy_problem(seed=5))
    o = jax.jit(lambda a, b, c: adapter.attention(a, b, c, causal=True))(q, k, v)
    assert o.dtype == dtype
    wide = [np.asarray(a, np.float64) for a in (q, k, v)]
    expected = tileattn.forward(*wide, causal=True, backend="reference")
    assert_attention_close(np.asarray(o, np.float32), expected, np.dtype(o.dtype))


def test_jax_gpu_runs_in_xla_buffers_under_vmap_and_grad():
    """On a GPU the passes are buffer_callbacks over XLA's device buffers and stream."""
    jax = require("jax")
    _gpu_or_skip()
    if jax.default_backend() != "gpu":
        pytest.skip("JAX's default backend is not a GPU")
    import tileattn.jax as adapter

    assert adapter._use_buffers("auto")
    rng = np.random.default_rng(9)
    shapes = [(2, 2, 4, 80, 64), (2, 2, 2, 80, 64), (2, 2, 2, 80, 64), (2, 2, 4, 80, 64)]
    q, k, v, do = (rng.standard_normal(s).astype(np.float32) for s in shapes)

    def loss(q, k, v, do):
        return jax.numpy.sum(adapter.attention(q, k, v, **OPTIONS) * do)

    on_gpu = [jax.device_put(a, jax.devices("gpu")[0]) for a in (q, k, v, do)]
    o = jax.jit(jax.vmap(lambda q, k, v: adapter.attention(q, k, v, **OPTIONS)))(*on_gpu[:3])
    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(*on_gpu)
    assert o.devices() == on_gpu[0].devices()
    for index in range(2):
        want_o, want_grads = golden_with((q[index], k[index], v[index]), do[index], OPTIONS)
        assert_attention_close(np.asarray(o[index]), want_o, np.float32)
        for name, grad, want in zip("qkv", grads, want_grads):
            assert_attention_close(np.asarray(grad[index]), want, np.float32, name=f"d{name}")


# --------------------------------------------------------------------------- varlen, paged


VARLEN_OPTIONS = dict(causal=True, softcap=4.0, window=(6, None),
                      alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4]))


VARLEN_LENGTHS = {
    "padded": dict(seqlens_q=[12, 5], seqlens_k=[4, 10]),
    "packed": dict(cu_seqlens_q=[0, 5, 5, 20], cu_seqlens_k=[0, 9, 12, 23]),
    # pools of 6 pages of 4 slots; page 5 is named by no row, -1 is a table's padding
    "paged": dict(block_table=[[2, 0, 4], [1, 3, -1]], seqlens_k=[11, 6]),
}


def varlen_problem(family: str, layout: str = "bhsd", seed: int = 12, lengths=None):
    """``(q, k, v, do), lengths`` (float32 arrays; int32 lengths, as flash-attn passes them)
    for the family, with `VARLEN_LENGTHS` or the `lengths` given. NaN fills everything that
    may not be read: padding rows and keys, and the page the table does not name, so a
    comparison also shows that none of it leaks."""
    rng = np.random.default_rng(seed)
    lengths = {n: np.array(a, np.int32) for n, a in
               (lengths or VARLEN_LENGTHS[family]).items()}

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    if family == "padded":
        q, do, k, v = normal(2, 4, 12, 8), normal(2, 4, 12, 8), normal(2, 2, 10, 8), \
            normal(2, 2, 10, 8)
        for b in range(2):
            q[b, :, lengths["seqlens_q"][b]:] = np.nan
            k[b, :, lengths["seqlens_k"][b]:] = v[b, :, lengths["seqlens_k"][b]:] = np.nan
    elif family == "packed":
        q, do, k, v = normal(4, 20, 8), normal(4, 20, 8), normal(2, 23, 8), normal(2, 23, 8)
    else:
        q, do, k, v = normal(2, 4, 3, 8), normal(2, 4, 3, 8), normal(6, 2, 4, 8), \
            normal(6, 2, 4, 8)
        k[5] = v[5] = np.nan
    arrays = (q, k, v, do)
    if layout == "bshd":  # (N, H, D) rows; paged pools (num_pages, page_size, Hkv, D)
        arrays = tuple(np.ascontiguousarray(a.swapaxes(-3, -2)) for a in arrays)
    return arrays, lengths


def _jax_backend() -> str:
    """The backend the JAX adapter's passes run on: the GPU kernels where its passes are
    buffer_callbacks on a GPU, else the CPU backend (host buffers or host arrays)."""
    jax = require("jax")
    from tileattn import jax as adapter

    return "gpu" if jax.default_backend() == "gpu" and adapter._use_buffers("auto") else "cpu"


def _on_backend(function, backend, arrays, *args, **keywords):
    """`function` (tileattn.forward/backward) on `backend`, NumPy in and out."""
    if backend == "gpu":
        import cupy

        results = function(*map(cupy.asarray, arrays), *args, backend="gpu", **keywords)
        return tuple(cupy.asnumpy(r) for r in results)
    return function(*arrays, *args, backend=backend, **keywords)


def varlen_expected(arrays, lengths, options, layout="bhsd", backend="cpu"):
    """tileattn.forward/backward with the same keywords on `backend` (the one the adapter
    runs on), and the float64 golden model's o and gradients (which they must be close
    to; no gradients for paged K/V)."""
    q, k, v, do = arrays
    options = dict(options, layout=layout)
    o, lse = _on_backend(tileattn.forward, backend, (q, k, v), return_lse=True, **lengths,
                         **options)
    as64 = [a.astype(np.float64) for a in arrays]
    golden_o, golden_lse = tileattn.forward(*as64[:3], return_lse=True, backend="reference",
                                            **lengths, **options)
    if "block_table" in lengths:
        return backend, o, None, golden_o, None
    grads = _on_backend(tileattn.backward, backend, (do, q, k, v, o, lse), **lengths,
                        **options)
    golden_grads = tileattn.backward(as64[3], *as64[:3], golden_o, golden_lse,
                                     backend="reference", **lengths, **options)
    return backend, o, grads, golden_o, golden_grads


def check_varlen_results(o, grads, expected, dtype=np.float32):
    """The adapter's results against tileattn's own call on the same backend, and the
    golden model. The CPU backend must be matched to the bit. On the GPU a call's kernel
    configuration follows its longest sequence, so a vmapped batch folded into one call
    may round differently from its elements' own calls: there both are held to the
    dtype's tolerance (the same one the golden model's comparison uses)."""
    backend, direct_o, direct_grads, golden_o, golden_grads = expected

    def same(actual, direct, name):
        if backend == "cpu":
            np.testing.assert_array_equal(actual, direct, err_msg=name)
        else:
            assert_attention_close(actual, direct, dtype, name=name)

    same(o, direct_o, "o")
    assert_attention_close(o, golden_o, dtype, name="o")
    if grads is None:
        return
    for name, grad, direct, want in zip("qkv", grads, direct_grads, golden_grads):
        same(grad, direct, f"d{name}")
        assert_attention_close(grad, want, dtype, name=f"d{name}")


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("family", ["padded", "packed", "paged"])
def test_torch_varlen_matches_tileattn_and_golden(family, layout):
    """Padded, packed and paged calls through the autograd op, lengths as int32 tensors:
    the o and gradients of tileattn.forward/backward with the same keywords."""
    torch = require("torch")
    from tileattn.torch import attention

    arrays, lengths = varlen_problem(family, layout)
    tensors = [torch.from_numpy(a).requires_grad_() for a in arrays[:3]]
    o = attention(*tensors, layout=layout, **{n: torch.from_numpy(a) for n, a in
                                              lengths.items()}, **VARLEN_OPTIONS)
    grads = None
    if family != "paged":
        o.backward(torch.from_numpy(arrays[3]))
        grads = [t.grad.numpy() for t in tensors]
    check_varlen_results(o.detach().numpy(), grads,
                         varlen_expected(arrays, lengths, VARLEN_OPTIONS, layout))


def test_torch_varlen_takes_lists_and_numpy_and_gives_no_length_gradient():
    torch = require("torch")
    from tileattn.torch import attention

    arrays, lengths = varlen_problem("padded")
    q, k, v = (torch.from_numpy(a).requires_grad_() for a in arrays[:3])
    o = attention(q, k, v, seqlens_q=lengths["seqlens_q"].tolist(),
                  seqlens_k=lengths["seqlens_k"], **VARLEN_OPTIONS)
    o.backward(torch.from_numpy(arrays[3]))
    check_varlen_results(o.detach().numpy(), [t.grad.numpy() for t in (q, k, v)],
                         varlen_expected(arrays, lengths, VARLEN_OPTIONS))
    with pytest.raises(TypeError, match="seqlens_q must have an integer dtype"):
        attention(q, k, v, seqlens_q=[1.0, 2.0])


@pytest.mark.parametrize("options, error, message", [
    (dict(scale="a"), TypeError, "scale must be a real number"),
    (dict(dropout_p=0.5), ValueError, "seed must be an int when dropout_p > 0"),
    (dict(window=3), ValueError, "window must be None or a pair"),
    (dict(window=(True, 1)), TypeError, "window left must be an int or None"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(block_q=0), ValueError, "block_q must be >= 1"),
    (dict(backend="tpu"), ValueError, "backend must be one of"),
    (dict(check_lengths=1), TypeError, "check_lengths must be a bool"),
    (dict(alibi_slopes=[[1.0, 2.0], [3.0]]), TypeError, "alibi_slopes must be an array of "
                                                        "numbers: setting an array element"),
])
def test_jax_adapter_rejects_bad_options_before_tracing(options, error, message):
    """tileattn.forward's own error, not JAX's runtime error around it from inside the
    callback (and the same after a valid call of the same shapes, which is remembered)."""
    require("jax")
    from tileattn.jax import attention

    q = np.ones((4, 8), np.float32)
    attention(q, q, q)
    with pytest.raises(error, match=message):
        attention(q, q, q, **options)


def test_jax_adapter_names_traced_slopes():
    """Options are static: ALiBi slopes traced under jit or vmap get a TypeError naming
    alibi_slopes (they reached NumPy's TracerArrayConversionError, naming nothing), and
    concrete JAX slopes are served."""
    jax = require("jax")
    from tileattn.jax import attention

    q = jax.numpy.asarray(numpy_problem((1, 2, 6, 8), (1, 2, 6, 8))[0])
    with pytest.raises(TypeError, match="alibi_slopes must be concrete .* got a traced value"):
        jax.jit(lambda q, s: attention(q, q, q, alibi_slopes=s))(q, jax.numpy.array([.1, .2]))
    with pytest.raises(TypeError, match="alibi_slopes must be concrete .* got a traced value"):
        jax.vmap(lambda s: attention(q, q, q, alibi_slopes=s))(jax.numpy.ones((3, 2)))
    slopes = np.array([0.1, 0.2])
    concrete = attention(q, q, q, alibi_slopes=jax.numpy.asarray(slopes))
    expected = tileattn.forward(*(np.asarray(q, np.float64),) * 3, alibi_slopes=slopes,
                                backend="reference")
    assert_attention_close(np.asarray(concrete), expected, np.float32)


def test_jax_adapter_rejects_bad_shapes_and_dtypes_before_tracing():
    jax = require("jax")
    from tileattn.jax import attention

    q = np.ones((4, 8), np.float32)
    with pytest.raises(TypeError, match="q must have a floating dtype"):
        attention(np.ones((4, 8), np.int32), q, q)
    kv = jax.numpy.ones((2, 8, 4))
    with pytest.raises(ValueError, match=r"Hq % Hkv == 0\), got Hq=3, Hkv=2"):
        jax.jit(attention)(jax.numpy.ones((3, 6, 4)), kv, kv)


def test_torch_adapter_names_an_input_that_is_not_a_tensor():
    """A NumPy array or a list among the tensors gets a TypeError naming it (it reached
    torch internals, whose message printed the whole array and named no argument)."""
    torch = require("torch")
    from tileattn.torch import attention

    q = torch.ones(4, 8)
    for args, name, kind in (((q, q.numpy(), q), "k", "numpy.ndarray"),
                             ((q.numpy(), q, q), "q", "numpy.ndarray"),
                             ((q, q, [[1.0] * 8] * 4), "v", "builtins.list")):
        with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor, got {kind}"):
            attention(*args)


@pytest.mark.parametrize("options, error, message", [
    (dict(window=4), ValueError, r"window must be None or a pair \(left, right\), got 4"),
    (dict(deterministic="no"), TypeError, "deterministic must be a bool, got 'no'"),
])
def test_torch_adapter_rejects_bad_options_in_the_forward(options, error, message):
    """tileattn.forward's error naming the argument, raised by the forward (not a conversion
    error, and not only once the backward runs)."""
    torch = require("torch")
    from tileattn.torch import attention

    q = torch.ones(1, 1, 4, 8, requires_grad=True)
    with pytest.raises(error, match=message):
        attention(q, q, q, **options)


def test_jax_adapter_names_an_unavailable_backend_before_tracing():
    """BackendUnavailableError naming the pip extra, as tileattn.forward raises it, not
    JAX's runtime error wrapped around it from inside the callback."""
    require("jax")
    from tileattn import backends
    from tileattn.jax import attention

    if backends.availability("gpu") is None:
        pytest.skip("a GPU is available here")
    q = np.ones((4, 8), np.float32)
    with pytest.raises(tileattn.BackendUnavailableError, match="backend='gpu'"):
        attention(q, q, q, backend="gpu")


def test_torch_paged_backward_raises_tileattn_error():
    torch = require("torch")
    from tileattn.torch import attention

    arrays, lengths = varlen_problem("paged")
    q, k, v = (torch.from_numpy(a).requires_grad_() for a in arrays[:3])
    o = attention(q, k, v, **lengths)
    with pytest.raises(ValueError, match="block_table is not accepted by backward"):
        o.sum().backward()


@pytest.mark.parametrize("family", ["padded", "packed", "paged"])
def test_torch_compile_fullgraph_varlen(family):
    """torch.compile(fullgraph=True) with length tensors as graph inputs: eager's results;
    new lengths of the same shape reuse the compiled graph."""
    torch = require("torch")
    from tileattn.torch import attention

    arrays, lengths = varlen_problem(family)
    names = sorted(lengths)

    def function(q, k, v, *length_tensors):
        return attention(q, k, v, **dict(zip(names, length_tensors)), **VARLEN_OPTIONS)

    def run(function):
        tensors = [torch.from_numpy(a).requires_grad_() for a in arrays[:3]]
        o = function(*tensors, *(torch.from_numpy(lengths[n]) for n in names))
        if family == "paged":
            return o.detach().numpy(), None
        o.backward(torch.from_numpy(arrays[3]))
        return o.detach().numpy(), [t.grad.numpy() for t in tensors]

    eager_o, eager_grads = run(function)
    check_varlen_results(eager_o, eager_grads, varlen_expected(arrays, lengths,
                                                                VARLEN_OPTIONS))
    for compile_backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        o, grads = run(torch.compile(function, fullgraph=True, backend=compile_backend))
        np.testing.assert_array_equal(o, eager_o, err_msg=compile_backend)
        for name, grad, want in zip("qkv", grads or (), eager_grads or ()):
            np.testing.assert_array_equal(grad, want, err_msg=f"{compile_backend} d{name}")


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("family", ["padded", "packed", "paged"])
def test_torch_library_opcheck_passes_with_lengths(family, layout):
    """opcheck of both ops with the length and table arguments. Paged K/V is checked on
    inputs that do not require grad only: opcheck's AOT test runs the backward, which
    refuses block_table by design."""
    torch = require("torch")
    import tileattn.torch  # noqa: F401  (registers torch.ops.tileattn)

    arrays, lengths = varlen_problem(family, layout)
    q, k, v, do = (torch.from_numpy(a) for a in arrays)
    do = torch.nan_to_num(do)
    options = (True, [4, -1], None, 3.0, None, 0.0, None, None, None, "auto", layout, True)
    keywords = {n: torch.from_numpy(a) for n, a in lengths.items()}
    o, lse = torch.ops.tileattn.forward(q, k, v, *options, **keywords)
    trainable = tuple(t.detach().requires_grad_() for t in (q, k, v))
    checks = [(torch.ops.tileattn.forward.default, (q, k, v) + options)]
    if family != "paged":
        checks += [(torch.ops.tileattn.forward.default, trainable + options),
                   (torch.ops.tileattn.backward.default, (do, q, k, v, o, lse) + options)]
    for op, args in checks:
        results = torch.library.opcheck(op, args, keywords)
        assert set(results.values()) == {"SUCCESS"}, results


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("family", ["padded", "packed", "paged"])
def test_jax_varlen_under_jit_matches_tileattn_and_golden(family, layout, jax_pass_kind):
    """Padded, packed and paged calls under jit, and jit(grad) for padded and packed: the
    o and gradients of tileattn.forward/backward with the same keywords."""
    jax = jax_pass_kind
    from tileattn.jax import attention

    arrays, lengths = varlen_problem(family, layout)
    q, k, v, do = arrays

    def call(q, k, v, lengths):
        return attention(q, k, v, layout=layout, **lengths, **VARLEN_OPTIONS)

    o = jax.jit(call)(q, k, v, lengths)
    grads = None
    if family != "paged":
        grads = jax.jit(jax.grad(lambda q, k, v, lengths: jax.numpy.sum(
            call(q, k, v, lengths) * do), argnums=(0, 1, 2)))(q, k, v, lengths)
        grads = [np.asarray(g) for g in grads]
    check_varlen_results(np.asarray(o), grads,
                         varlen_expected(arrays, lengths, VARLEN_OPTIONS, layout,
                                         _jax_backend()))


def test_jax_lengths_are_traced_operands_without_gradient():
    """New lengths of the same shape reuse the jitted function (no retrace); their
    gradient, where asked for, is float0 (integers have no cotangent space)."""
    jax = require("jax")
    from tileattn.jax import attention

    traces = []

    @jax.jit
    def loss(q, k, v, seqlens_q, seqlens_k):
        traces.append(1)
        return jax.numpy.sum(attention(q, k, v, seqlens_q=seqlens_q, seqlens_k=seqlens_k,
                                       **VARLEN_OPTIONS) * do)

    for lengths in (dict(seqlens_q=[12, 5], seqlens_k=[4, 10]),
                    dict(seqlens_q=[0, 12], seqlens_k=[10, 1])):
        arrays, lengths = varlen_problem("padded", lengths=lengths)
        q, k, v, do = arrays
        grads = jax.grad(loss, argnums=(0, 1, 2, 3), allow_int=True)(
            q, k, v, lengths["seqlens_q"], lengths["seqlens_k"])
        assert grads[3].dtype == jax.dtypes.float0 and grads[3].shape == (2,)
        check_varlen_results(np.asarray(attention(q, k, v, **lengths, **VARLEN_OPTIONS)),
                             [np.asarray(g) for g in grads[:3]],
                             varlen_expected(arrays, lengths, VARLEN_OPTIONS,
                                             backend=_jax_backend()))
    assert len(traces) == 1


def test_jax_paged_grad_raises_tileattn_error_and_combinations_are_checked():
    jax = require("jax")
    from tileattn.jax import attention

    arrays, lengths = varlen_problem("paged")
    q, k, v, _ = arrays
    with pytest.raises(ValueError, match="block_table is not accepted by backward"):
        jax.grad(lambda q: jax.numpy.sum(attention(q, k, v, **lengths)))(q)
    with pytest.raises(ValueError, match="seqlens_k must be given with block_table"):
        attention(q, k, v, block_table=lengths["block_table"])
    with pytest.raises(TypeError, match="seqlens_k must have an integer dtype"):
        attention(q, k, v, block_table=lengths["block_table"], seqlens_k=[1.0, 2.0])


VMAP_LENGTHS = {
    "padded": [dict(seqlens_q=[12, 5], seqlens_k=[4, 10]),
               dict(seqlens_q=[3, 0], seqlens_k=[10, 0]),
               dict(seqlens_q=[7, 12], seqlens_k=[1, 6])],
    "packed": [dict(cu_seqlens_q=[0, 5, 5, 20], cu_seqlens_k=[0, 9, 12, 23]),
               dict(cu_seqlens_q=[0, 0, 19, 20], cu_seqlens_k=[0, 20, 20, 23]),
               dict(cu_seqlens_q=[0, 10, 15, 20], cu_seqlens_k=[0, 3, 13, 23])],
    "paged": [dict(block_table=[[2, 0, 4], [1, 3, -1]], seqlens_k=[11, 6]),
              dict(block_table=[[4, -1, -1], [0, 1, 2]], seqlens_k=[3, 12]),
              dict(block_table=[[3, 3, 3], [-1, -1, -1]], seqlens_k=[9, 0])],
}


@pytest.mark.parametrize("family", ["padded", "packed", "paged"])
def test_jax_vmap_over_lengths_equals_the_loop(family, jax_pass_kind):
    """vmap over the arrays and their lengths (``(3, *batch)`` lengths; packed
    ``(3, S + 1)``; paged tables ``(3, *batch, max_pages)`` over one shared page pool):
    each element's o and gradients are those of its own tileattn call."""
    jax = jax_pass_kind
    from tileattn.jax import attention

    problems = [varlen_problem(family, seed=20 + index, lengths=lengths)
                for index, lengths in enumerate(VMAP_LENGTHS[family])]
    names = sorted(problems[0][1])
    q, k, v, do = (np.stack([arrays[i] for arrays, _ in problems]) for i in range(4))
    lengths = [np.stack([given[n] for _, given in problems]) for n in names]
    if family == "paged":  # one pool for every element
        k, v = problems[0][0][1], problems[0][0][2]
        problems = [((arrays[0], k, v, arrays[3]), given) for arrays, given in problems]

    def call(q, k, v, *lengths):
        return attention(q, k, v, **dict(zip(names, lengths)), **VARLEN_OPTIONS)

    kv_axis = None if family == "paged" else 0
    in_axes = (0, kv_axis, kv_axis) + (0,) * len(names)
    o = jax.jit(jax.vmap(call, in_axes=in_axes))(q, k, v, *lengths)
    grads = None
    if family != "paged":
        grads = jax.jit(jax.vmap(jax.grad(
            lambda q, k, v, do, *lengths: jax.numpy.sum(call(q, k, v, *lengths) * do),
            argnums=(0, 1, 2)), in_axes=in_axes[:3] + (0,) + in_axes[3:]))(
                q, k, v, do, *lengths)
    for index, (arrays, given) in enumerate(problems):
        check_varlen_results(np.asarray(o[index]),
                             None if grads is None else [np.asarray(g[index]) for g in grads],
                             varlen_expected(arrays, given, VARLEN_OPTIONS,
                                             backend=_jax_backend()))


def test_jax_vmap_over_lengths_alone(jax_pass_kind):
    """Only the lengths vmapped (arrays shared): broadcast_all hands the callback the
    arrays with the vmapped axis, one call for the whole vmapped batch."""
    jax = jax_pass_kind
    from tileattn.jax import attention

    arrays, _ = varlen_problem("padded", lengths=dict(seqlens_q=[0, 0], seqlens_k=[0, 0]))
    arrays = [np.nan_to_num(a) for a in arrays]
    seqlens_q = np.array([[12, 5], [3, 0], [7, 12]], np.int32)
    seqlens_k = np.array([4, 10], np.int32)
    o = jax.vmap(lambda lengths: attention(*arrays[:3], seqlens_q=lengths,
                                           seqlens_k=seqlens_k, **VARLEN_OPTIONS))(seqlens_q)
    for index in range(3):
        given = dict(seqlens_q=seqlens_q[index], seqlens_k=seqlens_k)
        check_varlen_results(np.asarray(o[index]), None,
                             varlen_expected(arrays, given, VARLEN_OPTIONS,
                                             backend=_jax_backend()))


def test_jax_vmap_over_single_head_queries_with_lengths(jax_pass_kind):
    """(N, D) queries with scalar lengths, vmapped: the inserted head axis leaves the
    vmapped axis as the batch, whose lengths are the vmapped scalars."""
    jax = jax_pass_kind
    from tileattn.jax import attention

    rng = np.random.default_rng(13)
    q = rng.standard_normal((3, 12, 8)).astype(np.float32)
    k, v = (rng.standard_normal((10, 8)).astype(np.float32) for _ in range(2))
    seqlens_q = np.array([5, 0, 12], np.int32)
    o = jax.vmap(lambda q, length: attention(q, k, v, seqlens_q=length, seqlens_k=4,
                                             causal=True))(q, seqlens_q)
    for index in range(3):
        given = dict(seqlens_q=seqlens_q[index], seqlens_k=np.int32(4))
        check_varlen_results(np.asarray(o[index]), None,
                             varlen_expected((q[index], k, v, q[index]), given,
                                             dict(causal=True), backend=_jax_backend()))
