"""Where a decode step's host time goes: each layer of a `tileattn.forward` call timed alone.

    PYTHONPATH=. python3 bench/experiments/overhead_breakdown_gpu.py

A tiny decode step (B 1, Hq 8, Hkv 1, Nq 1, Nk 512, D 64, float16: the split-KV kernel and
its merge), calls queued back to back and the device synchronised once, so each figure is
host microseconds per call: the whole call, validation (and the remembered problem of a
repeated signature), the backend call, the cached launches, one launch, output
allocation, CuPy's device and stream lookups, and a bare kernel launch with as many
arguments as the decode kernel's and with two.
"""

from __future__ import annotations

import cupy
import numpy as np

import tileattn
from tileattn import gpu
from tileattn.gpu import launch_forward
from tileattn.gpu.operands import cached, contiguous_strides, forward_plan_key
from tileattn.problem_cache import validate_call
from tileattn.validation import validate

from overhead_gpu import per_call_us  # noqa: E402  (this folder, first on sys.path)


def say(name: str, us: float) -> None:
    print(f"{name:56s} {us:7.1f} us", flush=True)


_EMPTY = cupy.RawKernel(r'''
extern "C" __global__ void many(const float* a, const float* b, const float* c, float* d,
    float* e, float* f, float* g, long long n0, long long n1, int i0, int i1, int i2,
    long long s0, long long s1, long long s2, long long s3, long long s4, long long s5,
    long long s6, long long s7, long long s8, float x0, float x1, long long w0, long long w1,
    long long w2, unsigned u0, unsigned u1, float x2, unsigned u2, unsigned u3,
    const long long* t0, const long long* t1, const long long* t2, long long w3,
    long long w4, long long w5) {}
extern "C" __global__ void two(const float* a, float* b) {}
''', "many")


def main() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (cupy.asarray(rng.standard_normal(s).astype(np.float16))
               for s in ((1, 8, 1, 64), (1, 1, 512, 64), (1, 1, 512, 64)))
    problem = validate(q, k, v, causal=False, window=None, scale=None, softcap=None,
                       alibi_slopes=None, dropout_p=0.0, seed=None, block_q=None,
                       block_k=None, deterministic=True, layout="bhsd",
                       outputs={"out": None, "lse_out": None}, varlen=None,
                       check_lengths=True)
    options = problem.options
    print("kernel:", launch_forward.choose(q, k, v, options).tiles)
    say("tileattn.forward", per_call_us(lambda: tileattn.forward(q, k, v)))
    say("validate", per_call_us(lambda: validate(
        q, k, v, causal=False, window=None, scale=None, softcap=None, alibi_slopes=None,
        dropout_p=0.0, seed=None, block_q=None, block_k=None, deterministic=True,
        layout="bhsd", outputs={"out": None, "lse_out": None}, varlen=None,
        check_lengths=True)))
    say("validate_call (remembered signature)", per_call_us(lambda: validate_call(
        q, k, v, causal=False, window=None, scale=None, softcap=None, alibi_slopes=None,
        dropout_p=0.0, seed=None, block_q=None, block_k=None, deterministic=True,
        layout="bhsd", outputs={"out": None, "lse_out": None}, varlen=None,
        check_lengths=True)))
    say("api.run_forward (after validation)",
        per_call_us(lambda: tileattn.api.run_forward(problem, "gpu")))
    say("gpu.forward (backend, with q.device)", per_call_us(lambda: gpu.forward(q, k, v, options)))
    say("launch_forward.forward", per_call_us(lambda: launch_forward.forward(q, k, v, options)))
    o_strides = contiguous_strides((1, 8, 1, 64), 2)
    key = forward_plan_key(options, q, k, v, o_strides)
    say("plan_key", per_call_us(lambda: forward_plan_key(options, q, k, v, o_strides)))
    say("cached", per_call_us(lambda: cached(key, q, k, v)))
    launch = cached(key, q, k, v)[0]
    o = cupy.empty((1, 8, 1, 64), np.float16)
    lse = cupy.empty((1, 8, 1), np.float32)
    say("the cached launches (decode + merge)", per_call_us(lambda: launch(q, k, v, o, lse)))
    scratch = launch.scratch()
    say("decode launch alone", per_call_us(lambda: launch.decode(q, k, v, o, lse, *scratch)))
    say("scratch (partials, counters)", per_call_us(launch.scratch))
    if launch.merge is not None:
        po, pl = scratch[:2]
        say("merge launch alone", per_call_us(lambda: launch.merge(po, pl, o, lse)))
    say("two cupy.empty", per_call_us(lambda: (cupy.empty((1, 8, 1, 64), np.float16),
                                               cupy.empty((1, 8, 1), np.float32))))

    def device_context():
        with q.device:
            pass
    say("with q.device", per_call_us(device_context))
    say("cupy.cuda.Device().id", per_call_us(lambda: cupy.cuda.Device().id))
    say("get_current_stream().ptr", per_call_us(lambda: cupy.cuda.get_current_stream().ptr))
    a = cupy.zeros(4, np.float32)
    t = cupy.zeros(4, np.int64)
    args = ((a,) * 7 + (np.int64(1), np.int64(1), np.int32(1), np.int32(1), np.int32(1))
            + (np.int64(1),) * 9 + (np.float32(1), np.float32(1)) + (np.int64(1),) * 3
            + (np.uint32(1), np.uint32(1), np.float32(1), np.uint32(1), np.uint32(1))
            + (t, t, t) + (np.int64(1),) * 3)
    say("bare launch, 40 arguments", per_call_us(lambda: _EMPTY((1,), (32,), args)))
    two = cupy.RawKernel(_EMPTY.code, "two")
    say("bare launch, 2 arguments", per_call_us(lambda: two((1,), (32,), (a, a))))

if __name__ == "__main__":
    main()
