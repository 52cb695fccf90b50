"""`spotswarm up --address` joins a Ray cluster it did not start: the supervisor runs on that
cluster's head as a detached actor (the run goes on when the command dies, and `down` stops it
there), each instance joins it as a Ray node, and releasing the run leaves the head up."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

pytestmark = pytest.mark.heavy

ROOT = Path(__file__).resolve().parent.parent.parent
RAY = Path(sys.executable).with_name("ray")
CONFIG = """\
cluster_name: j
runs_dir: runs
provider: {type: local, mode: nodes, zones: [a], time_scale: 1.0, provisioning_delay_s: 0}
available_node_types:
  small: {min_workers: 2, max_workers: 2, resources: {CPU: 1}, preemption: {distribution: none}}
training: {task: synthetic, target_batch_size: 64, min_matchmaking_time_s: 0.5, averaging_timeout_s: 10}
checkpoint: {every_s: 600}
dashboard: {enabled: false}
"""


def rows(db: Path, sql: str) -> list:
    conn = sqlite3.connect(db)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def epoch(db: Path) -> int:
    try:
        return rows(db, "SELECT COALESCE(MAX(epoch), 0) FROM progress")[0][0]
    except sqlite3.OperationalError:  # not created yet
        return 0


@pytest.mark.timeout(300)
def test_up_joins_an_existing_cluster_and_its_run_outlives_the_command(tmp_path, ray_heads, wait_for):
    head = ray_heads("join")
    env, address = head.env, head.address
    (tmp_path / "cluster.yaml").write_text(CONFIG)
    db = tmp_path / "runs" / "j" / "run.sqlite"
    cli = [sys.executable, "-m", "orchestrator.cli.main"]
    with open(tmp_path / "up.out", "w") as out:
        up = subprocess.Popen([*cli, "up", "cluster.yaml", "--address", address, "--duration", "240"],
                              cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: head.alive() and epoch(db) >= 20, 120, "the fleet to train")
    finally:
        up.kill()  # the command that started the run dies: the detached supervisor carries on
        up.wait(timeout=30)
    after_kill = epoch(db)
    wait_for(lambda: epoch(db) >= after_kill + 20, 120, "training to go on without the command")

    down = subprocess.run([*cli, "down", "runs/j"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=200)
    assert down.returncode == 0 and "detached supervisor" in down.stdout, down.stdout + down.stderr
    (detail,), = rows(db, "SELECT detail FROM events WHERE kind = 'supervisor_start'")
    assert json.loads(detail)["ray_node"]["head"] is True  # pinned to the cluster's head
    assert sorted(rows(db, "SELECT id, end_reason FROM instances")) == [("j-small-0000", "released"),
                                                                      ("j-small-0001", "released")]
    assert not list((tmp_path / "runs" / "j" / "nodes").glob("*.json"))  # every node stopped
    assert head.process.poll() is None  # releasing the run stops its instances' nodes, not the cluster
    output = (tmp_path / "up.out").read_text()
    assert "worker died or was killed" not in output  # no raylet paragraphs on the console
