"""Attack tests: hostile peers against each layer; each test file brings its own fixtures."""

from __future__ import annotations

import asyncio

import pytest

from dht import DHTNode


@pytest.fixture
async def swarm():
    """``await swarm(n, client_modes)``: n DHT peers joined through the first; shut down after."""
    created: list[DHTNode] = []

    async def factory(n: int, client_modes: list[bool] | None = None) -> list[DHTNode]:
        modes = client_modes or [False] * n
        first = await DHTNode.create()
        created.append(first)
        for mode in modes[1:]:
            created.append(await DHTNode.create([str(first.address)], client_mode=mode))
        return list(created)

    yield factory
    await asyncio.gather(*(node.shutdown() for node in reversed(created)))
