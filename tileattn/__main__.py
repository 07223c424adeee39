"""Command line: ``python -m tileattn check``."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tileattn", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "check", help="run every available backend against the golden model, with times")
    check.add_argument("--seq-len", type=int, default=512)
    check.add_argument("--heads", type=int, default=4)
    check.add_argument("--head-dim", type=int, default=64)
    check.add_argument("--batch", type=int, default=1)
    check.add_argument("--dtype", default="float32",
                       choices=["float16", "bfloat16", "float32", "float64"])
    check.add_argument("--no-causal", dest="causal", action="store_false")
    check.add_argument("--backend", action="append", dest="names",
                       help="backend to check (repeatable); default: all")
    args = parser.parse_args(argv)
    if args.command == "check":
        from .check import run_check

        dtype = args.dtype
        if dtype == "bfloat16":
            import ml_dtypes

            dtype = ml_dtypes.bfloat16
        ok = run_check(batch=args.batch, heads=args.heads, seq_len=args.seq_len,
                       head_dim=args.head_dim, dtype=dtype, causal=args.causal,
                       names=args.names)
        return 0 if ok else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
