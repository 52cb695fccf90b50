"""Lose everything — supervisor, Ray, every instance — with SIGKILL; `resume` carries on from the
newest checkpoint."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import psutil
import pytest

from orchestrator.run_store import RunStore

pytestmark = pytest.mark.heavy

ROOT = Path(__file__).resolve().parent.parent.parent
CONFIG = """\
cluster_name: r
runs_dir: runs
provider: {type: local, zones: [a], time_scale: 10.0, provisioning_delay_s: 5.0}
available_node_types:
  small:
    min_workers: 2
    max_workers: 2
    preemption: {distribution: none}
training: {task: synthetic, target_batch_size: 64, min_matchmaking_time_s: 0.5, averaging_timeout_s: 10}
checkpoint: {every_s: 20}
"""


def rows(db_path: Path, sql: str) -> list:
    if not db_path.exists():
        return []
    db = sqlite3.connect(db_path)
    try:
        return db.execute(sql).fetchall()
    except sqlite3.OperationalError:
        return []
    finally:
        db.close()


@pytest.mark.timeout(400)
def test_resume_after_the_supervisor_ray_and_the_fleet_are_sigkilled(tmp_path):
    (tmp_path / "cluster.yaml").write_text(CONFIG)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-m", "orchestrator.cli"]
    up = subprocess.Popen([*cli, "up", "cluster.yaml", "--duration", "300"], cwd=tmp_path, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    db = tmp_path / "runs" / "r" / "run.sqlite"
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and not rows(db, "SELECT epoch FROM checkpoints WHERE epoch >= 2"):
            time.sleep(0.2)  # polling the run store for a condition, not sleeping to synchronize
        checkpoint_epoch = max(r[0] for r in rows(db, "SELECT epoch FROM checkpoints"))
        tree = psutil.Process(up.pid).children(recursive=True) + [psutil.Process(up.pid)]
        assert any("raylet" in " ".join(p.cmdline()) for p in tree if p.is_running()), "Ray is part of the run"
        for p in tree:
            try:
                p.send_signal(signal.SIGKILL)  # supervisor, Ray, every simulated instance: all gone at once
            except psutil.NoSuchProcess:
                pass
        up.wait(timeout=30)
        psutil.wait_procs(tree, timeout=30)
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in tree)
    finally:
        if up.poll() is None:
            up.kill()
    # the last moment the store heard from the killed run (its clock is simulated, 10x): all it gets
    # later is the resume's, whose clock carries on from there
    with closing(RunStore.open(db.parent)) as store:
        killed_at = store.last_time()

    def progress_since_the_kill() -> list[int]:
        return [r[0] for r in rows(db, f"SELECT epoch FROM progress WHERE time > {killed_at} ORDER BY time")]

    def trained_on() -> bool:
        return max(progress_since_the_kill(), default=0) > checkpoint_epoch + 2

    out, err = tmp_path / "resume.out", tmp_path / "resume.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        resumed = subprocess.Popen([*cli, "resume", "runs/r", "--duration", "300"], cwd=tmp_path, env=env,
                                   stdout=stdout, stderr=stderr)
    try:
        deadline = time.monotonic() + 240
        while resumed.poll() is None and time.monotonic() < deadline and not trained_on():
            time.sleep(0.2)  # polling the run store for a condition, not sleeping to synchronize
        assert resumed.poll() is None, err.read_text()[-3000:]  # still running (--duration is far off)
        resumed.send_signal(signal.SIGINT)  # Ctrl-C: the run stops as at the end of --duration, exit 0
        assert resumed.wait(timeout=120) == 0, err.read_text()[-3000:]
    finally:
        if resumed.poll() is None:
            resumed.kill()
            resumed.wait(timeout=30)
    assert f"from checkpoint epoch {checkpoint_epoch}" in out.read_text()
    after = progress_since_the_kill()
    assert after, "no progress after resuming"
    assert min(after) >= checkpoint_epoch  # it continued from the checkpoint, not from scratch
    assert max(after) > checkpoint_epoch + 2  # and kept training
    assert rows(db, "SELECT COUNT(*) FROM events WHERE kind = 'resume'") == [(1,)]
