"""A GQA decode's packed rows on the wgmma prefill: each K/V head's group x Nq query rows
as the rows of one head (q (B, Hq, Nq, D) viewed as (B, Hkv, group * Nq, D), no copy, no
mask), against the tensor-core decode kernel that packs the same rows into mma.sync m16
tiles. At 32-64 packed rows the decode is bound by its products (NOTES-gpu v55); the
prefill runs them on wgmma with K and V read once per K/V head too.

    PYTHONPATH=. python3 bench/experiments/folded_decode_gpu.py \\
        [--shapes 'B8 H8/1 Nq8 Nk32k D128 float16' ...] [--tiles table 64x64x2/4 64x64x3/2o] \\
        [--splits auto 16 32 64] [--rounds 3] [--repetitions 7]

Per shape, interleaved rounds of kernels alone after a clean L2 flush: a grid-wide read of
K and V, the decode's table configuration, the folded prefill at each tile shape (`table`:
the prefill table's choice for the folded problem; or block_q x block_k x stages / blocks
an SM, with a trailing "o" for the overlapped schedule, WgmmaTiles.overlap) and key-split count (`auto`: `tiles.with_key_splits`), and torch SDPA's flash
backend (whole call). Each line: microseconds min / median, share of copy bandwidth.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import cupy

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_gpu_decode import _as_float64, _options, reference_group, shape_arrays
from decode_costs_gpu import parse_shape, stream_read
from decode_roofline_gpu import bandwidth_header, flash_variant, report_rounds

from tileattn.gpu import launch_forward, tiles
from tileattn.gpu.launch_decode import decode_shape, forward_decode
from tileattn.gpu.operands import problem_of
from tileattn.testing import assert_attention_close

SHAPES = ["B8 H8/1 Nq8 Nk32k D128 float16", "B1 H8/1 Nq8 Nk256k D128 float16",
          "B64 H8/1 Nq8 Nk4k D128 float16", "B8 H8/1 Nq8 Nk128k D128 float16",
          "B1 H8/1 Nq8 Nk256k D256 float16", "B8 H8/1 Nq8 Nk32k D256 float16",
          "B8 H8/1 Nq8 Nk128k D64 float16", "B8 H8/1 Nq4 Nk32k D128 float16",
          "B1 H8/1 Nq4 Nk256k D256 float16", "B8 H32/8 Nq8 Nk32k D128 float16"]


def folded(q, k):
    """q (B, Hq, Nq, D) as (B, Hkv, group * Nq, D): a view of the same memory."""
    batch, n_q_heads, n_q, head_dim = q.shape
    group = n_q_heads // k.shape[1]
    return q.reshape(batch, k.shape[1], group * n_q, head_dim)


def prefill_variant(q, k, v, text: str, splits: str, expected, group):
    """(label, launch) of the folded problem on the prefill, or None where it does not fit."""
    qf = folded(q, k)
    options = _options(qf, k, v)
    problem = problem_of(qf, k, v, options)
    shape = decode_shape(qf, k, options)
    if text == "table":
        choice = tiles.choose_forward(problem)
    else:
        overlap = text.endswith("o")
        sizes, _, per_sm = text.rstrip("o").partition("/")
        block_q, block_k, stages = map(int, sizes.split("x"))
        choice = tiles.Choice("wgmma", tiles.WgmmaTiles(block_q, block_k, stages,
                                                       int(per_sm or 1), overlap), "forced")
    if splits == "auto":
        choice = tiles.with_key_splits(choice, shape, tiles.FOLD_MAX_SPLITS)
    else:
        choice = replace(choice, key_splits=int(splits))
    o = cupy.empty(qf.shape[:3] + (v.shape[3],), dtype=q.dtype)
    lse = cupy.empty(qf.shape[:3], dtype=cupy.float32)
    try:
        launch = launch_forward.launch(choice, qf, k, v, o, lse, options)
    except Exception as error:  # a configuration that does not build or fit
        print(f"  {text}@{splits}: {type(error).__name__}: {str(error)[:100]}")
        return None
    launch(qf, k, v, o, lse)
    o_heads = o.reshape(q.shape[:3] + (v.shape[3],))
    assert_attention_close(_as_float64(o_heads[0, :group]).get(), expected, q.dtype,
                           name=text)
    config = choice.tiles
    label = (f"fold {config.block_q}x{config.block_k}x{config.stages}/"
             f"{config.blocks_per_sm}{'o' if config.overlap else ''}@{choice.key_splits}"
             f"{' (table)' if text == 'table' else ''}{' auto' if splits == 'auto' else ''}")
    return label, lambda: launch(qf, k, v, o, lse)


def decode_table(q, k, v, expected, group):
    options = _options(q, k, v)
    choice = launch_forward.choose(q, k, v, options)
    o = cupy.empty(q.shape[:3] + (v.shape[3],), dtype=q.dtype)
    lse = cupy.empty(q.shape[:3], dtype=cupy.float32)
    if choice.family == "decode":
        launch = forward_decode(q, k, v, o, lse, options, choice.tiles)[0]
        config = choice.tiles
        label = (f"decode r{config.rows} {config.warps}x{config.warp_keys}x{config.stages}"
                 f"@{config.splits}")
    else:
        launch = launch_forward.launch(choice, q, k, v, o, lse, options)
        label = f"table {choice.family}"
    launch(q, k, v, o, lse)
    assert_attention_close(_as_float64(o[0, :group]).get(), expected, q.dtype, name=label)
    return label, lambda: launch(q, k, v, o, lse)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=SHAPES)
    parser.add_argument("--tiles", nargs="*", default=["table", "64x64x2/4", "64x128x2/2",
                                                       "64x64x3/3", "128x64x2/2"])
    parser.add_argument("--splits", nargs="*", default=["auto"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repetitions", type=int, default=7)
    args = parser.parse_args()
    bandwidth = bandwidth_header(args.rounds)
    rng = cupy.random.default_rng(0)
    for text in args.shapes:
        shape = parse_shape(text)
        q, k, v = shape_arrays(shape, rng)
        group = shape.n_q_heads // shape.n_kv_heads
        expected = reference_group(q, k, v).get()
        variants = [("read", stream_read(k, v)), decode_table(q, k, v, expected, group)]
        for tile_text in args.tiles:
            for splits in args.splits:
                variant = prefill_variant(q, k, v, tile_text, splits, expected, group)
                if variant is not None:
                    variants.append(variant)
        report_rounds(shape, variants + flash_variant(q, k, v), args.rounds, args.repetitions,
                      bandwidth, 44)
        del q, k, v
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
