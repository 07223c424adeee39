"""Time of a paged prefill against the same keys contiguous, calls back to back (the host's
time overlaps the kernels' unless it is longer): B 4, Hq = Hkv = 16 (``--heads Hq/Hkv``),
512 new rows onto 8192 cached keys, D 128, float16, causal, pages of 16, 64 and 256 in
shuffled order; lengths and tables unchecked, from the host and from the device.

    PYTHONPATH=. python3 bench/experiments/paged_prefill_gpu.py [--tiles] [--heads 32/8]

``--sweep`` compares whole calls at D 64, 128 and 256, H 16/16 and 32/8, pages of 16, 64
and 256 (device tables).

``--profile`` runs the contiguous call and page 64's twice each, untimed, for
`ncu --kernel-name regex:attention_forward`.

``--tiles --profile`` runs the 256 x 64 tiles on the contiguous call and on pages of 64,
twice each and untimed, for ncu (launches 1 and 3 are the second of each).

``--tiles [--dim D]`` times the wgmma forward's candidate tiles instead (contiguous ms | page 16 ms |
page 64 ms | page 256 ms per line; with ``--all-columns`` also the same keys with device lengths (a
variable-length launch over every tile) and with host lengths (over the host's tile table)
after the contiguous column).
"""

from __future__ import annotations

import os
import sys

import cupy
import numpy as np

import tileattn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_timing import back_to_back_ms  # noqa: E402
from paged_pools import page_pool  # noqa: E402

CALLS = 50


def twice_untimed(function, _calls) -> float:
    """--profile's stand-in for the timing: two calls, for ncu to see."""
    function()
    function()
    cupy.cuda.Device().synchronize()
    return float("nan")


def query_and_kv_heads() -> tuple[int, int]:
    """``--heads Hq/Hkv`` (default 16/16)."""
    import sys

    given = sys.argv[sys.argv.index("--heads") + 1] if "--heads" in sys.argv else "16/16"
    q_heads, kv_heads = (int(x) for x in given.split("/"))
    return q_heads, kv_heads


def main(profile: bool = False) -> None:
    timed = twice_untimed if profile else back_to_back_ms
    (q_heads, heads), batch, n_new, n_keys, dim = query_and_kv_heads(), 4, 512, 8704, 128
    rng = np.random.default_rng(0)
    q = cupy.asarray(rng.standard_normal((batch, q_heads, n_new, dim)), dtype=cupy.float16)
    k = cupy.asarray(rng.standard_normal((batch, heads, n_keys, dim)), dtype=cupy.float16)
    dense = timed(lambda: tileattn.forward(q, k, k, causal=True, backend="gpu"),
                            CALLS)
    print(f"contiguous: {dense:.3f} ms")
    for page in (64,) if profile else (16, 64, 256):
        pool, device_table = page_pool(k, [n_keys] * batch, page, rng)
        lengths = {"block_table": cupy.asnumpy(device_table), "seqlens_k": np.full(batch, n_keys),
                   "check_lengths": False}
        on_device = {"block_table": device_table,
                     "seqlens_k": cupy.full(batch, n_keys, dtype=cupy.int32),
                     "check_lengths": False}
        padded = timed(lambda: tileattn.forward(
            q, k, k, causal=True, backend="gpu", seqlens_k=np.full(batch, n_keys),
            check_lengths=False), CALLS)
        paged = timed(lambda: tileattn.forward(q, pool, pool, causal=True,
                                                         backend="gpu", **lengths), CALLS)
        paged_device = timed(lambda: tileattn.forward(q, pool, pool, causal=True,
                                                      backend="gpu", **on_device), CALLS)
        same = float(cupy.abs(tileattn.forward(q, pool, pool, causal=True, backend="gpu",
                                               **lengths)
                              - tileattn.forward(q, k, k, causal=True, backend="gpu")).max())
        print(f"page {page:4d}: padded (host seqlens_k) {padded:.3f} ms, paged (host tables) "
              f"{paged:.3f} ms, paged (device tables) {paged_device:.3f} ms, contiguous / "
              f"paged {dense / paged:.2f} / {dense / paged_device:.2f}, max |diff| {same:.1e}")


def sweep_tiles() -> None:
    """``--tiles``: the wgmma forward's tiles on the contiguous call and on pages of 16, 64
    and 256 (the tables made once, outside the timing), to choose the tiles a page size
    gets."""
    import sys

    from tileattn.gpu import launch_forward
    from tileattn.gpu.tiles import WgmmaTiles
    from tileattn.gpu.varlen import Sequences
    from tileattn.validation import validate

    (q_heads, heads), batch, n_new, n_keys = query_and_kv_heads(), 4, 512, 8704
    dim = int(sys.argv[sys.argv.index("--dim") + 1]) if "--dim" in sys.argv else 128
    rng = np.random.default_rng(0)
    q = cupy.asarray(rng.standard_normal((batch, q_heads, n_new, dim)), dtype=cupy.float16)
    k = cupy.asarray(rng.standard_normal((batch, heads, n_keys, dim)), dtype=cupy.float16)
    o = cupy.empty_like(q)
    lse = cupy.empty((batch, q_heads, n_new), cupy.float32)
    defaults = dict(causal=True, window=None, scale=None, softcap=None, alibi_slopes=None,
                    dropout_p=0.0, seed=None, block_q=None, block_k=None, deterministic=True)
    dense_options = validate(q, k, k, **defaults).options
    calls = {}
    padded = {"seqlens_k": cupy.full(batch, n_keys, dtype=cupy.int32)}
    options = validate(q, k, k, varlen=padded, check_lengths=False, **defaults).options
    calls["padded"] = (k, options, Sequences(q, k, options, forward=True))
    options = validate(q, k, k, varlen={"seqlens_k": np.full(batch, n_keys)},
                       **defaults).options
    calls["padded, host tables"] = (k, options, Sequences(q, k, options, forward=True))
    for page in (16, 64, 256):
        pool, table = page_pool(k, [n_keys] * batch, page, rng)
        varlen = {"block_table": cupy.asnumpy(table), "seqlens_k": np.full(batch, n_keys)}
        options = validate(q, pool, pool, varlen=varlen, **defaults).options
        calls[page] = (pool, options, Sequences(q, pool, options, forward=True))
    profile = "--profile" in sys.argv
    if profile:
        calls = {64: calls[64]}
    candidates = [WgmmaTiles(256, 64, 2)] if profile else [WgmmaTiles(*t) for t in ((192, 128, 2), (192, 64, 2), (192, 64, 3),
                                           (128, 128, 2, 2), (128, 64, 2, 2), (128, 64, 3, 2),
                                           (128, 64, 3), (256, 64, 2))]
    if "--all-columns" not in sys.argv and not profile:
        del calls["padded"], calls["padded, host tables"]
    timed = twice_untimed if profile else back_to_back_ms
    for tiles in candidates:
        row = [f"{tiles}"]
        try:
            row.append(timed(lambda: launch_forward.forward_wgmma(
                q, k, k, o, lse, dense_options, tiles), CALLS))
            for page, (pool, options, sequences) in calls.items():
                row.append(timed(lambda: launch_forward.forward_wgmma(
                    q, pool, pool, o, lse, options, tiles, sequences), CALLS))
        except Exception as error:  # noqa: BLE001 (a candidate that does not fit)
            row.append(f"failed: {str(error).splitlines()[0][:80]}")
        print(" | ".join(f"{x:.3f}" if isinstance(x, float) else x for x in row),
              file=sys.stdout, flush=True)


def sweep() -> None:
    """``--sweep``: whole calls back to back, device tables unchecked, paged over contiguous
    for D 64 / 128 / 256, H 16/16 and 32/8, pages of 16, 64 and 256 (B 4, 512 new rows onto
    8704 keys, causal, float16; B 2 at D 256)."""
    print("| D | Hq/Hkv | contiguous ms | page 16 | page 64 | page 256 | worst ratio |")
    print("|---|---|---:|---:|---:|---:|---:|")
    n_new, n_keys = 512, 8704
    for dim in (64, 128, 256):
        for q_heads, heads in ((16, 16), (32, 8)):
            batch = 2 if dim == 256 else 4
            rng = np.random.default_rng(0)
            q = cupy.asarray(rng.standard_normal((batch, q_heads, n_new, dim)),
                             dtype=cupy.float16)
            k = cupy.asarray(rng.standard_normal((batch, heads, n_keys, dim)),
                             dtype=cupy.float16)
            dense = back_to_back_ms(lambda: tileattn.forward(q, k, k, causal=True), CALLS)
            expected = tileattn.forward(q, k, k, causal=True)
            row, ratios = [f"{dense:.3f}"], []
            for page in (16, 64, 256):
                pool, table = page_pool(k, [n_keys] * batch, page, rng)
                tables = {"block_table": table,
                          "seqlens_k": cupy.full(batch, n_keys, dtype=cupy.int32),
                          "check_lengths": False}
                paged = back_to_back_ms(lambda: tileattn.forward(q, pool, pool, causal=True,
                                                                 **tables), CALLS)
                same = float(cupy.abs(tileattn.forward(q, pool, pool, causal=True, **tables)
                                      - expected).max())
                ratios.append(dense / paged)
                row.append(f"{paged:.3f} ({dense / paged:.2f}"
                           f"{f', differs by {same:.0e}' if same else ''})")
            print(f"| {dim} | {q_heads}/{heads} | {' | '.join(row)} | {min(ratios):.2f} |",
                  flush=True)
            cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    import sys

    if "--sweep" in sys.argv[1:]:
        sweep()
    elif "--tiles" in sys.argv[1:]:
        sweep_tiles()
    else:
        main("--profile" in sys.argv[1:])
