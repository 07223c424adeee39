"""A small, representative workload for compute-sanitizer: every kernel of the GPU backend.

    compute-sanitizer --tool memcheck  python3 bench/sanitize_gpu.py
    compute-sanitizer --tool racecheck python3 bench/sanitize_gpu.py

Sizes are small (the sanitizer slows kernels down a hundredfold) but ragged, so every
kernel sees partial tiles, fully masked rows, GQA and each option switch. Each case is also
checked against the float64 golden model, so a clean run is a correct one too.
"""

from __future__ import annotations

import sys

import cupy
import numpy as np

import tileattn
from tileattn.gpu import _launch
from tileattn.options import AttentionOptions
from tileattn.testing import assert_attention_close
from tileattn.validation import validate

CASES = [
    # (dtype, (B, Hq, Hkv, Nq, Nk, D, Dv), options)
    ("float16", (1, 4, 2, 70, 150, 64, 64),
     dict(causal=True, window=(40, None), dropout_p=0.2, seed=11)),
    ("float16", (1, 2, 1, 130, 90, 128, 128),
     dict(softcap=4.0, alibi_slopes=np.array([0.2, 0.3]), window=(30, 10))),
    ("float16", (1, 2, 2, 40, 40, 64, 64), dict(block_q=64, block_k=32)),
    # the single-pass backward (dQ by atomics), with GQA and a ragged last tile
    ("float16", (1, 4, 2, 70, 150, 64, 64),
     dict(causal=True, dropout_p=0.2, seed=5, deterministic=False)),
    ("float16", (1, 2, 1, 130, 90, 128, 128), dict(softcap=4.0, deterministic=False)),
    ("float32", (2, 4, 2, 70, 150, 64, 64),
     dict(causal=True, window=(40, None), dropout_p=0.2, seed=11)),
    ("float32", (1, 2, 1, 130, 90, 128, 128), dict(softcap=4.0, window=(30, 10))),
    ("float32", (1, 2, 1, 33, 47, 96, 40),
     dict(softcap=4.0, alibi_slopes=np.array([0.2, 0.3]), block_q=7, block_k=13)),
    ("float64", (1, 2, 2, 20, 25, 256, 256), dict(causal=True)),
]

WARP_LAYOUTS = [_launch.WarpLayout(32, False), _launch.WarpLayout(32, True)]


def main() -> int:
    # Without CuPy's pool every array is its own cudaMalloc, so memcheck sees a read past
    # the end of an array instead of landing silently in a neighbouring pool block.
    cupy.cuda.set_allocator(None)
    rng = np.random.default_rng(0)
    for dtype, (batch, hq, hkv, nq, nk, d, dv), options in CASES:
        options = dict(options)
        deterministic = options.pop("deterministic", True)
        q = rng.standard_normal((batch, hq, nq, d)).astype(dtype)
        k = rng.standard_normal((batch, hkv, nk, d)).astype(dtype)
        v = rng.standard_normal((batch, hkv, nk, dv)).astype(dtype)
        do = rng.standard_normal((batch, hq, nq, dv)).astype(dtype)
        dq_, dk_, dv_ = (cupy.asarray(a) for a in (q, k, v))
        o, lse = tileattn.forward(dq_, dk_, dv_, backend="gpu", return_lse=True, **options)
        grads = tileattn.backward(cupy.asarray(do), dq_, dk_, dv_, o, lse, backend="gpu",
                                  deterministic=deterministic, **options)
        cupy.cuda.Device().synchronize()
        golden_o, golden_lse = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                                backend="reference", return_lse=True, **options)
        golden = _golden_grads(do, q, k, v, o, golden_lse, **options)
        assert_attention_close(o.get(), golden_o, q.dtype, name="o")
        for name, grad, want in zip(("dq", "dk", "dv"), grads, golden):
            assert_attention_close(grad.get(), want, q.dtype, name=name)
        path = "generic"
        resolved = _options(q, options)
        if _launch.tensor_core_blocks(dq_, dv_, resolved):
            path = "wgmma" if _launch.wgmma_tiles(dq_, dk_, resolved) else "mma.sync"
        elif _launch.tf32_tiles(dq_, dv_, resolved):
            path = "3xtf32"
        print(f"ok {dtype} {(batch, hq, hkv, nq, nk, d, dv)} {sorted(options)} forward={path}"
              f"{'' if deterministic else ' backward=single-pass'}")
    for dtype in ("float16", "float32"):  # D from rows the vector kernel cannot read
        q, k, v, do = (rng.standard_normal((1, 2, 70, 64)).astype(dtype) for _ in range(4))
        device = [cupy.asarray(a) for a in (q, k, v)]
        o, lse = tileattn.forward(*device, backend="gpu", return_lse=True, causal=True)
        padded = cupy.zeros(do.shape[:-1] + (65,), dtype=dtype)  # rows 65 elements apart
        padded[..., 1:] = cupy.asarray(do)
        grads = tileattn.backward(padded[..., 1:], *device, o, lse, backend="gpu", causal=True)
        golden = _golden_grads(do, q, k, v, o, lse, causal=True)
        for name, grad, want in zip(("dq", "dk", "dv"), grads, golden):
            assert_attention_close(grad.get(), want, q.dtype, name=name)
        print(f"ok {dtype} backward with a strided dO (D by one warp per row)")
    for layout in WARP_LAYOUTS:  # the forward's layouts that no default uses
        q, k, v = (rng.standard_normal((1, 2, n, 128)).astype(np.float16) for n in (70, 150, 150))
        options = dict(causal=True, softcap=4.0, dropout_p=0.2, seed=3)
        resolved = validate(q, k, v, **options, window=None, scale=None, alibi_slopes=None,
                            block_q=None, block_k=None, deterministic=True).options
        o = cupy.empty(q.shape, dtype=q.dtype)
        lse = cupy.empty(q.shape[:3], dtype=cupy.float32)
        _launch.forward_tensor_core(*map(cupy.asarray, (q, k, v)), o, lse, resolved,
                                    tileattn.Blocks(128, 64), layout)
        golden_o, _ = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                       backend="reference", return_lse=True, **options)
        assert_attention_close(o.get(), golden_o, q.dtype, name="o")
        print(f"ok float16 D=128 forward, warps of {layout.rows} rows, "
              f"Q in registers: {layout.q_in_registers}")
    for options in ({}, {"causal": True}):  # the single pass taking turns (deterministic)
        q, k, v, do = (rng.standard_normal((1, 4, n, 64)).astype(np.float16)
                       for n in (130, 200, 200, 130))
        k, v = k[:, :2], v[:, :2]
        device = [cupy.asarray(a) for a in (do, q, k, v)]
        o, lse = tileattn.forward(*device[1:], backend="gpu", return_lse=True, **options)
        resolved = validate(q, k, v, **{**dict(causal=False, window=None, scale=None,
                                               softcap=None, alibi_slopes=None, dropout_p=0.0,
                                               seed=None, block_q=None, block_k=None,
                                               deterministic=True), **options}).options
        grads = _launch.backward_tensor_core(*device, o, lse, resolved, single_pass=True)
        golden = _golden_grads(do, q, k, v, o, lse, **options)
        for name, grad, want in zip(("dq", "dk", "dv"), grads, golden):
            assert_attention_close(grad.get(), want, q.dtype, name=name)
        print(f"ok float16 D=64 ordered single-pass backward {sorted(options)}")
    for head_dim in (64, 128):  # single passes that no default takes on Hopper
        q, k, v, do = (rng.standard_normal((1, 4, n, head_dim)).astype(np.float16)
                       for n in (130, 200, 200, 130))
        k, v = k[:, :2], v[:, :2]
        options = dict(causal=True, dropout_p=0.2, seed=9)
        device = [cupy.asarray(a) for a in (do, q, k, v)]
        o, lse = tileattn.forward(*device[1:], backend="gpu", return_lse=True, **options)
        resolved = validate(q, k, v, **options, window=None, scale=None, softcap=None,
                            alibi_slopes=None, block_q=None, block_k=None,
                            deterministic=False).options
        backwards = {"mma.sync": _launch.backward_tensor_core}
        if cupy.cuda.Device().compute_capability == "90":
            backwards["wgmma"] = _launch.backward_wgmma
        golden = _golden_grads(do, q, k, v, o, lse, **options)
        for name, backward in backwards.items():
            grads = backward(*device, o, lse, resolved, single_pass=True)
            for grad_name, grad, want in zip(("dq", "dk", "dv"), grads, golden):
                assert_attention_close(grad.get(), want, q.dtype, name=grad_name)
            print(f"ok float16 D={head_dim} {name} single-pass backward (dQ added in arrival order)")
    return 0


def _golden_grads(do, q, k, v, o, lse, **options):
    """The golden dq, dk, dv for the `o` (and `lse`, host or device) the GPU backward was
    given (SPEC: D = rowsum(do * o))."""
    host = [cupy.asnumpy(a).astype(np.float64) for a in (do, q, k, v, o)]
    return tileattn.backward(*host, cupy.asnumpy(lse), backend="reference", **options)


def _options(q, options):
    """What `tensor_core_blocks` reads of the options: the caller's tile sizes."""
    return AttentionOptions(block_q=options.get("block_q"), block_k=options.get("block_k"))


if __name__ == "__main__":
    sys.exit(main())
