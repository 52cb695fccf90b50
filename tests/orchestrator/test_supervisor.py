"""The supervisor against a real local Ray: preemptions, graceful leave, trace replay, budget."""

from __future__ import annotations

from pathlib import Path

import pytest

ray = pytest.importorskip("ray")


from orchestrator.config.schema import ClusterConfig  # noqa: E402
from orchestrator.runs.store import RunStore, summarize_costs  # noqa: E402
from tests.orchestrator.run_checks import (  # noqa: E402
    event_time,
    query,
    supervised,
    wait_for_first_step,
    wait_until_preempted,
)

# alone: its traces preempt at fixed times after launch (it checks they replay exactly), which a boot
# slowed by another test beside it could miss
pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("ray_session"), pytest.mark.alone]


def cluster(tmp_path: Path, **overrides) -> ClusterConfig:
    data = {
        "cluster_name": "t", "runs_dir": str(tmp_path / "runs"),
        "provider": {"type": "local", "zones": ["a", "b"], "time_scale": 10.0, "provisioning_delay_s": 10.0},
        "available_node_types": {"small": {"min_workers": 2, "max_workers": 2, "on_demand_price_per_hour": 1.0,
                                           "spot_price_per_hour": {"a": 0.3, "b": 0.3}}},
        "spot": {"notice_period_s": 10.0},
        "training": {"task": "synthetic", "target_batch_size": 64, "min_matchmaking_time_s": 0.5,
                     "averaging_timeout_s": 10.0},
        "checkpoint": {"every_s": 30.0},
    }
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return ClusterConfig.model_validate(data)


def test_preemption_notice_graceful_leave_replacement_and_exact_trace_replay(tmp_path, wait_for):
    trace = tmp_path / "trace.csv"
    trace.write_text("notice_after_s,kill_after_s\n40,190\n,\n,\n")  # only the first instance is preempted
    # 150 simulated seconds (15 s here) between notice and kill: ample for a graceful leave on a busy machine
    config = cluster(tmp_path, provider={"trace_file": str(trace)})
    first = f"{config.cluster_name}-small-0000"
    with supervised(config) as (core, run_dir):
        wait_until_preempted(run_dir, first, wait_for, 120, "the first instance to be preempted")
        killed_epoch = core.epoch
        wait_for(lambda: len(query(run_dir, "SELECT id FROM instances")) == 3, 60, "a replacement")
        wait_for(lambda: core.epoch >= killed_epoch + 3, 90, "the epoch to keep advancing")

    (launched, notice, ended), = query(run_dir, "SELECT launched_at, notice_at, ended_at FROM instances WHERE id = ?",
                                       first)
    tick = core.tick_s * config.provider.time_scale
    assert notice - launched == pytest.approx(40.0, abs=1e-6)  # the trace replays exactly
    # the end is recorded when the supervisor collects the provider's poll: a few ticks late on a busy machine
    assert 190.0 <= ended - launched <= 190.0 + 5 * tick
    kinds = [k for _, k, i, _ in query(run_dir, "SELECT * FROM events WHERE instance_id = ? ORDER BY time", first)]
    assert kinds.index("notice") < kinds.index("left") < kinds.index("preempted")  # left gracefully first
    replacement_launch = query(run_dir, "SELECT launched_at FROM instances WHERE id LIKE '%-0002'")[0][0]
    # prompt: the provisioning delay plus a few supervisor ticks (each may wait on Ray when the machine is busy)
    assert replacement_launch - ended <= config.provider.provisioning_delay_s + 15 * tick
    assert query(run_dir, "SELECT COUNT(*) FROM instances WHERE end_reason = 'preempted'") == [(1,)]
    # the trainers' cost totals reached the store through their status answers (the dashboard's columns)
    costs = query(run_dir, "SELECT instance_id, samples, bytes_sent, comm_s, busy_s FROM peer_costs")
    assert len(costs) >= 2 and all(n > 0 and sent > 0 and 0 <= comm <= busy for _, n, sent, comm, busy in costs)
    # and the rounds they completed, each once: an epoch's compute and communication seconds, which for
    # each trainer add up to no more than its time training (the deltas of the same totals)
    rounds = query(run_dir, "SELECT instance_id, epoch, compute_s, comm_s FROM rounds ORDER BY instance_id, epoch")
    busy_of = {i: busy for i, _, _, _, busy in costs}
    assert len({i for i, *_ in rounds}) >= 2 and len({e for _, e, _, _ in rounds}) >= 3
    assert all(c >= 0 and m >= 0 for _, _, c, m in rounds)
    for instance_id in {i for i, *_ in rounds}:
        mine = [(e, c + m) for i, e, c, m in rounds if i == instance_id]
        assert sum(w for _, w in mine) <= busy_of[instance_id] + 0.01, (instance_id, mine)
    store = RunStore.open(run_dir)
    try:
        means = store.round_means(recent=1_000_000)
    finally:
        store.close()
    by_epoch: dict[int, list[tuple[float, float]]] = {}
    for _, epoch, compute, comm in rounds:
        by_epoch.setdefault(epoch, []).append((compute, comm))
    assert [m.epoch for m in means] == sorted(by_epoch, reverse=True)
    for m in means:  # per epoch, the mean over the trainers that reported it
        split = by_epoch[m.epoch]
        assert m.peers == len(split)
        assert m.compute_s == pytest.approx(sum(c for c, _ in split) / len(split))
        assert m.comm_s == pytest.approx(sum(c for _, c in split) / len(split))


def test_the_budget_cap_is_never_exceeded(tmp_path, wait_for):
    cap = 0.02
    config = cluster(tmp_path, provider={"time_scale": 100.0, "provisioning_delay_s": 0.0},
                     budget={"max_total_dollars": cap},
                     available_node_types={"small": {"min_workers": 2, "max_workers": 2,
                                                     "on_demand_price_per_hour": 2.0,
                                                     "spot_price_per_hour": {"a": 1.0, "b": 1.0},
                                                     "preemption": {"distribution": "none"}}})
    with supervised(config) as (core, run_dir):
        wait_for(lambda: core.budget_exhausted, 120, "the budget to run out")
    store = RunStore.open(run_dir)
    try:
        spent = summarize_costs(store, now=max(i.ended_at for i in store.instances())).dollars
        assert 0 < spent <= cap
        assert all(i.ended_at is not None for i in store.instances())
        assert store.events("budget_exhausted")
    finally:
        store.close()


def test_a_warm_spare_takes_a_noticed_trainers_place_before_the_kill(tmp_path, wait_for):
    """One trainer and one warm spare (real Ray actors): the trainer's notice activates the spare,
    which steps before the trainer is even killed; the trainer's replacement boots as the next spare."""
    trace = tmp_path / "trace.csv"
    trace.write_text("notice_after_s,kill_after_s\n60,400\n,\n,\n")  # the trainer: notice, then 34 s (real) to the kill
    config = cluster(tmp_path, provider={"trace_file": str(trace)},
                     available_node_types={"small": {"min_workers": 1, "max_workers": 1, "warm_spares": 1}})
    trainer, spare, replacement = (f"{config.cluster_name}-small-{i:04d}" for i in range(3))
    with supervised(config) as (core, run_dir):
        first_step = wait_for_first_step(run_dir, spare, wait_for, 150)
        wait_for(lambda: query(run_dir, "SELECT 1 FROM events WHERE kind = 'standby' AND instance_id = ?",
                               replacement), 60, "the trainer's replacement, as the next spare")
        assert core.status()["warm_spares"] == 1  # the replacement, live and idle

    assert event_time(run_dir, "notice", trainer) <= event_time(run_dir, "activated", spare) < first_step
    (launched,), = query(run_dir, "SELECT launched_at FROM instances WHERE id = ?", trainer)
    assert first_step < launched + 400  # the spare trained before the trainer's kill was even due
    assert [i for _, i in query(run_dir, "SELECT kind, instance_id FROM events WHERE kind = 'standby' ORDER BY time")] \
        == [spare, replacement]
    assert query(run_dir, "SELECT instance_id FROM events WHERE kind = 'activated'") == [(spare,)]
