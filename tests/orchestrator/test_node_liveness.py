"""Whether a ``nodes``-mode machine lives, on real detached sessions (no Ray): alive while its boot
script runs, still alive while any process of its session outlives the script, dead once all are
gone.  ``session_pids`` (the scan of every process) is the reference the quick answer must agree with."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest

from orchestrator.host.processes import session_pids, signal_session
from orchestrator.sim.nodes import boot_detached, node_alive

pytestmark = pytest.mark.timeout(60)


def test_a_node_lives_while_any_process_of_its_session_does(tmp_path: Path, wait_for) -> None:  # noqa: ANN001
    marker = tmp_path / "child-started"
    leader = boot_detached(f"sleep 120 & touch {marker}; wait", tmp_path, "machine", dict(os.environ))
    try:
        wait_for(marker.exists, 20, "the boot script's child started")
        assert node_alive(leader)  # the boot script runs
        child = next(pid for pid in session_pids(leader) if pid != leader)

        os.kill(leader, signal.SIGKILL)  # the script dies; its child, in the same session, runs on
        wait_for(lambda: leader not in session_pids(leader), 20, "the boot script gone")
        assert psutil.pid_exists(child)
        assert node_alive(leader)

        signal_session(leader, signal.SIGKILL)
        wait_for(lambda: not node_alive(leader), 20, "every process of the session gone")
        assert session_pids(leader) == []
    finally:
        signal_session(leader, signal.SIGKILL)


def test_an_unknown_session_is_not_alive() -> None:
    assert not node_alive(2**22 + 12345)  # above the largest pid Linux allows: no such process
