"""Training peers as real processes (``spotswarm worker``, forked from a preloaded interpreter: see
``zygote.py``), read through their reports."""

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


class _Lines:
    """A forked worker's stdout, a file it writes: ``readline`` waits for a whole line."""

    def __init__(self, path: Path, proc: ForkedProcess) -> None:
        self.path, self.proc, self.offset = path, proc, 0

    def readline(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.path.read_text() if self.path.exists() else ""
            end = text.find("\n", self.offset)
            if end >= 0:
                line, self.offset = text[self.offset:end + 1], end + 1
                return line
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return text[self.offset:]  # what it wrote before it ended (or stalled), as a pipe would give
            time.sleep(0.02)


class ForkedProcess:
    """What the tests use of ``subprocess.Popen``, for a child of the zygote (whose exit code the
    zygote writes to a file, being its parent)."""

    def __init__(self, pid: int, stdout: Path, exit_file: Path) -> None:
        self.pid, self.exit_file = pid, exit_file
        self.returncode: int | None = None
        self.stdout = _Lines(stdout, self)

    def poll(self) -> int | None:
        if self.returncode is None and self.exit_file.exists():
            self.returncode = int(self.exit_file.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never signal a pid that may have been reused
            os.kill(self.pid, sig)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


class Zygote:
    """The preloaded interpreter of ``zygote.py``: one per test session, forking every worker."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("zygote.py"))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                     env={**_env(), **(env or {})})

    def fork(self, argv: list[str], stdout: Path, stderr: Path, cwd: Path) -> ForkedProcess:
        exit_file = stdout.with_suffix(".exit")
        command = {"argv": argv, "stdout": str(stdout), "stderr": str(stderr), "exit": str(exit_file),
                   "cwd": str(cwd), "env": _env()}
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        assert answer, f"the zygote died (exit code {self.proc.wait(timeout=30)})"
        return ForkedProcess(json.loads(answer)["pid"], stdout, exit_file)

    def close(self) -> None:
        self.proc.stdin.close()  # it kills what still runs and exits
        self.proc.wait(timeout=60)
        self.proc.stdout.close()


class Worker:
    def __init__(self, proc: ForkedProcess, report: Path, log: Path) -> None:
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
    def __init__(self, tmp: Path, zygote: Zygote) -> None:
        self.tmp, self.zygote = tmp, zygote
        self.workers: list[Worker] = []

    def start(self, *args: str, initial: Worker | None = None, **options) -> Worker:
        return self.start_many(1, *args, initial=initial, **options)[0]

    def start_many(self, count: int, *args: str, initial: Worker | None = None, **options) -> list[Worker]:
        """``count`` workers with the same settings, launched at once and returned when every one of
        them listens."""
        launched = [self._launch(*args, initial=initial, **options) for _ in range(count)]
        for worker in launched:
            line = worker.proc.stdout.readline(timeout=120)
            assert line.startswith("worker "), f"worker did not start: {line!r}\n{worker.stderr()}"
            worker.address = line.split()[-1]
        return launched

    def _launch(self, *args: str, initial: Worker | None = None, **options) -> Worker:
        n = len(self.workers)
        report, log, out = self.tmp / f"w{n}.jsonl", self.tmp / f"w{n}.log", self.tmp / f"w{n}.out"
        argv = ["worker", "--run", "test", "--report-file", str(report), "--seed", str(n), *args]
        for key, value in options.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        if initial is not None:
            argv += ["--initial-peers", initial.address]
        proc = self.zygote.fork(argv, stdout=out, stderr=log, cwd=ROOT)
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

    def assert_succeeded(self, workers: list[Worker]) -> None:
        """Every one exited 0; otherwise name each that did not, with the end of its log."""
        failed = [f"--- worker {self.workers.index(w)}: exit code {w.proc.poll()}\n{w.stderr()[-3000:]}"
                  for w in workers if w.proc.poll() != 0]
        assert not failed, "\n".join(failed)

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
                w.proc.wait(timeout=30)


@pytest.fixture(scope="session")
def zygote():
    forks = Zygote()
    yield forks
    forks.close()


@pytest.fixture
def execing_zygote():
    """A zygote whose children exec a fresh interpreter, as where its preload started CUDA."""
    forks = Zygote({"ZYGOTE_EXEC": "1"})
    yield forks
    forks.close()


@pytest.fixture
def worker_swarm(tmp_path, zygote):
    swarm = WorkerSwarm(tmp_path, zygote)
    yield swarm
    swarm.stop_all()
