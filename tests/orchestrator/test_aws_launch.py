"""``spotswarm up`` from a laptop on AWS, against moto (EC2 and S3) and the harness that boots instances from
their user data: the shipped ``aws-spot.yaml``, only its endpoints pointed at the stand-ins, in a clean
"laptop" directory.  ``up`` launches the head (an instance too, with its instance profile's credentials
from its IMDS) through EC2's throttling of its first calls, the head launches the workers (charged at
moto's spot price history), the run trains; ``status`` from another directory shows its epochs; a
rebalance recommendation brings a replacement before any notice; a spot reclaim (the notice in the
instance's IMDS, the termination 15 s later: EC2 gives two minutes) is survived by a graceful leave and
a replacement; ``down`` from there stops everything, and moto has no instance left running."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("ray")
pytest.importorskip("boto3")
pytest.importorskip("s3fs")

from orchestrator.cli.main import main  # noqa: E402
from orchestrator.runs.durable import RunArchive  # noqa: E402
from tests.orchestrator.run_checks import (  # noqa: E402
    event_time,
    laptop_yaml,
    query,
    spotswarm_command,
    while_running,
)

pytestmark = [pytest.mark.timeout(400), pytest.mark.heavy]

NOTICE_S = 15.0  # EC2 gives two minutes; the harness gives fifteen seconds



def running(ec2) -> list[dict]:  # noqa: ANN001
    pages = ec2.describe_instances(Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}])
    return [i for r in pages["Reservations"] for i in r["Instances"]]


def test_up_from_a_laptop_launches_the_head_and_down_from_elsewhere_leaves_nothing(
        tmp_path, aws, aws_proxy, ec2_harness, wait_for, capsys, artifacts_dir):
    import boto3

    boto3.client("s3", endpoint_url=aws).create_bucket(Bucket="spotswarm-runs")
    boto3.client("iam", endpoint_url=aws).create_instance_profile(InstanceProfileName="spotswarm-head")
    ec2 = boto3.client("ec2", endpoint_url=aws)
    laptop = laptop_yaml(tmp_path / "laptop", "aws-spot.yaml", aws_proxy.url, aws)
    elsewhere = laptop_yaml(tmp_path / "elsewhere", "aws-spot.yaml", aws_proxy.url, aws)
    archive = RunArchive("s3://spotswarm-runs/aws-demo", endpoint_url=aws)
    out = tmp_path / "up.out"
    aws_proxy.throttle_next = 4  # EC2 throttles the first calls: retried, and the run never notices
    began = time.time()
    up = spotswarm_command(["up", laptop.name], laptop.parent, out)
    wait = while_running(up, out, wait_for)
    try:
        wait(lambda: (archive.status() or {}).get("epoch", 0) >= 1, 240, "the launched head's first epoch")
        first_epoch_s = time.time() - began
        said = out.read_text()
        head = next(m for m in ec2_harness.machines.values() if m.instance_id.startswith("head-"))
        assert f"launched: {head.key} (" in said and "spotswarm down aws-spot.yaml" in said
        assert head.metadata.role == "spotswarm-head"  # its credentials: its instance profile's, from its IMDS
        assert "ray, version" in ec2_harness.console(head.key)  # the config's setup_commands ran on it

        assert main(["status", str(elsewhere)]) == 0
        seen = capsys.readouterr().out
        assert "from s3://spotswarm-runs/aws-demo: the head" in seen and "running, epoch" in seen
        assert main(["logs", str(elsewhere)]) == 0  # the head's logs, archived at its first publication
        assert "supervisor.log" in capsys.readouterr().out
        assert "Token authentication" not in ec2_harness.console(head.key)  # Ray's notices: the run's log

        workers = [m for m in ec2_harness.machines.values() if m is not head]
        at_risk = workers[0]
        at_risk.metadata.rebalance = {"noticeTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        rebalanced_at = time.time()
        wait(lambda: at_risk.killed_at is not None and len(ec2_harness.alive()) == len(workers) + 1, 180,
             "a replacement for the machine at risk, which is then released")
        replacement = max(ec2_harness.machines.values(), key=lambda m: m.booted_at)
        assert replacement.booted_at >= rebalanced_at and replacement.zone != at_risk.zone
        assert at_risk.noticed_at is None  # no notice ever came: the replacement was there before it

        victim = next(m for m in ec2_harness.machines.values() if m not in (head, at_risk, replacement))
        ec2_harness.preempt(victim.instance_id, NOTICE_S)
        calls_before = len(aws_proxy.calls)

        def replaced_and_training() -> bool:
            doc = archive.status() or {}
            return victim.killed_at is not None and len(ec2_harness.alive()) == len(workers) + 1 and \
                doc.get("published_at", 0) > victim.killed_at and doc.get("live") == len(workers) and \
                doc.get("training") == len(workers)  # the victim gone from the fleet, all that is left stepped
        wait(replaced_and_training, 180, "the reclaimed instance's replacement to make its first averaged step")
        calls = len(aws_proxy.calls) - calls_before
        reclaim_replacement = max(ec2_harness.machines.values(), key=lambda m: m.booted_at)

        assert main(["down", str(elsewhere)]) == 0
        said_down = capsys.readouterr().out
        assert "stopped by its head" in said_down
        assert up.wait(timeout=60) == 0, out.read_text()[-3000:]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(30)
    assert running(ec2) == []
    assert "the run stopped" in out.read_text()
    assert ec2_harness.errors == []

    view = tmp_path / "view"
    archive.snapshot(view)
    assert query(view, "SELECT end_reason FROM instances WHERE id = ?", at_risk.instance_id) == \
        [("rebalanced",)]
    assert query(view, "SELECT end_reason FROM instances WHERE id = ?", victim.instance_id) == [("preempted",)]
    notice = json.loads(query(view, "SELECT detail FROM events WHERE kind = 'notice' AND instance_id = ?",
                              victim.instance_id)[0][0])
    assert notice["source"] == "instance"  # its own IMDS watcher saw it, not the supervisor
    left_at = event_time(view, "left", victim.instance_id)
    assert victim.noticed_at < left_at < victim.killed_at  # the graceful leave came before the kill
    first_step = event_time(view, "first_step", reclaim_replacement.instance_id)
    assert aws_proxy.throttled == 4
    moto_price = float(boto3.client("ec2", endpoint_url=aws).describe_spot_price_history(
        InstanceTypes=["m5.large"], AvailabilityZone=victim.zone)["SpotPriceHistory"][0]["SpotPrice"])
    prices = query(view, "SELECT DISTINCT price_per_hour, market FROM instances")
    assert prices == [(pytest.approx(moto_price), "spot")]  # moto's price history, the same for every zone
    assert not (tmp_path / "laptop" / "runs").exists()  # the laptop holds nothing of the run
    first_averaged = query(view, "SELECT MIN(time) FROM progress WHERE epoch >= 1")[0][0]
    figures = {"up_to_first_averaged_step_s": round(first_averaged - began, 1),
               "up_to_first_epoch_published_s": round(first_epoch_s, 1),
               "notice_to_graceful_leave_s": round(left_at - victim.noticed_at, 2),
               "reclaim_to_replacement_first_step_s": round(first_step - victim.killed_at, 2),
               "notice_to_replacement_first_step_s": round(first_step - victim.noticed_at, 2),
               "api_calls_per_replacement": calls,
               "run_instances_per_replacement": aws_proxy.count("RunInstances", since=victim.noticed_at),
               "spot_price_per_hour": moto_price}
    (artifacts_dir / "aws_launch.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures))
