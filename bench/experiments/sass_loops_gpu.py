"""What one kernel build executes per loop trip, read from its SASS with no GPU: the kernel
compiled by nvcc with the given defines, ptxas's registers and spills, then every loop
(a backward branch) with its instruction count and opcode mix, and the loads from local
memory (spills) inside each.

    PYTHONPATH=. python3 bench/experiments/sass_loops_gpu.py attention_decode_mma.cu \\
        HEAD_DIM=128 VALUE_DIM=128 ROW_TILES=1 WARPS=2 ROW_WARPS=2 WARP_KEYS=32 STAGES=2 \\
        MIN_BLOCKS=2 [--options ALIBI=1 ...] [--arch 90] [--sass FILE]

Defines not given take the decode's defaults below (16-byte copies, float16, no score
option, dense); `--options` replaces the score switches. attention_decode*.cu builds get
the EXPECTED_SHARED_BYTES their layout asserts. Needs nvcc and cuobjdump: on a machine
without the CUDA toolkit's cuobjdump, `pip download nvidia-cuda-cuobjdump --no-deps` and
unzip the wheel (its binary is nvidia/cu13/bin/cuobjdump), then pass `--cuobjdump PATH` or
put it on the PATH.

A static count: a loop's branches (a masked tile, a rescale taken only when a maximum
moves) are all counted; read the dump (`--sass`) for the path a trip takes. The decode's
main loop went from 794 to ~363 instructions a trip this way (bench/NOTES-gpu.md v55).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))
from tileattn.gpu._compile import source  # noqa: E402

DEFAULTS = ["COPY_BYTES=16", "Q_COPY_BYTES=16", "IS_BFLOAT16=0", "L2_PREFETCH=128",
            "FUSED_MERGE=0", "MIN_BLOCKS=1"]
NO_OPTIONS = ["ALIBI=0", "DROPOUT=0", "LIMIT_LEFT=0", "LIMIT_RIGHT=0", "SOFTCAP=0"]
INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
BRANCH = re.compile(r"\bBRA\s+(?:\S+\s+)?(0x[0-9a-f]+)")


def _merged(defaults: list[str], given: list[str]) -> list[str]:
    names = {d.split("=")[0] for d in given}
    return [d for d in defaults if d.split("=")[0] not in names] + given


def build(name: str, defines: list[str], arch: str, directory: str) -> tuple[str, str]:
    """(ptxas's report, the cubin's path) of `name` built with `defines`."""
    if name.startswith("attention_decode"):
        from compile_check_gpu import _decode_shared

        defines = defines + _decode_shared(defines)
    path = os.path.join(directory, name)
    with open(path, "w") as handle:
        handle.write(source(name))
    cubin = path + ".cubin"
    result = subprocess.run(["nvcc", "-cubin", f"-arch=sm_{arch}", "-std=c++17", "-ftz=true",
                             "-Xptxas", "-v", "-o", cubin, path]
                            + [f"-D{d}" for d in defines], capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(result.stderr[-4000:])
    report = [line.split("info    :")[-1].strip() for line in result.stderr.splitlines()
              if "Used" in line or ("spill" in line and " 0 bytes spill" not in line)]
    return " | ".join(report), cubin


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text) in order, predicates kept."""
    return [(int(m.group(1), 16), m.group(2).strip())
            for m in (INSTRUCTION.match(line) for line in sass.splitlines()) if m]


def loops(code: list[tuple[int, str]]):
    """(start, end, instructions) of each backward branch's range, innermost first."""
    index = {address: i for i, (address, _) in enumerate(code)}
    found = []
    for i, (address, text) in enumerate(code):
        match = BRANCH.search(text)
        if match and int(match.group(1), 16) <= address and int(match.group(1), 16) in index:
            start = index[int(match.group(1), 16)]
            found.append((code[start][0], address, code[start:i + 1]))
    return sorted(found, key=lambda loop: len(loop[2]))


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a .cu file of tileattn/gpu")
    parser.add_argument("defines", nargs="*", help="NAME=VALUE")
    parser.add_argument("--options", nargs="*", default=[],
                        help="score switches (ALIBI=1 ...); the rest stay 0")
    parser.add_argument("--arch", default="90")
    parser.add_argument("--cuobjdump", default=shutil.which("cuobjdump"))
    parser.add_argument("--sass", help="write the whole dump here")
    parser.add_argument("--top", type=int, default=12, help="opcodes shown a loop")
    args = parser.parse_args()
    if not args.cuobjdump:
        raise SystemExit("no cuobjdump: see this script's docstring")
    defines = _merged(_merged(DEFAULTS, NO_OPTIONS), args.options)
    defines = _merged(defines, args.defines)
    with tempfile.TemporaryDirectory() as directory:
        report, cubin = build(args.source, defines, args.arch, directory)
        sass = subprocess.run([args.cuobjdump, "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    if args.sass:
        with open(args.sass, "w") as handle:
            handle.write(sass)
    print(f"{args.source} {' '.join(args.defines + args.options)}\nptxas: {report}")
    code = instructions(sass)
    spills = [(address, text) for address, text in code if opcode(text) in ("LDL", "STL")]
    for start, end, body in loops(code):
        if len(body) < 4:  # the kernel's closing self-branch
            continue
        counts = collections.Counter(opcode(text) for _, text in body)
        local = sum(1 for address, _ in spills if start <= address <= end)
        print(f"loop {start:#x}-{end:#x}: {len(body)} instructions, "
              f"{local} local loads/stores\n  "
              + ", ".join(f"{name} {n}" for name, n in counts.most_common(args.top)))


if __name__ == "__main__":
    main()
