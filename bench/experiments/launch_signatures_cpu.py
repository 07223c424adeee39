"""Check every kernel launch of the GPU backend's Python against the kernel's own C
signature, no GPU: the launchers run on a stand-in for CuPy (emulate_decode_cpu.py's) whose
kernels, instead of running, compare the arguments they get with the parameters of their
entry point in the source as the launcher compiled it (preprocessed by g++ -E with the same
defines): the count, and each argument's kind (array or pointer, and the width and type of
a scalar: i64, int, u32, float, double).

    python3 bench/experiments/launch_signatures_cpu.py

A launcher that passes one argument too few or too many, or an int where the kernel takes
an i64, would misread every later parameter on a GPU; here it fails with the kernel, the
position and both types. Forwards and backwards of the tensor-core families (wgmma, mma.sync,
3xTF32), the generic kernels, decode, split keys, GQA group sums, and "bshd" outputs. Last,
a wgmma backward with tiles named beside the table's cached plan for the same problem must
launch kernels compiled for the named tiles (the plan cache is keyed by the problem).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from emulate_decode_cpu import _install_cupy_standin  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

# C parameter type (after preprocessing) -> what the launcher must pass.
SCALARS = {"i64": np.int64, "long long": np.int64, "int": np.int32, "u32": np.uint32,
           "unsigned int": np.uint32, "unsigned": np.uint32, "float": np.float32,
           "double": np.float64}


@functools.lru_cache(maxsize=None)
def signature(source_name: str, entry: str, defines: tuple) -> tuple:
    """The kinds of `entry`'s parameters: "pointer" or a NumPy scalar type."""
    from tileattn.gpu._compile import source

    with tempfile.NamedTemporaryFile("w", suffix=".cu", delete=False) as handle:
        handle.write(source(source_name).replace('#include "', '// #include "'))
        path = handle.name
    command = ["g++", "-E", "-P", "-x", "c++", path, "-D__global__=", "-D__device__=",
               "-D__forceinline__=", "-D__launch_bounds__(...)="] + [
        f"-D{name}={value}" for name, value in defines]
    text = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    os.unlink(path)
    match = re.search(r'extern\s+"C"\s+void\s+' + re.escape(entry) + r"\s*\(([^)]*)\)", text)
    assert match, f"{entry} not found in {source_name}"
    accum = "double" if dict(defines).get("ACCUM") == "double" else "float"
    real = "double" if str(dict(defines).get("IS_FLOAT64")) == "1" else "float"
    aliases = {"ACCUM": accum, "Acc": accum, "real": real, "score_real": real}
    kinds = []
    for parameter in match.group(1).split(","):
        words = parameter.replace("const", " ").split()
        if "*" in parameter:
            kinds.append("pointer")
            continue
        # The type and a name, or the type alone (`u32 /*unused*/`, comments gone).
        named = " ".join(words[:-1])
        type_name = named if named in SCALARS or named in aliases else " ".join(words)
        type_name = aliases.get(type_name, type_name)
        assert type_name in SCALARS, f"{entry}: parameter type {type_name!r}"
        kinds.append(SCALARS[type_name])
    return tuple(kinds)


class SignatureKernel:
    """A RawKernel stand-in that checks its arguments and runs nothing."""

    max_dynamic_shared_size_bytes = 48 * 1024
    launches: list = []
    defines: list = []  # each launch's compile-time defines, in launch order

    def __init__(self, source_name, entry, defines):
        self.source_name, self.entry, self.defines = source_name, entry, tuple(defines)
        self.kinds = signature(source_name, entry, self.defines)

    def __call__(self, grid, block, args, shared_mem=0):
        SignatureKernel.launches.append(self.entry)
        SignatureKernel.defines.append(dict(self.defines))
        label = f"{self.source_name}:{self.entry}"
        assert len(args) == len(self.kinds), (
            f"{label}: {len(args)} arguments for {len(self.kinds)} parameters")
        for position, (arg, kind) in enumerate(zip(args, self.kinds)):
            if kind == "pointer":
                assert isinstance(arg, np.ndarray), (
                    f"{label} #{position}: {type(arg)} for a pointer")
            else:
                assert not isinstance(arg, np.ndarray) and np.dtype(type(arg)) == np.dtype(kind), (
                    f"{label} #{position}: {type(arg).__name__} for {np.dtype(kind).name}")


def main() -> int:
    standin = _install_cupy_standin()
    standin.zeros = lambda shape, dtype=float: np.zeros(shape, dtype=dtype).view(standin.ndarray)
    standin.full = lambda shape, value, dtype=float: np.full(shape, value, dtype).view(
        standin.ndarray)
    standin.ascontiguousarray = lambda a, dtype=None: np.ascontiguousarray(a, dtype).view(
        standin.ndarray)
    standin.float32, standin.float64 = np.float32, np.float64
    standin.int32, standin.int64, standin.uint8 = np.int32, np.int64, np.uint8
    standin.cuda.runtime.getDevice = lambda: 0
    from tileattn.gpu import _compile, launch_backward, launch_forward, operands
    from tileattn.gpu import tiles as tile_tables
    from tileattn.gpu.operands import problem_of
    from tileattn.validation import validate

    _compile.kernel = lambda source_name, entry, defines, shared=0, arch=None: (
        SignatureKernel(source_name, entry, defines))
    operands._PLANS.clear()
    rng = np.random.default_rng(0)
    failures = 0
    cases = [  # (dtype, (B, Hq, Hkv, Nq, Nk, D, Dv), options, families)
        ("float16", (2, 4, 2, 96, 96, 64, 64), {"causal": True}, ("wgmma", "mma")),
        ("float16", (1, 16, 1, 128, 256, 64, 64), {}, ("wgmma", "mma")),  # group sums
        ("float16", (1, 2, 2, 64, 8192, 128, 128), {}, ("wgmma", "mma")),  # dQ key shares
        ("float16", (2, 6, 3, 33, 50, 72, 40), {"softcap": 5.0}, ("wgmma", "mma")),
        ("float32", (2, 2, 1, 40, 70, 32, 24), {"window": (20, 3)}, ("tf32",)),
        # The single pass ("bshd": dq through attention_backward_dq_convert_strided; MHA: a
        # GQA group on so small a grid would be cut over blocks, which takes the two
        # kernels), in arrival order and in turns.
        ("float32", (2, 4, 4, 40, 70, 256, 256), {"causal": True, "deterministic": False},
         ("tf32",)),
        ("float32", (2, 3, 3, 40, 70, 128, 96), {"window": (20, 3)}, ("tf32",)),
        ("float16", (2, 2, 2, 40, 70, 64, 64), {"deterministic": False}, ("mma",)),
        ("float64", (1, 3, 3, 20, 33, 16, 8), {"causal": True}, ("f64",)),
        ("float64", (2, 4, 2, 20, 33, 128, 96),
         {"window": (9, 2), "alibi_slopes": np.linspace(0.1, 0.4, 4), "dropout_p": 0.1,
          "seed": 3}, ("f64",)),
        ("float64", (1, 3, 3, 20, 33, 200, 8), {"causal": True}, ("generic",)),
        ("float16", (1, 8, 1, 1, 3000, 128, 128), {}, ("decode",)),
        ("float32", (2, 4, 4, 2, 3000, 64, 64), {"causal": True}, ("decode",)),
    ]
    for dtype, (batch, hq, hkv, n_q, n_k, dim, value_dim), options, families in cases:
        q, k, v, do = (standin.asarray(rng.standard_normal(s).astype(dtype))
                       for s in ((batch, hq, n_q, dim), (batch, hkv, n_k, dim),
                                 (batch, hkv, n_k, value_dim), (batch, hq, n_q, value_dim)))
        resolved = validate(q, k, v, **{**dict(causal=False, window=None, scale=None,
                                               softcap=None, alibi_slopes=None, dropout_p=0.0,
                                               seed=None, block_q=None, block_k=None,
                                               deterministic=True), **options}).options
        for family in families:
            for layout in ("bhsd", "bshd"):
                label = f"{family} {dtype} q{q.shape} k{k.shape} {sorted(options)} {layout}"
                SignatureKernel.launches = []
                try:
                    def buffer(like, width=None):
                        shape = like.shape[:3] + (width or like.shape[3],)
                        if layout == "bhsd":
                            return standin.empty(shape, like.dtype)
                        return standin.empty((shape[0], shape[2], shape[1], shape[3]),
                                             like.dtype).swapaxes(1, 2)
                    problem = problem_of(q, k, v, resolved)
                    out = buffer(q, value_dim)
                    lse = standin.empty(q.shape[:3], np.float64 if dtype == "float64"
                                        else np.float32)
                    if family == "decode":
                        launch_forward.forward(q, k, v, resolved, out=out, lse_out=lse)
                    else:
                        forward_choice = tile_tables.choose_forward(problem)
                        if forward_choice.family == family or family == "generic":
                            launch_forward.launch(forward_choice, q, k, v, out, lse, resolved)
                        backward_choice = tile_tables.choose_backward(problem)
                        choice = (backward_choice if backward_choice.family == family or
                                  family in ("generic", "tf32", "f64")
                                  else tile_tables.Choice(family, _mma_rows(dim, value_dim)))
                        launch_backward.run(choice, do, q, k, v, out, lse, resolved,
                                            given=(buffer(q), buffer(k), buffer(v)))
                    print(f"ok {label}: {len(SignatureKernel.launches)} launches "
                          f"({', '.join(sorted(set(SignatureKernel.launches)))})", flush=True)
                except (AssertionError, AttributeError, TypeError, ValueError) as error:
                    print(f"FAILED {label}: {type(error).__name__}: {error}", flush=True)
                    failures += 1
    failures += _named_tiles_launch_their_own_kernels(standin, rng, resolved_options=validate)
    failures += _single_pass_into_parts(standin, rng, resolved_options=validate)
    print("all passed" if not failures else f"{failures} failed")
    return int(failures > 0)


def _named_tiles_launch_their_own_kernels(standin, rng, resolved_options) -> int:
    """The plan cache is keyed by the problem: after a backward of the table's choice left
    its plan there, a backward with other tiles named (a test's, a sweep's) must launch
    kernels compiled for those tiles, and leave the cache as it was. 1 when it does not."""
    from tileattn.gpu import launch_backward, operands
    from tileattn.gpu import tiles as tile_tables
    from tileattn.gpu.operands import problem_of

    q, k, v, do, o = (standin.asarray(rng.standard_normal((1, 2, 300, 64)).astype("float16"))
                      for _ in range(5))
    lse = standin.empty(q.shape[:3], np.float32)
    options = resolved_options(q, k, v, causal=True, window=None, scale=None, softcap=None,
                               alibi_slopes=None, dropout_p=0.0, seed=None, block_q=None,
                               block_k=None, deterministic=True).options
    table = tile_tables.choose_backward(problem_of(q, k, v, options))
    named = tile_tables.WgmmaBackwardTiles((128, 64), (128, 64), 2)
    operands._PLANS.clear()
    launch_backward.backward(do, q, k, v, o, lse, options)
    plans = dict(operands._PLANS)
    SignatureKernel.defines = []
    try:
        launch_backward.run(tile_tables.Choice("wgmma", named), do, q, k, v, o, lse, options)
    except Exception as error:  # a cached plan run in its place fails on the stand-in
        print(f"FAILED named wgmma backward tiles: {type(error).__name__}: {error}")
        return 1
    rows = {(d["OWNED_ROWS"], d["STREAMED_ROWS"], d.get("STAGES"))
            for d in SignatureKernel.defines if "OWNED_ROWS" in d}
    wanted = {(named.dq[0], named.dq[1], named.stages),
              (named.dkdv[0], named.dkdv[1], named.stages)}
    if table.tiles == named or not plans or rows != wanted or dict(operands._PLANS) != plans:
        print(f"FAILED named wgmma backward tiles: table {table.tiles}, launched "
              f"(owned, streamed, stages) {sorted(rows)} for {sorted(wanted)}, plans "
              f"{len(plans)} -> {len(operands._PLANS)}", flush=True)
        return 1
    print(f"ok named wgmma backward tiles {named} launch their own kernels beside the "
          f"table's cached plan ({table.tiles})", flush=True)
    return 0


def _single_pass_into_parts(standin, rng, resolved_options) -> int:
    """The mma.sync single pass with a dQ slot per key block (`backward_mma(dq_parts=True)`,
    DQ_PARTS), 16-bit and float32, dq contiguous and at "bshd" strides: the dK/dV kernel
    and the convert with the slots' count. 1 when a launch's arguments do not match."""
    from tileattn.gpu import launch_backward
    from tileattn.gpu import tiles as tile_tables

    failures = 0
    for dtype in ("float16", "float32"):
        q, k, v, do, o = (standin.asarray(rng.standard_normal((1, 2, n, 64)).astype(dtype))
                          for n in (5, 300, 300, 5, 5))
        lse = standin.empty(q.shape[:3], np.float32)
        options = resolved_options(q, k, v, causal=True, window=None, scale=None,
                                   softcap=None, alibi_slopes=None, dropout_p=0.0, seed=None,
                                   block_q=None, block_k=None, deterministic=True).options
        for layout in ("bhsd", "bshd"):
            dq = (standin.empty(q.shape, q.dtype) if layout == "bhsd" else
                  standin.empty((1, 5, 2, 64), q.dtype).swapaxes(1, 2))
            label = f"mma single pass into parts {dtype} {layout}"
            SignatureKernel.launches = []
            SignatureKernel.defines = []
            try:
                launch_backward.backward_mma(do, q, k, v, o, lse, options,
                                             tile_tables.MmaBackwardTiles((64, 64), (64, 16)),
                                             single_pass=True, given=(dq, None, None),
                                             dq_parts=True)
                assert any(defines.get("DQ_PARTS") == 1
                           for defines in SignatureKernel.defines), "no DQ_PARTS kernel"
                print(f"ok {label}: {', '.join(sorted(set(SignatureKernel.launches)))}",
                      flush=True)
            except (AssertionError, AttributeError, TypeError, ValueError) as error:
                print(f"FAILED {label}: {type(error).__name__}: {error}", flush=True)
                failures += 1
    return failures


def _mma_rows(dim: int, value_dim: int):
    from tileattn.gpu import tiles

    return tiles.MmaBackwardTiles((64, 64), (64, 64)) if max(dim, value_dim) <= 128 else \
        tiles.MmaBackwardTiles((64, 32), (64, 32), split=True)


if __name__ == "__main__":
    sys.exit(main())
