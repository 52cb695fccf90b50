"""``spotswarm check`` and the invariants under it, on a run store filled by hand with a known history
(no Ray): what holds passes, and each way of breaking an invariant is one named violation."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orchestrator.cli.main import main
from orchestrator.host.processes import processes_mentioning
from orchestrator.runs.invariants import check_leaks, check_run, stalls
from tests.dashboard.conftest import T0, fill_run

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = fill_run(tmp_path / "runs")
    (run / "logs").mkdir()
    (run / "logs" / "supervisor.log").write_text("2026-11-28 10:00:00,000 INFO orchestrator.fleet.supervisor: fine\n")
    return run


def test_a_consistent_run_passes(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    torch.save({"epoch": 10, "state": {"w": torch.ones(3)}}, run_dir / "checkpoints" / "epoch-000010.pt")
    assert main(["check", str(run_dir)]) == 0
    out = capsys.readouterr().out
    # new epochs at 600, 1800, 3000, 4500 and 6000 s: the longest wait is 1500 s
    assert out == (f"{run_dir}: ok (stopped; 1 checkpoint(s) load; longest wait for an epoch 1500.0 s; "
                   "1 log file(s) scanned)\n")


def test_a_stall_past_the_bound_is_named(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["check", str(run_dir), "--stall-bound", "1000"]) == 1
    assert capsys.readouterr().out.splitlines()[0] == "stall: no new epoch for 1500.0 s (bound 1000 s)"


def test_each_broken_invariant_is_one_violation(run_dir: Path) -> None:
    db = sqlite3.connect(run_dir / "run.sqlite")
    db.execute("INSERT INTO instances VALUES ('open', 'small', 'a', 'spot', 0.3, 1.0, ?, NULL, NULL, NULL, NULL)",
               (T0 + 100,))
    db.execute("UPDATE instances SET ended_at = launched_at - 1 WHERE id = 'i1'")
    db.commit()
    db.close()
    (run_dir / "checkpoints" / "epoch-000003.pt").write_bytes(b"half a checkpoint")
    torch.save({"epoch": 4, "state": {"f": Path("/")}}, run_dir / "checkpoints" / "epoch-000004.pt")  # an object
    (run_dir / "nodes").mkdir()
    (run_dir / "nodes" / "n1.log").write_text("fine\nTraceback (most recent call last):\n  boom\n")
    result = check_run(run_dir, stopped=True)
    got = sorted((v.invariant, v.detail.split(":")[0] if v.invariant == "tracebacks" else v.detail[:40])
                 for v in result.violations)
    assert got == [
        ("checkpoints", f"checkpoint {run_dir}/checkpoints/epoch-0"[:40]),
        ("checkpoints", f"checkpoint {run_dir}/checkpoints/epoch-0"[:40]),
        ("store", "instance i1 ended (999999.0) before its launch (1000000.0)"[:40]),
        ("store", "instance open still open after the run stopped"[:40]),
        ("tracebacks", str(run_dir / "nodes" / "n1.log")),
    ]
    assert {v.detail.split()[1] for v in result.violations if v.invariant == "checkpoints"} == {
        str(run_dir / "checkpoints" / "epoch-000003.pt"), str(run_dir / "checkpoints" / "epoch-000004.pt")}
    assert [v.detail for v in result.violations if v.invariant == "tracebacks"] == [
        f"{run_dir / 'nodes' / 'n1.log'}:2: Traceback (most recent call last):"]


def test_a_live_run_may_hold_open_instances(run_dir: Path) -> None:
    db = sqlite3.connect(run_dir / "run.sqlite")
    db.execute("UPDATE instances SET ended_at = NULL, end_reason = NULL WHERE id = 'i6'")
    db.commit()
    db.close()
    assert check_run(run_dir, stopped=False).ok
    assert [v.detail for v in check_run(run_dir, stopped=True).violations] == [
        "instance i6 still open after the run stopped"]


def test_a_corrupt_store_is_a_violation_not_a_crash(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    (run_dir / "run.sqlite-wal").unlink(missing_ok=True)
    (run_dir / "run.sqlite").write_bytes(b"SQLite format 3\x00" + b"\xff" * 4000)
    assert main(["check", str(run_dir)]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("store: ")


def test_not_a_run_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["check", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"spotswarm check: {tmp_path} is not a run directory (no run.sqlite)\n"


def test_stalls_leave_out_excluded_intervals() -> None:
    rows = [(0.0, 1), (10.0, 2), (10.5, 2), (40.0, 3), (41.0, 5)]
    assert stalls(rows) == [10.0, 30.0, 1.0]
    assert stalls(rows, excluded=[(15.0, 35.0)]) == [10.0, 10.0, 1.0]  # the supervisor was down for 20 s


def test_a_process_left_behind_is_a_leak(tmp_path: Path) -> None:
    marker = str(tmp_path / "run-marker")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", marker], stdin=subprocess.PIPE)
    try:
        assert [p.pid for p in processes_mentioning(marker)] == [proc.pid]
        (violation,) = check_leaks(marker)
        assert violation.invariant == "leaks" and violation.detail.startswith(f"pid {proc.pid} still running")
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)
    assert check_leaks(marker) == []


def test_the_time_no_supervisor_ran_is_no_stall(run_dir: Path) -> None:
    """The hand-filled run was killed after its progress row at 6000 s and resumed at 7000 s: a new epoch
    at 7600 s waited 1600 s, of which only 600 s with a supervisor running."""
    db = sqlite3.connect(run_dir / "run.sqlite")
    db.execute("INSERT INTO progress VALUES (?, 21, 0.8, 45.0, 1, 6720)", (T0 + 7600,))
    db.commit()
    db.close()
    assert check_run(run_dir, stopped=True).max_stall_s == 1500.0


def test_a_missing_log_fails_the_check_instead_of_an_empty_scan(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """The supervisor's log is expected of every run, and on the local provider the worker's log of
    every instance that trained; the rotated ones are scanned too."""
    (run_dir / "logs" / "supervisor.log").unlink()
    db = sqlite3.connect(run_dir / "run.sqlite")
    db.execute("INSERT INTO events VALUES (?, 'first_step', 'i6', '{\"epoch\": 21}')", (T0 + 7100,))
    db.commit()
    db.close()
    assert main(["check", str(run_dir)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [f"logs: {run_dir / 'logs' / 'supervisor.log'} missing (expected for supervisor)",
                       f"logs: {run_dir / 'logs' / 'i6.log'} missing (expected for i6)"]
    assert out[2].endswith("0 log file(s) scanned)")
    (run_dir / "logs" / "supervisor.log.1").write_text("rotated\n")
    (run_dir / "logs" / "i6.log").write_text("INFO fine\n")
    (run_dir / "logs" / "i6.log.2").write_text("an old part\nTraceback (most recent call last):\n")
    result = check_run(run_dir, stopped=True)
    assert [(v.invariant, v.detail) for v in result.violations] == [
        ("tracebacks", f"{run_dir / 'logs' / 'i6.log.2'}:2: Traceback (most recent call last):")]
    assert result.logs == 3


def test_check_reads_a_run_without_importing_ray_or_torch(run_dir: Path) -> None:
    """``spotswarm check`` reads files: a checkpoint is judged by its zip and pickle alone."""
    torch.save({"epoch": 10, "state": {"w": torch.ones(3)}}, run_dir / "checkpoints" / "epoch-000010.pt")
    code = ("import sys; from orchestrator.cli.main import main; rc = main(['check', sys.argv[1]]); "
            "print(sorted(m for m in ('ray', 'torch') if m in sys.modules)); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]"


class _Code:
    def __reduce__(self) -> tuple:
        return (print, ("ran",))


def test_a_checkpoint_that_would_run_code_is_a_violation(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    torch.save({"epoch": 10, "state": _Code()}, run_dir / "checkpoints" / "epoch-000010.pt")
    assert main(["check", str(run_dir)]) == 1
    out = capsys.readouterr().out
    assert "refers to builtins.print, which is not a tensor or a plain value" in out
    assert "ran" not in out.split("\n")[0]
