"""Command line: ``python -m tileattn check | info | bench``."""

from __future__ import annotations

import argparse
import sys

DTYPES = ["float16", "bfloat16", "float32", "float64"]


def _dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return name


def _shape_arguments(parser, seq_len):
    parser.add_argument("--seq-len", type=int, default=seq_len)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=DTYPES)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tileattn", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    check = commands.add_parser(
        "check", help="run every available backend against the golden model, with times")
    _shape_arguments(check, 512)
    check.add_argument("--no-causal", dest="causal", action="store_false")
    check.add_argument("--backend", action="append", dest="names",
                       help="backend to check (repeatable); default: all")

    info = commands.add_parser(
        "info", help="backends, device, cache sizes, chosen tiles, modelled memory traffic")
    _shape_arguments(info, 4096)
    info.add_argument("--no-causal", dest="causal", action="store_false")

    bench = commands.add_parser(
        "bench", help="correctness check, then speed and memory against N vs the anchors")
    bench.add_argument("--backend", choices=["cpu", "gpu"], default=None,
                       help="default: gpu when available, else cpu")
    bench.add_argument("--quick", action="store_true", help="a smaller sweep (about a minute)")
    bench.add_argument("--out", default=None, help="folder for JSON, markdown and PNG plots")
    bench.add_argument("--sizes", type=int, nargs="+", default=None,
                       help="sequence lengths to time")
    bench.add_argument("--head-dims", type=int, nargs="+", default=[64],
                       help="head dims to sweep (memory is measured at the first)")
    bench.add_argument("--heads", type=int, default=None)
    bench.add_argument("--batch", type=int, default=1)
    bench.add_argument("--dtype", default="float32", choices=DTYPES)

    args = parser.parse_args(argv)
    if args.command == "check":
        from .check import run_check

        ok = run_check(batch=args.batch, heads=args.heads or 4, seq_len=args.seq_len,
                       head_dim=args.head_dim, dtype=_dtype(args.dtype), causal=args.causal,
                       names=args.names)
        return 0 if ok else 1
    if args.command == "info":
        from .info import describe

        describe(seq_len=args.seq_len, head_dim=args.head_dim, heads=args.heads or 8,
                 batch=args.batch, dtype=_dtype(args.dtype), causal=args.causal)
        return 0
    from . import backends
    from .benchmark import run_bench

    backend = args.backend or ("gpu" if backends.availability("gpu") is None else "cpu")
    run_bench(backend=backend, quick=args.quick, out=args.out, dtype=_dtype(args.dtype),
              head_dims=args.head_dims, batch=args.batch, heads=args.heads, sizes=args.sizes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
