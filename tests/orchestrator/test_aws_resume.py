"""Losing the head of an AWS run: the head machine and every instance's node are killed at once
(SIGKILL), and `spotswarm resume CONFIG` on a brand-new head with an empty run directory restores
the run from S3 (moto), retires the old fleet and continues from the newest checkpoint.  Then that
head's run is stopped cleanly (`down`), and a third head restores it from S3 and carries on from the
very epoch and parameters it stopped with."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray")
boto3 = pytest.importorskip("boto3")

pytestmark = pytest.mark.heavy

from tests.orchestrator.run_checks import (  # noqa: E402
    assert_resumed_from,
    assert_stop_lost_nothing,
    instances_since,
    loaded_states,
)
from tests.orchestrator.run_checks import resumed_at as last_resumed  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT_EVERY_S = 4.0
FLEET = 2  # the shipped config's min_workers: losing and retiring a fleet of two proves what three would


def rows(db: Path, sql: str, *args) -> list:
    if not db.exists():
        return []
    conn = sqlite3.connect(db, timeout=30)
    try:
        return conn.execute(sql, args).fetchall()
    except sqlite3.OperationalError:  # not created yet
        return []
    finally:
        conn.close()


def epoch(db: Path) -> int:
    found = rows(db, "SELECT COALESCE(MAX(epoch), 0) FROM progress")
    return found[0][0] if found else 0


def run_config(directory: Path, endpoint: str) -> Path:
    data = yaml.safe_load((ROOT / "cluster_configs" / "aws-spot.yaml").read_text())
    data["provider"]["endpoint_url"] = endpoint
    data["checkpoint"]["endpoint_url"] = endpoint
    data["checkpoint"]["every_s"] = CHECKPOINT_EVERY_S  # minutes on a real cloud; seconds here
    data["available_node_types"]["worker-spot"]["max_workers"] = FLEET
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "aws.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def tagged_running(endpoint: str) -> list[str]:
    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=endpoint)
    found = ec2.describe_instances(Filters=[{"Name": "tag:spotswarm-run", "Values": ["aws-demo"]},
                                            {"Name": "instance-state-name", "Values": ["pending", "running"]}])
    return sorted(i["InstanceId"] for r in found["Reservations"] for i in r["Instances"])


@pytest.mark.timeout(600)
def test_head_loss_resume_restores_from_s3_on_a_new_head(tmp_path, aws, ec2_harness, ray_heads, wait_for):
    boto3.client("s3", endpoint_url=aws).create_bucket(Bucket="spotswarm-runs")
    cli = [sys.executable, "-m", "orchestrator.cli.main"]
    old_dir, new_dir = tmp_path / "old-head", tmp_path / "new-head"
    old_config, new_config = run_config(old_dir, aws), run_config(new_dir, aws)
    old_db, new_db = old_dir / "runs" / "aws-demo" / "run.sqlite", new_dir / "runs" / "aws-demo" / "run.sqlite"
    # the new head machine boots while the old one runs the fleet: it holds nothing of the run until
    # `resume` (its own Ray, its own token, an empty run directory)
    booting, booting_third = ThreadPoolExecutor(max_workers=1), ThreadPoolExecutor(max_workers=1)
    new_head_boot = booting.submit(ray_heads, "awsB")
    booting.shutdown(wait=False)
    up = resume = third = third_head_boot = None
    try:
        old_head = ray_heads("awsA")
        with open(tmp_path / "up.out", "w") as out:
            up = subprocess.Popen([*cli, "up", str(old_config), "--address", old_head.address], cwd=old_dir,
                                  env=old_head.env, stdout=out, stderr=subprocess.STDOUT)
        wait_for(lambda: len(rows(old_db, "SELECT 1 FROM checkpoints")) >= 2 and epoch(old_db) >= 6, 240,
                 "the old head's run to train and checkpoint twice")
        old_fleet = tagged_running(aws)
        assert len(old_fleet) == FLEET

        # the head machine and every instance's node die at once
        up.send_signal(signal.SIGKILL)
        old_head.stop()
        ec2_harness.crash_all()
        killed_at = time.time()
        epoch_at_kill = epoch(old_db)
        (checkpoint_epoch, checkpoint_time), = rows(
            old_db, "SELECT epoch, time FROM checkpoints ORDER BY epoch DESC LIMIT 1")
        assert killed_at - checkpoint_time <= CHECKPOINT_EVERY_S + 5  # at most one interval unsaved

        new_head = new_head_boot.result(timeout=120)
        with open(tmp_path / "resume.out", "w") as out:
            resume = subprocess.Popen([*cli, "resume", str(new_config), "--address", new_head.address], cwd=new_dir,
                                      env=new_head.env, stdout=out, stderr=subprocess.STDOUT)
        resumed_at = killed_at

        def newer_checkpoints() -> list:
            return [e for (e,) in rows(new_db, "SELECT epoch FROM checkpoints WHERE time > ?", resumed_at)]

        wait_for(lambda: len(newer_checkpoints()) >= 1 and epoch(new_db) >= checkpoint_epoch + 3, 240,
                 "the new fleet to train on and checkpoint")
        # the new fleet started from the restored state: nothing recorded since is older than that (the
        # restored checkpoint itself is recorded anew when the archived history was saved before it)
        assert min(newer_checkpoints()) >= checkpoint_epoch
        start = json.loads(rows(new_db, "SELECT detail FROM events WHERE kind = 'supervisor_start' "
                                        "ORDER BY time DESC LIMIT 1")[0][0])
        assert start["resumed_epoch"] >= checkpoint_epoch  # from the newest checkpoint in S3, not from zero
        assert epoch_at_kill - start["resumed_epoch"] <= epoch_at_kill - checkpoint_epoch
        retired = dict(rows(new_db, "SELECT id, end_reason FROM instances WHERE end_reason = 'orphaned'"))
        assert len(retired) == FLEET  # the old fleet joined a head that is gone: released, not adopted
        assert not set(old_fleet) & set(tagged_running(aws))
        output = (tmp_path / "resume.out").read_text()
        assert f"at checkpoint epoch {checkpoint_epoch}" in output

        third_head_boot = booting_third.submit(ray_heads, "awsC")  # the machine after next boots meanwhile
        booting_third.shutdown(wait=False)
        down = subprocess.run([*cli, "down", str(new_config)], cwd=new_dir, env=new_head.env, capture_output=True,
                              text=True, timeout=240)
        assert down.returncode == 0, down.stdout + down.stderr
        # `down` signals the resume command (SIGTERM), which stops its supervisor and exits cleanly
        assert resume.wait(timeout=120) == 0, (tmp_path / "resume.out").read_text()[-3000:]
        assert rows(new_db, "SELECT id FROM instances WHERE ended_at IS NULL") == []
        assert tagged_running(aws) == []  # every instance of the run terminated

        # the clean stop lost nothing: its final checkpoint, archived, is where a third head carries on
        stopped_epoch, digest = assert_stop_lost_nothing(new_db.parent)
        archived = boto3.client("s3", endpoint_url=aws).list_objects_v2(Bucket="spotswarm-runs",
                                                                        Prefix="aws-demo/checkpoints/")
        assert f"aws-demo/checkpoints/epoch-{stopped_epoch:06d}.pt" in [o["Key"] for o in archived["Contents"]]
        third_dir = tmp_path / "third-head"
        third_config, third_run = run_config(third_dir, aws), third_dir / "runs" / "aws-demo"
        third_head = third_head_boot.result(timeout=120)
        with open(tmp_path / "third.out", "w") as out:
            third = subprocess.Popen([*cli, "resume", str(third_config), "--address", third_head.address],
                                     cwd=third_dir, env=third_head.env, stdout=out, stderr=subprocess.STDOUT)
        (stopped_at,), = rows(new_db, "SELECT MAX(time) FROM events WHERE kind = 'supervisor_stop'")
        # the restored history holds the second head's resume too: the third's is the one after the stop
        wait_for(lambda: rows(third_run / "run.sqlite", "SELECT 1 FROM events WHERE kind = 'resume' AND time > ?",
                              stopped_at), 120, "the third head to restore the run")
        since = last_resumed(third_run)
        wait_for(lambda: len(loaded_states(third_run, instances_since(third_run, since))) == FLEET, 240,
                 "the third head's fleet to load the run's state")
        assert f"at checkpoint epoch {stopped_epoch}\n" in (tmp_path / "third.out").read_text()
        assert_resumed_from(third_run, since, stopped_epoch, digest)
        down = subprocess.run([*cli, "down", str(third_config)], cwd=third_dir, env=third_head.env,
                              capture_output=True, text=True, timeout=240)
        assert down.returncode == 0, down.stdout + down.stderr
        assert third.wait(timeout=120) == 0, (tmp_path / "third.out").read_text()[-3000:]
        assert tagged_running(aws) == []
    finally:
        new_head_boot.exception(timeout=120)  # started, so that the fixture stops it
        if third_head_boot is not None:
            third_head_boot.exception(timeout=120)
        for process in (up, resume, third):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(timeout=30)
