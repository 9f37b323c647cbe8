"""python -m rlk_xla check | bench  — the installed build, on this machine."""
from __future__ import annotations

import argparse
import sys

from . import cli


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlk_xla", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="self-test every compiled route on this machine against float64")
    c.add_argument("--device", choices=("default", "cpu", "gpu"), default="default")
    b = sub.add_parser("bench", help="time fused vs reference (forward, forward+backward, memory)")
    b.add_argument("--shape", action="append", default=None,
                   help=f"a named shape ({', '.join(cli.SHAPES)}) or N,H,V; repeatable (default: small)")
    b.add_argument("--device", choices=("default", "cpu", "gpu"), default="default")
    b.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    b.add_argument("--iters", type=int, default=5)
    args = ap.parse_args(argv)
    if args.cmd == "check":
        return cli.check(args.device)
    return cli.bench(args.shape or ["small"], args.device, args.dtype, args.iters)


if __name__ == "__main__":
    sys.exit(main())
