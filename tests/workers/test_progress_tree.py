"""Progress in a tree of keys: every peer sees the whole swarm's sums, each peer counted once, and a
peer's traffic per view refresh stays flat as the swarm grows (one key read, not N records).  State
adverts live in the same leaves, so no key of a large run holds one subkey per peer."""

from __future__ import annotations

import asyncio
import random

import pytest

from dht import DHTNode
from p2p import Identity
from workers.progress import PeerProgress, ProgressTracker
from workers.progress_tree import ProgressLayout, ProgressSummary, merge, summarize
from workers.run_keys import run_validators
from workers.state import StateSharer

RUN = "tree"
TARGET = 10**9  # never reached: the sums are compared, not the readiness


def test_layout_sizes_the_tree_by_capacity():
    assert ProgressLayout(RUN, capacity=16).depth == 1  # one key, as every run up to 16 peers had
    assert ProgressLayout(RUN, capacity=16).key(()) == "tree.progress"
    big = ProgressLayout(RUN, capacity=256)
    assert (big.leaves, big.depth) == (16, 2)
    huge = ProgressLayout(RUN, capacity=10_000)
    assert (huge.leaves, huge.depth) == (625, 4)
    paths = huge.all_leaves()
    assert len(set(paths)) == 625 and all(len(p) == 3 and all(0 <= d < 16 for d in p) for p in paths)
    ids = [Identity().peer_id for _ in range(200)]
    assert {huge.leaf_of(p) for p in ids} <= set(paths)


def test_merged_summaries_equal_the_summary_of_all_records():
    rng = random.Random(3)
    records = [PeerProgress(epoch=rng.choice([4, 5]), samples=rng.randrange(100), samples_per_second=rng.random(),
                            time=100.0 - rng.random() * 10, loss=rng.random()) for _ in range(40)]
    whole = summarize(records, 100.0, 5.0, TARGET)
    parts = [summarize(records[i:i + 7], 100.0, 5.0, TARGET) for i in range(0, 40, 7)]
    merged = merge(parts, 100.0, TARGET)
    assert whole is not None and merged is not None
    assert (merged.epoch, merged.at_epoch, merged.live, merged.peers, merged.loss_count) == \
        (whole.epoch, whole.at_epoch, whole.live, whole.peers, whole.loss_count) == \
        (5, sum(r.epoch == 5 for r in records), sum(r.time >= 95.0 for r in records), 40, 40)
    assert merged.samples == pytest.approx(whole.samples)
    assert merged.samples_per_second == pytest.approx(whole.samples_per_second)
    # a summary of a later time extrapolates at its rate, capped at the target
    later = ProgressSummary(epoch=1, samples=10, samples_per_second=2.0, at_epoch=1, live=1, peers=1, time=0.0)
    assert later.extrapolated(5.0, 100) == 20.0 and later.extrapolated(500.0, 100) == 100.0


async def swarm_of_trackers(n: int, fanout: int) -> list[ProgressTracker]:
    layout = ProgressLayout(RUN, capacity=n, fanout=fanout)
    trackers: list[ProgressTracker] = []
    rng = random.Random(n)
    for _ in range(n):
        identity = Identity()
        validators = run_validators(RUN, identity)
        initial = [str(rng.choice(trackers).node.address)] if trackers else []
        node = await DHTNode.create(initial, identity=identity, validators=validators)
        tracker = ProgressTracker(node, RUN, TARGET, validators[0], refresh_interval=0.2, layout=layout)
        trackers.append(tracker)
    for i, t in enumerate(trackers):
        t.publish(PeerProgress(epoch=3, samples=i + 1, samples_per_second=0.0, time=t.now()))
    await asyncio.gather(*(t.start_view() for t in trackers))
    for t in trackers:
        t.node.spawn(keep_fresh(t))
    return trackers


async def keep_fresh(tracker: ProgressTracker) -> None:
    """What a training peer's keep_alive does: its record, again with the time of now, well within fresh_for.
    Republished every few refreshes of its view (about fresh_for / 4 at full speed), so that what a refresh
    costs does not depend on how fast a loaded machine runs refreshes; and at least every 3/4 of fresh_for."""
    every = max(round(tracker.fresh_for / 4 / tracker.refresh_interval), 1)
    published, seen = tracker.now(), tracker.refreshes
    while True:
        await asyncio.sleep(tracker.refresh_interval)
        if tracker.refreshes - seen < every and tracker.now() - published < tracker.fresh_for * 3 / 4:
            continue
        published, seen = tracker.now(), tracker.refreshes
        last = tracker.last_report
        if last is not None:
            tracker.publish(last.model_copy(update={"time": published}))


def sees_everyone(trackers: list[ProgressTracker]) -> bool:
    n = len(trackers)
    return all(v.peers == n and v.live_peers == n and v.num_peers == n and v.samples == n * (n + 1) // 2
               for v in (t.view() for t in trackers))


async def traffic_per_refresh(trackers: list[ProgressTracker], until, refreshes: int = 10) -> tuple[float, float]:
    """DHT messages and bytes (sent and received) per peer per view refresh, over ``refreshes`` of each."""
    for t in trackers:
        t.node.p2p.traffic.reset()
    start = [t.refreshes for t in trackers]
    await until(lambda: all(t.refreshes - s >= refreshes for t, s in zip(trackers, start, strict=True)), 60,
                f"{refreshes} refreshes of every view")
    done = sum(t.refreshes - s for t, s in zip(trackers, start, strict=True))
    totals = [t.node.p2p.traffic.total(["dht."]) for t in trackers]
    return sum(x.messages for x in totals) / done, sum(x.bytes for x in totals) / done


async def close(trackers: list[ProgressTracker]) -> None:
    await asyncio.gather(*(t.node.shutdown() for t in trackers))


async def measured_swarm(n: int, until) -> tuple[float, float]:
    """``n`` peers (fan-out 4): every view sums them all, a step reaches every view; the traffic per refresh."""
    trackers = await swarm_of_trackers(n, fanout=4)
    try:
        assert trackers[0].layout.depth == (2 if n == 8 else 3)
        await until(lambda: sees_everyone(trackers), 60, f"every view of {n} peers summing all {n}")
        cost = await traffic_per_refresh(trackers, until)
        first = trackers[0]  # a step of one peer reaches every view through the tree
        first.publish(PeerProgress(epoch=4, samples=0, samples_per_second=0.0, time=first.now()))
        await until(lambda: all(t.view().epoch == 4 and t.view().num_peers == 1 for t in trackers), 30,
                    "epoch 4 in every view")
        return cost
    finally:
        await close(trackers)


@pytest.mark.timeout(120)
async def test_every_view_sums_the_whole_swarm_and_a_peers_traffic_grows_sublinearly(until):
    costs = {n: await measured_swarm(n, until) for n in (8, 32)}
    (msgs8, bytes8), (msgs32, bytes32) = costs[8], costs[32]
    # four times the peers: a flat key would cost each reader four times the bytes per refresh.  The tree
    # costs 1.7-1.85 times here.  The keep-alive publications follow the refreshes (keep_fresh), so a
    # loaded machine's slower refreshes do not add to each one's cost (timed, they took the messages to
    # 2.29 times once)
    assert msgs32 / msgs8 < 2.0, costs
    assert bytes32 / bytes8 < 2.5, costs


@pytest.mark.timeout(60)
async def test_state_adverts_live_in_leaves_and_a_newcomer_finds_donors_in_other_leaves():
    layout = ProgressLayout(RUN, capacity=24, fanout=4)  # 6 leaves
    nodes, sharers = [], []
    try:
        for _ in range(12):
            identity = Identity()
            validators = run_validators(RUN, identity)
            node = await DHTNode.create([str(nodes[0].address)] if nodes else [], identity=identity,
                                        validators=validators)
            nodes.append(node)
            sharers.append(StateSharer(node, RUN, validators[0], lambda: (0, {}), layout=layout))
        for i, sharer in enumerate(sharers[:-1]):
            await sharer.advertise(epoch=i)
        keys = {s.key for s in sharers[:-1]}
        assert len(keys) > 1 and all(k.startswith(f"{RUN}.state.") for k in keys)
        newcomer = sharers[-1]
        found = await newcomer.donors(enough=100)  # every advert, wherever it lives
        assert [epoch for epoch, _ in found] == list(range(10, -1, -1))
        assert {address for _, address in found} == {str(n.address) for n in nodes[:-1]}
        held = [await nodes[0].get(k, latest=True) for k in keys]
        assert sum(len(h.value) for h in held) == 11 and max(len(h.value) for h in held) < 11
        assert len(await newcomer.donors(min_epoch=9)) == 2
    finally:
        for s in sharers:
            s.close()
        await asyncio.gather(*(n.shutdown() for n in nodes))


@pytest.mark.timeout(60)
async def test_a_summary_dated_ahead_is_not_taken_for_the_freshest(until):
    trackers = await swarm_of_trackers(8, fanout=4)
    try:
        await until(lambda: sees_everyone(trackers), 30, "every view of 8 peers")
        liar = trackers[0]
        forged = ProgressSummary(epoch=10**6, samples=0, samples_per_second=0, at_epoch=1000, live=1000,
                                 peers=1000, time=liar.now() + 3600)
        await liar.node.store(liar.key, forged.model_dump(), liar.now() + 30, subkey=liar.subkey + ":down")
        before = [t.refreshes for t in trackers]
        await until(lambda: all(t.refreshes >= b + 3 for t, b in zip(trackers, before, strict=True)), 30,
                    "three more refreshes of every view")
        assert all(t.view().epoch == 3 and t.view().peers == 8 for t in trackers)
    finally:
        await close(trackers)
