from __future__ import annotations

import asyncio
import random

import pytest

from dht import DHTNode


@pytest.fixture
async def make_swarm():
    """``await make_swarm(n, **options)``: n DHT peers on loopback, each joining through an earlier one.
    Every node made through it is shut down after the test."""
    created: list[DHTNode] = []

    async def factory(n: int, seed: int = 0, **options) -> list[DHTNode]:
        rng = random.Random(seed)
        nodes = [await DHTNode.create(**options)]
        created.append(nodes[0])
        for _ in range(n - 1):
            node = await DHTNode.create([str(rng.choice(nodes).address)], **options)
            created.append(node)
            nodes.append(node)
        return nodes

    factory.created = created
    yield factory
    await asyncio.gather(*(node.shutdown() for node in created))
