"""Moshpit SGD against the collaborative optimizer on the same task and the same number of samples."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.heavy]


def final_loss(workers) -> float:
    return sum(w.records()[-1]["loss"] for w in workers) / len(workers)


def test_moshpit_sgd_reaches_a_loss_comparable_to_the_collaborative_optimizer(worker_swarm):
    # collaborative: 40 global steps of 128 samples (4 peers x 32 x 1 each)
    first = worker_swarm.start(task="synthetic", target_batch_size=128, min_peers=4, max_epochs=40)
    collab = [first, *worker_swarm.start_many(3, task="synthetic", target_batch_size=128, min_peers=4, max_epochs=40,
                                              initial=first)]
    worker_swarm.finish(collab, timeout=150)
    # Moshpit SGD: 4 peers on a 2x2 grid, averaging every 4 local steps of 32: 10 rounds = 40 local steps
    first = worker_swarm.start("--moshpit-grid", "2", "2", task="synthetic", mode="moshpit", averaging_period=4,
                               max_epochs=10, min_peers=4)
    mosh = [first, *worker_swarm.start_many(3, "--moshpit-grid", "2", "2", task="synthetic", mode="moshpit",
                                            averaging_period=4, max_epochs=10, min_peers=4, initial=first)]
    worker_swarm.finish(mosh, timeout=150)
    worker_swarm.assert_succeeded(collab + mosh)
    assert sum(r["peers"] > 1 for w in mosh for r in w.records()) >= 10  # it really averaged in groups
    start = sum(w.records()[0]["loss"] for w in mosh) / 4
    assert final_loss(mosh) < 0.6 * start
    assert final_loss(mosh) < 1.5 * final_loss(collab) + 0.02, (final_loss(mosh), final_loss(collab))
