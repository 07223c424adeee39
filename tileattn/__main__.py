"""Command line: ``python -m tileattn check | info | bench | warmup``.

Every argument is checked before anything runs, as the API checks its arguments: a bad
value gets one line on stderr naming the argument and the value, and exit status 2; a
backend that cannot run, or a run that fails, gets one line and exit status 1. Never a
traceback for something the user typed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

DTYPES = ["float16", "bfloat16", "float32", "float64"]
FAST_BACKENDS = ["cpu", "gpu"]

# info's traffic model walks every query row in Python (about a second per million rows).
INFO_MAX_SEQ_LEN = 2 ** 22
# info plans the call on each backend, whose per-(batch, head) tables (ALiBi's slopes, even
# zero ones) then take 8 bytes a query head: 32 MiB at this bound.
INFO_MAX_QUERY_HEADS = 2 ** 22
# Beyond these a shape describes no call anyone runs, and the reports' byte counts must
# stay numbers a float holds (--batch 10**310 would overflow them). Lengths stay in the
# int32 the kernels take for counts.
MAX_LENGTH = 2 ** 31 - 1
MAX_HEADS = 2 ** 16
MAX_BATCH = 2 ** 16
MAX_HEAD_DIM = 2 ** 16


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block above it)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str, maximum: int = MAX_LENGTH) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    if value > maximum:
        raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
    return value


def _positive_at_most(maximum: int):
    """`_positive_int` with its own maximum, as an argparse type."""
    def positive(text: str) -> int:
        return _positive_int(text, maximum)

    return positive


_heads = _positive_at_most(MAX_HEADS)
_batch = _positive_at_most(MAX_BATCH)
_head_dim = _positive_at_most(MAX_HEAD_DIM)


def _dtype_name(text: str) -> str:
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(DTYPES)}, got {text!r}")
    if text == "bfloat16":
        try:
            import ml_dtypes  # noqa: F401  (NumPy knows bfloat16 only through ml_dtypes)
        except ImportError:
            raise argparse.ArgumentTypeError(
                "bfloat16 needs ml_dtypes, which is not installed: pip install ml_dtypes") \
                from None
    return text


def _dtype(name: str):
    import numpy as np

    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _shape_arguments(parser, seq_len, heads, max_seq_len=None):
    seq_help = f"sequence length N (default {seq_len}"
    seq_help += f", at most {max_seq_len})" if max_seq_len else ")"
    parser.add_argument("--seq-len", type=_positive_int, default=seq_len, help=seq_help)
    parser.add_argument("--heads", type=_heads, default=heads,
                        help=f"heads (default {heads}, at most {MAX_HEADS})")
    parser.add_argument("--head-dim", type=_head_dim, default=64,
                        help=f"D (default 64, at most {MAX_HEAD_DIM})")
    parser.add_argument("--batch", type=_batch, default=1,
                        help=f"batch (default 1, at most {MAX_BATCH})")
    parser.add_argument("--dtype", type=_dtype_name, default="float32", metavar="DTYPE",
                        help=f"one of {', '.join(DTYPES)} (default float32)")
    parser.add_argument("--no-causal", dest="causal", action="store_false",
                        help="no causal mask")


def _parser():
    from . import backends

    parser = _Parser(prog="python -m tileattn", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    check = commands.add_parser(
        "check", help="run every available backend against the golden model, with times")
    _shape_arguments(check, 512, 4)
    check.add_argument("--backend", action="append", dest="names",
                       choices=list(backends.REGISTRY),
                       help="backend to check (repeatable); default: every available one")

    info = commands.add_parser(
        "info", help="backends, device, cache sizes, chosen tiles, modelled memory traffic")
    _shape_arguments(info, 4096, 8, max_seq_len=INFO_MAX_SEQ_LEN)
    info.add_argument("--value-dim", type=_head_dim, default=None,
                      help=f"Dv (default: the head dim; at most {MAX_HEAD_DIM})")
    info.add_argument("--n-k", type=_positive_int, default=None,
                      help="keys Nk (default: --seq-len, which is then Nq); e.g. --seq-len 1 "
                           "--n-k 131072 shows a decode step's kernel")
    info.add_argument("--kv-heads", type=_heads, default=None,
                      help="K/V heads Hkv (default: --heads; fewer for GQA/MQA; at most "
                           f"{MAX_HEADS})")

    bench = commands.add_parser(
        "bench", help="correctness check, then speed and memory against N vs the anchors")
    bench.add_argument("--backend", choices=FAST_BACKENDS, default=None,
                       help="default: gpu when available, else cpu")
    bench.add_argument("--quick", action="store_true",
                       help="a smaller sweep (about a minute on 2 cores)")
    bench.add_argument("--out", default=None,
                       help="folder for bench-BACKEND.json, bench-BACKEND.md and the plots "
                            "speed-BACKEND.png and memory-BACKEND.png")
    bench.add_argument("--sizes", type=_positive_int, nargs="+", default=None, metavar="N",
                       help="sequence lengths to time")
    bench.add_argument("--head-dims", type=_head_dim, nargs="+", default=[64],
                       metavar="D", help="head dims to sweep (memory is measured at the first)")
    bench.add_argument("--heads", type=_heads, default=None,
                       help="default: 8 on the CPU, 32 on the GPU")
    bench.add_argument("--batch", type=_batch, default=1)
    bench.add_argument("--dtype", type=_dtype_name, default="float32", metavar="DTYPE",
                       help=f"one of {', '.join(DTYPES)} (default float32)")

    warmup = commands.add_parser(
        "warmup", help="compile the kernels ahead of the first call, with a progress bar")
    warmup.add_argument("--dtype", type=_dtype_name, action="append", dest="dtypes",
                        metavar="DTYPE",
                        help=f"one of {', '.join(DTYPES)} (repeatable); default: all")
    warmup.add_argument("--backend", action="append", dest="names", choices=FAST_BACKENDS,
                        help="backend to warm up (repeatable); default: every available one")
    return parser, commands.choices


class _Failure(Exception):
    """A run that cannot go on: its message is the one line the user sees (exit status 1)."""


def _require(names):
    """Load each backend named on the command line, or fail with the reason it cannot run."""
    from . import backends

    modules = {}
    for name in names:
        reason = backends.availability(name)
        if reason is not None:
            raise _Failure(reason)
        modules[name] = backends.load(name)
    return modules


def _check(parser, args) -> int:
    from .check import available_memory_bytes, golden_model_bytes, run_check

    needed = golden_model_bytes(args.batch, args.heads, args.seq_len, args.head_dim)
    available = available_memory_bytes()
    if needed > available:
        parser.error(f"--seq-len {args.seq_len} with --batch {args.batch} --heads {args.heads} "
                     f"--head-dim {args.head_dim} needs about {needed / 1e9:.1f} GB for the "
                     "golden model, which holds N x N float64 matrices; "
                     f"{available / 1e9:.1f} GB are available")
    if args.names:
        _require(args.names)
    try:
        ok = run_check(batch=args.batch, heads=args.heads, seq_len=args.seq_len,
                       head_dim=args.head_dim, dtype=_dtype(args.dtype), causal=args.causal,
                       names=args.names)
    except MemoryError:
        raise _Failure(f"out of memory at --seq-len {args.seq_len}: try a smaller one") \
            from None
    if not ok:
        raise _Failure("the check failed (see above)")
    return 0


def _info(parser, args) -> int:
    from .info import describe

    if args.seq_len > INFO_MAX_SEQ_LEN:
        parser.error(f"argument --seq-len: at most {INFO_MAX_SEQ_LEN} (the traffic model "
                     f"walks every row in Python), got {args.seq_len}")
    if args.n_k is not None and args.n_k > INFO_MAX_SEQ_LEN:
        parser.error(f"argument --n-k: at most {INFO_MAX_SEQ_LEN}, got {args.n_k}")
    if args.kv_heads is not None and args.heads % args.kv_heads:
        parser.error(f"argument --kv-heads: must divide --heads={args.heads}, got {args.kv_heads}")
    if args.batch * args.heads > INFO_MAX_QUERY_HEADS:
        parser.error(f"arguments --batch and --heads: their product at most "
                     f"{INFO_MAX_QUERY_HEADS} (info plans the call), got "
                     f"{args.batch} x {args.heads} = {args.batch * args.heads}")
    describe(seq_len=args.seq_len, n_k=args.n_k, head_dim=args.head_dim,
             value_dim=args.value_dim, heads=args.heads, kv_heads=args.kv_heads,
             batch=args.batch, dtype=_dtype(args.dtype), causal=args.causal)
    return 0


def _bench(parser, args) -> int:
    from . import backends
    from .benchmark import benchmark_bytes, default_memory_sizes, default_sizes, run_bench
    from .check import available_memory_bytes

    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"argument --out: {args.out!r} exists and is not a folder")
    name = args.backend or ("gpu" if backends.availability("gpu") is None else "cpu")
    module = _require([name])[name]
    heads = args.heads or (8 if module.MEMORY == "host" else 32)
    largest = max(args.sizes or default_sizes(module.MEMORY, args.quick))
    needed = benchmark_bytes(args.batch, heads, largest, max(args.head_dims),
                             _dtype(args.dtype).itemsize)
    available = available_memory_bytes()
    if module.MEMORY == "host" and needed > available:
        parser.error(f"N={largest} (--sizes) with --batch {args.batch}, {heads} heads and "
                     f"D={max(args.head_dims)} (--head-dims) needs about {needed / 1e9:.1f} "
                     f"GB of arrays; {available / 1e9:.1f} GB are available")
    swept = max(default_memory_sizes(args.quick))
    needed = benchmark_bytes(1, 1, swept, args.head_dims[0], _dtype(args.dtype).itemsize)
    if module.MEMORY == "host" and needed > available:
        parser.error(f"the memory sweep (one head up to N={swept}) at D={args.head_dims[0]} "
                     f"(the first --head-dims) needs about {needed / 1e9:.1f} GB of arrays; "
                     f"{available / 1e9:.1f} GB are available")
    # Created only once every value is known to run: a refused call leaves no folder behind.
    if args.out is not None:
        try:
            os.makedirs(args.out, exist_ok=True)
        except OSError as error:
            parser.error(f"argument --out: cannot create {args.out!r} ({error.strerror})")
        if not os.access(args.out, os.W_OK):
            parser.error(f"argument --out: cannot write into {args.out!r}")
    try:
        run_bench(backend=name, quick=args.quick, out=args.out, dtype=_dtype(args.dtype),
                  head_dims=args.head_dims, batch=args.batch, heads=heads, sizes=args.sizes)
    # A failed correctness check, a problem a backend refuses, memory, writing --out.
    except (RuntimeError, ValueError, MemoryError, OSError) as error:
        raise _Failure(f"{type(error).__name__}: {error}") from None
    return 0


def _warmup(parser, args) -> int:
    from . import backends
    from .benchmark import draw_progress

    if args.names:
        modules = _require(args.names)
    else:
        modules = {name: backends.load(name) for name in FAST_BACKENDS
                   if backends.availability(name) is None}
        if not modules:
            raise _Failure("no backend that compiles kernels can run here: "
                           + "; ".join(backends.availability(name) for name in FAST_BACKENDS))
    dtypes = None if not args.dtypes else tuple(_dtype(name) for name in args.dtypes)
    dtype_names = ", ".join(args.dtypes) if args.dtypes else "every dtype"
    warmed = []
    for name, module in modules.items():
        warmup = getattr(module, "warmup", None)
        if warmup is None:
            message = (f"the {name} backend has no warmup in this version of tileattn: its "
                       "kernels compile on first use")
            if args.names:
                raise _Failure(message)
            print(f"{name}: skipped: {message}")
            continue
        print(f"{name}: compiling for {dtype_names}", file=sys.stderr)
        start = time.perf_counter()
        warmup(dtypes=dtypes, progress=draw_progress)
        print(f"{name}: ready for {dtype_names} in {time.perf_counter() - start:.1f} s")
        warmed.append(name)
    if not warmed:
        raise _Failure("nothing was warmed up")
    return 0


def main(argv=None) -> int:
    from .backends import BackendUnavailableError

    parser, subparsers = _parser()
    args = parser.parse_args(argv)
    command = {"check": _check, "info": _info, "bench": _bench, "warmup": _warmup}
    subparser = subparsers[args.command]
    try:
        return command[args.command](subparser, args)
    except (_Failure, BackendUnavailableError) as error:
        print(f"{subparser.prog}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
