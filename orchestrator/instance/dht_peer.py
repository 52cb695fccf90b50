"""``spotswarm dht``: a standalone DHT peer, typically the bootstrap node others join through.

It checks owner signatures on every record it is asked to store, and with ``--run RUN`` also the
run's key rules (``workers.run_keys``), so a forged or malformed record is refused at the door.
With ``--membership-token`` (``spotswarm token issue``) it is a member of that run and talks only
to members.
"""

from __future__ import annotations

import asyncio
import re
import signal
import sys

import uvloop

from dht import DHTNode, RecordValidator, SignatureValidator
from p2p import Identity
from p2p.membership import Membership

RUN_NAME = re.compile(r"[A-Za-z0-9_-]+")  # as a run's cluster_name


def peer_validators(identity: Identity, run: str | None) -> list[RecordValidator]:
    if run is None:
        return [SignatureValidator(identity)]
    from workers.run_keys import run_validators  # heavy imports (torch), only for a run's peer

    return run_validators(run, identity)


async def start_dht_peer(host: str, port: int, initial_peers: list[str], identity: Identity | None = None,
                         run: str | None = None, membership: Membership | None = None) -> DHTNode:
    """The peer ``spotswarm dht`` runs, started on the running loop; the caller shuts it down."""
    identity = identity or Identity()
    if membership is not None:
        run = run or membership.run
    return await DHTNode.create(initial_peers, host=host, port=port, identity=identity,
                                validators=peer_validators(identity, run),
                                p2p_options={"membership": membership} if membership else None)


async def _serve(host: str, port: int, initial_peers: list[str], identity: Identity, run: str | None,
                 membership: Membership | None) -> None:
    node = await start_dht_peer(host, port, initial_peers, identity, run, membership)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"DHT peer listening at {node.address}", flush=True)
    print(f"others join with: --initial-peers {node.address}", file=sys.stderr, flush=True)
    try:
        await stop.wait()
    finally:
        await node.shutdown()


def run_dht_peer(host: str, port: int, initial_peers: list[str], identity_path: str | None,
                 run: str | None = None, membership_token: str | None = None) -> int:
    identity = Identity.from_file(identity_path) if identity_path else Identity()
    try:
        membership = Membership.from_token(membership_token, identity) if membership_token else None
    except ValueError as e:  # a token that does not fit: say so instead of a traceback
        print(f"spotswarm dht: --membership-token: {e}", file=sys.stderr)
        return 2
    uvloop.run(_serve(host, port, initial_peers, identity, run, membership))
    return 0
