"""A GCP run launched from a laptop survives losing its head: the shipped ``gcp-spot.yaml`` (its endpoints
pointed at the loopback Compute fake and gcp-storage-emulator, and checkpoints every 4 s instead of a
minute), ``up`` launches the head, the head its Spot workers; the head VM is then taken back with its
power cut, and ``resume`` from the laptop launches a new head, which restores the run from ``gs://``,
releases the old fleet (it joined a head that is gone), and trains on from the newest checkpoint.
``down`` leaves no VM."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("ray")
pytest.importorskip("google.cloud.compute_v1")
pytest.importorskip("gcsfs")

from orchestrator.cli.main import main  # noqa: E402
from orchestrator.runs.durable import RunArchive  # noqa: E402
from orchestrator.runs.durable import checkpoint_epoch as epoch_of  # noqa: E402
from tests.orchestrator.run_checks import laptop_yaml, query, spotswarm_command, while_running  # noqa: E402

pytestmark = [pytest.mark.timeout(400), pytest.mark.heavy]

CHECKPOINT_EVERY_S = 4.0  # minutes on a real cloud; seconds here
FLEET = 2  # the shipped config's worker-spot


def test_a_launched_run_loses_its_head_and_resumes_from_gs_on_a_new_one(tmp_path, gce_api, gce_harness, gcs,
                                                                         wait_for, capsys):
    laptop = laptop_yaml(tmp_path / "laptop", "gcp-spot.yaml", gce_api.url, gcs,
                         checkpoint={"uri": "gs://spotswarm-runs/gcp-demo", "endpoint_url": gcs,
                                     "every_s": CHECKPOINT_EVERY_S, "keep": 5})
    archive = RunArchive("gs://spotswarm-runs/gcp-demo", endpoint_url=gcs)
    up = spotswarm_command(["up", laptop.name], laptop.parent, tmp_path / "up.out")
    resume = None
    try:
        wait = while_running(up, tmp_path / "up.out", wait_for)
        wait(lambda: (archive.status() or {}).get("training") == FLEET and archive.checkpoints(), 240,
             "the launched head's fleet to train and checkpoint")
        machines = list(gce_harness.machines.values())
        (old_head,) = [m for m in machines if m.instance_id.startswith("head-")]
        old_fleet = sorted(m.instance_id for m in machines if m is not old_head)
        assert len(old_fleet) == FLEET

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

    view = tmp_path / "view"
    archive.snapshot(view)
    start = json.loads(query(view, "SELECT detail FROM events WHERE kind = 'supervisor_start' "
                                   "ORDER BY time DESC LIMIT 1")[0][0])
    assert start["resumed_epoch"] >= checkpoint_epoch  # from the newest checkpoint in gs://, not from zero
    retired = dict(query(view, "SELECT id, end_reason FROM instances WHERE end_reason = 'orphaned'"))
    assert sorted(retired) == old_fleet  # the old fleet joined a head that is gone: released, not adopted
    assert not (tmp_path / "laptop" / "runs").exists()
