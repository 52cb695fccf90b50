"""``spotswarm dht``: a standalone DHT peer, typically the bootstrap node others join through."""

from __future__ import annotations

import asyncio
import signal
import sys

import uvloop

from dht import DHTNode
from p2p import Identity


async def _serve(host: str, port: int, initial_peers: list[str], identity_path: str | None) -> None:
    identity = Identity.from_file(identity_path) if identity_path else None
    node = await DHTNode.create(initial_peers, host=host, port=port, identity=identity)
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


def run_dht_peer(host: str, port: int, initial_peers: list[str], identity_path: str | None) -> int:
    uvloop.run(_serve(host, port, initial_peers, identity_path))
    return 0
