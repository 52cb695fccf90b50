"""A GCP run launched from a laptop survives a preemption and losing its head: the shipped
``gcp-spot.yaml`` (its endpoints pointed at the loopback Compute fake and gcp-storage-emulator,
checkpoints every 4 s instead of a minute, and the harness's 15-s preemption window instead of GCE's
30), ``up`` launches the head through GCE's rate limits, the head its Spot workers (the cheapest zone
has no Spot capacity: the next ones); a worker is preempted (``instance/preempted`` TRUE on its
metadata server, the stop after the window) and replaced; then the head VM is taken back with its power
cut, and ``resume`` from the laptop launches a new head, which restores the run from ``gs://``,
releases the old fleet (it joined a head that is gone), and trains on from the newest checkpoint.
``down`` leaves no VM."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import yaml

pytest.importorskip("ray")
pytest.importorskip("google.cloud.compute_v1")
pytest.importorskip("gcsfs")

from orchestrator.cli.main import main  # noqa: E402
from orchestrator.runs.durable import RunArchive  # noqa: E402
from orchestrator.runs.durable import checkpoint_epoch as epoch_of  # noqa: E402
from tests.orchestrator.run_checks import (  # noqa: E402
    event_time,
    laptop_yaml,
    query,
    spotswarm_command,
    while_running,
)

pytestmark = [pytest.mark.timeout(400), pytest.mark.heavy]

CHECKPOINT_EVERY_S = 4.0  # minutes on a real cloud; seconds here
FLEET = 2  # the shipped config's worker-spot
WINDOW_S = 15.0  # GCE stops a preempted VM 30 s after the notice; the harness after fifteen


def test_a_launched_run_survives_a_preemption_loses_its_head_and_resumes_from_gs_on_a_new_one(
        tmp_path, gce_api, gce_harness, gcs, wait_for, capsys, artifacts_dir):
    shipped = laptop_yaml(tmp_path / "shipped", "gcp-spot.yaml", gce_api.url, gcs)
    spot = {**yaml.safe_load(shipped.read_text())["spot"], "notice_period_s": WINDOW_S}
    laptop = laptop_yaml(tmp_path / "laptop", "gcp-spot.yaml", gce_api.url, gcs, spot=spot,
                         checkpoint={"uri": "gs://spotswarm-runs/gcp-demo", "endpoint_url": gcs,
                                     "every_s": CHECKPOINT_EVERY_S, "keep": 5})
    zones = yaml.safe_load(laptop.read_text())["provider"]["availability_zone"].split(",")
    gce_api.exhausted = {(zones[0], "spot")}  # the cheapest zone has no Spot capacity: the next one
    gce_api.throttle = ["429", "403", "429"]  # and GCE rate-limits the first calls: retried
    archive = RunArchive("gs://spotswarm-runs/gcp-demo", endpoint_url=gcs)
    up = spotswarm_command(["up", laptop.name], laptop.parent, tmp_path / "up.out")
    resume = None
    try:
        wait = while_running(up, tmp_path / "up.out", wait_for)
        wait(lambda: (archive.status() or {}).get("training") == FLEET and archive.checkpoints(), 240,
             "the launched head's fleet to train and checkpoint")
        assert gce_api.throttled == 3 and (zones[0], "spot", "ZONE_RESOURCE_POOL_EXHAUSTED") in gce_api.refused
        (old_head,) = [m for m in gce_harness.machines.values() if m.instance_id.startswith("head-")]
        workers = [m for m in gce_harness.machines.values() if m is not old_head]
        assert len(workers) == FLEET and {m.zone for m in workers} <= set(zones[1:])

        victim = gce_harness.preempt(workers[0].instance_id, WINDOW_S)

        def replaced_and_training() -> bool:
            doc = archive.status() or {}
            return victim.killed_at is not None and doc.get("published_at", 0) > victim.killed_at and \
                doc.get("live") == doc.get("training") == FLEET  # the victim gone, its replacement stepped
        wait(replaced_and_training, 120, "the preempted worker's replacement to make its first averaged step")
        replacement = max(gce_harness.machines.values(), key=lambda m: m.booted_at)
        # its watcher read instance/preempted, then long-polled it
        assert [w for _, path, w in victim.metadata.reads if path == "instance/preempted"][:2] == [False, True]
        wait(lambda: victim.key not in gce_api.snapshot(), 30, "the TERMINATED VM deleted (its disk bills on)")
        old_fleet = sorted(i for i in (replacement.instance_id, workers[1].instance_id))
        before_loss = tmp_path / "before-loss"

        def archived_first_step() -> bool:  # the archive's history lags the head by up to a checkpoint
            shutil.rmtree(before_loss, ignore_errors=True)
            archive.snapshot(before_loss)
            return bool(query(before_loss, "SELECT 1 FROM events WHERE kind = 'first_step' AND instance_id = ?",
                              replacement.instance_id))
        wait(archived_first_step, 60, "the replacement's first step in the archived history")
        assert query(before_loss, "SELECT end_reason FROM instances WHERE id = ?", victim.instance_id) == \
            [("preempted",)]
        left_at = event_time(before_loss, "left", victim.instance_id)
        assert victim.noticed_at < left_at < victim.killed_at  # the graceful leave came before the stop
        first_step = event_time(before_loss, "first_step", replacement.instance_id)

        gce_harness.reclaim(old_head)  # the head VM is taken back, its power cut: the run's own state is gone
        lost_at = time.time()
        newest = max(epoch_of(name) or 0 for name in archive.checkpoints())
        checkpoint_epoch = newest
        up.kill()  # the laptop that followed it may go too: nothing of the run lives there
        up.wait(30)

        resume = spotswarm_command(["resume", laptop.name], laptop.parent, tmp_path / "resume.out")
        wait = while_running(resume, tmp_path / "resume.out", wait_for)

        def new_head_trains() -> bool:
            doc = archive.status() or {}
            return doc.get("published_at", 0) > lost_at and doc.get("head_instance") != old_head.instance_id \
                and doc.get("epoch", 0) > checkpoint_epoch and doc.get("live") == doc.get("training") == FLEET
        wait(new_head_trains, 240, "the new head's fleet to train on from the archived checkpoint")
        (new_head,) = [m for m in gce_harness.machines.values()
                       if m.instance_id.startswith("head-") and m is not old_head]
        assert f"restored run gcp-demo from gs://spotswarm-runs/gcp-demo at checkpoint epoch {checkpoint_epoch}" \
            in gce_harness.console(new_head.key[1])

        assert main(["down", str(laptop)]) == 0
        assert "stopped by its head" in capsys.readouterr().out
        assert resume.wait(timeout=60) == 0, (tmp_path / "resume.out").read_text()[-3000:]
    finally:
        for process in (up, resume):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(30)
    assert gce_api.snapshot() == {}  # every VM of the run deleted, the lost head's too
    assert gce_harness.errors == []

    view = tmp_path / "view"
    archive.snapshot(view)
    start = json.loads(query(view, "SELECT detail FROM events WHERE kind = 'supervisor_start' "
                                   "ORDER BY time DESC LIMIT 1")[0][0])
    assert start["resumed_epoch"] >= checkpoint_epoch  # from the newest checkpoint in gs://, not from zero
    retired = dict(query(view, "SELECT id, end_reason FROM instances WHERE end_reason = 'orphaned'"))
    assert sorted(retired) == old_fleet  # the old fleet joined a head that is gone: released, not adopted
    assert not (tmp_path / "laptop" / "runs").exists()
    spot_prices = yaml.safe_load(laptop.read_text())["available_node_types"]["worker-spot"]["spot_price_per_hour"]
    prices = query(view, "SELECT DISTINCT price_per_hour, zone FROM instances WHERE market = 'spot'")
    assert prices and all(p == spot_prices[z] for p, z in prices)  # the config's prices
    figures = {"window_s": WINDOW_S, "notice_to_graceful_leave_s": round(left_at - victim.noticed_at, 2),
               "preemption_to_replacement_first_step_s": round(first_step - victim.killed_at, 2),
               "notice_to_replacement_first_step_s": round(first_step - victim.noticed_at, 2),
               "inserts_per_replacement": sum(1 for t, m in gce_api.calls
                                              if m == "instances.insert" and victim.noticed_at <= t <= first_step),
               "api_calls_per_replacement": sum(1 for t, _ in gce_api.calls if victim.noticed_at <= t <= first_step)}
    (artifacts_dir / "gcp_e2e.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures))
