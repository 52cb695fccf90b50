"""The GCP provider end to end against a loopback fake of the Compute Engine API: the shipped
``gcp-spot.yaml`` (pointed at the fake), instances booted from their startup-script metadata as Ray
nodes joining this test's Ray, a preemption announced by an instance's metadata server, the stop
after the window, a replacement.  GCE's window is 30 s; the harness gives 15 (and the config's
``spot.notice_period_s`` says so, so that the workers plan for it)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("google.cloud.compute_v1")

from orchestrator.config import ClusterConfig, load_cluster_config  # noqa: E402
from orchestrator.ray_workers import worker_actor_name  # noqa: E402
from orchestrator.run_store import RunStore  # noqa: E402
from orchestrator.supervisor import SupervisorCore  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("ray_session")]

SHIPPED = Path(__file__).resolve().parents[2] / "cluster_configs" / "gcp-spot.yaml"
WINDOW_S = 15.0  # GCE stops a preempted VM 30 s after the notice; the harness after fifteen


def query(run_dir: Path, sql: str, *args) -> list:
    db = sqlite3.connect(run_dir / "run.sqlite")
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def shipped_config(tmp_path: Path, endpoint: str) -> ClusterConfig:
    """The shipped example pointed at the fake API and this test's directory; the harness's
    shorter window; parameter digests for the audit."""
    config = load_cluster_config(SHIPPED, warnings=[])
    return config.model_copy(update={
        "provider": config.provider.model_copy(update={"endpoint_url": endpoint}),
        "runs_dir": str(tmp_path / "runs"),
        "spot": config.spot.model_copy(update={"notice_period_s": WINDOW_S}),
        "training": config.training.model_copy(update={"param_digests": True})})


def history(instance_id: str) -> dict[int, str]:
    records = ray.get(ray.get_actor(worker_actor_name(instance_id)).history.remote(), timeout=60)
    return {r["epoch"]: r["params"] for r in records}


def event_time(run_dir: Path, kind: str, instance_id: str) -> float:
    rows = query(run_dir, "SELECT time FROM events WHERE kind = ? AND instance_id = ?", kind, instance_id)
    assert rows, f"no {kind} event for {instance_id}"
    return rows[0][0]


def test_spot_fleet_on_a_fake_gce_survives_a_preemption(tmp_path, gce_api, gce_harness, wait_for, artifacts_dir):
    config = shipped_config(tmp_path, gce_api.url)
    zones = config.provider.zones
    gce_api.exhausted = {(zones[0], "spot")}  # the cheapest zone has no Spot capacity: the next one
    gce_api.throttle = ["429", "403", "429"]  # and GCE rate-limits the run's first calls: retried
    RunStore.create(config).close()
    run_dir = config.run_dir()
    core = SupervisorCore(config, run_dir)
    core.start()
    try:
        size = config.available_node_types["worker-spot"].max_workers
        wait_for(lambda: len([i for i in list(core.live.values()) if i.tags.get("peer_id")]) == size, 180,
                 f"{size} workers running on their own GCE instances")
        assert gce_api.throttled == 3
        assert sorted(core.live) == gce_harness.alive()
        assert (zones[0], "spot", "ZONE_RESOURCE_POOL_EXHAUSTED") in gce_api.refused
        assert {i.zone for i in core.live.values()} <= set(zones[1:])
        spot_prices = config.available_node_types["worker-spot"].spot_price_per_hour
        prices = query(run_dir, "SELECT DISTINCT price_per_hour, market, zone FROM instances")
        assert prices and all((p, m) == (spot_prices[z], "spot") for p, m, z in prices)  # the config's prices
        wait_for(lambda: core.epoch >= 2, 120, "two global epochs")

        fleet = set(core.live)
        victim = sorted(fleet)[0]
        machine = gce_harness.by_instance(victim)
        calls_before = len(gce_api.calls)
        machine = gce_harness.preempt(victim, WINDOW_S)
        wait_for(lambda: query(run_dir, "SELECT end_reason FROM instances WHERE id = ?", victim) == [("preempted",)],
                 90, "the preempted instance to be recorded as preempted")
        notice = json.loads(query(run_dir, "SELECT detail FROM events WHERE kind = 'notice' AND instance_id = ?",
                                  victim)[0][0])
        assert notice["source"] == "instance"  # its own metadata watcher saw it, not the supervisor
        left_at = event_time(run_dir, "left", victim)
        assert machine.noticed_at < left_at < machine.killed_at  # the graceful leave came before the kill
        assert [wait for _, path, wait in machine.metadata.reads if path == "instance/preempted"][:2] == [False, True]

        found: list[str] = []

        def replaced() -> bool:
            found[:] = sorted(set(core.live) - fleet)
            return bool(found)

        wait_for(replaced, 60, "a replacement instance")
        replacement = found[0]
        wait_for(lambda: query(run_dir, "SELECT 1 FROM events WHERE kind = 'first_step' AND instance_id = ?",
                               replacement), 120, "the replacement's first averaged step")
        first_step = event_time(run_dir, "first_step", replacement)
        replacement_calls = len(gce_api.calls) - calls_before
        assert replacement in gce_harness.alive() and victim not in gce_harness.alive()
        assert (machine.zone, victim) not in gce_api.snapshot()  # the TERMINATED VM was deleted (its disk)

        epoch_now = core.epoch
        wait_for(lambda: core.epoch >= epoch_now + 1, 90, "training to go on")
        live = sorted(list(core.live))
        histories = {i: history(i) for i in live}
        common = set.intersection(*(set(h) for h in histories.values()))
        assert common, "the live peers share averaged epochs"
        for epoch in sorted(common):
            assert len({h[epoch] for h in histories.values()}) == 1, f"parameters differ after epoch {epoch}"
        figures = {
            "window_s": WINDOW_S,
            "api_calls_per_replacement": replacement_calls,
            "api_calls_per_replacement_by_method": {m: gce_api.count(m, since=machine.noticed_at) for m in sorted(
                {m for t, m in gce_api.calls if t >= machine.noticed_at})},
            "inserts_per_replacement": gce_api.count("instances.insert", since=machine.noticed_at),
            "notice_to_graceful_leave_s": round(left_at - machine.noticed_at, 2),
            "preemption_to_replacement_first_step_s": round(first_step - machine.killed_at, 2),
            "notice_to_replacement_first_step_s": round(first_step - machine.noticed_at, 2),
            "spot_price_per_hour": {z: spot_prices[z] for z in zones},
        }
        (artifacts_dir / "gcp_e2e.json").write_text(json.dumps(figures, indent=1))
        print(json.dumps(figures))
    finally:
        core.stop()
    # released: every instance deleted in GCE, so the harness cut its power
    wait_for(lambda: gce_harness.alive() == [], 60, "every instance's node to stop")
    assert gce_api.snapshot() == {}
    assert query(run_dir, "SELECT COUNT(*) FROM instances WHERE ended_at IS NULL") == [(0,)]
    assert gce_harness.errors == []
