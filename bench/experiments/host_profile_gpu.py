"""Where the host time of a small GPU call goes: the direct API, the JAX adapter and the
torch adapter, each timed per call and profiled.

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 bench/experiments/host_profile_gpu.py

A tiny problem (B 1, H 1, N 128, D 64, float16, causal), calls queued back to back and the
device synchronised once, so every figure is host microseconds per call. For the JAX
adapter the floors are timed too: a jitted elementwise op and a jitted buffer_callback that
does nothing; the adapter's callback body is timed on its own (perf_counter inside it).
"decode" times (back to back, and each call alone on an idle device: the host's own time)
and profiles a server's decode step (B 8, Hq 32 / Hkv 8, one query row, 4k
keys a sequence, float16) dense, with seqlens_k on the device (unchecked) and paged (pages
of 16 in a pool, block table and lengths on the device, unchecked); "prefill" the same for
a small causal append (B 4, H 16, 64 new rows onto 576 keys, pages of 64), whose host path
is a paged prefill's, and with tables from the host; "packed" the host time of one call of
bench_gpu_varlen.py's packed batch on an idle device.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import threading
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import cupy
import numpy as np

import tileattn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from paged_pools import page_pool  # noqa: E402

SHAPE = (1, 1, 128, 64)


def per_call_us(function, sync, calls: int = 1000) -> float:
    function()
    function()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        function()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def say(name: str, us: float) -> None:
    print(f"{name:60s} {us:8.1f} us", flush=True)


def profile(name: str, function, calls: int = 300, lines: int = 25) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        function()
    profiler.disable()
    show(name, pstats.Stats(profiler), lines)


def show(name: str, stats, lines: int = 25) -> None:
    print(f"\n== cProfile: {name}", flush=True)
    text = io.StringIO()
    stats.stream = text
    for order in ("tottime", "cumulative"):
        stats.sort_stats(order).print_stats(lines)
    print(text.getvalue()[-14000:], flush=True)


def cupy_sync() -> None:
    cupy.cuda.Device().synchronize()


def direct(arrays) -> None:
    q, k, v, do = arrays
    o, lse = tileattn.forward(q, k, v, causal=True, return_lse=True)
    say("direct forward", per_call_us(lambda: tileattn.forward(q, k, v, causal=True), cupy_sync))
    say("direct forward, return_lse",
        per_call_us(lambda: tileattn.forward(q, k, v, causal=True, return_lse=True), cupy_sync))
    say("direct backward", per_call_us(
        lambda: tileattn.backward(do, q, k, v, o, lse, causal=True), cupy_sync))
    say("cupy.empty", per_call_us(lambda: cupy.empty(SHAPE, cupy.float16), cupy_sync))
    say("cupy.cuda.get_current_stream()", per_call_us(cupy.cuda.get_current_stream, cupy_sync))
    result = {}

    def on_thread():
        result["us"] = per_call_us(lambda: tileattn.backward(do, q, k, v, o, lse, causal=True),
                                   cupy_sync, 300)
    thread = threading.Thread(target=on_thread)
    thread.start()
    thread.join()
    say("direct backward from a new thread", result.get("us", float("nan")))
    profile("direct forward", lambda: tileattn.forward(q, k, v, causal=True))
    profile("direct backward", lambda: tileattn.backward(do, q, k, v, o, lse, causal=True))


def decode(_arrays) -> None:
    server_calls("decode", batch=8, n_q_heads=32, n_kv_heads=8, n_q=1, n_k=4096, page=16,
                 causal=False)


def prefill(_arrays) -> None:
    server_calls("prefill", batch=4, n_q_heads=16, n_kv_heads=16, n_q=64, n_k=576, page=64,
                 causal=True)


def packed(_arrays) -> None:
    """bench_gpu_varlen.py's packed batch (32 sequences of 128-8192 tokens, seeded, H 16,
    D 128, float16, causal, cu_seqlens on the host): the host's time of one call, the
    device idle before it (its kernels take ~10 ms, so calls cannot be queued)."""
    lengths = np.random.default_rng(0).integers(128, 8193, size=32)
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    rng = cupy.random.default_rng(0)
    q, k, v = (rng.standard_normal((16, int(cu_seqlens[-1]), 128), dtype=cupy.float32)
               .astype(cupy.float16) for _ in range(3))
    device_cu = cupy.asarray(cu_seqlens)
    calls = {
        "packed, host cu_seqlens": lambda: tileattn.forward(
            q, k, v, causal=True, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens),
        "packed, device cu_seqlens": lambda: tileattn.forward(
            q, k, v, causal=True, cu_seqlens_q=device_cu, cu_seqlens_k=device_cu),
        "one dense sequence": lambda: tileattn.forward(q[None], k[None], v[None],
                                                       causal=True),
    }
    for name, call in calls.items():
        say(f"{name} (host time, idle device)", host_only_us(call))
    for name, call in calls.items():
        profile(name, call, calls=20)


def host_only_us(function, calls: int = 20) -> float:
    """Median host microseconds of `function` started on an idle device."""
    times = []
    for _ in range(calls + 2):
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    cupy.cuda.Device().synchronize()
    return 1e6 * float(np.median(times[2:]))


def server_calls(kind: str, batch: int, n_q_heads: int, n_kv_heads: int, n_q: int, n_k: int,
                 page: int, causal: bool, head_dim: int = 128) -> None:
    """One server step's host time, dense, with seqlens_k on the device and paged."""
    rng = cupy.random.default_rng(0)
    q = rng.standard_normal((batch, n_q_heads, n_q, head_dim), dtype=cupy.float32).astype(
        cupy.float16)
    k, v = (rng.standard_normal((batch, n_kv_heads, n_k, head_dim), dtype=cupy.float32)
            .astype(cupy.float16) for _ in range(2))
    (k_pool, table), (v_pool, _) = (page_pool(x, [n_k] * batch, page, np.random.default_rng(0))
                                    for x in (k, v))
    pool = (k_pool, v_pool)
    seqlens_k = cupy.full(batch, n_k, dtype=cupy.int32)
    host_table, host_lengths = cupy.asnumpy(table), cupy.asnumpy(seqlens_k)
    calls = {
        f"{kind} dense": lambda: tileattn.forward(q, k, v, causal=causal),
        f"{kind} seqlens_k (device, unchecked)":
            lambda: tileattn.forward(q, k, v, causal=causal, seqlens_k=seqlens_k,
                                     check_lengths=False),
        f"{kind} paged (device tables, unchecked)":
            lambda: tileattn.forward(q, pool[0], pool[1], causal=causal, block_table=table,
                                     seqlens_k=seqlens_k, check_lengths=False),
        f"{kind} paged (host tables, unchecked)":
            lambda: tileattn.forward(q, pool[0], pool[1], causal=causal,
                                     block_table=host_table, seqlens_k=host_lengths,
                                     check_lengths=False),
    }
    for name, call in calls.items():
        say(name, per_call_us(call, cupy_sync))
    # Back to back, a call that queues more device time than host time is timed by the
    # device (the launch queue fills): the host's own time, each call on an idle device.
    for name, call in calls.items():
        say(f"{name} (host time, idle device)", host_only_us(call, calls=200))
    # The same calls' host time by part: validation (problem_cache.validate_call), the GPU
    # backend's forward (plan lookup, table fill, launches) and the rest.
    import tileattn.api as api
    spent = {}

    def timed(part, function):
        def wrapper(*args, **keywords):
            start = time.perf_counter()
            try:
                return function(*args, **keywords)
            finally:
                spent[part] = spent.get(part, 0.0) + time.perf_counter() - start
        return wrapper
    import tileattn.gpu as gpu_backend
    import tileattn.gpu.launch_forward as launch_forward
    import tileattn.gpu.operands as operands
    import tileattn.gpu.varlen as varlen
    import tileattn.problem_cache as problem_cache
    originals = api.validate_call, gpu_backend.forward
    api.validate_call = timed("validate", originals[0])
    gpu_backend.forward = timed("gpu forward", originals[1])
    # Finer parts (nested in the two above; each wrapper adds ~0.3 us to its part).
    finer = [(problem_cache, "_lengths_signature"), (problem_cache, "with_lengths"),
             (problem_cache, "backend_views"), (launch_forward, "_outputs"),
             (launch_forward, "forward_plan_key"), (launch_forward, "cached"),
             (varlen.DeviceTables, "fill"), (varlen.DeviceTables, "_inputs"),
             (operands.Launch, "__call__")]
    kept = [(owner, name, owner.__dict__[name]) for owner, name in finer]
    for owner, name, function in kept:
        wrapped = function.__func__ if isinstance(function, staticmethod) else function
        wrapper = timed(name, wrapped)
        setattr(owner, name, staticmethod(wrapper) if isinstance(function, staticmethod)
                else wrapper)
    try:
        for name, call in calls.items():
            spent.clear()
            total = per_call_us(call, cupy_sync, 1000)
            parts = ", ".join(f"{part} {1e6 * seconds / 1002:.1f}" for part, seconds in
                              spent.items())
            print(f"{name}: {total:.1f} us a call, of which {parts} us", flush=True)
    finally:
        api.validate_call, gpu_backend.forward = originals
        for owner, name, function in kept:
            setattr(owner, name, function)
    for name, call in calls.items():
        profile(name, call)


def jax_part(host) -> None:
    import jax
    import jax.numpy as jnp
    from jax.experimental.buffer_callback import buffer_callback

    import tileattn.jax as tjax

    q, k, v, do = (jnp.asarray(a) for a in host)
    block = jax.block_until_ready
    plus = jax.jit(lambda x: x + 1)
    say("jax: jitted x + 1", per_call_us(lambda: plus(q), lambda: block(plus(q))))
    nothing = buffer_callback(lambda context, out, x: None,
                              jax.ShapeDtypeStruct(q.shape, q.dtype))
    empty_callback = jax.jit(lambda x: nothing(x))
    say("jax: jitted buffer_callback doing nothing",
        per_call_us(lambda: empty_callback(q), lambda: block(empty_callback(q))))
    inside = []
    original = tjax._BufferCallback.__call__

    def timed_body(*args):
        start = time.perf_counter()
        try:
            return original(*args)
        finally:
            inside.append(time.perf_counter() - start)
    tjax._BufferCallback.__call__ = timed_body
    for layout in ("bhsd", "bshd"):
        attend = jax.jit(lambda q, k, v, layout=layout: tjax.attention(q, k, v, causal=True,
                                                                        layout=layout))
        inside.clear()
        say(f"jax adapter forward ({layout})", per_call_us(lambda: attend(q, k, v),
                                                           lambda: block(attend(q, k, v))))
        say("  of which the callback body (median)", float(np.median(inside)) * 1e6)
        step = jax.jit(lambda q, k, v, do, layout=layout: jax.vjp(
            lambda *a: tjax.attention(*a, causal=True, layout=layout), q, k, v)[1](do))
        inside.clear()
        say(f"jax adapter forward + backward ({layout})",
            per_call_us(lambda: step(q, k, v, do), lambda: block(step(q, k, v, do)), 500))
        say("  of which callback bodies (median per body)", float(np.median(inside)) * 1e6)
    profiles = []

    def profiled_body(*args):
        profiler = cProfile.Profile()
        profiler.enable()
        try:
            return original(*args)
        finally:
            profiler.disable()
            profiles.append(profiler)
    tjax._BufferCallback.__call__ = profiled_body
    attend = jax.jit(lambda q, k, v: tjax.attention(q, k, v, causal=True, scale=0.5))
    for _ in range(300):
        attend(q, k, v)
    block(attend(q, k, v))
    tjax._BufferCallback.__call__ = original
    show("jax callback body (forward)", pstats.Stats(*profiles))
    profile("jax adapter forward, caller's thread", lambda: attend(q, k, v))


def torch_part(arrays) -> None:
    import torch

    import tileattn.torch as tt

    q, k, v, do = (torch.as_tensor(a, device="cuda") for a in arrays)
    sync = torch.cuda.synchronize
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    with torch.no_grad():
        say("torch adapter forward, no grad",
            per_call_us(lambda: tt.attention(q, k, v, causal=True), sync))
    say("torch adapter forward, grad", per_call_us(lambda: tt.attention(qg, kg, vg, causal=True),
                                                   sync))

    def step():
        tt.attention(qg, kg, vg, causal=True).backward(do)
    say("torch adapter forward + backward", per_call_us(step, sync, 300))
    say("torch SDPA forward + backward", per_call_us(
        lambda: torch.nn.functional.scaled_dot_product_attention(
            qg, kg, vg, is_causal=True).backward(do), sync, 300))
    inside = []
    original = tt._EagerAttention.backward

    def timed_backward(ctx, grad):
        start = time.perf_counter()
        try:
            return original(ctx, grad)
        finally:
            inside.append(time.perf_counter() - start)
    tt._EagerAttention.backward = staticmethod(timed_backward)
    say("torch adapter forward + backward, timed", per_call_us(step, sync, 300))
    say("  of which _EagerAttention.backward (median)", float(np.median(inside)) * 1e6)
    profiles = []

    def profiled_backward(ctx, grad):
        profiler = cProfile.Profile()
        profiler.enable()
        try:
            return original(ctx, grad)
        finally:
            profiler.disable()
            profiles.append(profiler)
    tt._EagerAttention.backward = staticmethod(profiled_backward)
    for _ in range(200):
        step()
    sync()
    tt._EagerAttention.backward = staticmethod(original)
    show("torch adapter backward (autograd's thread)", pstats.Stats(*profiles))
    profile("torch adapter forward with grad", lambda: tt.attention(qg, kg, vg, causal=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parts = ("direct", "jax", "torch", "decode", "prefill", "packed")
    parser.add_argument("--only", choices=parts, nargs="*", default=parts)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(SHAPE).astype(np.float16) for _ in range(4)]
    arrays = [cupy.asarray(a) for a in host]
    for name, part, given in (("direct", direct, arrays), ("jax", jax_part, host),
                              ("torch", torch_part, arrays), ("decode", decode, arrays),
                              ("prefill", prefill, arrays), ("packed", packed, arrays)):
        if name in args.only:
            part(given)


if __name__ == "__main__":
    main()
