"""The process that drives a run (``spotswarm up`` or ``resume`` in the foreground), as its run
directory records it: a pid and that process's start time, so that a pid the system gave to another
process after the run's own died is never taken for the run, nor signalled."""

from __future__ import annotations

import os
from pathlib import Path

import psutil

PID_FILE = "up.pid"


def claim(run_dir: Path) -> None:
    """Record this process as the run's driver."""
    (Path(run_dir) / PID_FILE).write_text(f"{os.getpid()} {psutil.Process().create_time()!r}")


def release(run_dir: Path) -> None:
    (Path(run_dir) / PID_FILE).unlink(missing_ok=True)


def driver(run_dir: Path) -> psutil.Process | None:
    """The run's driver while it runs; None when the file is missing, unreadable, or names a pid that
    is gone or now belongs to a process started at another time (or written by a release that
    recorded no start time: it cannot be told from a stranger)."""
    try:
        pid, started = (Path(run_dir) / PID_FILE).read_text().split()
        process = psutil.Process(int(pid))
        if process.create_time() != float(started) or process.status() == psutil.STATUS_ZOMBIE:
            return None
    except (OSError, ValueError, psutil.Error):
        return None
    return process
