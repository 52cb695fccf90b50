"""DeDLOC collaborative training with peers as separate processes on loopback."""

from __future__ import annotations

import signal

import pytest

pytestmark = [pytest.mark.timeout(180), pytest.mark.heavy]

COMMON = dict(task="synthetic", target_batch_size=128)


def same_params(workers, epoch: int) -> bool:
    digests = {w.epochs()[epoch]["params"] for w in workers}
    return len(digests) == 1


def test_four_peers_end_every_epoch_with_identical_parameters_and_learn(worker_swarm):
    first = worker_swarm.start(min_peers=4, max_epochs=8, **COMMON)
    others = worker_swarm.start_many(3, min_peers=4, max_epochs=8, initial=first, **COMMON)
    peers = [first, *others]
    worker_swarm.finish(peers, timeout=150)
    worker_swarm.assert_succeeded(peers)
    for epoch in range(1, 9):
        assert same_params(peers, epoch), f"parameters differ after epoch {epoch}"
    losses = [first.epochs()[e]["loss"] for e in range(1, 9)]
    assert losses[-1] < 0.7 * losses[0], losses
    assert max(w.epochs()[8]["peers"] for w in peers) == 4  # they really averaged together


def test_a_late_peer_loads_state_and_trains_in_step(worker_swarm):
    first = worker_swarm.start(min_peers=3, max_seconds=150, **COMMON)
    early = [first, *worker_swarm.start_many(2, min_peers=3, max_seconds=150, initial=first, **COMMON)]
    worker_swarm.wait(lambda: min(w.latest_epoch() for w in early) >= 4, 90, "epoch 4 on the first peers")
    late = worker_swarm.start(max_seconds=150, initial=first, **COMMON)
    worker_swarm.wait(lambda: len(late.records()) >= 4, 90, "four epochs on the late peer")
    worker_swarm.stop([*early, late])
    joined = min(late.epochs())
    assert joined >= 5, "the late peer must start from the others' epoch, not from zero"
    common = set(late.epochs()).intersection(*(w.epochs() for w in early))
    assert len(common) >= 3
    for epoch in sorted(common):
        assert same_params([*early, late], epoch), f"late peer out of step at epoch {epoch}"


def test_a_peer_killed_mid_training_does_not_stop_the_others(worker_swarm):
    first = worker_swarm.start(min_peers=4, max_epochs=10, **COMMON)
    peers = [first, *worker_swarm.start_many(3, min_peers=4, max_epochs=10, initial=first, **COMMON)]
    victim = peers[2]
    worker_swarm.wait(lambda: victim.latest_epoch() >= 2, 90, "epoch 2")
    victim.signal(signal.SIGKILL)
    survivors = [w for w in peers if w is not victim]
    worker_swarm.finish(survivors, timeout=150)
    assert all(w.proc.returncode == 0 and w.latest_epoch() == 10 for w in survivors)
    assert min(w.epochs()[10]["peers"] for w in survivors) == 3  # the epoch advanced without it


def test_a_paused_peer_catches_up_by_loading_state(worker_swarm):
    first = worker_swarm.start(min_peers=3, max_seconds=150, **COMMON)
    peers = [first, *worker_swarm.start_many(2, min_peers=3, max_seconds=150, initial=first, **COMMON)]
    sleeper = peers[1]
    worker_swarm.wait(lambda: sleeper.latest_epoch() >= 2, 90, "epoch 2")
    paused_at = sleeper.latest_epoch()
    sleeper.signal(signal.SIGSTOP)
    awake = [w for w in peers if w is not sleeper]
    worker_swarm.wait(lambda: min(w.latest_epoch() for w in awake) >= paused_at + 40, 120, "others moving on")
    sleeper.signal(signal.SIGCONT)
    # while it slept, every DHT call that asked it waited out its timeout: the two awake peers must not
    # take that slowness for each other's death and each step alone (the same epochs, other parameters)
    during = set(awake[0].epochs()).intersection(awake[1].epochs()) - set(range(paused_at + 1))
    assert during and all(same_params(awake, e) for e in during), \
        [(e, awake[0].epochs()[e]["peers"], awake[1].epochs()[e]["peers"]) for e in sorted(during)
         if not same_params(awake, e)][:10]
    worker_swarm.wait(lambda: "loaded state of epoch" in sleeper.stderr(), 60, "the sleeper loading state")
    resumed = max(w.latest_epoch() for w in awake)
    # every peer, not only the sleeper: an epoch here takes milliseconds, and a peer stopped before it
    # recorded the epochs after the sleeper's return would leave nothing to compare
    worker_swarm.wait(lambda: min(w.latest_epoch() for w in peers) >= resumed + 2, 90,
                      "the sleeper training in step again")
    worker_swarm.stop(peers)
    common = [e for e in set(sleeper.epochs()).intersection(*(w.epochs() for w in awake)) if e > resumed]
    assert common and all(same_params(peers, e) for e in common)


def test_graceful_leave_leaves_no_errors_behind(worker_swarm):
    first = worker_swarm.start(min_peers=3, max_epochs=10, **COMMON)
    peers = [first, *worker_swarm.start_many(2, min_peers=3, max_epochs=10, initial=first, **COMMON)]
    leaver = peers[2]
    worker_swarm.wait(lambda: leaver.latest_epoch() >= 3, 90, "epoch 3")
    leaver.signal(signal.SIGTERM)  # a preemption notice
    assert leaver.proc.wait(timeout=60) == 0
    stayers = peers[:2]
    worker_swarm.finish(stayers, timeout=150)
    assert all(w.latest_epoch() == 10 for w in stayers)
    for w in peers:
        text = w.stderr()
        assert " ERROR " not in text and "Traceback" not in text, text[-3000:]
    assert "left at epoch" in leaver.stderr()
