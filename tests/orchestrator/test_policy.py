"""FleetPolicy decisions against an in-memory cloud and a hand-advanced clock.

The policy is the part of the supervisor that spends money: zone and market choice, budget caps,
fleet size, adoption after a restart.  Each test drives its tick directly and reads the outcome
back from the fake provider, the fake workers and a real run store (SQLite on tmp_path), so every
decision is checked in milliseconds and without Ray.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config.schema import ClusterConfig
from orchestrator.config.tags import RUN_TAG
from orchestrator.fleet.policy import FleetPolicy
from orchestrator.host.wait import wait_for
from orchestrator.providers.base import CapacityError, Instance, LaunchSpec
from orchestrator.runs.store import RunStore, summarize_costs
from tests.fakes.clock import FakeClock
from tests.fakes.provider import FakeProvider
from tests.fakes.workers import FakeWorkers

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[2]
START = 1000.0  # the fake clock's origin: never 0, which the store would read as "no time given"
NODE = "gpu"
ZONES = ["a", "b", "c"]
SETTLE_S = 5.0  # bound on waiting for the policy's pools; the calls themselves take microseconds



def make_config(runs_dir: Path, *, spot_prices: dict[str, float] | None = None, min_workers: int = 0,
                max_workers: int = 3, spot: dict | None = None, budget: dict | None = None,
                every_s: float = 60.0, warm_spares: int = 0, policy: dict | None = None) -> ClusterConfig:
    return ClusterConfig.model_validate({
        "cluster_name": "c", "runs_dir": str(runs_dir),
        "provider": {"type": "local", "zones": ZONES},
        "available_node_types": {NODE: {
            "min_workers": min_workers, "max_workers": max_workers, "warm_spares": warm_spares,
            "on_demand_price_per_hour": 1.0,
            "spot_price_per_hour": spot_prices or {"a": 0.3, "b": 0.4, "c": 0.5}, "spot": True}},
        "spot": spot or {}, "budget": budget or {}, "checkpoint": {"every_s": every_s}, "policy": policy or {},
        "dashboard": {"enabled": False},
    })


def price_table(config: ClusterConfig) -> dict[tuple[str, str, str], float]:
    """The config's prices as the provider quotes them (missing spot zones: 0.3 x on-demand)."""
    table = {}
    for name, node_type in config.available_node_types.items():
        od = node_type.on_demand_price_per_hour
        for zone in config.provider.zones:
            table[(name, zone, "spot")] = node_type.spot_price_per_hour.get(zone, 0.3 * od)
            table[(name, zone, "on-demand")] = od
    return table


@dataclass
class Rig:
    config: ClusterConfig
    clock: FakeClock
    provider: FakeProvider
    store: RunStore
    workers: FakeWorkers
    policies: list[FleetPolicy] = field(default_factory=list)

    @property
    def policy(self) -> FleetPolicy:
        return self.policies[-1]

    def new_policy(self, workers: FakeWorkers | None = None, max_calls: int = 16) -> FleetPolicy:
        """A policy on this rig's store and cloud (a second one is a restarted supervisor)."""
        if workers is not None:
            self.workers = workers
        policy = FleetPolicy(self.config, self.provider, self.clock, self.store, self.workers,
                             worker_args=lambda node_type: {"run": self.config.cluster_name}, max_calls=max_calls)
        self.policies.append(policy)
        return policy


@pytest.fixture
def make_rig(tmp_path: Path) -> Iterator[Callable[..., Rig]]:
    """Builds a policy over a fake cloud and a real store; shuts every one down after the test."""
    rigs: list[Rig] = []

    def make(max_calls: int = 16, **options: Any) -> Rig:
        config = make_config(tmp_path / f"runs{len(rigs)}", **options)
        clock = FakeClock(START)
        RunStore.create(config).close()
        store = RunStore(config.run_dir())
        store.clock = clock  # as the supervisor does: the store's times are the policy's
        rig = Rig(config, clock, FakeProvider(clock, price_table(config)), store, FakeWorkers())
        rigs.append(rig)
        rig.new_policy(max_calls=max_calls)
        return rig

    yield make
    for rig in rigs:
        rig.provider.gate.set()  # no launch thread outlives its test
        for policy in rig.policies:
            policy.shutdown()
        rig.store.close()


# ---- driving the tick -----------------------------------------------------------------------------
def wait_until(condition: Callable[[], bool], deadline: float, what: str) -> None:
    """``wait_for`` against a deadline that several waits share (a settle, a tick loop)."""
    wait_for(condition, max(deadline - time.monotonic(), 0.0), what, every=0.001)


def poll_done(policy: FleetPolicy) -> bool:
    return policy.calls.poll_done()


def calls_done(policy: FleetPolicy) -> bool:
    return policy.calls.all_done()


def state(policy: FleetPolicy) -> tuple:
    return (sorted(policy.live), len(policy.pending), policy.launching, sorted(policy.noticed), sorted(policy.left),
            len(policy.preemptions), policy.budget_exhausted, policy.status_text, len(policy.store.events()))


def settle(policy: FleetPolicy, timeout: float = SETTLE_S) -> int:
    """Tick until every call the policy started has finished and a tick changes nothing.

    The tick only starts provider calls and collects finished ones, so reading outcomes after a
    single tick would race the pools; this waits on the calls themselves, bounded.  Returns ticks.
    """
    deadline = time.monotonic() + timeout
    before = None
    ticks = 0
    while True:
        policy.tick()
        ticks += 1
        wait_until(lambda: calls_done(policy), deadline, "the policy's provider calls")
        after = state(policy)
        if after == before and not policy.calls.running:
            return ticks
        before = after
        if time.monotonic() > deadline:
            raise AssertionError(f"the policy did not settle in {timeout} s: {after}")


def tick_until(policy: FleetPolicy, condition: Callable[[], bool], timeout: float = SETTLE_S) -> int:
    """Tick as the supervisor does (waiting only for the poll, never a launch) until ``condition``."""
    deadline = time.monotonic() + timeout
    ticks = 0
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached after {ticks} ticks")
        policy.tick()
        ticks += 1
        wait_until(lambda: poll_done(policy), deadline, "the provider poll")
    return ticks


def preempt(rig: Rig, instance_ids: list[str], notice_s: float = 120.0) -> None:
    """Notice then kill, as a spot market does, and let the policy replace them."""
    now = rig.clock()
    for instance_id in instance_ids:
        rig.provider.notice(instance_id, now, now + notice_s)
        rig.provider.kill(instance_id)
    settle(rig.policy)


def kill(rig: Rig, instance_ids: list[str]) -> None:
    """Instances die without notice (not a preemption) and the policy replaces them."""
    for instance_id in instance_ids:
        rig.provider.kill(instance_id)
    settle(rig.policy)


def launched(rig: Rig, start: int = 0) -> list[tuple[str, str]]:
    return [(s.zone, s.market) for s in rig.provider.specs[start:]]


def ids(rig: Rig, start: int = 0) -> list[str]:
    return [s.instance_id for s in rig.provider.specs[start:]]


def end_reasons(rig: Rig) -> dict[str, str | None]:
    return {r.id: r.end_reason for r in rig.store.instances()}


# ---- zone and market ------------------------------------------------------------------------------
def test_launches_go_to_the_cheapest_zone(make_rig: Callable[..., Rig]) -> None:
    """Spot prices differ by zone; every launch should pay the lowest."""
    rig = make_rig(spot_prices={"a": 0.5, "b": 0.3, "c": 0.4}, max_workers=3)
    settle(rig.policy)

    assert launched(rig) == [("b", "spot")] * 3
    records = rig.store.instances()
    assert [(r.zone, r.market, r.price_per_hour, r.ended_at) for r in records] == [("b", "spot", 0.3, None)] * 3
    assert [r.peer_id for r in records] == [f"peer-{r.id}" for r in records]  # each got its worker
    assert sorted(rig.workers.placed) == sorted(ids(rig))
    assert len(rig.store.events("launch")) == 3
    assert sorted(rig.policy.live) == sorted(ids(rig))
    assert rig.policy.status_text == "running"


def test_recent_preemptions_penalize_a_zone_until_the_window_passes(make_rig: Callable[..., Rig]) -> None:
    """A zone that keeps preempting costs more than its price says (x 1.5 per preemption in the
    window), so replacements go elsewhere; each preemption stops counting once the window passes."""
    rig = make_rig(spot_prices={"a": 0.30, "b": 0.40, "c": 0.50}, max_workers=2, spot={"fallback_window_s": 600})
    settle(rig.policy)
    first = ids(rig)
    assert launched(rig) == [("a", "spot")] * 2

    preempt(rig, first[:1])  # at t=1000: a scores 0.30 x 1.5 = 0.45, above b's 0.40
    assert launched(rig, 2) == [("b", "spot")]
    rig.clock.advance(10)
    preempt(rig, first[1:])  # at t=1010: a scores 0.60
    assert launched(rig, 3) == [("b", "spot")]
    reasons = end_reasons(rig)
    assert [reasons[i] for i in first] == ["preempted", "preempted"]
    assert len(rig.store.events("notice")) == 2
    assert sorted(i for i, _ in rig.workers.notified) == sorted(first)
    assert rig.provider.terminated == []  # the cloud took them; nothing left to release

    in_b = ids(rig, 2)
    rig.clock.advance(595)  # t=1605: the first preemption left the window, the second (595 s ago) has not
    kill(rig, in_b[:1])
    assert launched(rig, 4) == [("b", "spot")]  # a still scores 0.45
    rig.clock.advance(10)  # t=1615: both have left the window
    kill(rig, in_b[1:])
    assert launched(rig, 5) == [("a", "spot")]
    assert [end_reasons(rig)[i] for i in in_b] == ["died", "died"]  # a death without notice is no penalty


def test_spot_above_the_price_cap_everywhere_launches_on_demand(make_rig: Callable[..., Rig]) -> None:
    """Above max_price_per_hour spot is worse than on-demand for the user; never launch it."""
    rig = make_rig(spot_prices={"a": 0.5, "b": 0.6, "c": 0.7}, max_workers=2, spot={"max_price_per_hour": 0.4})
    settle(rig.policy)

    assert [market for _, market in launched(rig)] == ["on-demand"] * 2
    assert [(r.market, r.price_per_hour) for r in rig.store.instances()] == [("on-demand", 1.0)] * 2


def test_price_cap_keeps_launches_in_zones_under_it(make_rig: Callable[..., Rig]) -> None:
    """Only zones under the cap are candidates, even when preemptions make them score worse than a
    zone above it (c at 0.7 would beat a penalized a at 1.0 without the cap)."""
    rig = make_rig(spot_prices={"a": 0.5, "b": 0.8, "c": 0.7}, max_workers=2, spot={"max_price_per_hour": 0.6})
    settle(rig.policy)
    assert launched(rig) == [("a", "spot")] * 2

    preempt(rig, ids(rig))
    assert launched(rig, 2) == [("a", "spot")] * 2
    assert all(r.price_per_hour <= 0.6 for r in rig.store.instances())


def test_falls_back_to_on_demand_after_repeated_preemptions_and_returns(make_rig: Callable[..., Rig]) -> None:
    """Spot that keeps preempting stalls training; after fallback_to_on_demand_after preemptions in
    the window launch on-demand, and go back to the cheaper spot once they leave the window."""
    rig = make_rig(spot_prices={"a": 0.3, "b": 0.35, "c": 0.4}, max_workers=2,
                   spot={"fallback_to_on_demand_after": 2, "fallback_window_s": 300})
    settle(rig.policy)
    first = ids(rig)
    assert [m for _, m in launched(rig)] == ["spot", "spot"]

    preempt(rig, first[:1])  # one in the window: still spot
    assert [m for _, m in launched(rig, 2)] == ["spot"]
    rig.clock.advance(10)
    preempt(rig, first[1:])  # two: on-demand
    assert [m for _, m in launched(rig, 3)] == ["on-demand"]
    on_demand = ids(rig, 3)
    assert [(r.market, r.price_per_hour) for r in rig.store.instances() if r.id in on_demand] == [("on-demand", 1.0)]

    rig.clock.advance(301)  # both preemptions have left the window
    kill(rig, on_demand)
    assert [m for _, m in launched(rig, 4)] == ["spot"]


# ---- budget and fleet size ------------------------------------------------------------------------
def test_hourly_budget_caps_the_fleet(make_rig: Callable[..., Rig]) -> None:
    """max_dollars_per_hour bounds the fleet's running rate, below max_workers if need be."""
    rig = make_rig(spot_prices={z: 1.0 for z in ZONES}, max_workers=5, budget={"max_dollars_per_hour": 2.5})
    settle(rig.policy)
    rig.clock.advance(60)
    settle(rig.policy)  # later ticks do not squeeze in a third

    assert len(rig.provider.specs) == 2
    assert len(rig.policy.live) == 2
    assert sum(r.price_per_hour for r in rig.store.instances()) <= 2.5


def test_total_budget_releases_everything_before_it_is_exceeded(make_rig: Callable[..., Rig]) -> None:
    """max_total_dollars is a hard cap: once spending (plus a few ticks in reserve) reaches it,
    every instance is released and the run's cost stays under the cap."""
    rig = make_rig(spot_prices={z: 1.0 for z in ZONES}, max_workers=2, budget={"max_total_dollars": 1.0})
    policy = rig.policy
    tick_s = 70.0  # not a divisor of the time to the cap: the last step would overshoot it
    policy.spend_margin_s = 3 * tick_s  # as the supervisor sets it: a few ticks of spending in reserve
    before_release: list[tuple[float, list[str], float]] = []  # the supervisor's final checkpoint goes here
    policy.before_release = lambda left_s: before_release.append(
        (left_s, sorted(policy.live), summarize_costs(rig.store, rig.clock()).dollars))
    settle(policy)
    fleet = ids(rig)
    assert len(fleet) == 2

    for _ in range(100):  # 2 $/h reaches $1 in 30 minutes: about 23 steps with the reserve
        rig.clock.advance(tick_s)
        settle(policy)
        if policy.budget_exhausted:
            break
    assert policy.budget_exhausted
    assert policy.status_text.startswith("budget exhausted")
    assert policy.live == {}
    assert sorted(rig.provider.terminated) == sorted(fleet)
    assert sorted(rig.workers.stopped) == sorted(fleet)  # a graceful stop before the terminate
    records = rig.store.instances()
    assert [(r.end_reason, r.ended_at) for r in records] == [("budget", rig.clock())] * 2
    assert len(rig.store.events("budget_exhausted")) == 1
    assert summarize_costs(rig.store, rig.clock()).dollars <= 1.0
    # before anything was released, with the seconds the budget had left at the fleet's rate of 2 $/h
    ((left_s, live, spent),) = before_release
    assert live == sorted(fleet) and left_s == pytest.approx((1.0 - spent) / 2.0 * 3600 / 2)  # half: for the release

    rig.clock.advance(3600)
    settle(policy)
    assert len(rig.provider.specs) == 2  # nothing is launched after the budget is spent
    assert summarize_costs(rig.store, rig.clock()).dollars <= 1.0  # released instances cost nothing more


def test_launches_max_workers_when_affordable(make_rig: Callable[..., Rig]) -> None:
    """Without a budget in the way the fleet grows to max_workers, not just min_workers."""
    rig = make_rig(min_workers=2, max_workers=4)
    settle(rig.policy)

    assert len(rig.provider.specs) == 4
    assert len(rig.policy.live) == 4
    assert rig.policy.status_text == "running"


def test_status_says_when_the_budget_is_below_min_workers(make_rig: Callable[..., Rig]) -> None:
    """Running fewer than min_workers is the operator's call to fix, so the status names it."""
    rig = make_rig(spot_prices={z: 1.0 for z in ZONES}, min_workers=3, max_workers=4,
                   budget={"max_dollars_per_hour": 1.5})
    settle(rig.policy)

    assert len(rig.provider.specs) == 1
    assert "budget" in rig.policy.status_text
    assert "min_workers 3" in rig.policy.status_text


# ---- a hanging cloud API --------------------------------------------------------------------------
def test_hanging_launches_do_not_delay_a_notice(make_rig: Callable[..., Rig]) -> None:
    """A notice gives the worker about two minutes to leave; launches stuck in a cloud API must not
    hold it back, so the notice reaches the worker within a tick or two.  The stuck launches fill
    the policy's whole call pool: the poll must not queue behind them."""
    rig = make_rig(max_workers=6, max_calls=5)
    policy = rig.policy
    settle(policy)
    fleet = ids(rig)
    survivor = fleet[-1]

    rig.provider.hang = True
    now = rig.clock()
    for instance_id in fleet[:5]:
        rig.provider.notice(instance_id, now, now + 120)
        rig.provider.kill(instance_id)
    tick_until(policy, lambda: len(rig.provider.hanging) == 5)
    replacements = set(rig.provider.hanging)

    deadline = time.monotonic() + SETTLE_S
    wait_until(lambda: poll_done(policy), deadline, "the provider poll")  # the next poll is sure to see it
    rig.clock.advance(5)
    now = rig.clock()
    rig.provider.notice(survivor, now, now + 120)
    ticks = tick_until(policy, lambda: survivor in dict(rig.workers.notified))

    assert ticks <= 2
    assert replacements <= rig.provider.hanging  # all five launches are still stuck
    assert policy.launching >= 5
    assert dict(rig.workers.notified)[survivor] == pytest.approx(120 * 0.8)
    assert {r.id: r.notice_at for r in rig.store.instances()}[survivor] == now

    rig.provider.gate.set()
    settle(policy)
    assert rig.provider.hanging == set()
    assert replacements <= set(policy.live)
    assert len(policy.live) == 7  # five replacements, the noticed survivor and its own replacement
    rig.provider.kill(survivor)
    settle(policy)
    assert end_reasons(rig)[survivor] == "preempted"
    assert len(policy.live) == 6


# ---- adoption after a restart ---------------------------------------------------------------------
def test_restarted_policy_adopts_the_live_fleet(make_rig: Callable[..., Rig]) -> None:
    """A supervisor restart must not double the fleet (and the bill): the new policy finds the
    run's instances by tag and keeps their running workers."""
    rig = make_rig(max_workers=3)
    settle(rig.policy)
    fleet = ids(rig)
    before = rig.store.instances()
    rig.policy.shutdown()  # stop supervising, leaving the fleet running

    workers = FakeWorkers()
    workers.alive = set(fleet)
    second = rig.new_policy(workers)
    rig.clock.advance(30)
    adopted = second.adopt(lost_at=rig.store.last_time())
    settle(second)

    assert sorted(adopted) == sorted(fleet)
    assert sorted(second.live) == sorted(fleet)
    assert len(rig.provider.specs) == 3  # no new launches
    assert rig.provider.terminated == []
    assert workers.placed == []  # running workers are kept, not placed again
    assert rig.store.instances() == before
    assert sorted(e[2] for e in rig.store.events("adopted")) == sorted(fleet)


def test_adoption_releases_strays_and_closes_lost_instances(make_rig: Callable[..., Rig]) -> None:
    """The store and the cloud can disagree after a crash: an instance the store closed but the cloud
    still runs would bill forever, so it is released; one the store thinks open but the cloud lost
    stops costing at the last moment the store heard from the run."""
    rig = make_rig(max_workers=3)
    settle(rig.policy)
    closed, lost, kept = ids(rig)
    rig.policy.shutdown()

    rig.clock.advance(60)
    rig.store.update_instance(closed, ended_at=rig.clock(), end_reason="released")  # terminate never got through
    closed_record = next(r for r in rig.store.instances() if r.id == closed)
    last_heard = rig.store.last_time()
    rig.provider.lose(lost)
    stray = Instance("c-gpu-0099", NODE, "a", "spot", 0.3, rig.clock(), tags={RUN_TAG: "c"})
    other_run = Instance("other-gpu-0000", NODE, "a", "spot", 0.3, rig.clock(), tags={RUN_TAG: "other"})
    rig.provider.add(stray)
    rig.provider.add(other_run)
    rig.clock.advance(600)  # the supervisor was down for ten minutes

    workers = FakeWorkers()
    workers.alive = {kept}
    second = rig.new_policy(workers)
    adopted = second.adopt(lost_at=last_heard)
    lost_record = next(r for r in rig.store.instances() if r.id == lost)
    assert adopted == [kept]
    assert (lost_record.end_reason, lost_record.ended_at) == ("lost", last_heard)
    assert [e[2] for e in rig.store.events("lost")] == [lost]

    settle(second)
    assert sorted(rig.provider.terminated) == sorted([closed, stray.id])
    assert other_run.id in rig.provider.instances  # another run's instance is not ours to release
    assert next(r for r in rig.store.instances() if r.id == closed) == closed_record
    replacements = ids(rig, 3)  # the fleet is refilled to max_workers around the adopted one
    assert len(replacements) == 2
    assert not set(replacements) & {closed, lost, kept}  # ids continue after every id the run used
    assert sorted(second.live) == sorted([kept, *replacements])
    assert len(rig.store.instances()) == 5


# ---- no Ray -----------------------------------------------------------------------------------------
def test_instances_dying_while_booting_are_relaunched_with_backoff(make_rig: Callable[..., Rig]) -> None:
    """A broken boot must not buy machines as fast as they fail: one death while booting is relaunched
    at once (a machine reclaimed mid-boot), the next relaunches wait 30 s, then 60 s, and a worker
    that starts resets the wait."""
    rig = make_rig(max_workers=1)
    rig.workers.refuse = True
    settle(rig.policy)
    assert len(rig.provider.specs) == 2 and list(end_reasons(rig).values()) == ["died", "died"]
    assert "died while booting" in rig.policy.status_text
    assert rig.provider.terminated == ids(rig)  # the broken machines are released, not left billing
    for wait in (30.0, 60.0):
        launches = len(rig.provider.specs)
        rig.clock.advance(wait - 1)
        settle(rig.policy)
        assert len(rig.provider.specs) == launches  # still waiting
        rig.clock.advance(2)
        settle(rig.policy)
        assert len(rig.provider.specs) == launches + 1
    rig.workers.refuse = False
    rig.clock.advance(121)
    settle(rig.policy)
    assert len(rig.policy.live) == 1 and rig.policy.status_text == "running"
    kill(rig, list(rig.policy.live))  # an ordinary death after a good boot: replaced at once
    assert len(rig.policy.live) == 1 and len(rig.provider.specs) == 6


def test_a_machine_whose_worker_died_is_released_and_replaced(make_rig: Callable[..., Rig]) -> None:
    """A killed or crashed worker leaves its machine running and billing, training nothing: the
    machine ends as died, is released, and a replacement follows."""
    rig = make_rig(max_workers=2, min_workers=2)
    settle(rig.policy)
    first, second = ids(rig)
    rig.workers.dead.add(first)
    settle(rig.policy)
    assert end_reasons(rig) == {first: "died", second: None, ids(rig)[2]: None}
    assert rig.provider.terminated == [first]
    assert sorted(rig.policy.live) == sorted([second, ids(rig)[2]])
    assert "died: " + first in rig.policy.fleet_log[-1]


def test_the_head_node_type_is_never_launched(make_rig: Callable[..., Rig]) -> None:
    """The head is where the supervisor runs; its node type is not part of the fleet."""
    rig = make_rig(max_workers=2)
    config = rig.config.model_copy(update={"head_node_type": NODE})
    policy = FleetPolicy(config, rig.provider, rig.clock, rig.store, rig.workers, worker_args=lambda node_type: {})
    rig.policies.append(policy)
    rig.policies[0].shutdown()
    settle(policy)
    assert rig.provider.specs == [] and policy.live == {}


# ---- warm spares ----------------------------------------------------------------------------------
# ---- rebalance recommendations ---------------------------------------------------------------------
def test_a_rebalance_recommendation_brings_a_replacement_elsewhere_then_releases_the_machine(
        make_rig: Callable[..., Rig]) -> None:
    """EC2's early warning: the replacement launches at once, in another zone (both trainers are in the
    cheapest), and the machine at risk goes gracefully once the replacement trains: before any notice."""
    rig = make_rig(max_workers=2)
    policy = rig.policy
    settle(policy)
    first, second = ids(rig)
    assert launched(rig) == [("a", "spot"), ("a", "spot")]

    rig.workers.rebalanced.add(first)
    settle(policy)
    (replacement,) = ids(rig, 2)
    assert launched(rig, 2) == [("b", "spot")]  # zone a saw the warning: the next cheapest
    assert sorted(policy.live) == sorted([second, replacement]) and rig.workers.placed[-1] == replacement
    assert end_reasons(rig)[first] == "rebalanced" and first in rig.provider.terminated
    assert first in rig.workers.stopped  # its worker was stopped gracefully first
    assert [(e[2], json.loads(e[3])) for e in rig.store.events("rebalance")] == [(first, {"action": "replace"})]
    assert [e[2] for e in rig.store.events("rebalanced")] == [first] and not policy.at_risk

    rig.provider.notice(first, rig.clock(), rig.clock() + 120)  # the notice, late: nothing more happens
    settle(policy)
    assert len(rig.provider.specs) == 3 and not rig.store.events("notice")


def test_a_notice_before_the_replacement_trains_takes_the_machine_as_any_notice_does(
        make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(max_workers=2)
    policy = rig.policy
    settle(policy)
    first, second = ids(rig)
    rig.provider.hang = True  # the replacement's launch does not come back yet
    rig.workers.rebalanced.add(first)
    policy.tick()
    wait_until(lambda: len(rig.provider.hanging) == 1, time.monotonic() + SETTLE_S, "the replacement's launch")
    now = rig.clock()
    rig.provider.notice(first, now, now + 120)
    rig.provider.kill(first)
    rig.provider.gate.set()
    settle(policy)
    assert len(rig.provider.specs) == 3  # the replacement already asked for: no second one
    assert end_reasons(rig)[first] == "preempted" and len(policy.live) == 2 and not policy.at_risk


def test_with_on_rebalance_ignore_the_warning_is_recorded_and_nothing_launches(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(max_workers=2, policy={"on_rebalance": "ignore"})
    policy = rig.policy
    settle(policy)
    first, _ = ids(rig)
    rig.workers.rebalanced.add(first)
    settle(policy)
    assert len(rig.provider.specs) == 2 and first in policy.live and end_reasons(rig)[first] is None
    assert [json.loads(e[3]) for e in rig.store.events("rebalance")] == [{"action": "ignore"}]


def spares_of(rig: Rig) -> set[str]:
    """The instances whose worker was started as a warm spare."""
    return {i for i, args in rig.workers.args.items() if args.get("standby")}


def test_warm_spares_launch_after_the_trainers_and_take_a_noticed_trainers_place(make_rig: Callable[..., Rig]) -> None:
    """Two trainers and one spare.  A trainer's notice activates the spare at once (not a boot
    later); the trainer's replacement becomes the next spare; the kill changes nothing more."""
    rig = make_rig(max_workers=2, warm_spares=1)
    policy = rig.policy
    settle(policy)
    first, second, spare = ids(rig)
    assert spares_of(rig) == {spare} and policy.spares == {spare}
    assert [e[2] for e in rig.store.events("standby")] == [spare]

    now = rig.clock()
    rig.provider.notice(first, now, now + 120)
    settle(policy)
    assert rig.workers.activated == [spare]
    assert [e[2] for e in rig.store.events("activated")] == [spare]
    (replacement,) = ids(rig, 3)
    assert spares_of(rig) == {spare, replacement}  # started as spares, both
    assert policy.spares == {replacement}  # the first one trains now

    rig.provider.kill(first)
    settle(policy)
    assert sorted(policy.live) == sorted([second, spare, replacement])
    assert len(rig.provider.specs) == 4 and rig.workers.activated == [spare]


def test_a_noticed_spare_is_replaced_by_a_spare_and_a_trainer_lost_without_notice_by_one(
        make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(max_workers=2, warm_spares=1)
    policy = rig.policy
    settle(policy)
    first, second, spare = ids(rig)

    preempt(rig, [spare])  # the spare's own notice: nobody takes the place of a spare
    (new_spare,) = ids(rig, 3)
    assert rig.workers.activated == [] and policy.spares == {new_spare} and new_spare in spares_of(rig)

    kill(rig, [second])  # a trainer gone without a notice: the spare steps in when its end is seen
    assert rig.workers.activated == [new_spare]
    (replacement,) = ids(rig, 4)
    assert policy.spares == {replacement} and replacement in spares_of(rig)
    assert sorted(policy.live) == sorted([first, new_spare, replacement])


def test_a_noticed_trainer_with_no_spare_left_gets_a_trainer_as_replacement(make_rig: Callable[..., Rig]) -> None:
    """The spare noticed just before the trainer: no spare takes the place, so of the two
    replacements one trains and one is the next spare."""
    rig = make_rig(max_workers=1, warm_spares=1)
    policy = rig.policy
    settle(policy)
    trainer, spare = ids(rig)
    now = rig.clock()
    rig.provider.notice(spare, now, now + 120)
    rig.provider.notice(trainer, now, now + 120)
    settle(policy)
    assert rig.workers.activated == []
    new_trainer, new_spare = ids(rig, 2)
    assert not rig.workers.args[new_trainer].get("standby") and rig.workers.args[new_spare]["standby"]
    assert policy.spares == {spare, new_spare}  # the noticed spare stays one until it ends


def test_a_restarted_policy_knows_its_spares_from_their_workers(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(max_workers=2, warm_spares=1)
    settle(rig.policy)
    first, second, spare = ids(rig)
    rig.policy.shutdown()

    workers = FakeWorkers()
    workers.alive = {first, second, spare}
    workers.standby = {spare}
    second_policy = rig.new_policy(workers)
    second_policy.adopt(lost_at=rig.store.last_time())
    settle(second_policy)
    assert second_policy.spares == {spare} and len(rig.provider.specs) == 3

    now = rig.clock()
    rig.provider.notice(first, now, now + 120)
    settle(second_policy)
    assert workers.activated == [spare]


def test_warm_spares_are_for_trainers(tmp_path: Path) -> None:
    from orchestrator.config.checks import config_problems

    config = make_config(tmp_path, max_workers=3, warm_spares=2)
    assert config.max_trainers() == 5 and config.max_instances() == 5
    small = config.model_copy(update={"training": config.training.model_copy(update={"group_size": 4})})
    assert config_problems(small) == []  # five trainers average in groups of at most four
    with pytest.raises(ValueError, match="warm_spares .* is for trainers"):
        ClusterConfig.model_validate({
            "cluster_name": "c", "provider": {"type": "local"},
            "available_node_types": {"srv": {"role": "experts", "max_workers": 2, "warm_spares": 1}},
        })


# ---- regions ---------------------------------------------------------------------------------------
class RegionalCloud(FakeProvider):
    """The in-memory cloud with zones out of capacity: a launch there is refused as a cloud refuses it."""

    def __init__(self, clock: FakeClock, prices: dict[tuple[str, str, str], float],
                 no_capacity: set[tuple[str, str]]) -> None:
        super().__init__(clock, prices)
        self.no_capacity = no_capacity  # (zone, market)
        self.refused: list[tuple[str, str]] = []

    def launch(self, spec: LaunchSpec) -> Instance:
        if (spec.zone, spec.market) in self.no_capacity:
            self.refused.append((spec.zone, spec.market))
            raise CapacityError(f"no capacity in {spec.zone} ({spec.market})", spec.zone, spec.market)
        return super().launch(spec)


def two_regions(runs_dir: Path, budget: dict, spot: dict) -> ClusterConfig:
    """east in the provider's region and zones, west in a region of its own, listed second: its w-a is
    the cheapest zone of both."""
    return ClusterConfig.model_validate({
        "cluster_name": "c", "runs_dir": str(runs_dir),
        "provider": {"type": "local", "region": "east", "zones": ["e-a", "e-b"]},
        "available_node_types": {
            "east": {"max_workers": 1, "spot_price_per_hour": {"e-a": 0.20, "e-b": 0.25}},
            "west": {"max_workers": 1, "region": "west", "zones": ["w-a", "w-b"],
                     "spot_price_per_hour": {"w-a": 0.15, "w-b": 0.30}}},
        "spot": spot, "budget": budget, "dashboard": {"enabled": False},
    })


@pytest.fixture
def regional_rig(tmp_path: Path) -> Iterator[Callable[..., Rig]]:
    """A policy over the two regions' fake cloud (refusing ``no_capacity``) and a real store; the
    default budget has room for one spot instance."""
    rigs: list[Rig] = []

    def make(no_capacity: frozenset = frozenset(), budget: dict | None = None, spot: dict | None = None) -> Rig:
        config = two_regions(tmp_path / f"runs{len(rigs)}", {"max_dollars_per_hour": 0.26} if budget is None
                             else budget, spot or {})
        clock = FakeClock(START)
        RunStore.create(config).close()
        store = RunStore(config.run_dir())
        store.clock = clock
        prices = {(name, zone, market): nt.price(zone, market) for name, nt in config.available_node_types.items()
                  for zone in config.zones_of(name) for market in ("spot", "on-demand")}
        rig = Rig(config, clock, RegionalCloud(clock, prices, set(no_capacity)), store, FakeWorkers())
        rigs.append(rig)
        rig.new_policy()
        return rig

    yield make
    for rig in rigs:
        for policy in rig.policies:
            policy.shutdown()
        rig.store.close()


def where(rig: Rig) -> list[tuple[str, str | None, str, str]]:
    """(node type, region, zone, market) of every instance the store has, in launch order."""
    return [(r.node_type, r.region, r.zone, r.market) for r in rig.store.instances()]


def test_the_cheapest_capacity_of_all_regions_is_bought_first(regional_rig: Callable[..., Rig]) -> None:
    """The budget has room for one instance: it goes to west's w-a (0.15), the cheapest zone of both
    regions, though east is listed first (0.20 at best)."""
    rig = regional_rig()
    settle(rig.policy)
    assert where(rig) == [("west", "west", "w-a", "spot")]
    assert [i.region for i in rig.policy.live.values()] == ["west"]
    (_, _, _, detail), = rig.store.events("launch_requested")
    assert json.loads(detail) == {"node_type": "west", "zone": "w-a", "market": "spot", "region": "west"}
    assert json.loads(rig.store.events("launch")[0][3])["region"] == "west"


def test_a_capacity_error_moves_the_launch_to_the_other_region(regional_rig: Callable[..., Rig]) -> None:
    """w-a has no spot capacity: it rests, west's next zone (w-b, 0.30) now costs more than east's
    e-a (0.20), so the one instance the budget allows is bought in the other region."""
    rig = regional_rig(no_capacity=frozenset({("w-a", "spot")}))
    settle(rig.policy)
    assert rig.provider.refused == [("w-a", "spot")]
    assert where(rig) == [("east", "east", "e-a", "spot")]
    (_, _, _, detail), = rig.store.events("no_capacity")
    assert {k: json.loads(detail)[k] for k in ("node_type", "region", "zone")} == {
        "node_type": "west", "region": "west", "zone": "w-a"}
    rig.clock.advance(FleetPolicy.no_capacity_s + 1)  # w-a may be tried again: the budget still has no room
    settle(rig.policy)
    assert rig.provider.refused == [("w-a", "spot")] and len(rig.store.instances()) == 1


def test_preemptions_in_one_region_send_only_that_region_to_on_demand(regional_rig: Callable[..., Rig]) -> None:
    """fallback_to_on_demand_after counts the preemptions of a node type's own region."""
    rig = regional_rig(budget={}, spot={"fallback_to_on_demand_after": 1})
    settle(rig.policy)
    assert where(rig) == [("west", "west", "w-a", "spot"), ("east", "east", "e-a", "spot")]  # cheapest first
    first_west, first_east = ids(rig)
    preempt(rig, [first_west])
    kill(rig, [first_east])  # died, not preempted: east's replacement stays on spot
    # west on demand, in w-b: w-a's preemption still counts against it
    assert where(rig)[2:] == [("west", "west", "w-b", "on-demand"), ("east", "east", "e-a", "spot")]


def test_policy_module_imports_no_ray() -> None:
    """The policy must be testable (and these tests fast) without Ray.  A fresh interpreter, since
    other test modules in the same session may have imported Ray already."""
    code = "import sys, orchestrator.fleet.policy; print('ray' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=25)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
