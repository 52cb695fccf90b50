"""How beam search's cost grows with the grid, its prefix cache, and a mixture's second wave when
chosen experts turn out dead (issue 50: thousands of experts on hundreds of servers)."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Coroutine
from typing import Any

import numpy as np
import pytest
import torch

from dht.records import ValueWithExpiration
from experts import ExpertBackend, PrefixCache, RemoteMixtureOfExperts, declare_experts, find_best_experts
from experts.grid import prefix_key

pytestmark = pytest.mark.timeout(60)


class GridNode:
    """The DHT as beam search sees it, in memory: prefix records of the declared experts, and a
    count of ``get_many`` calls and keys.  ``spawn`` keeps background work for the test to run."""

    def __init__(self, prefix: str, declared: dict[tuple[int, ...], str]) -> None:
        self.records: dict[str, dict[int, ValueWithExpiration]] = {}
        for coords, address in declared.items():
            for d in range(len(coords)):
                sub = self.records.setdefault(prefix_key(prefix, coords[:d]), {})
                sub[coords[d]] = ValueWithExpiration(address, 0.0)
        self.calls: list[int] = []  # keys per get_many
        self.alphas: list[int | None] = []  # and how many replicas each asked at once (None: the default)
        self.spawned: list[Coroutine] = []

    async def get_many(self, keys: list[str], latest: bool = False,
                       alpha: int | None = None) -> dict[str, ValueWithExpiration | None]:
        self.calls.append(len(keys))
        self.alphas.append(alpha)
        return {k: ValueWithExpiration(self.records[k], 0.0) if k in self.records else None for k in keys}

    def spawn(self, coro: Coroutine) -> None:
        self.spawned.append(coro)


def frozen(uid: str, hidden: int) -> ExpertBackend:
    return ExpertBackend.from_kind(uid, "ffn", hidden, optimizer=lambda p: torch.optim.SGD(p, lr=0.0))


def brute_force(declared: dict[tuple[int, ...], Any], scores: list[np.ndarray], row: int, k: int) -> list:
    ranked = sorted(((sum(float(s[row][c]) for s, c in zip(scores, coords, strict=True)), coords)
                     for coords in declared), reverse=True)
    return [coords for _, coords in ranked[:k]]


@pytest.mark.parametrize("grid", [(8, 8), (32, 32)])
async def test_a_full_grid_costs_one_get_many_per_dimension_however_wide(grid):
    declared = {c: f"server{c[0]}" for c in itertools.product(*map(range, grid))}
    node = GridNode("ffn", declared)
    rows, k = 32, 4
    gen = np.random.default_rng(1)
    scores = [gen.normal(size=(rows, n)) for n in grid]
    found = await find_best_experts(node, "ffn", scores, k)
    assert len(node.calls) == len(grid)  # one get_many per level, all rows together
    assert node.calls[0] == 1 and node.calls[1] <= min(rows * k, grid[0])  # the root, then the rows' prefixes
    for r in range(rows):
        assert [e.coords for e in found[r]] == brute_force(declared, scores, r, k)


async def test_the_exact_top_k_on_wide_and_deep_grids_with_holes():
    rng = random.Random(5)
    for grid in [(32, 32), (6, 5, 4), (16, 3, 8)]:
        everything = list(itertools.product(*map(range, grid)))
        declared = {c: "a" for c in everything if rng.random() < 0.6}
        declared = {c: a for c, a in declared.items() if c[0] != 2}  # a dead subtree...
        gen = np.random.default_rng(len(grid))
        scores = [gen.normal(size=(8, n)) for n in grid]
        scores[0][:, 2] += 4.0  # ...that scores best: the search must look past it
        for k, beam in [(1, 1), (4, 4), (4, 1), (7, 12)]:
            found = await find_best_experts(GridNode("ffn", declared), "ffn", scores, k, beam_size=beam)
            for r in range(8):
                assert [e.coords for e in found[r]] == brute_force(declared, scores, r, k), (grid, k, beam, r)


async def test_a_prefix_cache_spares_the_dht_and_rereads_in_the_background():
    declared = {c: "a" for c in itertools.product(range(32), range(32))}
    node = GridNode("ffn", declared)
    cache = PrefixCache(max_age=60.0)
    gen = np.random.default_rng(2)
    scores = [gen.normal(size=(16, 32)) for _ in range(2)]
    first = await find_best_experts(node, "ffn", scores, 4, prefix_cache=cache)
    calls = len(node.calls)
    assert await find_best_experts(node, "ffn", scores, 4, prefix_cache=cache) == first
    assert len(node.calls) == calls and not node.spawned  # all from the cache, nothing due

    cache.refresh_after = 0.0  # every record is due: used as it is, read again in the background
    assert await find_best_experts(node, "ffn", scores, 4, prefix_cache=cache) == first
    assert len(node.calls) == calls and len(node.spawned) == 2  # one background read per level
    assert cache.refreshing
    for coro in node.spawned:
        await coro
    assert not cache.refreshing and sum(node.calls[calls:]) == sum(node.calls[:calls])
    assert node.alphas == [None] * calls + [1, 1]  # a background read asks one replica, not three

    cache.max_age = 0.0  # too old to use: read at once
    await find_best_experts(node, "ffn", scores, 4, prefix_cache=cache)
    assert len(node.calls) == calls + 2 + 2


async def test_excluded_experts_are_passed_over_and_their_records_read_again():
    declared = {c: f"server{c[1] % 2}" for c in itertools.product(range(4), range(4))}
    node = GridNode("ffn", declared)
    cache = PrefixCache(max_age=60.0, recheck_after=0.0)
    gen = np.random.default_rng(3)
    scores = [gen.normal(size=(4, 4)) for _ in range(2)]
    await find_best_experts(node, "ffn", scores, 3, prefix_cache=cache)
    found = await find_best_experts(node, "ffn", scores, 3, prefix_cache=cache,
                                    exclude=lambda uid, address: address == "server1")
    alive = {c: a for c, a in declared.items() if a == "server0"}
    for r in range(4):
        assert [e.coords for e in found[r]] == brute_force(alive, scores, r, 3)
    assert node.spawned  # a record naming an excluded server is read again: it may have moved
    for coro in node.spawned:
        await coro

    node.spawned.clear()
    fresh = PrefixCache(max_age=60.0)  # recheck_after 1 s: a record read just now is not read again yet
    await find_best_experts(node, "ffn", scores, 3, prefix_cache=fresh, exclude=lambda uid, a: a == "server1")
    assert not node.spawned


def test_a_row_left_short_by_dead_experts_gets_the_next_best_in_the_same_pass(start_server, client_dht):
    torch.manual_seed(3)
    hidden = 8
    server = start_server([frozen(f"ffn.{i}", hidden) for i in (0, 1)])
    dead = start_server([frozen("ffn.9", hidden)])
    dead_address = dead.address
    dead.shutdown(withdraw=False)  # killed: its records (and these two more) stay until they expire
    client_dht.run_coroutine(lambda node: declare_experts(node, ["ffn.2", "ffn.3"], dead_address, time.time() + 60))
    moe = RemoteMixtureOfExperts(hidden, [4], "ffn", k_best=2, k_min=2, forward_timeout=10, dht=client_dht)
    with torch.no_grad():  # every row prefers the dead experts
        moe.proj.weight.zero_()
        moe.proj.bias.copy_(torch.tensor([0.0, 1.0, 3.0, 2.0]))

    out = moe(torch.randn(5, hidden))  # would be NotEnoughExperts without the second wave
    out.sum().backward()
    report = moe.last_call
    assert set(report.failed) == {"ffn.2", "ffn.3"} and report.answered == {"ffn.0", "ffn.1"}
    assert report.fallbacks == 2 and report.chosen[0] == ["ffn.2", "ffn.3", "ffn.1", "ffn.0"]
    assert report.backward_answered == {"ffn.0", "ffn.1"}
    assert moe.take_stats()["calls_meeting_k_min"] == 1

    before = dict(client_dht.node.stats)
    moe(torch.randn(3, hidden))  # the dead server is passed over now, the prefixes come from the cache
    assert moe.last_call.chosen[0] == ["ffn.1", "ffn.0"] and not moe.last_call.failed
    assert moe.last_call.fallbacks == 0
    assert client_dht.node.stats["get_many"] - before.get("get_many", 0) <= 1  # at most the background re-read
    assert {s["requests_forward"] for s in server.server.stats.values()} == {2}
