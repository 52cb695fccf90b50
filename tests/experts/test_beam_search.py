"""DHT declarations of experts and beam search over them, checked against brute force."""

from __future__ import annotations

import asyncio
import itertools
import random
import time

import numpy as np
import pytest
import torch

from dht import DHTNode
from experts import (
    ExpertBackend,
    ExpertServer,
    declare_experts,
    find_best_experts,
    get_expert_holders,
    get_experts,
    withdraw_experts,
)
from experts.grid import make_uid
from orchestrator.host.wait import wait_for_async

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def swarm():
    nodes: list[DHTNode] = []

    async def factory(n: int, **options) -> list[DHTNode]:
        first = await DHTNode.create(**options)
        nodes.append(first)
        for _ in range(n - 1):
            nodes.append(await DHTNode.create([str(first.address)], **options))
        return nodes

    yield factory
    await asyncio.gather(*(n.shutdown() for n in reversed(nodes)))


def brute_force(live: dict[tuple[int, ...], str], scores: list[np.ndarray], row: int, k: int) -> list:
    ranked = sorted(((sum(float(s[row][c]) for s, c in zip(scores, coords, strict=True)), coords)
                     for coords in live), reverse=True)
    return [coords for _, coords in ranked[:k]]


async def test_beam_search_returns_exactly_the_top_k_live_experts(swarm):
    nodes = await swarm(4)
    grid = (4, 5, 3)
    rng = random.Random(7)
    everything = list(itertools.product(*map(range, grid)))
    declared = [c for c in everything if rng.random() < 0.7]  # the rest were never declared
    withdrawn = set(rng.sample(declared, 10))
    withdrawn |= {c for c in declared if c[0] == 2}  # a whole subtree died: its first-level prefix lingers
    addresses = {c: f"server{c[0] % 3}" for c in declared}
    for server in range(3):  # three "servers", each declaring its own experts through a different node
        mine = [make_uid("ffn", c) for c in declared if addresses[c] == f"server{server}"]
        assert await declare_experts(nodes[server], mine, f"server{server}", time.time() + 60)
    for server in range(3):  # anyone may withdraw a server's records (readers that care pass trusted_servers)
        gone = [make_uid("ffn", c) for c in withdrawn if addresses[c] == f"server{server}"]
        assert await withdraw_experts(nodes[3], gone, f"server{server}", time.time() + 61)
    live = {c: addresses[c] for c in declared if c not in withdrawn}
    assert len(live) > 10

    searcher = await DHTNode.create([str(nodes[0].address)], client_mode=True)
    try:
        gen = np.random.default_rng(3)
        scores = [gen.normal(size=(16, n)) for n in grid]
        scores[0][:, 2] += 5.0  # the dead subtree scores best: the search must look past it
        for k, beam in [(1, 1), (3, 3), (3, 1), (5, 10), (len(live) + 5, 4)]:
            found = await find_best_experts(searcher, "ffn", scores, k, beam_size=beam)
            for row, experts in enumerate(found):
                expected = brute_force(live, scores, row, k)
                assert [e.coords for e in experts] == expected, (k, beam, row)
                for e in experts:
                    assert e.address == live[e.coords] and e.uid == make_uid("ffn", e.coords)
                    expected_score = sum(float(s[row][c]) for s, c in zip(scores, e.coords, strict=True))
                    assert e.score == pytest.approx(expected_score)
    finally:
        await searcher.shutdown()


async def test_beam_search_on_an_empty_grid_finds_nothing(swarm):
    (node,) = await swarm(1)
    found = await find_best_experts(node, "nothing", [np.zeros((2, 3)), np.zeros((2, 3))], k=2)
    assert found == [[], []]


async def test_server_declares_redeclares_and_withdraws_its_experts(swarm):
    (boot,) = await swarm(1)
    backends = [ExpertBackend.from_kind(f"ffn.{i}.{j}", "nop", 4) for i in range(2) for j in range(2)]
    server = await ExpertServer.create(backends, initial_peers=[str(boot.address)], update_period=0.1,
                                       expiration=30.0)
    try:
        uids = [b.uid for b in backends]
        assert await get_experts(boot, uids) == {uid: server.address for uid in uids}
        top = await boot.get("ffn.")
        assert set(top.value) == {0, 1}
        assert {k: v.value for k, v in (await boot.get("ffn.1.")).value.items()} == {0: server.address,
                                                                                     1: server.address}
        first = server.declared_until
        # the re-declaration timer fires every 0.1 s
        await wait_for_async(lambda: server.declared_until != first, 20, "the server to re-declare")
        assert (await boot.get("ffn.0.0", latest=True)).expiration_time >= server.declared_until - 1e-6
    finally:
        await server.shutdown()
    assert await get_experts(boot, uids) == {uid: None for uid in uids}
    scores = [torch.zeros(1, 2).numpy(), torch.zeros(1, 2).numpy()]
    assert await find_best_experts(boot, "ffn", scores, k=4) == [[]]


async def test_a_restarted_server_wins_over_its_own_withdrawal(swarm):
    (boot,) = await swarm(1)
    first = await ExpertServer.create([ExpertBackend.from_kind("ffn.0", "nop", 4)], initial_peers=[str(boot.address)])
    await first.shutdown()
    second = await ExpertServer.create([ExpertBackend.from_kind("ffn.0", "nop", 4)],
                                       initial_peers=[str(boot.address)])
    try:
        assert await get_experts(boot, ["ffn.0"]) == {"ffn.0": second.address}
    finally:
        await second.shutdown()


async def test_every_holder_is_listed_and_withdrawing_one_leaves_the_others(swarm):
    a, b, reader = await swarm(3)
    now = time.time()
    assert await declare_experts(a, ["ffn.0.1", "ffn.1.0"], "server-a", now + 60)
    assert await declare_experts(b, ["ffn.0.1"], "server-b", now + 61)
    holders = await get_expert_holders(reader, ["ffn.0.1", "ffn.1.0", "ffn.1.1"], latest=True)
    assert holders == {"ffn.0.1": ["server-b", "server-a"], "ffn.1.0": ["server-a"], "ffn.1.1": []}  # newest first

    assert await withdraw_experts(b, ["ffn.0.1"], "server-b", now + 62)
    assert await get_expert_holders(reader, ["ffn.0.1"], latest=True) == {"ffn.0.1": ["server-a"]}
    found = await find_best_experts(reader, "ffn", [np.array([[1.0, 0.0]]), np.array([[0.0, 1.0]])], k=1)
    assert [(e.uid, e.address) for e in found[0]] == [("ffn.0.1", "server-a")]  # the prefix names the other holder

    assert await withdraw_experts(a, ["ffn.0.1"], "server-a", now + 63)  # the last holder: the expert is gone
    assert await get_experts(reader, ["ffn.0.1"], latest=True) == {"ffn.0.1": None}
    found = await find_best_experts(reader, "ffn", [np.array([[1.0, 0.0]]), np.array([[0.0, 1.0]])], k=1)
    assert [e.uid for e in found[0]] == ["ffn.1.0"]
