"""python -m rlk_xla check | bench  — the installed build, on this machine."""
from __future__ import annotations

import argparse
import sys

import jax

from . import cli

DEVICES = ("default", "cpu", "gpu")
DEVICE_HELP = "JAX platform to run on: default (JAX's default device), cpu or gpu (default: %(default)s)"


def _shape(text: str):
    try:
        return cli.parse_shape(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m rlk_xla", description=__doc__)
    sub = ap.add_subparsers(dest="command", metavar="{check,bench}", required=True)
    c = sub.add_parser("check", help="self-test every compiled route on this machine against float64")
    c.add_argument("--device", choices=DEVICES, default="default", help=DEVICE_HELP)
    c.set_defaults(parser=c)
    b = sub.add_parser("bench", help="time fused vs the plain XLA reference (forward, forward+backward, memory)",
                       epilog=cli.RATIO_NOTE)
    b.add_argument("--shape", action="append", type=_shape, default=None,
                   help="a named shape (" + ", ".join(f"{k}={n}x{h}x{v}" for k, (n, h, v) in cli.SHAPES.items())
                   + ") or N,H,V (tokens, hidden, vocab); repeatable (default: small)")
    b.add_argument("--device", choices=DEVICES, default="default", help=DEVICE_HELP)
    b.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="dtype of hidden and weight (default: %(default)s)")
    b.set_defaults(parser=b)
    b.add_argument("--iters", type=_positive, default=7,
                   help="timing samples per measurement, after 2 warm-up calls (default: %(default)s)")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        cli.device(args.device)
    except RuntimeError:
        args.parser.error(f"argument --device: no {args.device} device is available to JAX here "
                 f"(JAX sees: {', '.join(sorted({d.platform for d in jax.devices()}))})")
    if args.command == "check":
        return cli.check(args.device)
    return cli.bench([name for name, _ in args.shape or [cli.parse_shape("small")]], args.device, args.dtype, args.iters)


if __name__ == "__main__":
    sys.exit(main())
