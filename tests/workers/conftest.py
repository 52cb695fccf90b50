"""Training peers as real processes (``spotswarm worker``, forked from the simulator's warm image: see
``orchestrator/instance/warm_image.py``), read through their reports."""

from __future__ import annotations

import json
import os
import signal
from contextlib import suppress
from pathlib import Path

import pytest

from orchestrator.host.wait import wait_for
from orchestrator.instance.warm_image import ForkedCommand, WarmImage

ROOT = Path(__file__).resolve().parent.parent.parent


class _Lines:
    """A forked worker's stdout, a file it writes: ``readline`` waits for a whole line."""

    def __init__(self, path: Path, proc: ForkedCommand) -> None:
        self.path, self.proc, self.offset = path, proc, 0

    def _text(self) -> str:
        return self.path.read_text() if self.path.exists() else ""

    def readline(self, timeout: float) -> str:
        """The next line; what it wrote before it ended (or stalled), as a pipe would give."""
        with suppress(TimeoutError):
            wait_for(lambda: "\n" in self._text()[self.offset:] or self.proc.poll() is not None, timeout,
                     "a line", every=0.02)
        text = self._text()
        end = text.find("\n", self.offset)
        line = text[self.offset:end + 1] if end >= 0 else text[self.offset:]
        self.offset += len(line)
        return line


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


class Worker:
    def __init__(self, proc: ForkedCommand, out: Path, report: Path, log: Path) -> None:
        self.proc, self.report, self.log = proc, report, log
        self.stdout = _Lines(out, proc)
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
    def __init__(self, tmp: Path, image: WarmImage) -> None:
        self.tmp, self.image = tmp, image
        self.workers: list[Worker] = []

    def start(self, *args: str, initial: Worker | None = None, **options) -> Worker:
        return self.start_many(1, *args, initial=initial, **options)[0]

    def start_many(self, count: int, *args: str, initial: Worker | None = None, **options) -> list[Worker]:
        """``count`` workers with the same settings, launched at once and returned when every one of
        them listens."""
        launched = [self._launch(*args, initial=initial, **options) for _ in range(count)]
        for worker in launched:
            line = worker.stdout.readline(timeout=120)
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
        proc = ForkedCommand(self.image.path, "orchestrator.cli.main", argv, stdout=out, stderr=log, cwd=ROOT,
                             env=_env())
        worker = Worker(proc, out, report, log)
        self.workers.append(worker)  # before it listens: stop_all ends it whatever happens next
        return worker

    def wait(self, predicate, timeout: float, what: str) -> None:
        """Poll a condition on the workers' reports (not a sleep: it returns as soon as it holds); on
        timeout, the end of every worker's log."""
        try:
            wait_for(predicate, timeout, what)
        except TimeoutError as e:
            logs = "\n".join(f"--- worker {i}\n{w.stderr()[-3000:]}" for i, w in enumerate(self.workers))
            raise AssertionError(f"{e}\n{logs}") from None

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
def warm_image():
    """One image per test session, forking every worker (each starts in milliseconds, not after a
    fresh interpreter's seconds of imports); on a machine where its preload started CUDA, each is a
    fresh interpreter exec'd in the fork instead."""
    image = WarmImage(_env())
    yield image
    image.close()


@pytest.fixture
def worker_swarm(tmp_path, warm_image):
    swarm = WorkerSwarm(tmp_path, warm_image)
    yield swarm
    swarm.stop_all()
