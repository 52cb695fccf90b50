"""``spotswarm expert-server``: host experts for decentralized mixture-of-experts layers.

Settings come from a YAML file (``--config``) whose keys are the fields of
``experts.config.ExpertServerConfig``; flags given on the command line override them.  The server
prints its address, declares its experts in the DHT, and on SIGINT/SIGTERM withdraws them, saves
checkpoints (with ``--checkpoint-dir``) and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import Any

import uvloop
import yaml

# Flags whose value maps to a config field of the same name (dashes become underscores).
CONFIG_FLAGS = (
    "expert_cls", "hidden_dim", "expert_uids", "expert_pattern", "custom_module", "optimizer", "lr",
    "optimizer_update_period", "max_grad_norm", "max_batch_size", "batch_timeout", "host", "port", "announce_host",
    "initial_peers", "no_dht", "identity", "update_period", "expiration", "checkpoint_dir", "checkpoint_period",
    "max_message_mib", "seed", "num_threads", "membership_token",
)


def config_from_args(args: argparse.Namespace) -> Any:
    """YAML (if any) overridden by every flag that was given; errors name the bad field."""
    from experts.config import ExpertServerConfig

    data: dict[str, Any] = {}
    if args.config:
        with open(args.config) as f:
            loaded = yaml.safe_load(f) or {}
        if not isinstance(loaded, dict):
            raise SystemExit(f"{args.config}: expected a mapping of settings at the top level")
        data.update(loaded)
    for name in CONFIG_FLAGS:
        value = getattr(args, name, None)
        if value is not None and value is not False:
            data[name] = value
    return ExpertServerConfig.model_validate(data)


async def _serve(config: Any) -> None:
    from experts.config import serve

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


def _membership_problem(config: Any) -> str | None:
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


def run_expert_server(args: argparse.Namespace) -> int:
    # Idle OpenMP threads sleep instead of spinning: the runtime thread's torch work shares the cores with
    # the event loop (and, on small machines, with other processes).  Must be set before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from pydantic import ValidationError

    try:
        config = config_from_args(args)
    except ValidationError as e:
        print(f"invalid expert server settings:\n{e}", file=sys.stderr)
        return 2
    problem = _membership_problem(config)
    if problem:
        print(f"spotswarm expert-server: membership_token: {problem}", file=sys.stderr)
        return 2
    uvloop.run(_serve(config))
    return 0
