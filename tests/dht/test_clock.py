"""The swarm clock: one node whose wall clock is off, or steps, keeps the swarm's time, so its
records and the others' stay alive for everybody.  Real nodes on loopback, each with its own clock."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

import pytest

from dht import DHTNode, LocalClock, SwarmClock

pytestmark = pytest.mark.timeout(60)


def skewed(seconds: float) -> Callable[[], float]:
    return lambda: time.time() + seconds


async def three_nodes(third_clock: Callable[[], float], **options) -> list[DHTNode]:
    """Two nodes with sane clocks, then a third with ``third_clock``, joining through the first;
    sampling each other's clocks every half second (2 s in a run) so that a test waits less."""
    options.setdefault("clock_sample_interval", 0.5)
    first = await DHTNode.create(**options)
    nodes = [first]
    try:
        nodes.append(await DHTNode.create([str(first.address)], **options))
        nodes.append(await DHTNode.create([str(first.address)], clock=third_clock, **options))
    except BaseException:
        await asyncio.gather(*(n.shutdown() for n in nodes))
        raise
    return nodes


def agree(nodes: list[DHTNode], within: float = 1.0) -> bool:
    times = [n.clock.now() for n in nodes]
    return max(times) - min(times) < within


async def test_sane_clocks_need_no_correction(until):
    nodes = await three_nodes(time.time)
    try:
        await until(lambda: all(n.clock.voters == 2 for n in nodes), 20, "every node sampling both others")
        for n in nodes:
            assert abs(n.clock.offset) < 0.05, n.clock.offset
    finally:
        await asyncio.gather(*(n.shutdown() for n in nodes))


@pytest.mark.parametrize("skew", [120.0, -120.0])
async def test_a_node_with_a_wrong_clock_keeps_the_swarms_time(until, skew: float):
    # records may expire at most a minute ahead: a node 120 s off would write records the others
    # refuse, as expired (behind) or too far ahead (ahead)
    nodes = await three_nodes(skewed(skew), max_expiration=60.0)
    odd = nodes[2]
    try:
        await until(lambda: agree(nodes), 20, "the odd node's swarm clock to meet the others'")
        assert abs(odd.clock.offset + skew) < 1.0
        assert all(abs(n.clock.offset) < 0.05 for n in nodes[:2])  # the others do not move toward it

        assert await odd.store("from-odd", "hello", odd.clock.now() + 30)
        assert await nodes[0].store("from-sane", "hi", nodes[0].clock.now() + 30)
        for reader in nodes:
            got = await reader.get("from-odd", latest=True)
            assert got is not None and got.value == "hello"
            assert abs(got.expiration_time - (reader.clock.now() + 30)) < 2.0
            got = await reader.get("from-sane", latest=True)
            assert got is not None and got.value == "hi"
    finally:
        await asyncio.gather(*(n.shutdown() for n in nodes))


@pytest.mark.parametrize("step", [90.0, -90.0])
async def test_a_clock_step_mid_run_is_outvoted_at_once(until, step: float):
    local = LocalClock()
    nodes = await three_nodes(local, max_expiration=60.0)
    try:
        await until(lambda: all(n.clock.voters == 2 for n in nodes), 20, "every node sampling both others")
        before = nodes[2].clock.now()
        local.jump(step)  # an NTP step on the third node's machine
        assert abs(nodes[2].clock.now() - before) < 1.0  # its own samples are kept against monotonic time
        assert agree(nodes)
        assert await nodes[2].store("after-step", 1, nodes[2].clock.now() + 30)
        assert (await nodes[0].get("after-step", latest=True)).value == 1
        # the others, once their samples of it show the step, are not moved by the one stepped clock
        stepped = nodes[2].node_id
        votes = {n.node_id: n.clock.votes()[stepped] for n in nodes[:2]}
        await until(lambda: all(abs(n.clock.votes()[stepped] - votes[n.node_id] - step) < 1.0 for n in nodes[:2]),
                    20, "the others' samples of the stepped node to show the step")
        assert agree(nodes) and all(abs(n.clock.offset) < 0.05 for n in nodes[:2])
    finally:
        await asyncio.gather(*(n.shutdown() for n in nodes))


async def test_two_nodes_agree_and_a_step_moves_neither(until):
    """With two clocks there is no majority.  At first both take the earlier one (the side on which
    records look fresher than they are, rather than live peers dead); then each keeps to where both
    were, so a step of either clock moves neither."""
    b_clock = LocalClock(lambda: time.time() + 90)
    a = await DHTNode.create(clock_sample_interval=0.5)
    b = await DHTNode.create([str(a.address)], clock=b_clock, clock_sample_interval=0.5)
    try:
        await until(lambda: a.clock.voters == 1 and b.clock.voters == 1, 20, "both nodes sampling each other")
        assert agree([a, b])
        assert abs(a.clock.offset) < 0.05 and abs(b.clock.offset + 90.0) < 1.0
        vote = a.clock.votes()[b.node_id]
        b_clock.jump(-180.0)  # now 90 s behind
        assert agree([a, b])
        await until(lambda: abs(a.clock.votes()[b.node_id] - vote + 180) < 1.0, 20, "a's samples showing the step")
        assert agree([a, b]) and abs(a.clock.offset) < 0.05
    finally:
        await asyncio.gather(b.shutdown(), a.shutdown())


def test_samples_from_slow_calls_or_without_a_time_are_ignored():
    clock = SwarmClock(time.time, max_rtt=0.5)
    t = time.monotonic()
    assert not clock.record("p", time.time() + 100, t, t + 2.0)  # too slow to say anything
    assert not clock.record("p", math.nan, t, t + 0.01)
    assert not clock.record("p", None, t, t + 0.01)  # an old peer whose ping reply has no time
    assert not clock.record("p", True, t, t + 0.01)
    assert clock.voters == 0 and clock.offset == 0.0
    assert clock.record("p", time.time() + 100, t, t)
    assert clock.record("q", time.time() + 100, t, t)
    assert abs(clock.offset - 100) < 0.05  # two peers out of three: the swarm's time is theirs
