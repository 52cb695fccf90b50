"""The ``spotswarm`` command.  Subcommands import what they need lazily, so ``--help`` stays fast."""

from __future__ import annotations

import argparse
import logging
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(peers=args.peers, tensor_mib=args.tensor_mib)


def _dht(args: argparse.Namespace) -> int:
    from .dht_peer import run_dht_peer

    return run_dht_peer(host=args.host, port=args.port, initial_peers=args.initial_peers, identity_path=args.identity)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spotswarm", description="Decentralized training on preemptible machines.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the embedded local demo")
    demo.add_argument("--peers", type=int, default=8, help="number of peers (default 8)")
    demo.add_argument("--tensor-mib", type=int, default=64, help="size of the streamed tensor in MiB (default 64)")
    demo.set_defaults(func=_demo)
    dht = sub.add_parser("dht", help="run a DHT peer (e.g. a bootstrap node) and print its address")
    dht.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    dht.add_argument("--port", type=int, default=0, help="port to listen on (default: any free port)")
    dht.add_argument("--initial-peers", nargs="*", default=[], metavar="ADDR",
                     help="peers to join through, as host:port or peerid@host:port")
    dht.add_argument("--identity", metavar="PATH", help="private key file; created if missing, keeps the peer id")
    dht.set_defaults(func=_dht)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
