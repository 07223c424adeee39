"""Compile every tensor-core and generic kernel with nvcc, no GPU needed: syntax, registers
and spills per entry point, with every score option on (the heaviest variant).

    python3 bench/experiments/compile_check_gpu.py [--keep DIR] [--backward-rows [--flag-keys]]

Needs nvcc (CUDA 12+) on the PATH. Each line: source, result, ptxas's register and spill
report. A kernel that gains spills here has grown past its register budget.
--backward-rows compiles the 16-bit backward rows of the tile tables instead (wgmma D = 64,
128, 192, 256 and the mma.sync single pass), each without a band, causal, and with every
option: the rows whose registers the cut-tile non-finite corrections must not grow;
--flag-keys compiles them as a query tail does (FLAG_NON_FINITE_KEYS). --strided compiles
the backward kernels and group_sum with STRIDED_OUT=1 (gradients at the caller's "bshd"
strides), as the launchers do for them (never with the single pass or GROUP_SPLITS).
--decode-registers compiles each row of tiles.DECODE_MMA_REGISTERS as the table measured
it (no score option, no launch bound, dense), and paged, and says where ptxas's count
(rounded up to 8) leaves the residency the table gives.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tileattn.gpu._compile import source  # noqa: E402

EVERY_OPTION = ["ALIBI=1", "DROPOUT=1", "LIMIT_LEFT=1", "LIMIT_RIGHT=1", "SOFTCAP=1"]
BACKWARD = ["COPY_BYTES=16", "DKDV_PART=0", "IS_BFLOAT16=0", "SINGLE_PASS=0", "VALUE_DIM=128",
            "HEAD_DIM=128"]
# dQ added in turns (ORDERED) by the single pass, the only kernel that takes them.
SINGLE_PASS = [b for b in BACKWARD if b != "SINGLE_PASS=0"] + ["SINGLE_PASS=1"]
DECODE = ["COPY_BYTES=16"]
JOBS = [
    ("attention_wgmma_forward.cu", "90a",
     ["BLOCK_K=64", "BLOCK_Q=128", "BLOCKS_PER_SM=1", "IS_BFLOAT16=0", "STAGES=2",
      "COPY_BYTES=16", "HEAD_DIM=128", "VALUE_DIM=128"]),
    # Short sequences' row at D <= 64 (tiles.WGMMA_FORWARD, no score option): four blocks an
    # SM cap the registers at 128 (ptxas: 113-128, a 4-byte spill paged under a band; D 80
    # and 96 spilled 24-140 bytes there, so they take two).
    ("attention_wgmma_forward.cu", "90a",
     ["BLOCK_K=64", "BLOCK_Q=64", "BLOCKS_PER_SM=4", "IS_BFLOAT16=0", "STAGES=2",
      "COPY_BYTES=16", "HEAD_DIM=64", "VALUE_DIM=64"],
     ["ALIBI=0", "DROPOUT=0", "LIMIT_LEFT=1", "LIMIT_RIGHT=1", "SOFTCAP=0"]),
    ("attention_mma_forward.cu", "90",
     ["BLOCK_K=64", "BLOCK_Q=128", "IS_BFLOAT16=0", "Q_IN_REGISTERS=1", "WARP_ROWS=16",
      "COPY_BYTES=16", "HEAD_DIM=64", "VALUE_DIM=64"]),
    ("attention_tf32_forward.cu", "90",
     ["BLOCK_K=32", "BLOCK_Q=64", "WARP_ROWS=16", "COPY_BYTES=16", "HEAD_DIM=64",
      "VALUE_DIM=64"]),
    # float64 on sm_90's FP64 tensor cores (tiles.F64_FORWARD's rows).
    ("attention_tf32_forward.cu", "90",
     ["IS_FLOAT64=1", "BLOCK_K=64", "BLOCK_Q=128", "WARP_ROWS=16", "COPY_BYTES=16",
      "HEAD_DIM=64", "VALUE_DIM=64"]),
    ("attention_tf32_forward.cu", "90",
     ["IS_FLOAT64=1", "BLOCK_K=32", "BLOCK_Q=128", "WARP_ROWS=16", "COPY_BYTES=16",
      "HEAD_DIM=96", "VALUE_DIM=96"]),
    ("attention_tf32_forward.cu", "90",  # key shares into double partials
     ["IS_FLOAT64=1", "BLOCK_K=16", "BLOCK_Q=128", "WARP_ROWS=16", "COPY_BYTES=16",
      "HEAD_DIM=128", "VALUE_DIM=128", "SPLIT_KEYS=1"]),
    ("split_keys_merge.cu", "90", ["PARTIAL=double", "STORAGE=double", "VALUE_DIM=128"]),
    ("attention_tf32_forward.cu", "90",
     ["IS_FLOAT64=1", "BLOCK_K=16", "BLOCK_Q=128", "WARP_ROWS=16", "COPY_BYTES=16",
      "HEAD_DIM=128", "VALUE_DIM=128"]),
    ("attention_wgmma_backward.cu", "90a",
     BACKWARD + ["OWNED_ROWS=128", "STAGES=2", "STREAMED_ROWS=64"]),
    ("attention_wgmma_backward.cu", "90a",
     BACKWARD + ["OWNED_ROWS=128", "STAGES=2", "STREAMED_ROWS=64", "FLAG_NON_FINITE_KEYS=1"]),
    ("attention_mma_backward.cu", "90",
     SINGLE_PASS + ["IS_FLOAT32=0", "ORDERED=1", "OWNED_ROWS=64", "STREAMED_ROWS=64"]),
    ("attention_mma_backward.cu", "90",
     BACKWARD + ["IS_FLOAT32=0", "ORDERED=0", "OWNED_ROWS=64", "STREAMED_ROWS=64",
                 "FLAG_NON_FINITE_KEYS=1"]),
    ("attention_mma_backward.cu", "90",
     SINGLE_PASS + ["IS_FLOAT32=1", "ORDERED=1", "OWNED_ROWS=64", "STREAMED_ROWS=32"]),
    ("attention_wgmma_backward.cu", "90a",  # a GQA group cut over four blocks
     BACKWARD + ["OWNED_ROWS=128", "STAGES=2", "STREAMED_ROWS=64", "GROUP_SPLITS=4"]),
    ("attention_mma_backward.cu", "90",
     BACKWARD + ["IS_FLOAT32=1", "ORDERED=0", "OWNED_ROWS=64", "STREAMED_ROWS=32",
                 "GROUP_SPLITS=2"]),
    # float64 on sm_90's FP64 tensor cores: the two kernels (tiles.F64_BACKWARD's rows).
    ("attention_mma_backward.cu", "90",
     [b for b in BACKWARD if not b.startswith("DKDV_PART")]
     + ["DKDV_PART=1", "IS_FLOAT32=0", "IS_FLOAT64=1", "ORDERED=0", "OWNED_ROWS=64",
        "STREAMED_ROWS=32"]),
    ("attention_mma_backward.cu", "90",
     [b for b in BACKWARD if not b.startswith("DKDV_PART")]
     + ["DKDV_PART=2", "IS_FLOAT32=0", "IS_FLOAT64=1", "ORDERED=0", "OWNED_ROWS=64",
        "STREAMED_ROWS=32"]),
    ("attention_mma_backward.cu", "90",
     [b for b in BACKWARD if not b.startswith(("HEAD_DIM", "VALUE_DIM"))]
     + ["HEAD_DIM=64", "VALUE_DIM=64", "IS_FLOAT32=0", "IS_FLOAT64=1", "ORDERED=0",
        "OWNED_ROWS=64", "STREAMED_ROWS=32"]),
    ("attention_mma_backward.cu", "90",  # dQ's key shares in doubles, a cut GQA group
     [b for b in BACKWARD if not b.startswith(("HEAD_DIM", "VALUE_DIM"))]
     + ["HEAD_DIM=64", "VALUE_DIM=64", "IS_FLOAT32=0", "IS_FLOAT64=1", "ORDERED=0",
        "OWNED_ROWS=64", "STREAMED_ROWS=32", "SPLIT_KEYS=1", "GROUP_SPLITS=2"]),
    ("group_sum.cu", "90", ["STORAGE=bfloat16_storage", "ACCUM=float"]),
    ("group_sum.cu", "90", ["STORAGE=double", "ACCUM=double", "PART=double"]),
    ("attention_generic.cu", "90",
     ["ACCUM=float", "BLOCK_K=32", "BLOCK_Q=32", "HEAD_DIM_PAD=64", "STORAGE=float",
      "THREADS=256", "VALUE_DIM_PAD=64"]),
    ("attention_generic.cu", "90",
     ["ACCUM=float", "BLOCK_K=64", "BLOCK_Q=32", "HEAD_DIM_PAD=128", "STORAGE=half_storage",
      "THREADS=256", "VALUE_DIM_PAD=128"]),
    ("attention_generic.cu", "90",
     ["ACCUM=double", "BLOCK_K=16", "BLOCK_Q=16", "HEAD_DIM_PAD=16", "STORAGE=double",
      "THREADS=256", "VALUE_DIM_PAD=16"]),
    ("attention_generic.cu", "90",  # above 256: a thread keeps two columns of each row
     ["ACCUM=float", "BLOCK_K=16", "BLOCK_Q=16", "HEAD_DIM_PAD=512", "STORAGE=half_storage",
      "THREADS=256", "VALUE_DIM_PAD=256"]),
    # The decode kernel (launch_decode.py): the hot fp16 rows, the widest rows, odd dims.
    ("attention_decode.cu", "90", DECODE + ["STORAGE=half_storage", "ACCUM=float", "ROWS=16",
     "HEAD_DIM=128", "VALUE_DIM=128", "BLOCK_K=32", "STAGES=4", "THREADS=128"]),
    ("attention_decode.cu", "90", DECODE + ["STORAGE=half_storage", "ACCUM=float", "ROWS=1",
     "HEAD_DIM=128", "VALUE_DIM=128", "BLOCK_K=32", "STAGES=4", "THREADS=128"]),
    ("attention_decode.cu", "90", DECODE + ["STORAGE=bfloat16_storage", "ACCUM=float",
     "ROWS=64", "HEAD_DIM=256", "VALUE_DIM=256", "BLOCK_K=16", "STAGES=4", "THREADS=256"]),
    ("attention_decode.cu", "90", DECODE + ["STORAGE=bfloat16_storage", "ACCUM=float",
     "ROWS=16", "HEAD_DIM=576", "VALUE_DIM=512", "BLOCK_K=16", "STAGES=2", "THREADS=128"]),
    ("attention_decode.cu", "90", ["STORAGE=half_storage", "ACCUM=float", "ROWS=8",
     "HEAD_DIM=33", "VALUE_DIM=200", "BLOCK_K=32", "STAGES=4", "THREADS=128", "COPY_BYTES=2"]),
    ("attention_decode.cu", "90", ["STORAGE=double", "ACCUM=double", "ROWS=16",
     "HEAD_DIM=256", "VALUE_DIM=256", "BLOCK_K=16", "STAGES=2", "THREADS=128",
     "COPY_BYTES=8"]),
    ("attention_decode.cu", "90", ["STORAGE=double", "ACCUM=double", "ROWS=16",
     "HEAD_DIM=256", "VALUE_DIM=256", "BLOCK_K=8", "STAGES=2", "THREADS=128",
     "COPY_BYTES=8"]),
    ("attention_decode.cu", "90", ["STORAGE=float", "ACCUM=float", "ROWS=2",
     "HEAD_DIM=64", "VALUE_DIM=64", "BLOCK_K=32", "STAGES=4", "THREADS=128",
     "COPY_BYTES=16"]),
]
# The tensor-core decode (DecodeMmaTiles): D = 128 as the table runs it, D = 256, four row
# tiles at D = 64, row warps (32 rows at D = 128, 64 at D = 64 and 256), odd dims; every
# option it takes (dropout decodes on CUDA cores).
DECODE_MMA_OPTIONS = ["ALIBI=1", "DROPOUT=0", "LIMIT_LEFT=1", "LIMIT_RIGHT=1", "SOFTCAP=1"]
JOBS += [("attention_decode_mma.cu", "90", [f"COPY_BYTES={copy}", f"Q_COPY_BYTES={copy}",
          f"FUSED_MERGE={int(row_warps == 1)}", "IS_BFLOAT16=0",
          f"HEAD_DIM={d}", f"VALUE_DIM={dv}", f"ROW_TILES={row_tiles}", f"WARPS={warps}",
          f"MIN_BLOCKS={4 if (d, row_tiles) == (64, 1) else 2}", f"ROW_WARPS={row_warps}",
          f"WARP_KEYS={keys}", f"STAGES={stages}"], DECODE_MMA_OPTIONS)
         for d, dv, row_tiles, warps, keys, row_warps, stages, copy in (
             (128, 128, 1, 4, 16, 1, 2, 16), (256, 256, 1, 4, 16, 1, 2, 16),
             (64, 64, 4, 4, 16, 1, 2, 16), (128, 128, 2, 4, 16, 1, 2, 16),
             (64, 64, 1, 4, 16, 1, 2, 16), (33, 200, 1, 4, 16, 1, 2, 2),
             (128, 128, 1, 2, 32, 2, 2, 16), (64, 64, 1, 1, 64, 4, 2, 16),
             (256, 256, 1, 1, 64, 4, 2, 16))]
# Variable-length calls (sequences.cuh): each family once more with the tile tables, the
# forwards also with the block table (paged K/V); the backwards have no single pass there.
VARLEN = ["VARLEN=1", "PAGED=1"]
# Nor the cut GQA groups or dQ key shares, which run dense grids only.
JOBS += [(name, arch, [{"ORDERED=1": "ORDERED=0", "SINGLE_PASS=1": "SINGLE_PASS=0"}.get(d, d)
                       for d in defines]
          + (["VARLEN=1"] if "backward" in name else VARLEN), *options)
         for name, arch, defines, *options in JOBS
         if (name != "attention_decode.cu" or "ROWS=16" in defines)
         and not any(d.startswith(("SPLIT_KEYS", "GROUP_SPLITS")) for d in defines)]
# The Hopper forward once more with pages that hold whole key tiles (PAGES_HOLD_TILES).
JOBS += [(name, arch, defines + ["PAGES_HOLD_TILES=1"], *options)
         for name, arch, defines, *options in JOBS
         if name == "attention_wgmma_forward.cu" and "PAGED=1" in defines]
# The mma.sync single pass with a dQ slot per key block (DQ_PARTS; dense calls only), on
# 16-row query tiles: few query rows.
JOBS += [("attention_mma_backward.cu", "90",
          [d for d in BACKWARD if not d.startswith("SINGLE_PASS")]
          + [f"IS_FLOAT32={f32}", "ORDERED=0", "SINGLE_PASS=1", "DQ_PARTS=1",
             "OWNED_ROWS=64", "STREAMED_ROWS=16"]) for f32 in (0, 1)]


NO_BAND = ["ALIBI=0", "DROPOUT=0", "LIMIT_LEFT=0", "LIMIT_RIGHT=0", "SOFTCAP=0"]
CAUSAL = ["ALIBI=0", "DROPOUT=0", "LIMIT_LEFT=0", "LIMIT_RIGHT=1", "SOFTCAP=0"]
_WGMMA_ROWS = [  # (head dim, (dq owned, streamed), (dkdv owned, streamed), stages, split)
    (64, (192, 64), (192, 64), 3, False), (128, (192, 64), (128, 64), 2, False),
    (128, (192, 64), (128, 64), 3, False), (192, (128, 64), (128, 64), 2, True),
    (256, (128, 32), (128, 32), 2, True)]


def _backward_rows(extra: list[str]):
    """(source, arch, defines, options) of the 16-bit backward rows, per option set, with
    `extra` defines."""
    jobs = []
    for options in (NO_BAND, CAUSAL, EVERY_OPTION):
        for dim, dq, dkdv, stages, split in _WGMMA_ROWS:
            for part in ((1, 2) if split else (0,)):
                for entry, (owned, streamed) in (("dq", dq), ("dkdv", dkdv)):
                    if entry == "dq" and part == 2:
                        continue
                    jobs.append(("attention_wgmma_backward.cu", "90a",
                                 ["COPY_BYTES=16", f"DKDV_PART={part}", "IS_BFLOAT16=0",
                                  "SINGLE_PASS=0", f"HEAD_DIM={dim}", f"VALUE_DIM={dim}",
                                  f"OWNED_ROWS={owned}", f"STREAMED_ROWS={streamed}",
                                  f"STAGES={stages}", f"ENTRY={entry}"] + extra, options))
        for dim, owned, streamed in ((64, 128, 64), (128, 128, 64), (128, 64, 64)):
            jobs.append(("attention_mma_backward.cu", "90",
                         ["COPY_BYTES=16", "DKDV_PART=0", "IS_BFLOAT16=0", "IS_FLOAT32=0",
                          "ORDERED=0", "SINGLE_PASS=1", f"HEAD_DIM={dim}", f"VALUE_DIM={dim}",
                          f"OWNED_ROWS={owned}", f"STREAMED_ROWS={streamed}"] + extra,
                         options))
    return jobs


def _strided(jobs: list) -> list:
    """The backward and group-sum jobs of `jobs` with STRIDED_OUT=1, where the launchers
    compile it: not with the single pass or a cut GQA group (contiguous parts)."""
    chosen = []
    for name, arch, defines, *options in jobs:
        if ("backward" not in name and name != "group_sum.cu") or "SINGLE_PASS=1" in defines \
                or any(d.startswith("GROUP_SPLITS") for d in defines):
            continue
        chosen.append((name, arch, defines + ["STRIDED_OUT=1"], *options))
    return chosen


def _decode_shared(defines) -> list[str]:
    """-DEXPECTED_SHARED_BYTES from DecodeTiles.shared_bytes (DecodeMmaTiles'), which the
    kernel asserts."""
    from tileattn.gpu.tiles import DecodeMmaTiles, DecodeTiles

    value = dict(d.split("=") for d in defines)
    if "ROW_TILES" in value:
        tiles = DecodeMmaTiles(int(value["ROW_TILES"]), int(value["WARPS"]),
                               int(value["WARP_KEYS"]), int(value["STAGES"]), 1,
                               int(value["ROW_WARPS"]))
        shared = tiles.shared_bytes(int(value["HEAD_DIM"]), int(value["VALUE_DIM"]))
        return [f"EXPECTED_SHARED_BYTES={shared}"]
    itemsize = {"half_storage": 2, "bfloat16_storage": 2, "float": 4, "double": 8}[value["STORAGE"]]
    tiles = DecodeTiles(int(value["ROWS"]), int(value["BLOCK_K"]), int(value["STAGES"]),
                        int(value["THREADS"]), 1)
    accum = 8 if value["ACCUM"] == "double" else 4
    return [f"EXPECTED_SHARED_BYTES={tiles.shared_bytes(itemsize, accum, int(value['HEAD_DIM']), int(value['VALUE_DIM']))}"]


def compile_one(job, directory: str) -> str:
    index, (name, arch, defines, *options) = job
    options = options[0] if options else EVERY_OPTION
    if name.startswith("attention_decode"):
        defines = defines + _decode_shared(defines)
    path = os.path.join(directory, f"{index}_{name}")
    with open(path, "w") as handle:
        handle.write(source(name))
    command = ["nvcc", "-cubin", f"-arch=sm_{arch}", "-std=c++17", "-ftz=true", "-Xptxas", "-v",
               "-o", path + ".cubin", path] + [f"-D{d}" for d in defines + options]
    result = subprocess.run(command, capture_output=True, text=True)
    output = result.stdout + result.stderr
    if result.returncode:
        return f"{name}: FAILED\n{output[:4000]}"
    entry = next((d.split("=")[1] for d in defines if d.startswith("ENTRY=")), None)
    report, function = [], ""
    for line in output.splitlines():
        if "Compiling entry function" in line:
            function = line.split("'")[1]
        if entry and not function.endswith(f"_{entry}_wgmma"):
            continue
        if "registers" in line or ("spill" in line and " 0 bytes spill" not in line):
            shown_line = line.split("info    :")[-1].strip()
            if entry or "SINGLE_PASS=1" in defines:
                shown_line = f"{function.split('attention_')[-1][:24]}: {shown_line}"
            report.append(shown_line)
    decode_keys = ('STORAGE', 'ROWS', 'HEAD_DIM', 'VALUE_DIM', 'BLOCK_K', 'THREADS', 'ROW_TILES',
                   'STAGES', 'WARPS', 'WARP_KEYS', 'ROW_WARPS')
    shown = ' '.join(d for d in defines if d.startswith(('IS_', 'VARLEN'))
                     or name.startswith('attention_decode') and d.startswith(decode_keys))
    if entry or "SINGLE_PASS=1" in defines:
        shown = ' '.join(d for d in defines if d.startswith(
            ('HEAD_DIM', 'OWNED', 'STREAMED', 'STAGES', 'DKDV', 'ENTRY', 'SINGLE')))
        shown += ' ' + {id(NO_BAND): 'none', id(CAUSAL): 'causal'}.get(id(options), 'every')
    return f"{name} ({shown}): ok; " + " | ".join(report)


def _decode_register_jobs() -> list:
    """(source, arch, defines, options) of every DECODE_MMA_REGISTERS row, dense and paged."""
    from tileattn.gpu.tiles import DECODE_MMA_REGISTERS

    jobs = []
    for (width, value_width, row_tiles, row_warps, warps, keys) in DECODE_MMA_REGISTERS:
        for paged in (0, 1):
            jobs.append(("attention_decode_mma.cu", "90",
                         ["COPY_BYTES=16", "Q_COPY_BYTES=16", f"FUSED_MERGE={int(row_warps == 1)}",
                          "IS_BFLOAT16=0", f"HEAD_DIM={width}", f"VALUE_DIM={value_width}",
                          f"ROW_TILES={row_tiles}", f"WARPS={warps}", "MIN_BLOCKS=1",
                          f"ROW_WARPS={row_warps}", f"WARP_KEYS={keys}", "STAGES=2",
                          f"VARLEN={paged}", f"PAGED={paged}"], NO_BAND))
    return jobs


def _check_decode_registers(job, result: str) -> str:
    """`result` with the table's count and both residencies (blocks an SM by registers)."""
    import re

    from tileattn.gpu.tiles import DECODE_MMA_REGISTERS, SM_REGISTERS, DecodeMmaTiles

    value = dict(d.split("=") for d in job[2])
    tiles = DecodeMmaTiles(int(value["ROW_TILES"]), int(value["WARPS"]), int(value["WARP_KEYS"]),
                           2, 1, int(value["ROW_WARPS"]))
    found = re.search(r"Used (\d+) registers", result)
    if not found:
        return result
    used = -(-int(found.group(1)) // 8) * 8
    table = DECODE_MMA_REGISTERS[(int(value["HEAD_DIM"]), int(value["VALUE_DIM"]),
                                  tiles.row_tiles, tiles.row_warps, tiles.warps,
                                  tiles.warp_keys)]
    by_ptxas, by_table = (SM_REGISTERS // (tiles.threads * count) for count in (used, table))
    verdict = "same residency" if by_ptxas == by_table else "RESIDENCY DIFFERS"
    return (f"{result} | table {table}: {by_table} blocks an SM, ptxas {used}: {by_ptxas}, "
            f"{verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", help="keep the spliced sources and cubins in this folder")
    parser.add_argument("--backward-rows", action="store_true",
                        help="the 16-bit backward rows, no band / causal / every option")
    parser.add_argument("--flag-keys", action="store_true",
                        help="--backward-rows with FLAG_NON_FINITE_KEYS=1 (a query tail)")
    parser.add_argument("--strided", action="store_true",
                        help="the backward kernels and group_sum with STRIDED_OUT=1")
    parser.add_argument("--source", help="only the jobs of this .cu file")
    parser.add_argument("--decode-registers", action="store_true",
                        help="tiles.DECODE_MMA_REGISTERS against ptxas")
    args = parser.parse_args()
    extra = ["FLAG_NON_FINITE_KEYS=1"] if args.flag_keys else []
    jobs = _backward_rows(extra) if args.backward_rows else JOBS
    if args.decode_registers:
        jobs = _decode_register_jobs()
    if args.strided:
        jobs = _strided(jobs)
    if args.source:
        jobs = [job for job in jobs if job[0] == args.source]
    directory = args.keep or tempfile.mkdtemp(prefix="tileattn-nvcc-")
    os.makedirs(directory, exist_ok=True)
    with ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 4)) as pool:
        results = list(pool.map(lambda job: compile_one(job, directory), enumerate(jobs)))
    if args.decode_registers:
        results = [_check_decode_registers(job, result) for job, result in zip(jobs, results)]
    print("\n".join(results))
    sys.exit(any("FAILED" in r for r in results))


if __name__ == "__main__":
    main()
