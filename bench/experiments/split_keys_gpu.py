"""Split-KV in the prefill forward (tiles.forward_key_splits) and the backward's dQ kernel
(tiles.dq_key_splits): each shape's forward (or, with --backward, backward) with the keys cut
into 1-32 shares (SPLITS) and as the rule chooses, against torch SDPA's flash
(FlashAttention-2), memory-efficient and cuDNN backends (their backward: forward + backward
less forward), calls back to back (kernels and host alike).

    PYTHONPATH=. python3 bench/experiments/split_keys_gpu.py [--dtype bfloat16] [--quick]
    PYTHONPATH=. python3 bench/experiments/split_keys_gpu.py --backward
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 2)[0])  # bench/, for gpu_timing and bench_gpu

# (B, Hq, Nq, Nk, D, causal): few query tiles over many keys, and a few that fill the GPU.
SHAPES = [
    (1, 32, 1, 65536, 128, False), (4, 16, 100, 8192, 128, True),
    (1, 32, 128, 32768, 128, True), (4, 16, 100, 8192, 128, False),
    (4, 16, 65, 8192, 128, True), (4, 16, 128, 8192, 64, True),
    (1, 32, 128, 2048, 128, False),
    (1, 16, 256, 8192, 128, True), (1, 8, 512, 32768, 128, True),
    (1, 8, 1024, 1024, 128, True), (2, 8, 2048, 2048, 64, True),
    (1, 8, 200, 16384, 256, True), (8, 16, 128, 4096, 128, True),
]
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--quick", action="store_true", help="the first three shapes")
    parser.add_argument("--backward", action="store_true", help="time the backward")
    args = parser.parse_args(argv)

    import cupy
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from bench_gpu import _as_torch
    from gpu_timing import back_to_back_ms
    from tileattn.gpu import launch_backward, launch_forward, operands, tiles
    from tileattn.testing import assert_attention_close, bfloat16
    from tileattn.validation import validate

    dtype = bfloat16() if args.dtype == "bfloat16" else np.dtype(args.dtype)
    direction = "backward" if args.backward else "forward"
    print(f"# {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, {args.dtype}, "
          f"{direction} ms, calls back to back")
    print("| B, Hq, Nq, Nk, D, causal | chosen | " + " | ".join(f"s={s}" for s in SPLITS)
          + " | flash | efficient | cudnn | flash / chosen | best torch / chosen |")
    print("|---|---|" + "---:|" * (len(SPLITS) + 5))
    for shape in SHAPES[:3] if args.quick else SHAPES:
        batch, heads, n_q, n_k, head_dim, causal = shape
        rng = np.random.default_rng(0)
        host = [rng.standard_normal((batch, heads, n, head_dim), dtype=np.float32).astype(dtype)
                for n in (n_q, n_k, n_k, n_q)]
        q, k, v, do = map(cupy.asarray, host)
        options = validate(q, k, v, causal=causal, window=None, scale=None, softcap=None,
                           alibi_slopes=None, dropout_p=0.0, seed=None, block_q=None,
                           block_k=None, deterministic=True).options
        forward_choice = launch_forward.choose(q, k, v, options)
        o, lse = launch_forward.run(replace(forward_choice, key_splits=1), q, k, v, options)
        if args.backward:
            choice = tiles.choose_backward(operands.problem_of(q, k, v, options))
            chosen = tiles.dq_key_splits(choice.tiles, launch_forward.decode_shape(q, k, options))

            def timed(splits):
                """dq and the backward's ms, the rule answering `splits` (cached plans)."""
                rule = launch_backward.dq_key_splits
                launch_backward.dq_key_splits = lambda *_: splits
                operands._PLANS.clear()
                try:
                    def call():
                        return launch_backward.backward(do, q, k, v, o, lse, options)[0]
                    return call(), back_to_back_ms(call, 20)
                finally:
                    launch_backward.dq_key_splits = rule
                    operands._PLANS.clear()
        else:
            choice, chosen = forward_choice, forward_choice.key_splits

            def timed(splits):
                """o and the forward's ms in `splits` shares (the launch, as a plan holds it)."""
                forced = replace(choice, key_splits=splits)
                out, out_lse = launch_forward.run(forced, q, k, v, options)
                launch = launch_forward.launch(forced, q, k, v, out, out_lse, options)
                return out, back_to_back_ms(lambda: launch(q, k, v, out, out_lse), 20)

        times = {}
        reference, times[1] = timed(1)
        reference = reference.get().astype(np.float32)
        for splits in sorted((set(SPLITS) | {chosen}) - {1}):
            result, times[splits] = timed(splits)
            assert_attention_close(result.get().astype(np.float32), reference, dtype,
                                   name="out")
        tq, tk, tv, tdo = map(_as_torch, (q, k, v, do))
        mask = causal_lower_right(n_q, n_k) if causal and n_q != n_k else None
        anchors = {}
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                              ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            def attention(grad, backend=backend):
                operands_ = [t.detach().requires_grad_(grad) for t in (tq, tk, tv)]
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(*operands_, attn_mask=mask,
                                                          is_causal=causal and mask is None)

            def forward_only():
                with torch.no_grad():
                    attention(False)

            try:
                attention(True).backward(tdo)
                anchors[name] = back_to_back_ms(forward_only, 20)
                if args.backward:
                    anchors[name] = back_to_back_ms(
                        lambda: attention(True).backward(tdo), 20) - anchors[name]
            except RuntimeError:
                anchors[name] = float("nan")
        mine = times[chosen]
        best = min((t for t in anchors.values() if t == t), default=float("nan"))
        cells = " | ".join(f"{times[s]:.3f}" for s in SPLITS)
        print(f"| {shape} | {chosen} ({choice.family}) | {cells} | "
              + " | ".join(f"{anchors[n]:.3f}" for n in ("flash", "efficient", "cudnn"))
              + f" | {anchors['flash'] / mine:.2f} | {best / mine:.2f} |", flush=True)


if __name__ == "__main__":
    main()
