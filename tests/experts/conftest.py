"""Fixtures for the experts layer: a DHT to meet in, expert servers on loopback, a client DHT.

Servers run on their own event-loop threads (``BackgroundExpertServer``) because remote experts
block the calling thread; every server and DHT made here is shut down after the test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


class ServerProcess:
    """``spotswarm expert-server`` in a child process; its stdout lines are read by a thread."""

    def __init__(self, *flags: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli.main", "expert-server", *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self.lines.append("<EOF>")
            self._cond.notify_all()

    def wait_line(self, pattern: str, timeout: float = 60.0) -> re.Match:
        """The first stdout line matching ``pattern``, waiting for it; fails at EOF or timeout."""
        regex = re.compile(pattern)

        def found() -> re.Match | None:
            return next((m for m in map(regex.search, self.lines) if m), None)

        with self._cond:
            self._cond.wait_for(lambda: found() is not None or "<EOF>" in self.lines, timeout)
            match = found()
        if match is None:
            raise AssertionError(f"server process printed no line matching {pattern!r}: {self.lines}")
        return match

    @property
    def address(self) -> str:
        return self.wait_line(r"expert server listening at (\S+)").group(1)

    def kill(self) -> int:
        self.proc.kill()
        return self.proc.wait(timeout=30)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                return self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(timeout=30)


@pytest.fixture
def server_process():
    """``server_process(*flags)``: a CLI expert server in a child process, killed after the test."""
    procs: list[ServerProcess] = []

    def factory(*flags: str) -> ServerProcess:
        p = ServerProcess(*flags)
        procs.append(p)
        return p

    yield factory
    for p in procs:
        if p.proc.poll() is None:
            p.proc.kill()
        p.proc.wait(timeout=30)
        if p.proc.stdout is not None:
            p.proc.stdout.close()
        p._reader.join(timeout=10)
