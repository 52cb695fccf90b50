from __future__ import annotations

import asyncio

import pytest

from dht import DHTNode


@pytest.fixture
async def swarm():
    """``await swarm(n, client_mode=...)``: n DHT peers joined through the first; shut down after."""
    created: list = []

    async def factory(n: int, client_modes: list[bool] | None = None) -> list[DHTNode]:
        modes = client_modes or [False] * n
        first = await DHTNode.create()
        created.append(first)
        nodes = [first]
        for mode in modes[1:]:
            node = await DHTNode.create([str(first.address)], client_mode=mode)
            created.append(node)
            nodes.append(node)
        return nodes

    factory.created = created
    yield factory
    await asyncio.gather(*(node.shutdown() for node in reversed(created)))
