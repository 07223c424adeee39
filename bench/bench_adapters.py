"""The framework adapters on the GPU: exactness per adapter and mode, and what they cost.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/bench_adapters.py [--quick]

1. Exactness: `tileattn.jax.attention` under jit, vmap and jit(grad), and
   `tileattn.torch.attention` eager, under ``torch.compile(fullgraph=True)`` and on a
   non-default torch stream, in float16, bfloat16 and float32, against the float64 golden
   model. Each entry is the largest error as a multiple of the dtype's tolerance
   (`tileattn.testing.attention_error`; <= 1 passes), worst over o and the gradients.
2. Overhead: microseconds per call of a tiny problem (B 1, H 1, N 128, D 64), in both
   layouts, through each adapter, minus the same call made directly on CuPy arrays with
   `tileattn.forward`; calls are queued back to back and the device synchronised once, so
   the figure is host time.
3. Speed on FlashAttention's shapes (batch * N = 16k tokens, hidden 2048, "bshd" layout),
   forward and forward+backward (`jax.vjp`), per call, back to back: the JAX adapter, a
   direct CuPy call of tileattn on the same shape (the kernels' own time), and
   `jax.nn.dot_product_attention` with ``implementation="cudnn"`` and XLA's default.
   FLOP/s use FlashAttention's count (forward 4 B H N^2 D, halved for causal; backward 2.5x).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import cupy
import jax
import jax.numpy as jnp
import numpy as np

import tileattn
import tileattn.jax as tjax
from tileattn.options import UNLIMITED, AttentionOptions
from tileattn.reference import dense_backward, dense_forward
from tileattn.testing import attention_error

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import _to_dtype

DTYPES = ("float16", "bfloat16", "float32")


def say(*parts) -> None:
    print(*parts, flush=True)


# --------------------------------------------------------------------------- exactness


def _golden(q, k, v, do, causal: bool):
    """o and (dq, dk, dv) in float64 for "bshd" host arrays (the golden model is "bhsd")."""
    def bhsd(a):
        return np.swapaxes(np.asarray(a, dtype=np.float64), 1, 2)
    options = AttentionOptions(causal=causal, window_right=0 if causal else UNLIMITED,
                               scale=1.0 / np.sqrt(q.shape[-1]))
    o, _ = dense_forward(bhsd(q), bhsd(k), bhsd(v), options)
    grads = dense_backward(bhsd(do), bhsd(q), bhsd(k), bhsd(v), o, options)
    return np.swapaxes(o, 1, 2), tuple(np.swapaxes(g, 1, 2) for g in grads)


def _host_inputs(dtype: str, shape=(2, 256, 4, 64), seed=0):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(shape).astype(np.float32) for _ in range(4)]
    return [jnp.asarray(a).astype(dtype) for a in arrays]


def _to_host(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


def _worst(dtype, results, golden):
    o, grads = results
    want_o, want_grads = golden
    errors = [attention_error(_to_host(o), want_o, dtype)]
    errors += [attention_error(_to_host(g), w, dtype) for g, w in zip(grads, want_grads)]
    return max(errors)


def jax_exactness(dtype: str, causal: bool = True) -> dict:
    q, k, v, do = _host_inputs(dtype)
    golden = _golden(*(_to_host(a) for a in (q, k, v, do)), causal)

    def attend(q, k, v):
        return tjax.attention(q, k, v, causal=causal, layout="bshd")

    def forward_and_vjp(function, q, k, v, do):
        o, pullback = jax.vjp(function, q, k, v)
        return o, pullback(do.astype(o.dtype))

    jitted = jax.jit(lambda *a: forward_and_vjp(attend, *a))
    # vmap over the batch axis: each element a (N, H, D) problem, one tileattn call in all
    vmapped = jax.jit(jax.vmap(lambda *a: forward_and_vjp(attend, *a)))
    grad = jax.jit(jax.grad(lambda q, k, v, do: jnp.sum(attend(q, k, v).astype(jnp.float32)
                                                          * do.astype(jnp.float32)),
                            argnums=(0, 1, 2)))
    results = {"jit": _worst(dtype, jitted(q, k, v, do), golden),
               "vmap": _worst(dtype, vmapped(q, k, v, do), golden)}
    o = jax.jit(attend)(q, k, v)
    results["jit(grad)"] = _worst(dtype, (o, grad(q, k, v, do)), golden)
    return results


def torch_exactness(dtype: str, causal: bool = True) -> dict:
    import torch

    import tileattn.torch as ttorch

    q, k, v, do = (torch.from_dlpack(cupy.asarray(_to_host(a)))
                   for a in _host_inputs("float32"))
    q, k, v, do = (t.to(getattr(torch, dtype)) for t in (q, k, v, do))
    golden = _golden(*(t.float().cpu().numpy() for t in (q, k, v, do)), causal)

    def attend(q, k, v):
        return ttorch.attention(q, k, v, causal=causal, layout="bshd")

    def run(function):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o = function(*leaves)
        o.backward(do)
        return o.detach(), tuple(t.grad for t in leaves)

    def as_numpy(results):
        o, grads = results
        return (o.float().cpu().numpy(), tuple(g.float().cpu().numpy() for g in grads))

    results = {"eager": _worst(dtype, as_numpy(run(attend)), golden)}
    compiled = torch.compile(attend, fullgraph=True)
    results["compile"] = _worst(dtype, as_numpy(run(compiled)), golden)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        side = as_numpy(run(attend))
    stream.synchronize()
    results["side stream"] = _worst(dtype, side, golden)
    return results


# --------------------------------------------------------------------------- timing


def per_call_ms(function, block, repetitions: int, rounds: int = 3) -> float:
    """Milliseconds per call of `repetitions` calls queued back to back, `block` waiting for
    the last; the median of `rounds`."""
    block(function())
    block(function())
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repetitions - 1):
            function()
        block(function())
        times.append((time.perf_counter() - start) * 1e3 / repetitions)
    return statistics.median(times)


def _block_jax(result):
    jax.block_until_ready(result)


def _block_cupy(_result):
    cupy.cuda.Device().synchronize()


def overhead_us() -> dict:
    """Per-call microseconds of the tiny problem in both layouts (results written in place
    into XLA's buffers, in the caller's layout)."""
    results = {}
    for layout in ("bhsd", "bshd"):
        shape = (1, 1, 128, 64) if layout == "bhsd" else (1, 128, 1, 64)
        q, k, v, _ = _host_inputs("float16", shape)
        cq, ck, cv = (cupy.asarray(_to_host(a)).astype(cupy.float16) for a in (q, k, v))
        direct = per_call_ms(lambda: tileattn.forward(cq, ck, cv, layout=layout),
                             _block_cupy, 2000)
        jitted = jax.jit(lambda q, k, v: tjax.attention(q, k, v, layout=layout))
        through_jax = per_call_ms(lambda: jitted(q, k, v), _block_jax, 2000)
        results.update({f"{layout}: direct CuPy call (us)": direct * 1e3,
                        f"{layout}: JAX adapter (us)": through_jax * 1e3,
                        f"{layout}: JAX overhead (us)": (through_jax - direct) * 1e3})
        try:
            import torch

            import tileattn.torch as ttorch
        except ImportError:
            continue
        tq, tk, tv = (torch.from_dlpack(a) for a in (cq, ck, cv))
        through_torch = per_call_ms(lambda: ttorch.attention(tq, tk, tv, layout=layout),
                                    lambda _: torch.cuda.synchronize(), 2000)
        results[f"{layout}: torch adapter (us)"] = through_torch * 1e3
        results[f"{layout}: torch overhead (us)"] = (through_torch - direct) * 1e3
    return results


def speed_rows(dtype: str, head_dim: int, length: int, causal: bool):
    heads, batch = 2048 // head_dim, max(1, 16384 // length)
    shape = (batch, length, heads, head_dim)
    q, k, v, do = _host_inputs(dtype, shape, seed=1)
    forward_flops = 4 * batch * heads * length * length * head_dim / (2 if causal else 1)
    functions = {
        "tileattn.jax": lambda q, k, v: tjax.attention(q, k, v, causal=causal, layout="bshd"),
        "jax cudnn": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"),
        "jax xla": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="xla"),
    }
    repetitions = max(3, min(50, int(2e13 / forward_flops)))
    times = {}
    for name, function in functions.items():
        if name == "jax xla" and batch * heads * length * length * 4 > 8e9:
            continue  # XLA's default materialises the scores: skip what would not fit
        try:
            fwd = jax.jit(function)
            both = jax.jit(lambda q, k, v, do, f=function: jax.vjp(f, q, k, v)[1](do))
            times[name] = (
                per_call_ms(lambda fwd=fwd: fwd(q, k, v), _block_jax, repetitions),
                per_call_ms(lambda both=both: both(q, k, v, do), _block_jax, repetitions))
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as error:  # cuDNN refuses some shapes/dtypes: say so and go on
            say(f"  {name} failed at {shape} {dtype}: {type(error).__name__}: "
                f"{str(error).splitlines()[0][:120]}")
    cq, ck, cv, cdo = (_to_dtype(cupy.asarray(_to_host(a)), dtype) for a in (q, k, v, do))

    def direct_both():
        o, lse = tileattn.forward(cq, ck, cv, causal=causal, layout="bshd", return_lse=True)
        return tileattn.backward(cdo, cq, ck, cv, o, lse, causal=causal, layout="bshd")

    times["direct CuPy"] = (
        per_call_ms(lambda: tileattn.forward(cq, ck, cv, causal=causal, layout="bshd"),
                    _block_cupy, repetitions),
        per_call_ms(direct_both, _block_cupy, repetitions))
    return shape, forward_flops, times


def _cells(times: dict, key: str, index: int, ours: float) -> tuple[str, str]:
    """An anchor's time and its ratio to ours, or dashes where it did not run."""
    if key not in times:
        return "-", "-"
    value = times[key][index]
    return f"{value:.3f}", f"{value / ours:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="float16 and bfloat16 at N = 1k and 8k only")
    args = parser.parse_args()
    device = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    say(f"# device: {device.decode() if isinstance(device, bytes) else device}; "
        f"jax {jax.__version__}, cupy {cupy.__version__}")

    say("\n## Exactness (largest error / tolerance, worst of o, dq, dk, dv; <= 1 passes)\n")
    say("| adapter | mode | " + " | ".join(DTYPES) + " |")
    say("|---|---|" + "---|" * len(DTYPES))
    jax_results = {dtype: jax_exactness(dtype) for dtype in DTYPES}
    for mode in jax_results[DTYPES[0]]:
        say(f"| jax | {mode} | " + " | ".join(f"{jax_results[d][mode]:.3f}" for d in DTYPES)
            + " |")
    try:
        torch_results = {dtype: torch_exactness(dtype) for dtype in DTYPES}
        for mode in torch_results[DTYPES[0]]:
            say(f"| torch | {mode} | "
                + " | ".join(f"{torch_results[d][mode]:.3f}" for d in DTYPES) + " |")
    except ImportError:
        say("(torch not installed: no torch rows)")

    say("\n## Overhead per call (B 1, H 1, N 128, D 64, float16; back to back)\n")
    for name, value in overhead_us().items():
        say(f"- {name}: {value:.1f}")

    lengths = (1024, 8192) if args.quick else (512, 1024, 2048, 4096, 8192, 16384)
    say("\n## Speed, FlashAttention's shapes (ms per call; TFLOP/s; ratio = other / "
        "tileattn.jax time)\n")
    say("| dtype | D | N | causal | pass | tileattn.jax ms | TFLOP/s | direct CuPy ms | "
        "jax cudnn ms | cudnn / ours | jax xla ms | xla / ours |")
    say("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dtype in ("float16", "bfloat16"):
        for head_dim in (64, 128):
            for length in lengths:
                for causal in (False, True):
                    _, flops, times = speed_rows(dtype, head_dim, length, causal)
                    for index, name in enumerate(("fwd", "fwd+bwd")):
                        work = flops * (1 if index == 0 else 3.5)
                        ours = times["tileattn.jax"][index]
                        cudnn, cudnn_ratio = _cells(times, "jax cudnn", index, ours)
                        xla, xla_ratio = _cells(times, "jax xla", index, ours)
                        say(f"| {dtype} | {head_dim} | {length} | {causal} | {name} | "
                            f"{ours:.3f} | {work / ours / 1e9:.0f} | "
                            f"{times['direct CuPy'][index]:.3f} | {cudnn} | {cudnn_ratio} | "
                            f"{xla} | {xla_ratio} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
