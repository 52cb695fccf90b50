"""Matchmaking's DHT traffic: a key's replica set is looked up once and reused while it holds."""

from __future__ import annotations

import asyncio

import pytest
import torch

from averaging import DecentralizedAverager
from averaging.matchmaking import REPLICAS_REUSED_FOR

pytestmark = pytest.mark.timeout(120)


def count_lookups(node) -> list[int]:
    calls = [0]
    lookup = node.nearest_replicas

    async def counted(key):
        calls[0] += 1
        return await lookup(key)

    node.nearest_replicas = counted
    return calls


async def test_steps_reuse_the_replica_set_until_a_replica_fails_a_call(swarm):
    assert REPLICAS_REUSED_FOR >= 5  # far longer than these steps take
    nodes = await swarm(3)
    lookups = [count_lookups(n) for n in nodes[:2]]
    averagers = [DecentralizedAverager([torch.full((10,), float(i))], n, "mm", target_group_size=3,
                                       min_matchmaking_time=5.0) for i, n in enumerate(nodes)]
    try:
        for _ in range(2):
            results = await asyncio.gather(*(a.step(timeout=30) for a in averagers))
            assert [r.group_size for r in results] == [3, 3, 3]
        assert [c[0] for c in lookups] == [1, 1]  # one lookup for both steps
        assert all(torch.equal(a.tensors[0], torch.full((10,), 1.0)) for a in averagers)

        await averagers[2].shutdown()
        await nodes[2].shutdown()  # one replica of the key is gone
        for _ in range(2):  # the first call to it fails, so one of these steps looks up again
            results = await asyncio.gather(*(a.step(timeout=30, target_group_size=2) for a in averagers[:2]))
            assert [r.group_size for r in results] == [2, 2]
        assert [c[0] for c in lookups] == [2, 2]
    finally:
        for a in averagers[:2]:
            await a.shutdown()
