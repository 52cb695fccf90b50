"""Invariants a run must keep whatever happened to it, checked from what it leaves behind: its store,
its checkpoints, its logs and the machine's process table.

A fault-injected run checks these while it runs and after it stops; each broken invariant is a
``Violation`` with the invariant's name and what exactly was wrong, so a report can count them by
kind.  Nothing here starts or stops anything.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from orchestrator.host.processes import processes_mentioning
from orchestrator.runs.checkpoints import checkpoint_directory, checkpoint_epoch
from orchestrator.runs.figures import cost_breakdown
from orchestrator.runs.logs import LOG_DIR, RAY_DRIVER_LOG, SUPERVISOR_LOG, log_files
from orchestrator.runs.store import RunStore, summarize_costs

COST_TOLERANCE = 1e-9  # dollars: the breakdown and the total are the same sums in another order
TRACEBACK = "Traceback (most recent call last):"
ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL)\b")


@dataclass(frozen=True)
class Violation:
    invariant: str  # store | checkpoints | stall | recovery | leaks | logs | tracebacks | equal_params
    detail: str


def store_unreadable(run_dir: Path) -> Violation | None:
    """Why the run store cannot be read (it does not open, or fails SQLite's integrity check); None if it can."""
    path = run_dir / "run.sqlite"
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as db:
            (verdict,) = db.execute("PRAGMA integrity_check").fetchone()
    except (sqlite3.Error, OSError) as e:
        return Violation("store", f"{path} unreadable: {e}")
    return None if verdict == "ok" else Violation("store", f"{path} fails its integrity check: {verdict}")


def check_store(store: RunStore, stopped: bool) -> list[Violation]:
    """A readable run store adds up: instance times in order, every instance closed once the run
    stopped, the cost breakdown summing to the total."""
    out: list[Violation] = []
    instances = store.instances()
    now = store.last_time() or 0.0
    for i in instances:
        if i.ended_at is not None and i.ended_at < i.launched_at:
            out.append(Violation("store", f"instance {i.id} ended ({i.ended_at}) before its launch ({i.launched_at})"))
        if stopped and i.ended_at is None:
            out.append(Violation("store", f"instance {i.id} still open after the run stopped"))
        if i.ended_at is not None and i.end_reason is None:
            out.append(Violation("store", f"instance {i.id} ended without a reason"))
    total = summarize_costs(store, now).dollars
    parts = sum(g.dollars for g in cost_breakdown(instances, now))
    if abs(total - parts) > COST_TOLERANCE:
        out.append(Violation("store", f"cost breakdown sums to ${parts:.9f}, the total is ${total:.9f}"))
    return out


def supervisor_downtimes(store: RunStore) -> list[tuple[float, float]]:
    """The intervals in which no supervisor ran (stopped, or killed, then resumed): from the last
    progress row before each later supervisor start to that start.  Nobody records epochs then."""
    starts = [row[0] for row in store.events("supervisor_start")][1:]
    times = [row[0] for row in store.progress_rows()]
    out = []
    for start in starts:
        before = [t for t in times if t < start]
        if before:
            out.append((max(before), start))
    return out


def check_checkpoints(run_dir: Path) -> tuple[list[Violation], int]:
    """Every epoch checkpoint on disk loads as tensors and plain values (a crash mid-write never leaves
    a half-written file under a checkpoint's name); and how many there are."""
    out, files = [], sorted(checkpoint_directory(RunStore.read_config(run_dir), run_dir).glob("epoch-*.pt"))
    for path in files:
        try:
            checkpoint_epoch(path)
        except ValueError as e:
            out.append(Violation("checkpoints", str(e)))
    return out, len(files)


def stalls(times_and_epochs: Iterable[tuple[float, int]], excluded: Iterable[tuple[float, float]] = ()) -> list[float]:
    """Gaps between one new epoch and the next (in the store's clock), leaving out the parts of a gap
    inside ``excluded`` intervals (e.g. while the supervisor that writes progress was down)."""
    cuts = sorted(excluded)
    gaps, last_time, last_epoch = [], None, None
    for t, epoch in sorted(times_and_epochs):
        if last_epoch is not None and epoch <= last_epoch:
            continue
        if last_time is not None:
            overlap = sum(max(min(b, t) - max(a, last_time), 0.0) for a, b in cuts)
            gaps.append(t - last_time - overlap)
        last_time, last_epoch = t, epoch
    return gaps


def error_tracebacks(paths: Iterable[Path]) -> list[str]:
    """ERROR/CRITICAL log lines and Python tracebacks in these files, each as ``file:line: text``."""
    found = []
    for path in paths:
        with contextlib.suppress(OSError), open(path, errors="replace") as f:
            for number, line in enumerate(f, 1):
                if TRACEBACK in line or ERROR_LINE.search(line):
                    found.append(f"{path}:{number}: {line.strip()[:300]}")
    return found


def check_tracebacks(paths: Iterable[Path]) -> list[Violation]:
    return [Violation("tracebacks", line) for line in error_tracebacks(paths)]


def expected_logs(store: RunStore) -> list[str]:
    """The logs a run must have left in ``<run dir>/logs``: the supervisor's, once one ran, and, on the
    local provider (whose instances share this machine's disk), the worker's of every instance that
    trained (its first averaged step is on record).  A cloud instance's log is on its own disk."""
    names = [SUPERVISOR_LOG] if store.events("supervisor_start") else []
    if store.config().provider.type == "local":
        names += sorted({row[2] for row in store.events("first_step") if row[2]})
    return names


def run_logs(run_dir: Path) -> list[Path]:
    """Every log file of the run: ``*.log`` anywhere in the run directory and the rotated ones in ``logs/``
    (not Ray's console on the driver: its dumps for a node killed on purpose are not the run's errors)."""
    found = {*run_dir.rglob("*.log"), *(run_dir / LOG_DIR).glob("*.log.*")}
    return sorted(p for p in found if not p.name.startswith(RAY_DRIVER_LOG + ".log"))


def check_logs_present(run_dir: Path, names: Iterable[str]) -> list[Violation]:
    """A log that should be there and is not: a check that scanned nothing would pass anything."""
    return [Violation("logs", f"{run_dir / LOG_DIR / (name + '.log')} missing (expected for {name})")
            for name in names if not log_files(run_dir, name)]


def check_leaks(marker: str, exclude: Iterable[int] = ()) -> list[Violation]:
    """After a clean stop nothing of the run is left: no process names it (sockets die with them)."""
    return [Violation("leaks", f"pid {p.pid} still running: {' '.join(p.cmdline())[:200]}")
            for p in processes_mentioning(marker, exclude)]


@dataclass
class RunCheck:
    """What ``spotswarm check`` found in a run directory."""

    violations: list[Violation]
    max_stall_s: float  # the store's clock: simulated seconds with the local provider
    checkpoints: int
    logs: int

    @property
    def ok(self) -> bool:
        return not self.violations


def check_run(run_dir: Path, stopped: bool, stall_bound_s: float | None = None) -> RunCheck:
    """Every invariant that a run directory alone can show (a live run is checked as it is now)."""
    run_dir = Path(run_dir)
    if (unreadable := store_unreadable(run_dir)) is not None:
        return RunCheck([unreadable], 0.0, 0, 0)
    store = RunStore.open(run_dir)
    try:
        violations = check_store(store, stopped)
        rows = [(row[0], row[1]) for row in store.progress_rows()]
        worst = max(stalls(rows, supervisor_downtimes(store)), default=0.0)
        expected = expected_logs(store)
    finally:
        store.close()
    broken, checkpoints = check_checkpoints(run_dir)
    violations += broken
    if stall_bound_s is not None and worst > stall_bound_s:
        violations.append(Violation("stall", f"no new epoch for {worst:.1f} s (bound {stall_bound_s:g} s)"))
    logs = run_logs(run_dir)
    violations += check_logs_present(run_dir, expected)
    violations += check_tracebacks(logs)
    if stopped:  # nothing of a stopped run runs on (this check itself excepted)
        violations += check_leaks(str(run_dir.resolve()), exclude=[os.getpid()])
    return RunCheck(violations, worst, checkpoints, len(logs))


def stall_violation(rows: list[tuple[float, int]], downtimes: Iterable[tuple[float, float]], now: float,
                    bound_s: float) -> Violation | None:
    """A run whose longest gap between new epochs, the gap still open at ``now`` included, passed
    ``bound_s`` (the supervisor's downtimes left out); None while it keeps the bound."""
    if not rows:
        return None
    worst = max(stalls(list(rows) + [(now, rows[-1][1] + 1)], downtimes), default=0.0)
    if worst <= bound_s:
        return None
    return Violation("stall", f"no new epoch for {worst:.1f} s (bound {bound_s:g} s)")


class CheckpointWatch:
    """Checks each checkpoint file of a running run once, as it appears."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.checked: set[str] = set()

    def check_new(self) -> list[Violation]:
        out = []
        for path in sorted(self.directory.glob("epoch-*.pt")):
            if path.name in self.checked:
                continue
            self.checked.add(path.name)
            try:
                checkpoint_epoch(path)
            except ValueError as e:
                if path.exists():  # not rotated away while it was read
                    out.append(Violation("checkpoints", str(e)))
        return out


class ParamsAgreement:
    """Peers that completed the same epoch hold the same parameters (their digests after it), for
    peers that trained at the same time.  After the whole fleet was lost, the next one continues from
    the newest checkpoint and completes again epochs the lost fleet had completed: that is a rollback
    (the work since the checkpoint is lost), counted apart, not a divergence."""

    def __init__(self) -> None:
        # epoch -> peer -> (parameter digest, all-reduce group, when it completed the epoch)
        self.digests: dict[int, dict[str, tuple[str, str, float]]] = {}
        self.last_seen: dict[str, float] = {}  # peer -> its newest epoch record's time
        self.rolled_back: set[int] = set()  # epochs completed again after the whole fleet was lost
        self.diverged: set[int] = set()  # epochs already reported as violations (histories are read whole)

    def observe(self, peer: str, history: Iterable[dict]) -> None:
        """A peer's epoch records (``epoch``, ``params``, ``group``, ``time``)."""
        for record in history:
            if "params" not in record or record["epoch"] in self.diverged:
                continue
            seen = self.digests.setdefault(record["epoch"], {})
            seen[peer] = (record["params"], record.get("group") or "-", record["time"])
            self.last_seen[peer] = max(self.last_seen.get(peer, 0.0), record["time"])

    def judge(self) -> list[Violation]:
        """Each epoch whose peers disagree: a violation (reported once) if two of them trained together."""
        out = []
        for epoch, by_peer in list(self.digests.items()):
            if len({digest for digest, _, _ in by_peer.values()}) < 2:
                continue
            pairs = [(a, b) for a in by_peer for b in by_peer if a < b and by_peer[a][0] != by_peer[b][0]]
            together = [(a, b) for a, b in pairs  # each still training when the other completed the epoch
                        if min(self.last_seen[a], self.last_seen[b]) >= max(by_peer[a][2], by_peer[b][2])]
            detail = {i: f"{d} (group {g})" for i, (d, g, _) in by_peer.items()}
            if together:
                self.diverged.add(epoch)
                self.rolled_back.discard(epoch)
                out.append(Violation("equal_params", f"after epoch {epoch} peers hold different "
                                                     f"parameters: {json.dumps(detail)}"))
            else:
                self.rolled_back.add(epoch)
            self.digests[epoch] = {}  # judged again on the next read: what looked a rollback may prove not one
        return out
