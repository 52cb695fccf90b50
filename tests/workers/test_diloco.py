"""DiLoCo with real peers on loopback, in one process: the outer step is the Nesterov step on the
sample-weighted mean of the pseudo-gradients, identical on every peer bit for bit; a slow peer
weighs what it processed; a noticed peer's inner work counts through the peer it hands it to; a
newcomer joins at the next round with the same global state; and in a run with membership a
stranger is refused by a round's every method."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from dht import DHT, DHTNode
from p2p import Authority, Identity, Membership, NotAMember, P2PError
from tests.workers.local_dhts import signed_dhts
from workers.diloco import DiLoCoOptimizer

pytestmark = pytest.mark.timeout(90)
SIZE, LR, MOMENTUM, INNER_LR = 97, 0.7, 0.9, 0.05
BATCH = 4


class Recorded(DiLoCoOptimizer):
    """Keeps each round's pseudo-gradient and weight as it sent them."""

    def _fill_buffers(self) -> None:
        super()._fill_buffers()
        self.sent = ([b.clone() for b in self.grad_buffers], self._round_weight())


def make_peers(n: int, authority: Authority | None = None, initial: list[str] | None = None,
               load_state_on_start: bool = False, cls: type[Recorded] = Recorded, target_peers: int | None = None,
               **options) -> tuple[list[DHT], list[Recorded], list[torch.nn.Parameter]]:
    """``n`` peers of a run whose round is ``target_peers`` (default ``n``) peers' 10 steps each."""
    def member(identity: Identity) -> dict:
        cert = authority.issue(identity.peer_id, 3600.0)
        return {"p2p_options": {"membership": Membership(authority.run, authority.public_key, cert)}}

    dhts, opts, params = signed_dhts(n, initial, member if authority is not None else None), [], []
    for dht in dhts:
        param = torch.nn.Parameter(torch.zeros(SIZE))
        params.append(param)
        opts.append(cls(torch.optim.SGD([param], lr=INNER_LR), dht, "diloco",
                        target_batch_size=(target_peers or n) * 10 * BATCH, outer_lr=LR, outer_momentum=MOMENTUM,
                        min_matchmaking_time=0.5, averaging_timeout=20, load_state_on_start=load_state_on_start,
                        **options))
    return dhts, opts, params


def leave(dhts: list[DHT], opts: list[DiLoCoOptimizer]) -> None:
    for opt in reversed(opts):
        opt.prepare_to_leave()
    for dht in dhts:
        dht.shutdown()


def wait_all_seen(opts: list[DiLoCoOptimizer], n: int, wait_for) -> None:
    def seen() -> bool:
        for opt in opts:
            opt.keep_alive()
        return all(opt.tracker.view().live_peers == n for opt in opts)

    wait_for(seen, 30, f"every view to hold {n} peers")


def train_round(opts: list[DiLoCoOptimizer], params: list[torch.nn.Parameter], epoch: int,
                slow: dict[int, float] | None = None) -> None:
    """Inner steps on every peer (each its own target) until each reaches ``epoch``."""
    done = threading.Barrier(len(opts) + 1)

    def train(i: int) -> None:
        target = torch.full((SIZE,), float(i + 1)) * torch.linspace(-1, 1, SIZE)
        try:
            deadline = time.monotonic() + 60  # bounded: a peer that never gets there fails the assertions
            while time.monotonic() < deadline:
                params[i].grad = (params[i].detach() - target) * 2  # the gradient of |θ - target|²
                if (slow or {}).get(i):
                    time.sleep(slow[i])
                opts[i].step(BATCH)
                if opts[i].epoch >= epoch:
                    return
        finally:
            done.wait()

    threads = [threading.Thread(target=train, args=(i,), daemon=True) for i in range(len(opts))]
    for t in threads:
        t.start()
    done.wait(timeout=80)


def expected_outer_step(before: torch.Tensor, momentum: torch.Tensor | None, sent: list[tuple]) -> tuple:
    """The outer SGD's Nesterov step on the sample-weighted mean pseudo-gradient, in float64."""
    total = sum(w for _, w in sent)
    g = sum(b[0].double() * w for b, w in sent) / total
    buf = g if momentum is None else momentum.double() * MOMENTUM + g
    return before.double() - LR * (g + MOMENTUM * buf), buf


def test_the_outer_step_is_the_weighted_nesterov_step_and_identical_everywhere_and_a_slow_peer_weighs_less(
        wait_for):
    dhts, opts, params = make_peers(3)
    try:
        wait_all_seen(opts, 3, wait_for)
        train_round(opts, params, 1, slow={2: 0.02})
        assert [o.epoch for o in opts] == [1, 1, 1]
        sent = [o.sent for o in opts]
        weights = [w for _, w in sent]
        # each peer weighs the samples it processed: the slow one got through fewer
        assert weights == [float(o.history[-1].samples) for o in opts]
        assert weights[2] < min(weights[:2])
        expected, _ = expected_outer_step(torch.zeros(SIZE), None, sent)
        for o, p in zip(opts, params, strict=True):
            assert torch.equal(o.global_params[0], opts[0].global_params[0])  # bit for bit
            assert torch.equal(p.detach(), o.global_params[0])  # the next inner phase starts from them
            assert torch.equal(o.outer.state_dict()["state"][0]["momentum_buffer"],
                               opts[0].outer.state_dict()["state"][0]["momentum_buffer"])
        torch.testing.assert_close(opts[0].global_params[0].double(), expected, rtol=0, atol=1e-5)
    finally:
        leave(dhts, opts)


def test_a_newcomer_loads_the_global_state_and_joins_the_next_round_in_step(wait_for):
    dhts, opts, params = make_peers(2)
    late: tuple | None = None
    try:
        wait_all_seen(opts, 2, wait_for)
        train_round(opts, params, 1)
        momentum = opts[0].outer.state_dict()["state"][0]["momentum_buffer"].clone()
        for o in opts:  # their adverts of epoch 1 are stored before the newcomer reads them (not in flight)
            o._advertise(wait=True)
        # the run's round size, as the others have it (one run, one target batch size)
        late = make_peers(1, initial=dhts[0].addresses, load_state_on_start=True, target_peers=2)
        newcomer = late[1][0]
        assert newcomer.epoch == 1
        assert torch.equal(newcomer.global_params[0], opts[0].global_params[0])
        assert torch.equal(late[2][0].detach(), opts[0].global_params[0])
        assert torch.equal(newcomer.outer.state_dict()["state"][0]["momentum_buffer"], momentum)
        everyone, all_params = [*opts, newcomer], [*params, *late[2]]
        wait_all_seen(everyone, 3, wait_for)
        before = opts[0].global_params[0].clone()
        train_round(everyone, all_params, 2)
        assert [o.epoch for o in everyone] == [2, 2, 2]
        assert [o.history[-1].group_size for o in everyone] == [3, 3, 3]  # the newcomer averaged in that round
        assert all(torch.equal(o.global_params[0], opts[0].global_params[0]) for o in everyone)
        expected, _ = expected_outer_step(before, momentum, [o.sent for o in everyone])
        torch.testing.assert_close(opts[0].global_params[0].double(), expected, rtol=0, atol=1e-5)
    finally:
        if late is not None:
            leave(late[0], late[1])
        leave(dhts, opts)


def test_a_stranger_is_refused_by_every_method_of_a_diloco_round(wait_for):
    authority = Authority(Identity(), "diloco")
    dhts, opts, params = make_peers(2, authority=authority)
    try:
        wait_all_seen(opts, 2, wait_for)
        train_round(opts, params, 1)
        assert [o.epoch for o in opts] == [1, 1] and opts[0].history[-1].group_size == 2  # members average
        averager = opts[0].averager
        methods = [averager.method, averager.outcome_method, averager.matchmaker.method, opts[0].state.meta_method]
        other = Authority(Identity(), "diloco")  # a certificate for this run's name from another authority
        identity = Identity()

        async def try_all() -> list[str]:
            refusals = []
            for membership in (None, Membership("diloco", other.public_key,
                                                other.issue(identity.peer_id, 3600.0))):
                node = await DHTNode.create([], identity=identity, client_mode=True,
                                            p2p_options={"membership": membership})
                try:
                    for method in methods:
                        with pytest.raises(NotAMember) as refusal:
                            await node.p2p.call(dhts[0].addresses[0], method, {}, timeout=10)
                        refusals.append(str(refusal.value))
                finally:
                    await node.shutdown()
            return refusals

        refusals = asyncio.run(try_all())
        assert len(refusals) == 2 * len(methods) and all(refusals)
        # the members are untouched: they go on averaging together
        train_round(opts, params, 2)
        assert [o.epoch for o in opts] == [2, 2] and opts[0].history[-1].group_size == 2
        assert torch.equal(opts[0].global_params[0], opts[1].global_params[0])
    finally:
        leave(dhts, opts)


def test_a_noticed_peer_hands_its_inner_work_on_and_it_counts_weighted_by_its_samples(wait_for):
    dhts, opts, params = make_peers(3)
    try:
        wait_all_seen(opts, 3, wait_for)
        leaver = opts[2]
        target = torch.full((SIZE,), 5.0)
        for _ in range(6):  # a few inner steps, then a notice: it leaves before the round
            params[2].grad = (params[2].detach() - target) * 2
            leaver.step(BATCH)
        assert leaver.epoch == 0
        leaver.prepare_to_leave()
        epoch, weight, bequest, heir = leaver.bequeathed
        assert (epoch, weight) == (0, 6.0 * BATCH) and heir is not None
        torch.testing.assert_close(bequest, -params[2].detach(), rtol=0, atol=0)  # θ_global (0) − θ_local
        train_round(opts[:2], params[:2], 1)
        assert [o.epoch for o in opts[:2]] == [1, 1]
        heirs = [o for o in opts[:2] if o.sent[1] > o.history[-1].samples]
        assert len(heirs) == 1  # one heir, and its declared weight carries the leaver's samples
        assert heirs[0].sent[1] == heirs[0].history[-1].samples + weight
        # the outer step is the weighted mean over all three peers' work, the leaver's included
        expected, _ = expected_outer_step(torch.zeros(SIZE), None, [o.sent for o in opts[:2]])
        torch.testing.assert_close(opts[0].global_params[0].double(), expected, rtol=0, atol=1e-5)
        assert torch.equal(opts[0].global_params[0], opts[1].global_params[0])
    finally:
        leave(dhts[:2], opts[:2])
        dhts[2].shutdown()


def test_a_bequest_that_does_not_fit_is_refused_with_its_reason_and_the_round_goes_on(wait_for):
    dhts, opts, params = make_peers(2)
    try:
        wait_all_seen(opts, 2, wait_for)
        heir, address = opts[0], dhts[0].addresses[0]
        good = torch.zeros(SIZE)

        async def send(node: DHTNode, request: dict) -> str:
            try:
                reply = await node.p2p.call(address, heir.bequest_method, request, timeout=10)
            except P2PError as e:
                return str(e)
            return repr(reply)

        answers = [dhts[1].run_coroutine(lambda n, r=r: send(n, r)) for r in (
            {"e": 0, "w": 8.0, "t": torch.full((SIZE,), float("nan"))},
            {"e": 0, "w": 1e12, "t": good},
            {"e": 0, "w": 8.0, "t": torch.zeros(SIZE + 1)},
            {"e": 0, "w": 8.0},
            {"e": 5, "w": 8.0, "t": good},
        )]
        assert "not finite" in answers[0]
        assert "weight must be in" in answers[1]
        assert f"holds {SIZE} float32 values" in answers[2]
        assert "a bequest is" in answers[3]
        assert "'ok': False" in answers[4] and "epoch 0" in answers[4]
        assert heir._bequests == []  # nothing refused was kept
        train_round(opts, params, 1)
        assert [o.epoch for o in opts] == [1, 1]
        assert [o.sent[1] for o in opts] == [float(o.history[-1].samples) for o in opts]
        assert torch.equal(opts[0].global_params[0], opts[1].global_params[0])
    finally:
        leave(dhts, opts)


def test_a_member_bequeaths_once_a_round_and_a_peer_holds_a_bounded_number(wait_for, monkeypatch):
    monkeypatch.setattr("workers.diloco.BEQUESTS_HELD", 2)
    dhts, opts, _ = make_peers(4)
    try:
        heir, address = opts[0], dhts[0].addresses[0]
        request = {"e": 0, "w": 8.0, "t": torch.zeros(SIZE)}

        async def send(node: DHTNode) -> dict:
            return await node.p2p.call(address, heir.bequest_method, request, timeout=10)

        answers = [dhts[i].run_coroutine(send) for i in (1, 1, 2, 3)]
        assert answers[0] == {"ok": True}
        assert answers[1] == {"ok": False, "why": "one bequest per peer and round"}  # the same member again
        assert answers[2] == {"ok": True}
        assert answers[3] == {"ok": False, "why": "we hold 2 bequests for this round already"}
        assert len(heir._bequests) == 2
    finally:
        leave(dhts, opts)
