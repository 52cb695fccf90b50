"""A peer whose wall clock is off, or steps mid-run, still sees the others live and is seen live:
progress records carry the swarm clock's time.  Two peers training together stay in step across
a clock step of one of them."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from dht import DHTNode, LocalClock, SignatureValidator
from p2p import Identity
from tests.workers.two_peers import assert_in_step, two_peers_training
from workers.progress import PeerProgress, ProgressTracker


async def tracker_on(initial: list[str], clock: Callable[[], float]) -> ProgressTracker:
    identity = Identity()
    signer = SignatureValidator(identity)
    node = await DHTNode.create(initial, identity=identity, validators=[signer], clock=clock)
    return ProgressTracker(node, "skew", target_batch_size=10_000, signer=signer)


async def live_counts(trackers: list[ProgressTracker]) -> list[int]:
    """Every peer reports now, then each counts the peers it sees live (read from the DHT)."""
    for i, t in enumerate(trackers):
        await t.report(PeerProgress(epoch=0, samples=i, samples_per_second=1.0, time=t.now()))
    return [(await t.global_progress()).live_peers for t in trackers]


@pytest.mark.timeout(60)
async def test_progress_liveness_survives_a_wrong_and_a_stepping_clock(until):
    odd_clock = LocalClock(lambda: time.time() + 120)  # wrong from the start, then steps too
    first = await tracker_on([], time.time)
    trackers = [first]
    try:
        trackers.append(await tracker_on([str(first.node.address)], time.time))
        trackers.append(await tracker_on([str(first.node.address)], odd_clock))
        nodes = [t.node for t in trackers]
        await until(lambda: all(n.clock.voters == 2 for n in nodes), 20, "every node sampling both others")
        assert await live_counts(trackers) == [3, 3, 3]
        for step in (90.0, -180.0):  # +90 s, then 90 s behind where it started
            odd_clock.jump(step)
            assert await live_counts(trackers) == [3, 3, 3], f"after a step of {step:+.0f} s"
        # the sane peers' own view of the time did not follow the odd one
        assert all(abs(n.clock.offset) < 0.05 for n in nodes[:2])
    finally:
        for t in trackers:
            await t.node.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("step", [90.0, -90.0])
def test_two_peers_stay_in_step_across_a_clock_step(wait_for, step: float):
    """Peer b's clock steps 90 s mid-training.  Without the swarm clock, ahead, b would see a's
    records as stale, believe itself alone and step alone; behind, a would see b as dead.  Here
    the two keep averaging together, and never hold different parameters at the same epoch."""
    common = dict(task="synthetic", target_batch_size=128, min_peers=2, param_digests=True, device="cpu",
                  run="skew", min_matchmaking_time=1.0, averaging_timeout=10.0)
    with two_peers_training(**common) as peers:
        wait_for(lambda: min(p.epoch for p in peers) >= 3, 30, "epoch 3 on both peers")
        peers[1].jump_clock(step)
        jumped_at = max(p.epoch for p in peers)
        wait_for(lambda: min(p.epoch for p in peers) >= jumped_at + 6, 30, "six more epochs on both peers")
        leaving_at = min(p.epoch for p in peers)
    # every step after the step of b's clock was taken together, none alone
    assert_in_step(peers, after=jumped_at, before=leaving_at, at_least=6)
