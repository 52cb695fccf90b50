"""The fleet policy at 1,000 instances, against the in-memory cloud and a real run store.

What each tick decides and records must come out the same at a thousand instances as at three:
every launch asked for, recorded and placed once, every end recorded with its reason and
replaced, the hourly budget and the warm spares counted launch by launch, and all that a tick
records committed at once (one transaction), so a reader elsewhere sees it whole.  Each tick is
also held under a generous bound, a guard against work that grows with the square of the fleet;
the figures themselves come from ``benchmarks/_scale_orchestrator.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config.schema import ClusterConfig
from orchestrator.fleet.policy import FleetPolicy
from orchestrator.host.wait import wait_for
from orchestrator.runs.store import RunStore
from tests.fakes.clock import FakeClock
from tests.fakes.provider import FakeProvider
from tests.fakes.workers import FakeWorkers

pytestmark = pytest.mark.timeout(60)

N = 1000
NODE = "worker"
ZONES = ["a", "b", "c"]
SPOT = {"a": 0.3, "b": 0.4, "c": 0.5}
START = 1000.0
CALLS_S = 20.0  # bound on waiting for the policy's pool calls; each takes microseconds
TICK_GUARD_S = 1.0  # a tick over a thousand instances takes milliseconds; this only catches a quadratic one
FILL_TICK_GUARD_S = 5.0  # the tick that records a thousand launches at once


@dataclass
class Rig:
    config: ClusterConfig
    clock: FakeClock
    provider: FakeProvider
    store: RunStore
    workers: FakeWorkers
    policy: FleetPolicy


@pytest.fixture
def make_rig(tmp_path: Path) -> Iterator[Callable[..., Rig]]:
    """A policy over a fake cloud, fake workers and a real store; shut down after the test."""
    rigs: list[Rig] = []

    def make(budget: dict | None = None, **node: Any) -> Rig:
        config = ClusterConfig.model_validate({
            "cluster_name": "big", "runs_dir": str(tmp_path / f"runs{len(rigs)}"),
            "provider": {"type": "local", "zones": ZONES},
            "available_node_types": {NODE: {"min_workers": 0, "max_workers": N, "on_demand_price_per_hour": 1.0,
                                            "spot_price_per_hour": SPOT, **node}},
            "budget": budget or {}, "dashboard": {"enabled": False},
        })
        clock = FakeClock(START)
        store = RunStore.create(config)
        store.clock = clock
        prices = {(NODE, z, "spot"): p for z, p in SPOT.items()} | {(NODE, z, "on-demand"): 1.0 for z in ZONES}
        provider = FakeProvider(clock, prices)
        workers = FakeWorkers()
        policy = FleetPolicy(config, provider, clock, store, workers, worker_args=lambda node_type: {"run": "big"})
        rigs.append(Rig(config, clock, provider, store, workers, policy))
        return rigs[-1]

    yield make
    for rig in rigs:
        rig.provider.gate.set()
        rig.policy.shutdown()
        rig.store.close()


def calls_done(policy: FleetPolicy) -> None:
    wait_for(policy.calls.all_done, CALLS_S, "the policy's provider calls", every=0.001)


def timed_tick(policy: FleetPolicy) -> float:
    started = time.perf_counter()
    policy.tick()
    return time.perf_counter() - started


def settle(policy: FleetPolicy) -> list[float]:
    """Tick (waiting for the pool calls between ticks) until a tick starts no call; the ticks' seconds."""
    seconds = []
    while True:
        seconds.append(timed_tick(policy))
        calls_done(policy)
        if not policy.calls.running and policy.launching == 0 and not policy.pending:
            policy.tick()  # collects the last poll; a settled fleet starts nothing more
            calls_done(policy)
            if not policy.calls.running:
                return seconds
        assert len(seconds) < 20, f"the fleet did not settle: {len(policy.live)} live"


def reader(rig: Rig) -> RunStore:
    """The run store as another process sees it (its own connection): only what was committed."""
    return RunStore.open(rig.config.run_dir())


def test_a_thousand_instances_are_launched_recorded_and_placed_once(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(min_workers=N)
    seconds = settle(rig.policy)

    ids = sorted(s.instance_id for s in rig.provider.specs)  # launched on a pool: in any order
    assert ids == [f"big-{NODE}-{k:04d}" for k in range(N)]  # each asked for once
    assert {(s.zone, s.market) for s in rig.provider.specs} == {("a", "spot")}  # the cheapest zone
    assert sorted(rig.policy.live) == ids and sorted(rig.workers.placed) == ids
    with closing(reader(rig)) as store:
        records = store.instances()
        assert sorted(r.id for r in records) == ids  # launched at one moment: no order among them
        assert all(r.ended_at is None and r.peer_id == f"peer-{r.id}" for r in records)
        assert len(store.events("launch")) == len(store.events("launch_requested")) == N
    assert max(seconds) < FILL_TICK_GUARD_S, seconds


def test_a_tick_records_the_churn_of_a_thousand_in_one_commit_and_replaces_it(
        make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(min_workers=N)
    settle(rig.policy)
    live = sorted(rig.policy.live)
    preempted, died = live[:10], live[500:505]
    now = rig.clock.advance(30.0)
    for instance_id in preempted:
        rig.provider.notice(instance_id, now, now + 120.0)
        rig.provider.kill(instance_id)
    for instance_id in died:
        rig.provider.kill(instance_id)
    rig.policy.tick()  # collects the poll started before the churn (empty), starts one that sees it
    calls_done(rig.policy)

    statements: list[str] = []
    rig.store.db.set_trace_callback(statements.append)
    seconds = timed_tick(rig.policy)
    rig.store.db.set_trace_callback(None)

    assert statements.count("COMMIT") == 1, "the tick's writes were not committed together"
    assert sorted(rig.policy.noticed) == preempted
    assert len(rig.policy.live) == N - 15 and rig.policy.launching == 15  # replacements asked at once
    with closing(reader(rig)) as store:  # committed: another connection sees all of it
        reasons = {r.id: r.end_reason for r in store.instances()}
        assert sorted(i for i, why in reasons.items() if why == "preempted") == preempted
        assert sorted(i for i, why in reasons.items() if why == "died") == died
        assert len(store.events("notice")) == 10 and len(store.events("launch_requested")) == N + 15
    assert seconds < TICK_GUARD_S, seconds

    settle(rig.policy)
    assert len(rig.policy.live) == N and len(rig.provider.specs) == N + 15
    with closing(reader(rig)) as store:
        assert sum(r.ended_at is None for r in store.instances()) == N
    steady = [timed_tick(rig.policy) for _ in range(5)]
    assert max(steady) < TICK_GUARD_S, steady


def test_the_hourly_budget_weighs_a_thousand_launches_one_by_one(make_rig: Callable[..., Rig]) -> None:
    """$180/h at $0.30/h: exactly 600 instances, however many the node type allows."""
    rig = make_rig(budget={"max_dollars_per_hour": 180.0})
    settle(rig.policy)

    assert len(rig.policy.live) == len(rig.provider.specs) == 600
    assert sum(i.price_per_hour for i in rig.policy.live.values()) == pytest.approx(180.0)
    rig.clock.advance(60.0)
    settle(rig.policy)
    assert len(rig.provider.specs) == 600  # still full: nothing more fits


def test_warm_spares_are_counted_among_a_thousand_trainers(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(warm_spares=20)
    settle(rig.policy)

    assert len(rig.policy.live) == N + 20
    assert rig.policy.idle_spares() == 20
    standby = sorted(i for i, args in rig.workers.args.items() if args.get("standby"))
    assert standby == [f"big-{NODE}-{k:04d}" for k in range(N, N + 20)]  # the last twenty launched
    with closing(reader(rig)) as store:
        assert sorted(row[2] for row in store.events("standby")) == standby
