"""More peers than one group: groups of groups, the top's mean handed back down, bit for bit."""

from __future__ import annotations

import asyncio

import pytest
import torch

from averaging import DecentralizedAverager, GroupPlan, average_in_groups
from p2p import Identity

from .means import assert_exact_mean_everywhere

pytestmark = pytest.mark.timeout(60)
PEERS = [Identity().peer_id for _ in range(120)]


def weighted_mean(inputs: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    stacked = torch.stack(inputs).double()
    w = torch.tensor(weights, dtype=torch.float64)
    return ((stacked * w[:, None]).sum(0) / w.sum()).float()


async def run_grouped(nodes, group_size: int, absent: int = 0, compression: str = "none"):
    """Every node averages a vector of its own; the last ``absent`` nodes are planned but never come."""
    torch.manual_seed(0)
    inputs = [torch.randn(5000) * (i + 1) for i in range(len(nodes))]
    weights = [float(8 + 3 * i) for i in range(len(nodes))]
    averagers = [DecentralizedAverager([x.clone()], node, "grads", min_matchmaking_time=0.5, request_timeout=1.0,
                                       compression=compression) for x, node in zip(inputs, nodes, strict=True)]
    plan = GroupPlan.of([node.peer_id for node in nodes], group_size)
    present = averagers[:len(averagers) - absent]
    results = await asyncio.gather(*(average_in_groups(a, plan, w, "e7", timeout=20) for a, w in
                                     zip(present, weights, strict=False)))
    for a in averagers:
        await a.shutdown()
    return plan, present, results, weighted_mean(inputs[:len(present)], weights[:len(present)])


def test_plans_split_any_swarm_into_runs_no_larger_than_group_size():
    for n in range(1, 120):
        for m in (2, 3, 16):
            plan = GroupPlan.of(PEERS[:n], m)
            counts = plan.levels
            assert counts[0] == n and counts[-1] <= m
            for level, count in enumerate(counts[:-1]):
                groups = [plan.group_of(u, count) for u in range(count)]
                assert groups == sorted(groups) and groups[-1] + 1 == counts[level + 1]
                sizes = [groups.count(g) for g in sorted(set(groups))]
                assert all(size == m for size in sizes[:-1]) and 1 <= sizes[-1] <= m
                assert sizes == [plan.size_of(g, count) for g in sorted(set(groups))]


async def test_nine_peers_in_groups_of_three_end_with_the_exact_weighted_mean(swarm):
    nodes = await swarm(9)
    plan, averagers, results, expected = await run_grouped(nodes, 3)
    assert plan.levels == [9, 3]
    assert all(r.complete for r in results), [r.reason for r in results]
    assert all(max(r.group_sizes) <= 3 for r in results)
    assert len({r.levels[0].group_id for r in results}) == 3  # three groups of three below
    tops = [r.top_group_id for r in results if r.top_group_id]  # the representatives': the others never see it
    assert len(tops) == 3 and len(set(tops)) == 1
    assert_exact_mean_everywhere(averagers, [expected])


async def test_ten_peers_in_groups_of_three_take_three_levels_and_stay_exact(swarm):
    nodes = await swarm(10)
    plan, averagers, results, expected = await run_grouped(nodes, 3, compression="float16")
    assert plan.levels == [10, 4, 2]  # groups of 3, 3, 3 and 1; then of 3 and 1; the top of 2
    assert all(r.complete for r in results), [r.reason for r in results]
    assert all(max(r.group_sizes) <= 3 for r in results)
    torch.testing.assert_close(averagers[0].tensors[0], expected, rtol=2e-3, atol=2e-3)  # float16 on the way up
    for a in averagers:
        assert torch.equal(a.tensors[0], averagers[0].tensors[0])  # the way down is exact: the same bits


async def test_a_planned_peer_that_never_comes_is_left_out_and_the_others_complete(swarm):
    nodes = await swarm(9)
    plan, averagers, results, expected = await run_grouped(nodes, 3, absent=1)
    assert all(r.complete for r in results), [r.reason for r in results]
    assert sorted(r.levels[0].group_size for r in results).count(2) == 2  # its group formed without it
    assert_exact_mean_everywhere(averagers, [expected])


async def test_a_group_waits_for_no_planned_member_that_is_gone_nor_the_top_for_a_group_that_is(swarm):
    """Planned members that died: their group closes once a ping finds them gone, not after its whole
    patience; a group left short of its quorum says so, and the top closes without it."""
    nodes = await swarm(9)
    torch.manual_seed(0)
    inputs = [torch.randn(1000) * (i + 1) for i in range(9)]
    # request_timeout 5: a level-0 leader would wait 10.5 s for a missing member, the top 21 s
    averagers = [DecentralizedAverager([x.clone()], node, "grads", min_matchmaking_time=0.5, request_timeout=5.0)
                 for x, node in zip(inputs, nodes, strict=True)]
    plan = GroupPlan.of([node.peer_id for node in nodes], 3)
    order = [plan.members.index(node.peer_id) for node in nodes]
    dead = [i for i in range(9) if order[i] in (1, 7, 8)]  # one of group 0; two of group 2, whose last one is alone
    alive = [i for i in range(9) if i not in dead]
    everyone = [str(node.address) for node in nodes]
    await asyncio.gather(*(node.bootstrap(everyone) for node in nodes))  # a leader pings only peers it knows
    for i in dead:
        await averagers[i].shutdown()
        await nodes[i].shutdown()
    started = asyncio.get_running_loop().time()
    results = await asyncio.gather(*(average_in_groups(averagers[i], plan, 1.0, "e3", timeout=30) for i in alive))
    elapsed = asyncio.get_running_loop().time() - started
    by_rank = {order[i]: r for i, r in zip(alive, results, strict=True)}
    assert not by_rank[6].complete and "fewer than 2" in by_rank[6].reason  # group 2: one of three left
    completed = [i for i in alive if by_rank[order[i]].complete]
    assert sorted(order[i] for i in completed) == [0, 2, 3, 4, 5]
    assert elapsed < 10.0, elapsed  # neither group 0 nor the top waited out its patience
    expected = torch.stack([inputs[i] for i in completed]).double().mean(0).float()
    assert_exact_mean_everywhere([averagers[i] for i in completed], [expected])
    for i in range(9):
        if i not in dead:
            await averagers[i].shutdown()
