"""A quick chaos run: the local nodes mode (every instance its own Ray node) under every fault kind the
injector has, with a fixed seed, and every invariant asserted from its report and its run directory.
The 20-minute soak with a fault every ~15 s is ``benchmarks/bench_chaos.py``."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest

pytest.importorskip("ray")

from orchestrator.chaos import disk as chaos_disk  # noqa: E402
from orchestrator.chaos.runner import ChaosError, ChaosRun, ChaosSettings, plan  # noqa: E402
from orchestrator.config.schema import ClusterConfig  # noqa: E402
from orchestrator.runs.chaos_report import (
    FAULT_KINDS,  # noqa: E402
    REPORT,  # noqa: E402
)
from orchestrator.runs.invariants import check_leaks  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.heavy]

SETTINGS = ChaosSettings(duration_s=48.0, seed=11, every_s=5.5, calm_s=8.0, stall_bound_s=30.0, check_every_s=2.0,
                         disk_mb=64, aim_s=0.0)  # faults land where they fall: the soak aims at phases


def chaos_config(tmp_path: Path) -> ClusterConfig:
    return ClusterConfig.model_validate({
        "cluster_name": "chaos", "runs_dir": str(tmp_path / "runs"),
        "provider": {"type": "local", "mode": "nodes", "zones": ["a"], "time_scale": 1.0,
                     "provisioning_delay_s": 0.0},
        "available_node_types": {"small": {"min_workers": 3, "max_workers": 3, "resources": {"CPU": 1},
                                           "on_demand_price_per_hour": 1.0,
                                           "preemption": {"distribution": "none"}}},
        "training": {"task": "synthetic", "target_batch_size": 64, "min_matchmaking_time_s": 0.5,
                     "averaging_timeout_s": 5.0, "param_digests": True},
        "checkpoint": {"every_s": 4.0},
        "dashboard": {"enabled": False},
    })


def test_the_plan_holds_every_kind_and_is_the_seeds():
    drawn = plan(SETTINGS)
    assert {kind for _, kind in drawn} == set(FAULT_KINDS)
    assert drawn == plan(SETTINGS)  # the seed decides
    assert all(0 < t < SETTINGS.duration_s - SETTINGS.calm_s for t, _ in drawn)


def test_a_quick_chaos_run_survives_every_fault_kind_and_keeps_every_invariant(tmp_path):
    config = chaos_config(tmp_path)
    report = ChaosRun(config, SETTINGS).run()
    run_dir = config.run_dir()

    expected = set(FAULT_KINDS) - ({"disk_full"} if chaos_disk.unavailable() else set())
    injected = {f.kind for f in report.faults if f.outcome == "injected"}
    skipped = [f"{f.kind}: {f.outcome}" for f in report.faults if f.outcome != "injected"]
    assert injected == expected, f"not every fault kind was injected; skipped: {skipped}"
    assert report.violations == []
    summary = report.summary
    assert (summary["invariant_violations"], summary["error_tracebacks"]) == (0, 0)
    assert summary["max_stall_s"] <= SETTINGS.stall_bound_s
    assert summary["recovery_s"] is not None and 0 < summary["recovery_s"] <= SETTINGS.stall_bound_s
    assert json.loads((run_dir / REPORT).read_text())["summary"] == summary  # the report on disk is this one

    db = sqlite3.connect(run_dir / "run.sqlite")
    try:
        died = db.execute("SELECT COUNT(*) FROM instances WHERE end_reason = 'died'").fetchone()[0]
        starts = db.execute("SELECT COUNT(*) FROM events WHERE kind = 'supervisor_start'").fetchone()[0]
        open_ = db.execute("SELECT COUNT(*) FROM instances WHERE ended_at IS NULL").fetchone()[0]
        last_fault = max(f.time for f in report.faults if f.outcome == "injected")
        after = db.execute("SELECT MAX(epoch) - MIN(epoch) FROM progress WHERE time > ?", (last_fault,)).fetchone()[0]
    finally:
        db.close()
    assert died >= 2  # the killed worker's and the killed node's instances, each released and replaced
    assert starts == 2  # the first supervisor and the one resumed after its SIGKILL
    assert open_ == 0  # the stop released every instance
    assert after and after > 0, "training went on after the last fault"  # the run waited for it
    assert check_leaks(str(run_dir.resolve()), exclude=[os.getpid()]) == []



def test_the_chaos_command_refuses_what_it_cannot_run_and_starts_nothing(tmp_path):
    """A config that is not the local nodes mode in real time, or an unknown fault kind: exit 2 and one
    line saying why, before any Ray or run directory exists."""
    import subprocess
    import sys

    import yaml

    nodes = chaos_config(tmp_path).model_dump(mode="json", exclude_defaults=True)
    path = tmp_path / "actors.yaml"
    path.write_text(yaml.safe_dump({**nodes, "provider": {**nodes["provider"], "mode": "actors"}}))
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "chaos", str(path), "--duration", "5"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "needs the local provider in nodes mode" in proc.stderr
    scaled = chaos_config(tmp_path).model_copy(update={"provider": chaos_config(tmp_path).provider.model_copy(
        update={"time_scale": 10.0})})
    with pytest.raises(ChaosError, match="time_scale 1"):
        ChaosRun(scaled, SETTINGS)
    with pytest.raises(ChaosError, match="unknown fault kind"):
        ChaosSettings(5.0, kinds=("worker_kill", "meteor"))
    assert not (tmp_path / "runs").exists()
