"""Lose everything — supervisor, Ray, every instance — with SIGKILL; `resume` carries on from the
newest checkpoint.  Stop cleanly (`--duration`, `down`, Ctrl-C) and nothing is lost: `resume` carries
on from the very epoch and parameters the run stopped with."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import psutil
import pytest

from orchestrator.runs.store import RunStore
from tests.orchestrator.run_checks import (
    assert_resumed_from,
    assert_stop_lost_nothing,
    instances_since,
    loaded_states,
    query,
    resumed_at,
)

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
# the SIGKILL test's run is stopped at the end with no time for a final checkpoint: the miss is recorded
KILL_CONFIG = CONFIG.replace("checkpoint: {every_s: 20}", "checkpoint: {every_s: 20, final_timeout_s: 0.001}")


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
    (tmp_path / "cluster.yaml").write_text(KILL_CONFIG)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-m", "orchestrator.cli.main"]
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

    # the Ctrl-C stop had 1 ms for its final checkpoint: too little, and the store and `status` say how
    # many epochs the last checkpoint is behind the stop
    (last_checkpoint,), = rows(db, "SELECT MAX(epoch) FROM checkpoints")
    missed_rows = rows(db, "SELECT detail FROM events WHERE kind = 'final_checkpoint_missed'")
    if not missed_rows:  # a checkpoint already held the stop's epoch or a newer one (a slow, loaded run; or a
        # file the killed supervisor wrote and never recorded, which the resumed one found and served)
        (detail,), = rows(db, "SELECT detail FROM events WHERE kind = 'final_checkpoint'")
        assert json.loads(detail)["written"] is False and json.loads(detail)["epoch"] == last_checkpoint >= max(after)
        return
    (detail,), = missed_rows
    missed = json.loads(detail)
    assert missed["epoch"] == max(after) and missed["checkpoint_epoch"] == last_checkpoint
    assert missed["epochs_behind"] == max(after) - last_checkpoint
    status = subprocess.run([*cli, "status", "runs/r"], cwd=tmp_path, env={**env, "COLUMNS": "200"},
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert (f"epoch {last_checkpoint} ({missed['epochs_behind']} epochs older than the stop: final checkpoint "
            "missed)") in status.stdout


# ---- a clean stop loses nothing ----------------------------------------------------------------------
STOP_CONFIG = CONFIG.replace("cluster_name: r", "cluster_name: s").replace(
    "checkpoint: {every_s: 20}", "checkpoint: {every_s: 100}\ndashboard: {enabled: false}")


@dataclasses.dataclass
class Stops:
    """One run stopped three ways, each stop followed by a resume: ``--duration``, then ``down`` from
    another shell, then Ctrl-C.  What each stop left and what the following resume started from."""

    run: Path
    stopped: list[tuple[int, str]]  # each stop's final checkpoint: (epoch, parameter digest)
    resumed: list[float]  # when each resume began (the store's clock)
    outputs: list[str]  # each resume command's output


@pytest.fixture(scope="module")
def stops(tmp_path_factory: pytest.TempPathFactory, wait_for) -> Stops:
    base = tmp_path_factory.mktemp("stops")
    (base / "cluster.yaml").write_text(STOP_CONFIG)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-m", "orchestrator.cli.main"]
    run = base / "runs" / "s"
    up = subprocess.run([*cli, "up", "cluster.yaml", "--duration", "30"], cwd=base, env=env, capture_output=True,
                        text=True, timeout=240)
    assert up.returncode == 0, up.stderr[-3000:]
    result = Stops(run, [assert_stop_lost_nothing(run)], [], [])

    def resume_until_loaded(then: Callable[[subprocess.Popen], None], epochs: int) -> None:
        """Resume; once its workers loaded a state and trained ``epochs`` more, stop it with ``then``."""
        before = len(query(run, "SELECT 1 FROM events WHERE kind = 'resume'"))
        out = base / f"resume-{len(result.resumed)}.out"
        with open(out, "w") as stdout:
            resumed = subprocess.Popen([*cli, "resume", "runs/s"], cwd=base, env=env, stdout=stdout,
                                       stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: len(query(run, "SELECT 1 FROM events WHERE kind = 'resume'")) > before, 60,
                     "the resume to start")
            since, stopped_at = resumed_at(run), result.stopped[-1][0]
            wait_for(lambda: loaded_states(run, instances_since(run, since))
                     and (query(run, "SELECT MAX(epoch) FROM progress WHERE time >= ?", since)[0][0] or 0)
                     >= stopped_at + epochs, 150, "the resumed workers to load the state and train on")
            then(resumed)
            assert resumed.wait(timeout=150) == 0, out.read_text()[-3000:]
        finally:
            if resumed.poll() is None:
                resumed.kill()
                resumed.wait(timeout=30)
        result.resumed.append(since)
        result.outputs.append(out.read_text())
        result.stopped.append(assert_stop_lost_nothing(run))

    def down(_: subprocess.Popen) -> None:  # from another shell
        done = subprocess.run([*cli, "down", "runs/s"], cwd=base, env=env, capture_output=True, text=True,
                              timeout=200)
        assert done.returncode == 0, done.stdout + done.stderr

    resume_until_loaded(down, epochs=3)
    resume_until_loaded(lambda process: process.send_signal(signal.SIGINT), epochs=0)  # Ctrl-C
    return result


@pytest.mark.timeout(600)
def test_a_stopped_run_resumes_from_the_epoch_it_stopped_at_with_the_same_parameters(stops: Stops) -> None:
    """Stopped by --duration, by `down` from another shell and by Ctrl-C: each stop checkpointed the
    epoch it stopped at, bit-equal to its peers' parameters (assert_stop_lost_nothing), and each resume
    continued from exactly that epoch and those parameters."""
    assert len(stops.stopped) == 3 and len(stops.resumed) == 2
    (first, _), (second, _), _ = stops.stopped
    assert first < second  # the second run trained on from the first stop
    for (epoch, digest), since, output in zip(stops.stopped, stops.resumed, stops.outputs, strict=False):
        assert f"resuming s from checkpoint epoch {epoch}\n" in output
        assert_resumed_from(stops.run, since, epoch, digest)
    stopping = query(stops.run, "SELECT COUNT(*) FROM events WHERE kind = 'stopping'")
    assert stopping == [(3,)] and query(stops.run, "SELECT COUNT(*) FROM events WHERE kind = 'final_checkpoint'") \
        == [(3,)]


@pytest.mark.timeout(120)
def test_check_reads_the_log_of_every_instance_of_an_actors_mode_run(stops: Stops, capsys) -> None:
    """Each instance's worker logged into the run directory (actors mode: Ray's session directory is
    gone with the session); `check` scans those logs, and a traceback in one fails the run, named."""
    from orchestrator.cli.main import main

    instances = [i for (i,) in query(stops.run, "SELECT id FROM instances ORDER BY id")]
    assert len(instances) >= 6  # two per run
    logs = {i: stops.run / "logs" / f"{i}.log" for i in instances}
    assert all(log.stat().st_size > 0 for log in logs.values())
    assert main(["check", str(stops.run)]) == 0
    out = capsys.readouterr().out
    scanned = int(re.search(r"(\d+) log file\(s\) scanned", out).group(1))
    assert scanned >= len(instances) + 1, out  # every instance's and the supervisor's
    victim = logs[instances[1]]
    lines = len(victim.read_text().splitlines())
    with open(victim, "a") as f:
        f.write("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\nRuntimeError: planted\n")
    assert main(["check", str(stops.run)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert f"tracebacks: {victim}:{lines + 1}: Traceback (most recent call last):" in out
    assert out[-1].startswith(f"{stops.run}: 1 violation(s)")
