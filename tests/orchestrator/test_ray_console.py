"""What Ray prints on the console of the process that drives a run goes to the run's log
(``logs/ray-driver.log``), not the terminal: its token-authentication notice at every session start,
and its paragraphs for a worker or node that died (a raylet's with the last 20 lines of its log, 40
lines a node kill in nodes mode and ``spotswarm chaos``).  Other Ray output still reaches the terminal."""

from __future__ import annotations

import logging

import pytest

from orchestrator.fleet.ray_session import _quiet_notices, _quiet_worker_deaths, run_log

RAYLET_DUMP = ["Raylet is terminated. Termination is unexpected. Possible reasons include: (1) SIGKILL by the user "
               "or system OOM killer, ... Last 20 lines of the Raylet logs:",
               "    [state-dump] NodeManager.deadline_timer.debug_state_dump - 1 total (1 active)"]


def test_a_raylet_dump_goes_to_the_runs_log_and_other_output_still_to_the_terminal(tmp_path, capfd):
    worker = pytest.importorskip("ray._private.worker")
    _quiet_worker_deaths()
    path = tmp_path / "logs" / "ray-driver.log"
    with run_log(path):
        worker.print_to_stdstream({"pid": "raylet", "ip": "10.0.0.1", "is_err": False, "lines": RAYLET_DUMP}, True)
        worker.print_to_stdstream({"pid": "raylet", "ip": "10.0.0.1", "is_err": False,
                                   "lines": ["something else the raylet says"]}, True)
    out = capfd.readouterr().out
    assert "Raylet is terminated" not in out and "something else the raylet says" in out
    assert "Raylet is terminated" in path.read_text() and "[state-dump]" in path.read_text()


def test_rays_token_notice_goes_to_the_runs_log(tmp_path, caplog):
    _quiet_notices()
    path = tmp_path / "ray-driver.log"
    notice = logging.getLogger("ray._private.authentication.authentication_token_setup")
    with caplog.at_level(logging.WARNING), run_log(path):
        notice.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
        logging.getLogger("ray.other").warning("a warning of Ray's that is not a notice")
    shown = [r.getMessage() for r in caplog.records]  # what reached this process's handlers (its terminal)
    assert shown == ["a warning of Ray's that is not a notice"]
    assert "Token authentication is enabled" in path.read_text()
