"""65-256 packed decode rows (GQA chunks, MHA speculative steps) on the tensor-core decode
kernel: the table's row warps (4 groups of two m16 tiles) against 8 groups of one tile,
and against the split-KV prefill forward, kernels and host alike, calls back to back.

    PYTHONPATH=. python3 bench/experiments/decode_rows_gpu.py [B,Hq,Hkv,Nq,Nk,D ...]

(shapes named on the command line replace the list below)
"""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 2)[0])  # bench/, for gpu_timing

# (B, Hq, Hkv, Nq, Nk, D), causal
SHAPES = [(4, 32, 8, 17, 8192, 128), (4, 32, 8, 32, 8192, 128), (1, 32, 8, 64, 32768, 128),
          (4, 16, 16, 33, 8192, 128), (4, 16, 16, 64, 8192, 128), (8, 32, 8, 16, 4096, 128),
          (4, 32, 8, 17, 8192, 64), (2, 16, 2, 48, 16384, 256), (8, 32, 8, 17, 8192, 128),
          (8, 71, 1, 1, 32768, 64), (8, 71, 1, 4, 32768, 64)]


def main() -> None:
    import cupy

    from gpu_timing import back_to_back_ms
    from tileattn.gpu import launch_forward, operands, tiles
    from tileattn.gpu.launch_decode import decode_shape, forward_decode
    from tileattn.testing import assert_attention_close
    from tileattn.validation import validate

    print(f"# {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, float16, causal, "
          "forward ms back to back")
    print("| B, Hq/Hkv, Nq, Nk, D | chosen | chosen ms | 4 x 2 tiles | 8 x 1 tile, 64 keys | "
          "8 x 1, 32 keys | split prefill |")
    print("|---|---|---:|---:|---:|---:|---:|")
    shapes = [tuple(int(x) for x in arg.split(",")) for arg in sys.argv[1:]] or SHAPES
    for batch, heads, kv_heads, n_q, n_k, dim in shapes:
        rng = np.random.default_rng(0)
        q, k, v = (cupy.asarray(rng.standard_normal(s, dtype=np.float32).astype(np.float16))
                   for s in ((batch, heads, n_q, dim), (batch, kv_heads, n_k, dim),
                             (batch, kv_heads, n_k, dim)))
        options = validate(q, k, v, causal=True, window=None, scale=None, softcap=None,
                           alibi_slopes=None, dropout_p=0.0, seed=None, block_q=None,
                           block_k=None, deterministic=True).options
        problem = operands.problem_of(q, k, v, options)
        shape = decode_shape(q, k, options)
        chosen = launch_forward.choose(q, k, v, options)
        reference = launch_forward.run(chosen, q, k, v, options)[0].get().astype(np.float32)
        cells = []

        def time_launch(make):
            o, lse = launch_forward._outputs(q, v)
            try:
                launch = make(o, lse)
            except Exception as error:  # a configuration that does not build or fit
                return f"{type(error).__name__}"
            assert_attention_close(o.get().astype(np.float32), reference, np.float16, name="o")
            return f"{back_to_back_ms(lambda: launch(q, k, v, o, lse), 30):.3f}"

        cells.append(time_launch(lambda o, lse: launch_forward.launch(chosen, q, k, v, o, lse,
                                                                      options)))
        for row_warps, row_tiles, keys in ((4, 2, None), (8, 1, 64), (8, 1, 32)):
            def decode(o, lse, row_warps=row_warps, row_tiles=row_tiles, keys=keys):
                forced = tiles.decode_mma_tiles(problem, shape, warps=1, warp_keys=keys,
                                                row_warps=row_warps, row_tiles=row_tiles)
                return forward_decode(q, k, v, o, lse, options, forced)[0]
            cells.append(time_launch(decode))
        prefill = tiles.with_key_splits(tiles.choose_forward(
            replace(problem, query_heads=batch * heads, n_q=n_q,
                    multiprocessors=shape.sm_count)), shape)
        cells.append(time_launch(lambda o, lse: launch_forward.launch(prefill, q, k, v, o, lse,
                                                                      options)))
        label = f"{chosen.family} {getattr(chosen.tiles, 'row_warps', '')}"
        print(f"| {batch}, {heads}/{kv_heads}, {n_q}, {n_k}, {dim} | {label} | "
              + " | ".join(cells) + f" | (prefill shares {prefill.key_splits}) |", flush=True)


if __name__ == "__main__":
    main()
