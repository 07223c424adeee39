"""Where the torch adapter's host time goes on the GPU: each piece of a call timed alone.

    PYTHONPATH=. python3 bench/experiments/overhead_adapters_gpu.py

A tiny problem (B 1, H 1, N 128, D 64, float16, causal), calls queued back to back and the
device synchronised once, so every figure is host microseconds per call:

- tileattn.forward/backward on CuPy arrays (the floor the adapter adds to);
- the adapter's forward alone and forward + backward;
- its pieces: DLPack in and out, raw-pointer CuPy views, torch's current stream, the
  CuPy stream/device contexts, a trivial torch.autograd.Function on CUDA tensors (torch's
  own floor), and tileattn.backward run from a second thread (the autograd engine runs the
  backward on its CUDA worker thread).

host_profile_gpu.py profiles whole calls through each adapter.
"""

from __future__ import annotations

import threading
import time

import cupy
import torch

import tileattn
import tileattn.torch as tt
from tileattn import arrays


def per_call_us(function, calls: int = 1000) -> float:
    function()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        function()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def say(name: str, us: float) -> None:
    print(f"{name:58s} {us:8.1f} us", flush=True)


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def raw_view(tensor):
    memory = cupy.cuda.UnownedMemory(tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                                     tensor)
    return cupy.ndarray(tuple(tensor.shape), cupy.float16, cupy.cuda.MemoryPointer(memory, 0),
                        tuple(s * tensor.element_size() for s in tensor.stride()))


def main() -> None:
    torch.manual_seed(0)
    shape = (1, 1, 128, 64)
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(4))
    cq, ck, cv, cdo = (cupy.asarray(t.cpu().numpy()) for t in (q, k, v, do))
    o, lse = tileattn.forward(cq, ck, cv, backend="gpu", causal=True, return_lse=True)
    say("direct forward (CuPy)",
        per_call_us(lambda: tileattn.forward(cq, ck, cv, backend="gpu", causal=True)))
    say("direct backward (CuPy)",
        per_call_us(lambda: tileattn.backward(cdo, cq, ck, cv, o, lse, backend="gpu",
                                              causal=True)))
    say("direct forward on torch tensors (api, DLPack)",
        per_call_us(lambda: tileattn.forward(q, k, v, backend="gpu", causal=True)))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    with torch.no_grad():
        say("adapter forward, no grad",
            per_call_us(lambda: tt.attention(q, k, v, causal=True, backend="gpu")))
    say("adapter forward, grad",
        per_call_us(lambda: tt.attention(qg, kg, vg, causal=True, backend="gpu")))

    def step():
        tt.attention(qg, kg, vg, causal=True, backend="gpu").backward(do)
    say("adapter forward + backward", per_call_us(step, 300))
    x = torch.randn(4, device="cuda", requires_grad=True)
    g = torch.ones(4, device="cuda")
    say("trivial autograd.Function forward + backward (CUDA)",
        per_call_us(lambda: _Identity.apply(x).backward(g), 300))
    say("torch SDPA forward + backward",
        per_call_us(lambda: torch.nn.functional.scaled_dot_product_attention(
            qg, kg, vg, is_causal=True).backward(do), 300))
    say("arrays.to_native(torch tensor) (DLPack)", per_call_us(lambda: arrays.to_native(q)))
    say("raw-pointer CuPy view of a tensor", per_call_us(lambda: raw_view(q)))
    say("arrays.from_native(CuPy) -> torch (DLPack)",
        per_call_us(lambda: arrays.from_native(o, "torch")))
    say("torch.as_tensor(CuPy array) (__cuda_array_interface__)",
        per_call_us(lambda: torch.as_tensor(o, device="cuda")))
    say("torch.cuda.current_stream(device)",
        per_call_us(lambda: torch.cuda.current_stream(q.device)))

    def contexts():
        with tt._on_torch_stream(q):
            pass
    say("_on_torch_stream enter + exit", per_call_us(contexts))
    say("torch.empty_like", per_call_us(lambda: torch.empty_like(q)))
    say("cupy.empty", per_call_us(lambda: cupy.empty(shape, cupy.float16)))

    result = {}

    def threaded(function, calls=300):
        def body():
            with cupy.cuda.Device(0):
                result["us"] = per_call_us(function, calls)
        thread = threading.Thread(target=body)
        thread.start()
        thread.join()
        return result["us"]
    say("direct backward (CuPy), from a second thread",
        threaded(lambda: tileattn.backward(cdo, cq, ck, cv, o, lse, backend="gpu",
                                           causal=True)))


if __name__ == "__main__":
    main()
