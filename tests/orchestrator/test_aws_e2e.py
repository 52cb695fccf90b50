"""The AWS provider end to end against moto in server mode: the shipped ``aws-spot.yaml`` (with
the endpoints pointed at moto), instances booted from their user data as Ray nodes joining this
test's head, an interruption notice in an instance's IMDS, a spot reclaim, a replacement."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("boto3")

from orchestrator.config import ClusterConfig, load_cluster_config  # noqa: E402
from orchestrator.ray_workers import worker_actor_name  # noqa: E402
from orchestrator.run_store import RunStore  # noqa: E402
from orchestrator.supervisor import SupervisorCore  # noqa: E402

pytestmark = [pytest.mark.timeout(400), pytest.mark.usefixtures("ray_session")]

SHIPPED = Path(__file__).resolve().parents[2] / "cluster_configs" / "aws-spot.yaml"
NOTICE_S = 20.0  # EC2 gives two minutes; the harness gives twenty seconds


def query(run_dir: Path, sql: str, *args) -> list:
    db = sqlite3.connect(run_dir / "run.sqlite")
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def shipped_config(tmp_path: Path, ec2_endpoint: str, s3_endpoint: str) -> ClusterConfig:
    """The shipped example, only pointed at the stand-ins (and at this test's directories)."""
    config = load_cluster_config(SHIPPED, warnings=[])
    provider = config.provider.model_copy(update={"endpoint_url": ec2_endpoint})
    checkpoint = config.checkpoint.model_copy(update={"endpoint_url": s3_endpoint})
    return config.model_copy(update={"provider": provider, "checkpoint": checkpoint,
                                     "runs_dir": str(tmp_path / "runs")})


def history(instance_id: str) -> dict[int, str]:
    records = ray.get(ray.get_actor(worker_actor_name(instance_id)).history.remote(), timeout=60)
    return {r["epoch"]: r["params"] for r in records}


def event_time(run_dir: Path, kind: str, instance_id: str) -> float:
    rows = query(run_dir, "SELECT time FROM events WHERE kind = ? AND instance_id = ?", kind, instance_id)
    assert rows, f"no {kind} event for {instance_id}"
    return rows[0][0]


def test_spot_fleet_on_moto_survives_a_reclaim(tmp_path, aws, aws_proxy, ec2_harness, wait_for, artifacts_dir):
    import boto3

    boto3.client("s3", endpoint_url=aws).create_bucket(Bucket="spotswarm-runs")
    config = shipped_config(tmp_path, aws_proxy.url, aws)
    config = config.model_copy(update={"training": config.training.model_copy(update={"param_digests": True})})
    aws_proxy.throttle_next = 4  # EC2 throttles the run's first calls: retried, and the run never notices
    RunStore.create(config).close()
    run_dir = config.run_dir()
    core = SupervisorCore(config, run_dir)
    core.start()
    try:
        size = config.available_node_types["worker-spot"].max_workers
        wait_for(lambda: len([i for i in list(core.live.values()) if i.tags.get("peer_id")]) == size, 240,
                 f"{size} workers running on their own EC2 instances")
        assert aws_proxy.throttled == 4
        assert sorted(list(core.live)) == ec2_harness.alive()
        zones = {i.zone for i in core.live.values()}
        assert zones <= set(config.provider.zones)
        # the cost uses moto's spot price history (the same price moto reports for every zone)
        moto_price = float(boto3.client("ec2", endpoint_url=aws).describe_spot_price_history(
            InstanceTypes=["m5.large"], AvailabilityZone=sorted(zones)[0])["SpotPriceHistory"][0]["SpotPrice"])
        prices = query(run_dir, "SELECT DISTINCT price_per_hour, market FROM instances")
        assert prices == [(pytest.approx(moto_price), "spot")]
        wait_for(lambda: core.epoch >= 2, 120, "two global epochs")

        fleet = set(core.live)
        victim = sorted(fleet)[0]
        calls_before = len(aws_proxy.calls)
        machine = ec2_harness.preempt(victim, NOTICE_S)
        wait_for(lambda: query(run_dir, "SELECT end_reason FROM instances WHERE id = ?", victim) == [("preempted",)],
                 120, "the reclaimed instance to be recorded as preempted")
        notice = json.loads(query(run_dir, "SELECT detail FROM events WHERE kind = 'notice' AND instance_id = ?",
                                  victim)[0][0])
        assert notice["source"] == "instance"  # its own IMDS watcher saw it, not the supervisor
        left_at = event_time(run_dir, "left", victim)
        assert machine.noticed_at < left_at < machine.killed_at  # the graceful leave came before the kill

        found: list[str] = []

        def replaced() -> bool:
            found[:] = sorted(set(core.live) - fleet)
            return bool(found)

        wait_for(replaced, 120, "a replacement instance")
        replacement = found[0]
        wait_for(lambda: query(run_dir, "SELECT 1 FROM events WHERE kind = 'first_step' AND instance_id = ?",
                               replacement), 180, "the replacement's first averaged step")
        first_step = event_time(run_dir, "first_step", replacement)
        replacement_calls = len(aws_proxy.calls) - calls_before
        assert replacement in ec2_harness.alive() and victim not in ec2_harness.alive()

        epoch_now = core.epoch
        wait_for(lambda: core.epoch >= epoch_now + 2, 120, "training to go on")
        live = sorted(list(core.live))
        histories = {i: history(i) for i in live}
        common = set.intersection(*(set(h) for h in histories.values()))
        assert common, "the live peers share averaged epochs"
        for epoch in sorted(common):
            assert len({h[epoch] for h in histories.values()}) == 1, f"parameters differ after epoch {epoch}"
        figures = {
            "api_calls_per_replacement": replacement_calls,
            "run_instances_per_replacement": aws_proxy.count("RunInstances", since=machine.noticed_at),
            "notice_to_graceful_leave_s": round(left_at - machine.noticed_at, 2),
            "reclaim_to_replacement_first_step_s": round(first_step - machine.killed_at, 2),
            "notice_to_replacement_first_step_s": round(first_step - machine.noticed_at, 2),
            "spot_price_per_hour": moto_price,
        }
        (artifacts_dir / "aws_e2e.json").write_text(json.dumps(figures, indent=1))
        print(json.dumps(figures))
    finally:
        core.stop()
    # released: every instance terminated in EC2, so the harness cut its power
    wait_for(lambda: ec2_harness.alive() == [], 60, "every instance's node to stop")
    assert query(run_dir, "SELECT COUNT(*) FROM instances WHERE ended_at IS NULL") == [(0,)]
    assert ec2_harness.errors == []
