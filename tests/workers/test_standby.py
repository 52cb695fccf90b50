"""A warm spare (``TrainingPeer(standby=True)``): booted and joined to the DHT, but invisible to the
swarm's progress until it takes a place, and then training from the swarm's current state, never
from epoch 0.  Real peers on real sockets, each on its own thread of this process."""

from __future__ import annotations

import logging
import re
import threading
import time

import pytest

from tests.workers.two_peers import leave_all
from workers.peer import TrainingPeer, WorkerConfig

COMMON = dict(task="synthetic", target_batch_size=128, param_digests=True, device="cpu", run="spare",
              min_matchmaking_time=0.5, averaging_timeout=10.0)


def progress_records(peer: TrainingPeer) -> int:
    """How many peers' progress records ``peer`` reads from the DHT."""
    optimizer = peer.optimizer
    assert optimizer is not None
    return len(peer.dht.run_coroutine(lambda _n: optimizer.tracker.peers()))


@pytest.mark.timeout(90)
def test_a_spare_is_not_counted_until_activated_then_trains_in_step_from_the_swarms_epoch(wait_for, caplog):
    caplog.set_level(logging.INFO, logger="averaging.averager")
    trainer = TrainingPeer(WorkerConfig(seed=0, **COMMON))
    spare = None
    threads: list[threading.Thread] = []
    try:
        spare = TrainingPeer(WorkerConfig(seed=1, initial_peers=[trainer.address], **COMMON), standby=True)
        threads.append(threading.Thread(target=trainer.run, name="trainer", daemon=True))
        threads[0].start()
        wait_for(lambda: trainer.epoch >= 3, 40, "epoch 3 on the trainer alone")

        assert (spare.phase, spare.epoch, spare.optimizer) == ("standby", 0, None)
        assert len(spare.dht.node.routing) > 0  # joined: it knows the swarm's DHT
        assert progress_records(trainer) == 1  # but the swarm does not count it: the trainer's own record only
        assert {r.group_size for r in trainer.optimizer.history} == {1}

        activated_at = trainer.epoch
        threads.append(threading.Thread(target=spare.run, name="spare", daemon=True))
        threads[1].start()
        wait_for(lambda: len(spare.history) >= 3, 40, "three epochs on the activated spare")

        # it loaded the swarm's state: its first epoch follows the trainer's, not epoch 1 of its own
        assert spare.history[0]["epoch"] > activated_at
        mine = {r["epoch"]: r["params"] for r in spare.history}
        theirs = {r["epoch"]: r["params"] for r in trainer.history}
        shared = sorted(set(mine) & set(theirs))
        assert len(shared) >= 2
        assert all(mine[e] == theirs[e] for e in shared)  # the same parameters at every shared epoch
        assert {r.group_size for r in spare.optimizer.history} == {2}  # every step taken together
        # having loaded state, it measured its upload to the trainer before its first round
        assert re.search(r"bandwidth probe to 1 peers: \d+ Mbit/s", caplog.text), caplog.text
    finally:
        leave_all([trainer, spare], threads)


@pytest.mark.timeout(30)
def test_a_spare_that_never_trained_leaves_at_once_and_never_starts_after(caplog):
    spare = TrainingPeer(WorkerConfig(**COMMON), standby=True)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="workers.peer"):
        spare.prepare_to_leave(deadline=10.0, train_for=7.5)  # a preemption notice reaching a spare
    assert time.monotonic() - started < 5.0  # nothing to finish: not the notice's 7.5 s
    assert "did not stop" not in caplog.text
    spare.run()  # activated too late: returns without joining
    assert spare.optimizer is None and spare.phase == "standby"
