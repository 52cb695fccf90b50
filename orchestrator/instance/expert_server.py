"""``spotswarm expert-server``: host experts for decentralized mixture-of-experts layers.

Settings come from ``FLAGS``: a YAML file (``--config``) whose keys are the fields of
``experts.config.ExpertServerConfig``, and one flag per field over it.  The server
prints its address, declares its experts in the DHT, and on SIGINT/SIGTERM withdraws them, saves
checkpoints (with ``--checkpoint-dir``) and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import Any

import uvloop

from experts.config import ExpertServerConfig, serve
from orchestrator.config.loader import ModelFlags
from p2p.devices import pick_device

FLAGS = ModelFlags(ExpertServerConfig)


def config_from_args(args: argparse.Namespace) -> ExpertServerConfig:
    """The settings of a parsed command line: ``--config``'s YAML with the flags given over it."""
    return FLAGS.load(args.config, vars(args))


async def _serve(config: ExpertServerConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def ready(server: Any) -> None:
        print(f"expert server listening at {server.address}", flush=True)
        print(f"hosting {len(server.backends)} experts: {' '.join(sorted(server.backends))}", flush=True)
        if server.dht is not None:
            print(f"DHT peers join with: --initial-peers {server.address}", file=sys.stderr, flush=True)

    await serve(config, stop, ready)


def _membership_problem(config: ExpertServerConfig) -> str | None:
    """Why the token cannot make this server a member (checked before anything starts), or None."""
    if not config.membership_token:
        return None
    if not config.identity:
        return "needs --identity: the key file the token was issued for"
    from p2p import Identity
    from p2p.membership import Membership

    try:
        Membership.from_token(config.membership_token, Identity.from_file(config.identity, create=False))
    except (ValueError, FileNotFoundError) as e:
        return str(e)
    return None


def run(config: ExpertServerConfig) -> int:
    problem = _membership_problem(config)
    if problem:
        print(f"spotswarm expert-server: membership_token: {problem}", file=sys.stderr)
        return 2
    try:
        pick_device(config.device)  # a GPU asked for and missing: said before anything starts
    except ValueError as e:
        print(f"spotswarm expert-server: {e}", file=sys.stderr)
        return 2
    uvloop.run(_serve(config))
    return 0
