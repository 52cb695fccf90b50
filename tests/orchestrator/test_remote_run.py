"""A real run stopped from "another machine" through its archive: ``spotswarm up`` runs the head (a
local Ray session, the supervisor, a simulated fleet) and publishes to a directory archive; a second
directory holding only the cluster YAML (another runs_dir, no run) reads ``status`` and ``logs`` from
the archive, then ``down`` asks the head to stop, and the head stops cleanly: its final checkpoint,
every instance released, ``stopped`` published, exit 0."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.cli.main import main
from orchestrator.runs.durable import RunArchive

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]


def config_data(runs_dir: Path, archive: Path) -> dict:
    return {
        "cluster_name": "rr", "runs_dir": str(runs_dir),
        "provider": {"type": "local", "zones": ["a"], "time_scale": 10.0, "provisioning_delay_s": 5.0},
        "available_node_types": {"small": {"min_workers": 2, "max_workers": 2,
                                           "preemption": {"distribution": "none"}}},
        "training": {"task": "synthetic", "target_batch_size": 64, "min_matchmaking_time_s": 0.5},
        "checkpoint": {"uri": str(archive), "every_s": 20},
        "dashboard": {"enabled": False},
    }


def test_up_publishes_to_its_archive_and_down_from_elsewhere_stops_it_cleanly(tmp_path, capsys):
    archive_dir = tmp_path / "archive" / "rr"
    head, laptop = tmp_path / "head", tmp_path / "laptop"
    head.mkdir()
    laptop.mkdir()
    (head / "cluster.yaml").write_text(yaml.safe_dump(config_data(head / "runs", archive_dir)))
    (laptop / "cluster.yaml").write_text(yaml.safe_dump(config_data(laptop / "runs", archive_dir)))
    archive = RunArchive(str(archive_dir))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = head / "up.out"
    with open(out, "w") as stdout:
        up = subprocess.Popen([sys.executable, "-m", "orchestrator.cli.main", "up", "cluster.yaml", "--duration",
                               "200"], cwd=head, env=env, stdout=stdout, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 150
        while not ((archive.status() or {}).get("epoch", 0) >= 1 and archive.has_history()):
            assert up.poll() is None, out.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no epoch published: {archive.status()}"
            time.sleep(0.5)  # polling the archive for a condition, not sleeping to synchronize

        assert main(["status", str(laptop / "cluster.yaml")]) == 0
        seen = capsys.readouterr().out
        assert f"from {archive_dir}: the head" in seen and "running, epoch" in seen and "run rr: summary" in seen
        assert main(["logs", str(laptop / "cluster.yaml")]) == 0
        assert "supervisor.log" in capsys.readouterr().out

        assert main(["down", str(laptop / "cluster.yaml")]) == 0
        said = capsys.readouterr().out
        assert "stop requested through" in said and "rr: stopped by its head" in said
        assert up.wait(timeout=120) == 0, out.read_text()[-3000:]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(30)
    said = out.read_text()
    assert "a stop was asked for through the archive" in said
    assert "Token authentication" not in said  # Ray's notices: the run's log, not the terminal
    assert (head / "runs" / "rr" / "logs" / "ray-driver.log").is_file()
    assert archive.status()["state"] == "stopped" and archive.status()["live"] == 0
    assert not (laptop / "runs").exists()  # the laptop wrote nothing of the run
