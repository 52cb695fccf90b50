"""DiLoCo with ``overlap``: a round all-reduces in the background while the next inner phase trains.
Its outer step is the same on every peer, bit for bit, and the inner progress made while it averaged
is kept on top of the new global parameters; a peer that trained a whole round's share waits for it.
One thread drives every peer in turn: with overlap, a step never waits for the others (except that
last wait, which the test opens from another thread)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from tests.workers.test_diloco import BATCH, SIZE, Recorded, expected_outer_step, leave, make_peers, wait_all_seen

pytestmark = pytest.mark.timeout(90)


class Gated(Recorded):
    """Averages only once the test opens ``gate``; tells when a training step waits for its round."""

    gate = threading.Event()
    waiting = threading.Event()

    async def _average(self, live_peers: int, weight: float | None = None):
        await asyncio.to_thread(self.gate.wait, 60)
        return await super()._average(live_peers, weight)

    def _land(self) -> bool:
        if not self._inflight.future.done():
            self.waiting.set()
        return super()._land()


@pytest.fixture
def gated():
    Gated.gate, Gated.waiting = threading.Event(), threading.Event()
    return Gated


def inner_step(opt, param: torch.nn.Parameter, i: int, zero: bool = False) -> bool:
    """One step down a slope of its own per peer (however many steps a phase takes, each moves it)."""
    param.grad = torch.zeros(SIZE) if zero else torch.linspace(-1, 1, SIZE) * (i + 1)
    return opt.step(BATCH)


def until_launched(opts, params, deadline_s: float = 30.0) -> None:
    """Step every peer in turn until each has its round in flight."""
    deadline = time.monotonic() + deadline_s
    while not all(o._inflight is not None for o in opts):
        assert time.monotonic() < deadline, "every peer to launch its round"
        for i, (o, p) in enumerate(zip(opts, params, strict=True)):
            if o._inflight is None:
                assert not inner_step(o, p, i)


def test_the_round_averages_while_the_next_phase_trains_and_that_progress_is_kept(wait_for, gated):
    dhts, opts, params = make_peers(3, cls=gated, overlap=True)
    try:
        wait_all_seen(opts, 3, wait_for)
        until_launched(opts, params)
        sent = [o.sent for o in opts]
        launched_from = [o._inflight.launched_from[0].clone() for o in opts]
        assert [o.epoch for o in opts] == [0, 0, 0]
        after = [0, 0, 0]
        for _ in range(3):  # the next phase trains while the round waits: no step, no wait
            for i, (o, p) in enumerate(zip(opts, params, strict=True)):
                assert not inner_step(o, p, i)
                after[i] += 1
        assert [o.epoch for o in opts] == [0, 0, 0] and not gated.waiting.is_set()
        trained = [p.detach().clone() for p in params]
        assert all(not torch.equal(t, f) for t, f in zip(trained, launched_from, strict=True))
        gated.gate.set()
        deadline = time.monotonic() + 30
        while not all(o.epoch == 1 for o in opts):
            assert time.monotonic() < deadline, "every peer to land its round"
            for i, (o, p) in enumerate(zip(opts, params, strict=True)):
                if o.epoch == 0:
                    inner_step(o, p, i, zero=True)  # moves nothing: the progress since the launch is `trained`
                    after[i] += 1
        expected, _ = expected_outer_step(torch.zeros(SIZE), None, sent)
        for o, p, t, f, n in zip(opts, params, trained, launched_from, after, strict=True):
            assert torch.equal(o.global_params[0], opts[0].global_params[0])  # bit for bit
            assert torch.equal(o.outer.state_dict()["state"][0]["momentum_buffer"],
                               opts[0].outer.state_dict()["state"][0]["momentum_buffer"])
            assert torch.equal(p.detach(), o.global_params[0] + (t - f))  # the new global, plus what we trained since
            assert (o.local_steps, o.local_samples) == (n, n * BATCH)  # those steps count for the next round
            assert o.history[-1].samples == o.sent[1]  # the round weighed what it was launched with
        torch.testing.assert_close(opts[0].global_params[0].double(), expected, rtol=0, atol=1e-5)

        # the next round takes its pseudo-gradient from the new global parameters, and lands the same everywhere
        before = opts[0].global_params[0].clone()
        momentum = opts[0].outer.state_dict()["state"][0]["momentum_buffer"].clone()
        until_launched(opts, params)
        for o, p in zip(opts, params, strict=True):
            assert torch.equal(o.sent[0][0], o.global_params[0] - p.detach())
        deadline = time.monotonic() + 30
        while not all(o.epoch == 2 for o in opts):
            assert time.monotonic() < deadline, "every peer to land its second round"
            for i, (o, p) in enumerate(zip(opts, params, strict=True)):
                if o.epoch == 1:
                    inner_step(o, p, i)
        expected, _ = expected_outer_step(before, momentum, [o.sent for o in opts])
        assert all(torch.equal(o.global_params[0], opts[0].global_params[0]) for o in opts)
        torch.testing.assert_close(opts[0].global_params[0].double(), expected, rtol=0, atol=1e-5)
    finally:
        gated.gate.set()
        leave(dhts, opts)


def test_a_peer_that_trained_a_whole_share_meanwhile_waits_for_its_round(wait_for, gated):
    dhts, opts, params = make_peers(3, cls=gated, overlap=True)
    opener = threading.Thread(target=lambda: gated.waiting.wait(60) and gated.gate.set(), daemon=True)
    try:
        wait_all_seen(opts, 3, wait_for)
        until_launched(opts, params)
        share = opts[0]._inflight.share
        assert share == 3 * 10 * BATCH / 3
        opener.start()
        steps = 0
        while opts[0].epoch == 0:
            steps += 1
            assert steps * BATCH <= share, "the round to land by the step that completes our share"
            landed = inner_step(opts[0], params[0], 0)
            assert landed == (opts[0].epoch == 1)
        assert steps * BATCH == share and gated.waiting.is_set()  # it waited, then stepped
        assert opts[0].comm_seconds > 0  # the wait is communication the training did not hide
        for i in (1, 2):  # the others land theirs too, without having waited
            wait_for(lambda i=i: inner_step(opts[i], params[i], i) or opts[i].epoch == 1, 30, f"peer {i} to land")
        assert all(torch.equal(o.global_params[0], opts[0].global_params[0]) for o in opts)
    finally:
        gated.gate.set()
        opener.join(timeout=5)
        leave(dhts, opts)


def test_a_peer_leaving_with_its_round_in_flight_lands_it_first(wait_for, gated):
    dhts, opts, params = make_peers(2, cls=gated, overlap=True)
    try:
        wait_all_seen(opts, 2, wait_for)
        until_launched(opts, params)
        gated.gate.set()
        opts[1].prepare_to_leave()  # lands the round (the other's averaging runs on its own loop), then bequeaths
        assert opts[1].epoch == 1 and opts[1]._inflight is None
        wait_for(lambda: inner_step(opts[0], params[0], 0) or opts[0].epoch == 1, 30, "the stayer to land")
        assert torch.equal(opts[0].global_params[0], opts[1].global_params[0])
    finally:
        gated.gate.set()
        leave(dhts, opts)
