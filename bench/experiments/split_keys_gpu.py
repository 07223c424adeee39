"""Split-KV in the prefill forward (tiles.forward_key_splits): each shape's forward with its
keys cut into 1, 2, 3, 4, 6, 8 and 12 shares and as the rule chooses, against torch SDPA's
flash (FlashAttention-2), memory-efficient and cuDNN backends, calls back to back (kernels and host alike).

    PYTHONPATH=. python3 bench/experiments/split_keys_gpu.py [--dtype bfloat16] [--quick]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 2)[0])  # bench/, for gpu_timing and bench_gpu

# (B, Hq, Nq, Nk, D, causal): few query tiles over many keys, and a few that fill the GPU.
SHAPES = [
    (4, 16, 100, 8192, 128, True), (4, 16, 100, 8192, 128, False),
    (4, 16, 65, 8192, 128, True), (4, 16, 128, 8192, 64, True),
    (1, 32, 128, 32768, 128, True), (1, 32, 128, 2048, 128, False),
    (1, 16, 256, 8192, 128, True), (1, 8, 512, 32768, 128, True),
    (1, 8, 1024, 1024, 128, True), (2, 8, 2048, 2048, 64, True),
    (1, 8, 200, 16384, 256, True), (8, 16, 128, 4096, 128, True),
]
SPLITS = (1, 2, 3, 4, 6, 8, 12)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--quick", action="store_true", help="the first three shapes")
    args = parser.parse_args(argv)

    import cupy
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from bench_gpu import _as_torch
    from gpu_timing import back_to_back_ms
    from tileattn.gpu import launch_forward
    from tileattn.testing import assert_attention_close, bfloat16
    from tileattn.validation import validate

    dtype = bfloat16() if args.dtype == "bfloat16" else np.dtype(args.dtype)
    print(f"# {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, {args.dtype}, "
          f"forward ms, calls back to back")
    print("| B, Hq, Nq, Nk, D, causal | chosen | " + " | ".join(f"s={s}" for s in SPLITS)
          + " | flash | efficient | cudnn | flash / chosen | best torch / chosen |")
    print("|---|---|" + "---:|" * (len(SPLITS) + 5))
    for shape in SHAPES[:3] if args.quick else SHAPES:
        batch, heads, n_q, n_k, head_dim, causal = shape
        rng = np.random.default_rng(0)
        host = [rng.standard_normal((batch, heads, n, head_dim), dtype=np.float32).astype(dtype)
                for n in (n_q, n_k, n_k)]
        q, k, v = map(cupy.asarray, host)
        options = validate(q, k, v, causal=causal, window=None, scale=None, softcap=None,
                           alibi_slopes=None, dropout_p=0.0, seed=None, block_q=None,
                           block_k=None, deterministic=True).options
        chosen = launch_forward.choose(q, k, v, options)
        reference = launch_forward.run(replace(chosen, key_splits=1), q, k, v, options)
        times = {}
        for splits in sorted(set(SPLITS) | {chosen.key_splits}):
            choice = replace(chosen, key_splits=splits)
            o, lse = launch_forward.run(choice, q, k, v, options)
            assert_attention_close(o.get().astype(np.float32),
                                   reference[0].get().astype(np.float32), dtype, name="o")
            launch = launch_forward.launch(choice, q, k, v, o, lse, options)
            times[splits] = back_to_back_ms(lambda: launch(q, k, v, o, lse), 30)
        tq, tk, tv = map(_as_torch, (q, k, v))
        mask = causal_lower_right(n_q, n_k) if causal and n_q != n_k else None
        anchors = {}
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                              ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            def call(backend=backend):
                with sdpa_kernel(backend), torch.no_grad():
                    F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask,
                                                   is_causal=causal and mask is None)
            try:
                call()
                anchors[name] = back_to_back_ms(call, 30)
            except RuntimeError:
                anchors[name] = float("nan")
        mine = times[chosen.key_splits]
        cells = " | ".join(f"{times[s]:.3f}" for s in SPLITS)
        best = min((t for t in anchors.values() if t == t), default=float("nan"))
        print(f"| {shape} | {chosen.key_splits} ({chosen.family}) | {cells} | "
              + " | ".join(f"{anchors[n]:.3f}" for n in ("flash", "efficient", "cudnn"))
              + f" | {anchors['flash'] / mine:.2f} | {best / mine:.2f} |", flush=True)


if __name__ == "__main__":
    main()
