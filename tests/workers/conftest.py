"""Training peers as real processes (`python -m orchestrator.cli worker`), read through their reports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


class Worker:
    def __init__(self, proc: subprocess.Popen, report: Path, log: Path) -> None:
        self.proc, self.report, self.log = proc, report, log
        self.address: str | None = None

    def records(self) -> list[dict]:
        if not self.report.exists():
            return []
        return [json.loads(line) for line in self.report.read_text().splitlines() if line.strip()]

    def epochs(self) -> dict[int, dict]:
        return {r["epoch"]: r for r in self.records()}

    def latest_epoch(self) -> int:
        records = self.records()
        return records[-1]["epoch"] if records else 0

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stderr(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


class WorkerSwarm:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.workers: list[Worker] = []

    def start(self, *args: str, initial: Worker | None = None, **options) -> Worker:
        return self.start_many(1, *args, initial=initial, **options)[0]

    def start_many(self, count: int, *args: str, initial: Worker | None = None, **options) -> list[Worker]:
        """``count`` workers with the same settings, launched at once (each one's interpreter and
        imports take seconds) and returned when every one of them listens."""
        launched = [self._launch(*args, initial=initial, **options) for _ in range(count)]
        for worker in launched:
            line = worker.proc.stdout.readline()
            assert line.startswith("worker "), f"worker did not start: {line!r}\n{worker.stderr()}"
            worker.address = line.split()[-1]
        return launched

    def _launch(self, *args: str, initial: Worker | None = None, **options) -> Worker:
        n = len(self.workers)
        report, log = self.tmp / f"w{n}.jsonl", self.tmp / f"w{n}.log"
        cmd = [sys.executable, "-m", "orchestrator.cli", "worker", "--run", "test", "--report-file", str(report),
               "--seed", str(n), *args]
        for key, value in options.items():
            cmd += [f"--{key.replace('_', '-')}", str(value)]
        if initial is not None:
            cmd += ["--initial-peers", initial.address]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        worker = Worker(proc, report, log)
        self.workers.append(worker)  # before it listens: stop_all ends it whatever happens next
        return worker

    def wait(self, predicate, timeout: float, what: str) -> None:
        """Poll a condition on the workers' reports (not a sleep: it returns as soon as it holds)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.05)
        logs = "\n".join(f"--- worker {i}\n{w.stderr()[-3000:]}" for i, w in enumerate(self.workers))
        raise AssertionError(f"timed out waiting for {what}\n{logs}")

    def finish(self, workers: list[Worker], timeout: float = 60) -> None:
        for w in workers:
            w.proc.wait(timeout=timeout)

    def stop(self, workers: list[Worker], timeout: float = 60) -> None:
        """Ask workers to leave (SIGTERM, a preemption notice) and wait until they have."""
        for w in workers:
            if w.proc.poll() is None:
                w.signal(signal.SIGTERM)
        self.finish(workers, timeout)

    def stop_all(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGKILL)
                w.proc.wait()
            w.proc.stdout.close()


@pytest.fixture
def worker_swarm(tmp_path):
    swarm = WorkerSwarm(tmp_path)
    yield swarm
    swarm.stop_all()
