"""Whether a ``nodes``-mode machine lives, on real detached sessions (no Ray): alive while its boot
script runs, still alive while any process of its session outlives the script, dead once all are
gone."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from orchestrator.providers.local_nodes import boot_detached, kill_node, node_alive

pytestmark = pytest.mark.timeout(60)


def _wait_for(condition, what: str, timeout: float = 20.0) -> None:  # noqa: ANN001 - a predicate
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.05)  # polling a process table, bounded


def _session(leader: int) -> list[int]:
    pids = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(proc.pid) == leader:
                pids.append(proc.pid)
        except OSError:
            continue
    return pids


def test_a_node_lives_while_any_process_of_its_session_does(tmp_path: Path) -> None:
    marker = tmp_path / "child-started"
    leader = boot_detached(f"sleep 120 & touch {marker}; wait", tmp_path, "machine", dict(os.environ))
    try:
        _wait_for(marker.exists, "the boot script's child started")
        assert node_alive(leader)  # the boot script runs
        child = next(pid for pid in _session(leader) if pid != leader)

        os.kill(leader, signal.SIGKILL)  # the script dies; its child, in the same session, runs on
        _wait_for(lambda: leader not in _session(leader), "the boot script gone")
        assert psutil.pid_exists(child)
        assert node_alive(leader)

        kill_node(leader, signal.SIGKILL)
        _wait_for(lambda: not node_alive(leader), "every process of the session gone")
        assert _session(leader) == []
    finally:
        kill_node(leader, signal.SIGKILL)


def test_an_unknown_session_is_not_alive() -> None:
    assert not node_alive(2**22 + 12345)  # above the largest pid Linux allows: no such process
