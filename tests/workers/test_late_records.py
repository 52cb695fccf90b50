"""Progress records can be late while their peer is alive: a DHT lookup waiting out a stopped
replica held every record of two live peers back past the freshness period, each took the other
for dead, and both stepped alone at the same epochs with other parameters (found by a chaos run:
one worker SIGSTOPped, the other two diverged for good).  A peer about to step alone first pings
the peers whose records went stale; and the DHT no longer asks a contact that timed out again
because another peer's answer still lists it."""

from __future__ import annotations

import asyncio
import socket

import pytest

from dht import DHTNode, SignatureValidator
from dht.routing import Contact
from p2p import Identity
from tests.workers.two_peers import assert_in_step, two_peers_training
from workers.progress import ProgressTracker


@pytest.mark.timeout(60)
def test_two_live_peers_whose_records_stop_reaching_the_dht_keep_training_together(wait_for):
    common = dict(task="synthetic", target_batch_size=128, min_peers=2, param_digests=True, device="cpu",
                  run="late", min_matchmaking_time=0.5, averaging_timeout=5.0)
    with two_peers_training(**common) as peers:
        a, b = peers
        wait_for(lambda: min(p.epoch for p in peers) >= 3, 30, "epoch 3 on both peers")

        async def never(*_args: object) -> None:
            await asyncio.Event().wait()  # a DHT that never carries this peer's records again

        b.optimizer.tracker.report = never  # b's record ages in a's view, and b's view of a stops
        stalled_at = max(p.epoch for p in peers)
        a_view, b_key = a.optimizer.tracker, b.optimizer.tracker.subkey
        wait_for(lambda: a_view.now() - a_view.records()[b_key].time > a_view.fresh_for, 30,
                 "b's record stale in a's view")  # and a's in b's: the old code stepped alone from here on
        stale_at = max(p.epoch for p in peers)
        wait_for(lambda: min(p.epoch for p in peers) >= stale_at + 8, 40, "eight more epochs on both peers")
        leaving_at = min(p.epoch for p in peers)
    # every step while b's records were missing was taken together, none alone
    assert_in_step(peers, after=stalled_at, before=leaving_at, at_least=stale_at - stalled_at + 8)


@pytest.mark.timeout(30)
async def test_a_contact_that_timed_out_is_not_asked_again_when_another_peer_lists_it():
    """A stopped process: its socket accepts (the kernel does that) and never answers."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    stopped = Contact.make(Identity().peer_id, "127.0.0.1", silent.getsockname()[1])
    quiet = dict(rpc_timeout=0.5, clock_sample_interval=0)  # no clock pings: only lookups call it
    first = await DHTNode.create([], **quiet)
    second = await DHTNode.create([str(first.address)], **quiet)
    try:
        for node in (first, second):  # both know it, as peers knew a worker before it was stopped
            node.routing.add_or_update(stopped)
        await second.store("k", 1, second.storage.clock() + 60)  # asks it, waits out the timeout
        assert stopped.node_id not in second.routing
        accepted = _accepted(silent)
        assert accepted >= 1
        # ``first`` still lists it in every answer; ``second`` does not ask it again
        for i in range(3):
            await second.store(f"k{i}", i, second.storage.clock() + 60)
            assert (await second.get(f"k{i}")).value == i
        assert _accepted(silent) == 0, "the timed-out contact was asked again"
        assert stopped.node_id in first.routing  # first never called it: still listed
        assert second.known_address(stopped.peer_id) == stopped.address  # kept for a direct ping
        assert not await second.answers(stopped.peer_id, timeout=0.3)
        assert await second.answers(first.peer_id, timeout=2.0)
    finally:
        await second.shutdown()
        await first.shutdown()
        silent.close()


def test_a_progress_record_names_only_its_signers_own_peer():
    """Whom a stale record makes us ping: a member signing records that name other peers (or junk)
    gets none of them pinged."""
    me, other = Identity(), Identity()
    mine = f"{SignatureValidator(me).marker}{me.peer_id}"
    assert ProgressTracker.peer_of(mine) == me.peer_id
    assert ProgressTracker.peer_of(f"{SignatureValidator(me).marker}{other.peer_id}") is None
    assert ProgressTracker.peer_of(f"{other.peer_id}") is None  # no owner at all
    assert ProgressTracker.peer_of(f"{SignatureValidator(me).marker}not-a-peer") is None


@pytest.mark.timeout(30)
async def test_suspects_of_long_ago_do_not_pile_up():
    node = await DHTNode.create([], clock_sample_interval=0, suspect_for=1e-6)
    try:
        for _ in range(3000):  # churn: peers that timed out once and never came back
            node._forget(Contact.make(Identity().peer_id, "127.0.0.1", 9), TimeoutError("gone"))
        assert len(node._suspects) <= 1024
    finally:
        await node.shutdown()


@pytest.mark.timeout(30)
async def test_a_client_mode_peer_answers_though_it_serves_no_dht():
    """Behind NAT it takes no calls but its own connections' (it dialed us), and runs no DHT handlers:
    the error it answers with is an answer all the same."""
    node = await DHTNode.create([], clock_sample_interval=0)
    client = await DHTNode.create([str(node.address)], client_mode=True, clock_sample_interval=0)
    try:
        assert node.known_address(client.peer_id) is None  # nowhere to dial: its own connection only
        assert await node.answers(client.peer_id, timeout=2.0)
        await client.shutdown()
        assert not await node.answers(client.peer_id, timeout=2.0)
    finally:
        await client.shutdown()
        await node.shutdown()


def _accepted(listener: socket.socket) -> int:
    """Connections made to ``listener`` since the last call (accepted here, then closed)."""
    listener.setblocking(False)
    count = 0
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1
