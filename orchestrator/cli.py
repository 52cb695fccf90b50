"""The ``spotswarm`` command.  Subcommands import what they need lazily, so ``--help`` stays fast."""

from __future__ import annotations

import argparse
import logging
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(peers=args.peers, tensor_mib=args.tensor_mib)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spotswarm", description="Decentralized training on preemptible machines.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the embedded local demo")
    demo.add_argument("--peers", type=int, default=8, help="number of peers (default 8)")
    demo.add_argument("--tensor-mib", type=int, default=64, help="size of the streamed tensor in MiB (default 64)")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
