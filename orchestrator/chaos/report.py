"""A chaos run's report: the faults injected (each with the phase its target was in), the invariants
broken, and the summary figures, saved as ``chaos.json`` in the run directory (the dashboard's chaos
page reads it) and printed by ``spotswarm chaos``."""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from contextlib import closing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.chaos.faults import Fault
from orchestrator.runs.chaos_report import FAULT_KINDS, PHASES, REPORT
from orchestrator.runs.invariants import Violation, stalls, supervisor_downtimes
from orchestrator.runs.store import RunStore

logger = logging.getLogger(__name__)


@dataclass
class ChaosReport:
    seed: int
    config: str
    cluster: str
    started_at: float
    duration_s: float
    state: str = "running"
    ended_at: float | None = None
    faults: list[Fault] = field(default_factory=list)
    violations: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    recovery_s: float | None = None  # from the last fault's end to the fleet's second epoch after it

    def violate(self, v: Violation) -> None:
        logger.warning("invariant %s broken: %s", v.invariant, v.detail)
        self.violations.append({"time": time.time(), "invariant": v.invariant, "detail": v.detail})

    def to_json(self) -> dict:
        return {"version": 1, **asdict(self)}


def save_report(report: ChaosReport, run_dir: Path) -> None:
    """Best effort while the run goes on (the disk may be full); the last one always lands."""
    path = run_dir / REPORT
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(report.to_json(), indent=1))
        tmp.replace(path)
    except OSError as e:
        logger.info("chaos report not saved now: %s", e)
        tmp.unlink(missing_ok=True)


def summarize(report: ChaosReport, run_dir: Path, max_stall_s: float, rolled_back: int) -> dict:
    """The run's figures from its store, with the report's faults and violations counted."""
    with closing(RunStore.open(run_dir)) as store:
        rows = [(row[0], row[1]) for row in store.progress_rows()]
        gaps = stalls(rows, supervisor_downtimes(store))
        samples = store.db.execute("SELECT MAX(samples), MIN(time), MAX(time) FROM progress").fetchone()
    injected = [f for f in report.faults if f.outcome == "injected"]
    span = (samples[2] - samples[1]) if samples and samples[1] is not None else 0.0
    return {
        "faults": len(injected), "skipped": len(report.faults) - len(injected),
        "invariant_violations": len(report.violations),
        "error_tracebacks": sum(v["invariant"] == "tracebacks" for v in report.violations),
        "max_stall_s": round(max_stall_s, 2), "p99_stall_s": round(_percentile(gaps, 99), 2),
        "epochs": rows[-1][1] if rows else 0, "samples": int(samples[0] or 0) if samples else 0,
        "samples_per_second": round(samples[0] / span, 2) if span > 0 and samples[0] else 0.0,
        "retained": None, "rolled_back_epochs": rolled_back, "recovery_s": report.recovery_s,
        "by_kind": dict(Counter(f.kind for f in injected)), "by_phase": dict(Counter(f.phase for f in injected)),
    }


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)]


def print_report(report: ChaosReport, console: Any) -> None:
    """The report as the chaos command prints it: faults by kind and phase, then any violation."""
    from rich.table import Table

    summary = report.summary
    table = Table(title=f"chaos run {report.cluster} (seed {report.seed}): faults by kind and phase")
    phases = PHASES
    table.add_column("kind", no_wrap=True)
    narrow = {"matchmaking": "match-\nmaking", "all-reduce": "all-\nreduce", "state download": "state\ndownload",
              "checkpoint write": "check-\npoint\nwrite"}  # fits an 80-column terminal
    for phase in phases:
        table.add_column(narrow.get(phase, phase), justify="right")
    table.add_column("skip-\nped", justify="right")
    for kind in FAULT_KINDS:
        hits = [f for f in report.faults if f.kind == kind]
        table.add_row(kind, *(str(sum(f.phase == p and f.outcome == "injected" for f in hits)) for p in phases),
                      str(sum(f.outcome != "injected" for f in hits)))
    console.print(table)
    console.print(f"faults {summary.get('faults')}, invariant violations {summary.get('invariant_violations')}, "
                  f"error tracebacks {summary.get('error_tracebacks')}, max stall {summary.get('max_stall_s')} s, "
                  f"p99 stall {summary.get('p99_stall_s')} s, recovered {summary.get('recovery_s')} s after "
                  f"the last fault, {summary.get('epochs')} epochs, "
                  f"{summary.get('samples_per_second')} samples/s")
    for v in report.violations:
        console.print(f"[red]{v['invariant']}[/]: {v['detail']}")
    for f in report.faults:
        if f.outcome != "injected":
            console.print(f"{f.kind}: {f.outcome}")
