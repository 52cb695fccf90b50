"""DiLoCo peers as separate processes (``spotswarm worker --mode diloco``): every outer round ends
with the same parameters everywhere, and a peer killed in its inner phase costs the others no more
than the round's own bounds."""

from __future__ import annotations

import signal
import time

import pytest

pytestmark = [pytest.mark.timeout(180), pytest.mark.heavy]

COMMON = dict(task="synthetic", mode="diloco", inner_steps=4, round_peers=3, min_matchmaking_time=0.5,
              averaging_timeout=10)  # the report file holds every round's parameter digest


def test_a_peer_killed_in_its_inner_phase_costs_the_others_one_bounded_round(worker_swarm):
    first = worker_swarm.start(min_peers=3, max_seconds=150, **COMMON)
    peers = [first, *worker_swarm.start_many(2, min_peers=3, max_seconds=150, initial=first, **COMMON)]
    worker_swarm.wait(lambda: min(w.latest_epoch() for w in peers) >= 3, 90, "three outer rounds")
    victim, survivors = peers[2], peers[:2]
    victim.signal(signal.SIGKILL)
    killed_at, reached = time.monotonic(), max(w.latest_epoch() for w in survivors)
    worker_swarm.wait(lambda: min(w.latest_epoch() for w in survivors) >= reached + 3, 60, "rounds without it")
    # a round waits for a dead member no longer than its matchmaking bounds and one averaging timeout
    assert time.monotonic() - killed_at < 3 * COMMON["averaging_timeout"]
    worker_swarm.stop(survivors)
    shared = set(survivors[0].epochs()) & set(survivors[1].epochs()) & set(range(1, reached + 4))
    assert len(shared) >= 4
    for epoch in sorted(shared):
        digests = {w.epochs()[epoch]["params"] for w in survivors}
        if epoch <= 3:
            digests.add(victim.epochs().get(epoch, survivors[0].epochs()[epoch])["params"])
        assert len(digests) == 1, f"parameters differ after outer round {epoch}"
    assert min(w.epochs()[reached + 3]["peers"] for w in survivors) == 2  # the rounds went on without it
