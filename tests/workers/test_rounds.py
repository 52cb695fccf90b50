"""Each epoch a peer completes, split into compute and communication seconds: the deltas of its
cost totals between epoch records, which add up to the totals' growth; and a real peer's records."""

from __future__ import annotations

import threading

import pytest

from workers.peer import TrainingPeer, WorkerConfig
from workers.rounds import RECENT_ROUNDS, ROUNDS_PER_STATUS, RoundSplitter, RoundTime


def test_each_epochs_split_is_the_growth_of_the_totals_since_the_previous_record():
    splitter = RoundSplitter()
    splitter.start(epoch=4, busy_s=0.0, comm_s=0.5)  # it averaged half a second before it trained
    # (epoch, busy_s, comm_s) at each epoch record: cumulative, as ``TrainingPeer.costs`` has them
    totals = [(5, 3.0, 1.5), (6, 7.5, 2.0), (7, 8.0, 2.5)]
    splits = [splitter.close(e, busy, comm, at=100.0 + e) for e, busy, comm in totals]
    assert splits == [RoundTime(5, 105.0, 2.0, 1.0), RoundTime(6, 106.0, 4.0, 0.5), RoundTime(7, 107.0, 0.0, 0.5)]
    assert sum(s.compute_s for s in splits) == (8.0 - 2.5) - (0.0 - 0.5)  # busy − comm grew by 6
    assert sum(s.comm_s for s in splits) == 2.5 - 0.5
    assert splitter.recent() == [s.as_dict() for s in splits]
    assert splitter.recent(1) == [{"epoch": 7, "time": 107.0, "compute_s": 0.0, "comm_s": 0.5}]


def test_a_jump_of_several_epochs_is_split_but_kept_as_no_round():
    splitter = RoundSplitter()
    splitter.start(epoch=0, busy_s=0.0, comm_s=0.0)
    splitter.close(1, 2.0, 1.0, at=1.0)
    jump = splitter.close(5, 10.0, 6.0, at=2.0)  # it loaded the state of a peer four epochs ahead
    after = splitter.close(6, 13.0, 7.0, at=3.0)
    assert (jump.compute_s, jump.comm_s) == (3.0, 5.0)  # the split still adds up...
    assert [r["epoch"] for r in splitter.recent()] == [1, 6]  # ...but no one round took that long
    assert (after.compute_s, after.comm_s) == (2.0, 1.0)


def test_a_status_carries_the_rounds_after_the_callers_newest_a_bounded_few_at_a_time():
    splitter = RoundSplitter(keep=4 * ROUNDS_PER_STATUS)
    splitter.start(epoch=0, busy_s=0.0, comm_s=0.0)
    for epoch in range(1, 5 * ROUNDS_PER_STATUS + 1):
        splitter.close(epoch, float(epoch), 0.0, at=float(epoch))
    recent = splitter.recent()  # a caller that names no round it has: the newest few
    assert [r["epoch"] for r in recent] == list(range(5 * ROUNDS_PER_STATUS - RECENT_ROUNDS + 1,
                                                      5 * ROUNDS_PER_STATUS + 1))
    assert all(r["compute_s"] == 1.0 and r["comm_s"] == 0.0 for r in recent)
    # a caller that has up to epoch 3 * ROUNDS_PER_STATUS: the next ones, a status' worth at a time
    cursor, got = 3 * ROUNDS_PER_STATUS, []
    while batch := splitter.after(cursor):
        assert len(batch) <= ROUNDS_PER_STATUS
        got += [r["epoch"] for r in batch]
        cursor = batch[-1]["epoch"]
    assert got == list(range(3 * ROUNDS_PER_STATUS + 1, 5 * ROUNDS_PER_STATUS + 1))
    # one that has none (a new supervisor): all those kept, oldest first, the oldest beyond ``keep`` gone
    assert splitter.after(-1)[0]["epoch"] == ROUNDS_PER_STATUS + 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["collaborative", "diloco"])
def test_a_peers_epoch_records_split_its_time_and_add_up_to_its_totals(mode):
    """A real peer alone (its DHT on loopback) trains four epochs (in DiLoCo, outer rounds): every
    record's split is the growth of the totals in it since the record before, and its recent rounds
    are the same splits."""
    peer = TrainingPeer(WorkerConfig(task="synthetic", mode=mode, target_batch_size=64, inner_steps=2, round_peers=1,
                                     device="cpu", run=f"rounds-{mode}", min_matchmaking_time=0.5,
                                     averaging_timeout=10.0, max_epochs=4, seed=0))
    try:
        runner = threading.Thread(target=peer.run, name="peer", daemon=True)
        runner.start()
        runner.join(timeout=90)  # it stops by itself after max_epochs
        assert not runner.is_alive(), "the peer did not finish its four epochs"
        records = list(peer.history)
        assert [r["epoch"] for r in records] == [1, 2, 3, 4]
        # the first epoch is all of its time training so far (what it spent looking for state before
        # it trained is no epoch's); each later one is the growth of the totals since the record before
        # (within the rounding of the totals to a millisecond and of each split to 0.1 ms)
        first = records[0]
        assert first["epoch_compute_s"] + first["epoch_comm_s"] == pytest.approx(first["busy_s"], abs=2e-3)
        for before, r in zip(records, records[1:], strict=False):
            assert r["epoch_compute_s"] == pytest.approx(
                (r["busy_s"] - r["comm_s"]) - (before["busy_s"] - before["comm_s"]), abs=2e-3)
            assert r["epoch_comm_s"] == pytest.approx(r["comm_s"] - before["comm_s"], abs=2e-3)
        assert all(r["epoch_compute_s"] >= 0 and r["epoch_comm_s"] >= 0 for r in records)
        assert sum(r["epoch_compute_s"] + r["epoch_comm_s"] for r in records) == \
            pytest.approx(records[-1]["busy_s"], abs=2e-3)  # the epochs' lengths add up to its time training
        rounds = [{"epoch": r["epoch"], "time": r["time"], "compute_s": r["epoch_compute_s"],
                   "comm_s": r["epoch_comm_s"]} for r in records]
        assert peer.recent_rounds() == rounds and peer.recent_rounds(after=2) == rounds[2:]
    finally:
        peer.prepare_to_leave(deadline=10.0)
