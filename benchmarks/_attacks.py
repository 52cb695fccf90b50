"""Members' attacks on averaging, in one process on loopback, for bench_security.py: each attack
against each byzantine level, measuring how far the honest members' values end from the honest
mean, and how many rounds an audited group takes to catch a cheating reducer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch

from averaging import DecentralizedAverager
from averaging.allreduce import AllReduceRound
from averaging.partition import Chunk
from dht import DHTNode

SIZE = 4096
CHUNK = 512


class ServesHuge(AllReduceRound):
    """As a reducer: its part comes back as 1e30 (finite, under the replies' overflow check)."""

    async def serve(self, *args: Any, **kwargs: Any) -> Any:
        async for payload in super().serve(*args, **kwargs):
            yield {**payload, "d": torch.full_like(payload["d"], 1e30)}


class SendsNinety(AllReduceRound):
    """As a sender: every value 90, under the 100x norm screen; joined and calls with weight 1e6."""

    def _header(self) -> dict:
        return {**super()._header(), "w": 1e6}

    def _outgoing(self, chunk: Chunk) -> dict:
        payload = super()._outgoing(chunk)
        return {**payload, "d": torch.full_like(payload["d"], 90.0)}


def _heavy(averager: DecentralizedAverager) -> None:
    form_group = averager.matchmaker.form_group

    async def lying(group_key: str, deadline: float, target: int | None = None, _weight: float = 1.0,
                    *rest: Any) -> Any:
        return await form_group(group_key, deadline, target, 1e6, *rest)

    averager.matchmaker.form_group = lying  # type: ignore[method-assign]


def _greedy(averager: DecentralizedAverager) -> None:
    averager.matchmaker.declare_bandwidth(1e6)
    averager.meter = None  # keeps declaring 1e6 Mbit/s: claims the whole vector
    averager.round_class = ServesHuge


def _rewrites(averager: DecentralizedAverager) -> None:
    assemble = averager.matchmaker._assemble

    def rewriting(lead: Any) -> Any:
        for follower in lead.followers:
            follower.weight = 2e6
        return assemble(lead)

    averager.matchmaker._assemble = rewriting  # type: ignore[method-assign]


def _serves_huge(averager: DecentralizedAverager) -> None:
    averager.round_class = ServesHuge


def _ninety(averager: DecentralizedAverager) -> None:
    _heavy(averager)
    averager.round_class = SendsNinety


# name -> (what the rogue does to its own averager, whether it reduces a part, whether it must lead)
ATTACKS: dict[str, tuple[Callable[[DecentralizedAverager], None], bool, bool]] = {
    "rogue reducer serves 1e30": (_serves_huge, True, False),
    "weight 1e6, values 90": (_ninety, False, False),
    "claims the whole vector": (_greedy, True, False),
    "leader rewrites weights": (_rewrites, True, True),
}


def _data(i: int) -> torch.Tensor:
    return torch.randn(SIZE, generator=torch.Generator().manual_seed(i)) * (1 + i % 3)


async def _nodes(n: int, client_last: bool) -> list[DHTNode]:
    first = await DHTNode.create()
    nodes = [first]
    for i in range(1, n):
        nodes.append(await DHTNode.create([str(first.address)], client_mode=client_last and i == n - 1))
    return nodes


async def _declared(node: DHTNode, key: str) -> None:
    for _ in range(300):  # until the rogue's declaration is visible: then it is everyone's first leader
        found = await node.get(key, latest=True)
        if found is not None and isinstance(found.value, dict) and found.value:
            return
        await asyncio.sleep(0.01)


async def play(attack: str, mode: str, rounds: int = 1) -> dict:
    """One game of 3 honest members and 1 rogue; the honest values' largest distance from the honest
    mean (max |x - mean| over elements and members) in units of the honest inputs' own (1: as far as
    the farthest honest input), and the round in which every honest member had caught the rogue
    (None: not caught)."""
    act, reduces, leads = ATTACKS[attack]
    nodes = await _nodes(4, client_last=not reduces)
    tensors = [_data(i) for i in range(4)]
    averagers = [DecentralizedAverager([t], node, "bench", target_group_size=4, min_matchmaking_time=3.0,
                                       chunk_size=CHUNK, byzantine=mode)
                 for t, node in zip(tensors, nodes, strict=True)]
    honest, rogue = averagers[:3], averagers[3]
    act(rogue)
    mean = torch.stack(tensors[:3]).double().mean(0)
    spread = max(float((t.double() - mean).abs().max()) for t in tensors[:3])  # before they average in place
    caught_in = None
    try:
        for r in range(rounds):
            if leads:
                leading = asyncio.ensure_future(rogue.step(timeout=4))
                await _declared(nodes[0], "bench.mm.all")
                results = await asyncio.gather(*(a.step(timeout=20, target_group_size=3) for a in honest))
                await leading
            else:
                results = list(await asyncio.gather(*(a.step(timeout=20) for a in averagers)))[:3]
            if caught_in is None and all(rogue.peer_id in a.banned for a in honest):
                caught_in = r + 1
            del results
        error = max(float((a.tensors[0].double() - mean).abs().max()) for a in honest) / spread
    finally:
        for a in averagers:
            await a.shutdown()
        for node in reversed(nodes):
            await node.shutdown()
    return {"error": error, "caught_in": caught_in}
