"""What every benchmark does alike: child processes read with a deadline and killed with their whole
tree, figures formatted into tables, and the last line of JSON.

Standard library only when imported (Linux /proc): the scripts that the reference library's separate
virtualenv runs import it too.  Killing a child goes through ``orchestrator.host`` (psutil), imported
when a child is killed, which only this project's own scripts do.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BENCH_PY = os.path.join(ROOT, ".bench-venv", "bin", "python")  # `make bench-env`: the reference library
HIVEMIND_MISSING = f"hivemind skipped: {BENCH_PY} is missing (run `make bench-env`)"
# One thread per peer process: N peers share this machine's cores, on a real swarm each has its own.
ONE_THREAD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


# ---- figures -----------------------------------------------------------------------------------
def rounded(value: Any, digits: int = 3) -> Any:
    """Floats rounded, inside dicts and lists too: the JSON line stays readable."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v, digits) for v in value]
    return value


def print_json(figures: dict, digits: int = 4) -> None:
    """The benchmark's last line: one JSON object of its figures."""
    print(json.dumps(rounded(figures, digits)), flush=True)


def emit(obj: dict) -> None:
    """One JSON line to the parent (a child's protocol)."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def percentile(samples: Sequence[float], q: float) -> float | None:
    """The sample at rank ``q`` of the sorted samples (no interpolation); None without samples."""
    if not samples:
        return None
    s = sorted(samples)
    return s[min(len(s) - 1, int(len(s) * q))]


def median(samples: Sequence[float]) -> float | None:
    return statistics.median(samples) if samples else None


def fmt(value: Any, spec: str = ".3f") -> str:
    """A table cell: ``-`` for a figure that is missing."""
    return "-" if value is None else format(value, spec)


def print_table(specs: Sequence[str], header: Sequence[str], rows: Iterable[Sequence[Any]], *,
                note_sep: str = "   ", rule: bool = False) -> None:
    """Rows of cells padded by ``specs`` (``"<28"``, ``">10"``); the cells past them (a target, a
    verdict) follow ``note_sep`` as they are.  ``rule``: a line of dashes under the header."""
    def line(cells: Sequence[Any]) -> str:
        fixed = "".join(format(str(c), s) for c, s in zip(cells, specs, strict=False))
        return (fixed + note_sep + "".join(str(c) for c in cells[len(specs):])).rstrip()

    head = line(header)
    print(head)
    if rule:
        print("-" * len(head))
    for row in rows:
        print(line(row))


def guarded(name: str, fn: Callable[..., dict], *args: Any) -> dict:
    """One part's figures; a part that fails or runs past its limit is reported, the rest still run."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - whatever it was, the other parts still run
        return {f"{name}_error": f"{type(e).__name__}: {e}"}


def retry(fn: Callable[[], Any], tries: int = 3, pause_s: float = 1.0) -> Any:
    """``fn()``, tried again after a failure (a flaky start, such as ``ray.init``'s), ``tries`` times in all."""
    for attempt in range(tries):
        try:
            return fn()
        except Exception:
            if attempt == tries - 1:
                raise
            time.sleep(pause_s)  # a retry after a failed start, not synchronization


class WarningCounter(logging.Handler):
    """Counts warnings by ``key(record)`` instead of printing them (there are thousands under churn)."""

    def __init__(self, key: Callable[[logging.LogRecord], str]) -> None:
        super().__init__(logging.WARNING)
        self.key = key
        self.counts: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[self.key(record)] += 1


def exit_on_sigterm() -> None:
    """SIGTERM runs the ``finally`` blocks (children killed, namespaces removed) instead of dying at once."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


class PeakSampler:
    """Samples ``measure()`` every ``period`` seconds in a thread and keeps the peak."""

    def __init__(self, measure: Callable[[], int], period: float = 0.1) -> None:
        self.measure, self.period = measure, period
        self.peak = measure()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.peak = max(self.peak, self.measure())
            except Exception:  # noqa: BLE001 - the process is gone: the peak so far stands
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peak


# ---- process trees (Linux /proc) ---------------------------------------------------------------
def descendants(pid: int) -> list[int]:
    """Every process started (transitively) by ``pid`` that is still alive."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(x) for x in f.read().split()]
                out.extend(kids)
                todo.extend(kids)
        except (OSError, ValueError):
            pass
    return out


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name (field 3 onwards)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def start_time(pid: int) -> int | None:
    """When the process started (clock ticks since boot): tells it from a later one with its pid."""
    try:
        return int(_stat(pid)[19])
    except (OSError, IndexError, ValueError):
        return None


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds the processes used so far (those still alive)."""
    ticks = 0
    for pid in pids:
        try:
            fields = _stat(pid)
            ticks += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return ticks / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> dict[int, int | None]:
    """The process and its descendants, each with its start time (to recognise it later)."""
    return {p: start_time(p) for p in [pid, *descendants(pid)]}


def kill_tree(pid: int, known: dict[int, int | None] | None = None) -> None:
    """SIGKILL ``pid``, its process group (a session leader's), its tree, and every process of its tree
    as ``known`` earlier (``process_tree``) that left both, only while it is still the same process:
    ``orchestrator.host.processes.kill_tree``."""
    import psutil

    from orchestrator.host.processes import kill_tree as kill_processes

    remembered = []
    for p, started in (known or {}).items():
        if p != pid and start_time(p) == started:
            with contextlib.suppress(psutil.Error):
                remembered.append(psutil.Process(p))
    kill_processes(pid, remembered)


# ---- child processes ---------------------------------------------------------------------------
class ChildFailed(RuntimeError):
    """A child did not answer in time, or exited before it did."""


class ChildTimeout(ChildFailed):
    """A child did not answer in time."""


LIVE: list[Child] = []  # every child not killed yet: ``kill_all`` is the last resort


class Child:
    """A child process in its own session: lines in on stdin, lines out read by a thread, stderr to
    a log (``log_path``, or a temporary file), killed with its whole tree."""

    def __init__(self, name: str, argv: Sequence[str], *, env: dict | None = None, cwd: str | None = ROOT,
                 stdin: bool = True, log_path: str | None = None, quit_line: str | None = "quit") -> None:
        self.name, self.quit_line = name, quit_line
        self.log = open(log_path, "a+") if log_path else tempfile.TemporaryFile(mode="a+")
        self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=cwd,
                                     start_new_session=True)
        LIVE.append(self)
        self.killed = False
        self.known: dict[int, int | None] = {}
        self.noise: list[str] = []  # stdout lines that were not JSON
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)  # EOF

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def send(self, line: str) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (OSError, ValueError) as e:
            raise ChildFailed(f"{self.name}: cannot write to it ({e}){self.tail()}") from None

    def next_line(self, deadline: float, what: str = "answer") -> str | None:
        """The next stdout line, None once stdout closed; ChildTimeout past ``deadline``."""
        try:
            line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            raise ChildTimeout(f"{self.name}: no {what} in time{self.tail()}") from None
        if line is None:
            self.lines.put(None)
        return line

    def line(self, deadline: float, what: str = "answer") -> str:
        """The next stdout line; ChildFailed on timeout or exit."""
        line = self.next_line(deadline, what)
        if line is None:
            raise ChildFailed(f"{self.name}: exited (rc={self.proc.poll()}) before its {what}{self.tail()}")
        return line

    def recv(self, key: str, deadline: float) -> dict:
        """The next JSON message that has ``key`` (others are skipped); ChildFailed on timeout or exit."""
        while True:
            line = self.line(deadline, f"'{key}' message")
            try:
                obj = json.loads(line)
            except ValueError:
                self.noise.append(line)
                continue
            if isinstance(obj, dict) and key in obj:
                return obj

    def tail(self, n: int = 15) -> str:
        """The last lines of its stderr (and of what it printed that was not JSON), indented."""
        try:
            self.log.seek(0)
            lines = self.log.read().splitlines()[-n:] + self.noise[-5:]
        except (OSError, ValueError):
            lines = []
        return ("\n    " + "\n    ".join(lines)) if lines else ""

    def remember_tree(self) -> None:
        """Note its descendants now, so that those that leave its group are still killed."""
        self.known.update(process_tree(self.proc.pid))

    def ask_to_stop(self) -> None:
        """Its quit line, or (``quit_line`` None) the end of its stdin."""
        if not self.running or self.proc.stdin is None:
            return
        with contextlib.suppress(ChildFailed, OSError):
            if self.quit_line is None:
                self.proc.stdin.close()
            else:
                self.send(self.quit_line)

    def finish(self, deadline: float) -> None:
        """Wait for it until ``deadline``, then kill whatever is left of its tree."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        self.kill()

    def kill(self) -> None:
        if self.killed:  # its pid may be someone else's by now
            return
        self.killed = True
        kill_tree(self.proc.pid, self.known)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout):  # no ResourceWarning for a child we stopped
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self.log.close()
        if self in LIVE:
            LIVE.remove(self)


def stop_all(children: Sequence[Child], grace: float) -> None:
    """Ask every running child to stop at once, give them ``grace`` seconds together, kill the rest."""
    running = [c for c in children if c.running]
    for c in running:
        c.ask_to_stop()
    deadline = time.monotonic() + (grace if running else 0.0)
    for c in children:
        c.finish(deadline)


def kill_all() -> None:
    """Every child still alive, killed (the benchmark is ending, whatever happened)."""
    for child in list(LIVE):
        child.kill()


def run_for_json(name: str, argv: Sequence[str], limit_s: float, **child_args: Any) -> dict:
    """Run a child to its end within ``limit_s``; its last JSON line.  ChildFailed if it runs past the
    limit (it is killed) or prints none."""
    child = Child(name, argv, stdin=False, **child_args)
    deadline = time.monotonic() + limit_s
    last = None
    try:
        while (line := child.next_line(deadline)) is not None:
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    last = json.loads(line)
        child.finish(deadline)
    except ChildTimeout:
        raise ChildFailed(f"{name}: ran past its {limit_s:.0f} s limit and was stopped{child.tail()}") from None
    finally:
        tail = child.tail()
        child.kill()
    if last is None:
        raise ChildFailed(f"{name}: exited (rc={child.proc.returncode}) without a JSON line{tail}")
    return last
