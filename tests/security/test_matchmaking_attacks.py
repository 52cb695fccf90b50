"""Matchmaking against a member's lies: silent leaders it declares, bandwidth it claims."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from averaging import DecentralizedAverager
from averaging.load_balancing import SHARE_FACTOR, claims_within_reason, load_balanced_parts
from dht import DHTNode
from p2p import PeerID

pytestmark = pytest.mark.timeout(60)


async def silent_socket() -> tuple[asyncio.Server, list[asyncio.StreamWriter]]:
    """A listener that accepts connections and never says a word."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    return await asyncio.start_server(hold, "127.0.0.1", 0), held


async def test_declared_leaders_that_never_answer_do_not_stop_the_group_forming():
    first = await DHTNode.create()
    nodes = [first] + [await DHTNode.create([str(first.address)]) for _ in range(3)]
    server, held = await silent_socket()
    port = server.sockets[0].getsockname()[1]
    averagers = [DecentralizedAverager([torch.full((8,), float(i))], n, "mm", target_group_size=4,
                                       min_matchmaking_time=5.0) for i, n in enumerate(nodes)]
    try:
        now = first.clock.now()
        for _ in range(5):  # declared well before anyone honest: each would be tried as the leader first
            fake = PeerID(os.urandom(32))
            await first.store("mm.mm.all", {"a": f"{fake}@127.0.0.1:{port}", "t": now - 60, "bw": 100.0, "h": ""},
                              now + 60, subkey=str(fake))
        # a dead leader used to cost a follower its whole request timeout; 5 of them, the whole window
        results = await asyncio.gather(*(a.step(timeout=6.0) for a in averagers))
        assert [r.group_size for r in results] == [4, 4, 4, 4]
        assert all(torch.equal(a.tensors[0], torch.full((8,), 1.5)) for a in averagers)
    finally:
        for a in averagers:
            await a.shutdown()
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()
        await asyncio.gather(*(n.shutdown() for n in reversed(nodes)))


def test_a_huge_bandwidth_claim_buys_at_most_a_bounded_part():
    numel, n = 4000, 4
    honest = [100.0] * (n - 1)
    sizes = load_balanced_parts(numel, [*honest, 1e6], bounded=True)
    assert sizes[-1] <= SHARE_FACTOR / n * numel  # the LP alone gives it all 4000
    assert sum(sizes) == numel
    assert all(s > 0 for s in sizes[:-1])  # every honest peer still reduces a part of its own
    # honest declarations are left as they are
    assert claims_within_reason([50.0, 100.0, 150.0]) == [50.0, 100.0, 150.0]
    assert claims_within_reason([0.0, 0.0]) == [0.0, 0.0]
