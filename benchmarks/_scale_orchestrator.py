"""The orchestrator at 1,000 instances: the fleet policy's tick, the run store's writes, the dashboard
and ``/metrics``, ``spotswarm status`` and ``spotswarm report``, against an in-memory cloud and a
run store filled by hand (no Ray).

1. Policy tick: a ``FleetPolicy`` over the tests' in-memory cloud (``tests/fakes``: launches and
   polls answered at once), a hand-advanced clock and a real run store (SQLite on disk), one node
   type of ``instances`` workers with a total budget (so every launch asks the budget).  The fleet
   is filled from nothing (``fleet_fill_s``, and the slowest tick of the fill), then ``ticks`` ticks
   are timed with 1 % of the fleet preempted before each (notice and kill: each timed tick records
   the ends, asks for replacements and collects the launches of the tick before).  Between ticks the
   benchmark waits, untimed, for the policy's pool calls, as a supervisor's 0.2-s period would.
2. Store writes: ``instances`` worker reports (each an instance update and an event, what a tick
   writes for a worker it heard from) in one ``RunStore.batch()``, the median of several batches;
   and the same writes one commit each, for comparison.
3. A stopped-looking run made live: ``instances`` live instances plus a tenth as many preempted
   ones, their events, and ``sample_rows`` progress rows (one per second of the run's clock),
   written with ``executemany``; this process claims the run (``up.pid``), so every reader treats
   it as up.  The dashboard is served as ``spotswarm dashboard`` serves it (``DashboardServer``) and
   each of its pages and ``/metrics`` is fetched over loopback HTTP (the first fetch of each, then
   the median of ``repeats``); ``spotswarm status`` and ``spotswarm report`` run in this process
   through the CLI's ``main`` (the first run, which imports what it needs, and then the median).
   Beside them, the report of a run of ten rows: what drawing its PNGs costs whatever the run's size.

    python benchmarks/_scale_orchestrator.py [--quick] [--instances N] [--sample-rows N]

``--quick``: 100,000 sample rows and 3 repeats (well under a minute).  Prints a table, then one JSON
line of figures.  ``benchmarks/bench_scale.py`` imports ``measure``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from _common import fmt, print_json, print_table  # noqa: E402

from orchestrator.config.schema import ClusterConfig  # noqa: E402
from orchestrator.fleet.policy import FleetPolicy  # noqa: E402
from orchestrator.runs import pid as run_pid  # noqa: E402
from orchestrator.runs.store import RunStore  # noqa: E402
from tests.fakes.clock import FakeClock  # noqa: E402
from tests.fakes.provider import FakeProvider  # noqa: E402
from tests.fakes.workers import FakeWorkers  # noqa: E402

NODE = "worker"
ZONES = ["a", "b", "c"]
SPOT = {"a": 0.30, "b": 0.35, "c": 0.40}
ON_DEMAND = 1.0
T0 = 1_000_000.0  # the run's clock at its first record
CALLS_LIMIT_S = 30.0  # the policy's pool calls answer in microseconds; past this something hangs
PAGES = ("/", "/api/summary", "/api/charts", "/api/series", "/api/instances", "/api/costs", "/api/experts")
HTTP_TIMEOUT_S = 60.0


def config_for(runs_dir: Path, instances: int) -> ClusterConfig:
    return ClusterConfig.model_validate({
        "cluster_name": "scale", "runs_dir": str(runs_dir),
        "provider": {"type": "local", "zones": ZONES},
        "available_node_types": {NODE: {"min_workers": instances, "max_workers": instances,
                                        "on_demand_price_per_hour": ON_DEMAND, "spot_price_per_hour": SPOT}},
        "budget": {"max_total_dollars": 1e9}, "dashboard": {"enabled": False},
    })


def _prices() -> dict[tuple[str, str, str], float]:
    table = {(NODE, z, "spot"): p for z, p in SPOT.items()}
    table.update({(NODE, z, "on-demand"): ON_DEMAND for z in ZONES})
    return table


def _wait_calls(policy: FleetPolicy) -> None:
    """Until every call the policy started (launches, placements, the poll) has finished."""
    deadline = time.monotonic() + CALLS_LIMIT_S
    while not policy.calls.all_done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the policy's calls did not finish in {CALLS_LIMIT_S:.0f} s")
        time.sleep(0.001)


def _timed_tick(policy: FleetPolicy) -> float:
    started = time.perf_counter()
    policy.tick()
    return time.perf_counter() - started


def measure_policy(base: Path, instances: int, ticks: int) -> dict[str, Any]:
    """The fill of an empty fleet, then ``ticks`` timed ticks under 1 % churn each."""
    config = config_for(base, instances)
    clock = FakeClock(T0)
    store = RunStore.create(config)
    store.clock = clock
    provider = FakeProvider(clock, _prices())
    workers = FakeWorkers()
    policy = FleetPolicy(config, provider, clock, store, workers, worker_args=lambda node_type: {"run": "scale"})
    try:
        fill, fill_ticks = [], 0
        started = time.perf_counter()
        while len(policy.live) < instances or not policy.calls.all_done():
            fill.append(_timed_tick(policy))
            fill_ticks += 1
            _wait_calls(policy)
            if fill_ticks > 100:
                raise RuntimeError(f"the fleet did not fill in 100 ticks: {len(policy.live)} of {instances}")
        fill_s = time.perf_counter() - started
        churn = max(instances // 100, 1)
        times = []
        for _ in range(ticks):
            clock.advance(1.0)
            for instance_id in sorted(policy.live)[:churn]:
                provider.notice(instance_id, clock(), clock() + 120.0)
                provider.kill(instance_id)
            _wait_calls(policy)
            policy.tick()  # collects the poll started by the last tick (nothing new in it) and starts one
            _wait_calls(policy)
            times.append(_timed_tick(policy))  # collects that poll: the churn, its replacements
        _wait_calls(policy)
        policy.tick()
        _wait_calls(policy)
        return {
            f"policy_tick_ms_{instances}": 1e3 * statistics.median(times),
            f"policy_tick_max_ms_{instances}": 1e3 * max(times),
            "policy_fill_s": fill_s, "policy_fill_ticks": fill_ticks,
            "policy_fill_tick_max_ms": 1e3 * max(fill),
            "policy_live_after": len(policy.live), "policy_ticks": len(times),
            "policy_store_instances": len(store.instances()),
        }
    finally:
        provider.gate.set()
        policy.shutdown()
        store.close()


def _reports(store: RunStore, instance_ids: list[str], at: float) -> None:
    """What a tick writes for each worker it heard from: its instance's row, and an event."""
    for instance_id in instance_ids:
        store.update_instance(instance_id, peer_id=f"peer-{instance_id}")
        store.event("report", instance_id, {"epoch": 1}, at=at)


def measure_store(base: Path, instances: int, rounds: int) -> dict[str, Any]:
    """``instances`` worker reports batched (median of ``rounds``) against the same one commit each."""
    store = RunStore.create(config_for(base, instances).model_copy(update={"cluster_name": "writes"}))
    try:
        ids = [f"w-{i:05d}" for i in range(instances)]
        with store.db:
            store.db.executemany("INSERT INTO instances VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                                 [(i, NODE, "a", "spot", 0.3, ON_DEMAND, T0, None, None, None, None) for i in ids])
        batched = []
        for r in range(rounds):
            started = time.perf_counter()
            with store.batch():
                _reports(store, ids, T0 + r)
            batched.append(time.perf_counter() - started)
        started = time.perf_counter()
        _reports(store, ids, T0 + rounds)
        one_by_one = time.perf_counter() - started
        return {f"store_report_batch_ms_{instances}": 1e3 * statistics.median(batched),
                f"store_report_unbatched_ms_{instances}": 1e3 * one_by_one}
    finally:
        store.close()


def fill_run(base: Path, instances: int, sample_rows: int) -> Path:
    """A run of ``sample_rows`` seconds: ``instances`` live instances launched in its first minutes,
    a tenth as many preempted along the way, one progress row per second; written with executemany."""
    config = config_for(base, instances).model_copy(update={"cluster_name": "filled"})
    store = RunStore.create(config)
    end = T0 + sample_rows
    # the clock a live run's readers rebuild "now" from: the run's end is this moment
    clock = {"clock": {"scale": 1.0, "wall0": time.time(), "origin": end}}
    rows, events = [], [(T0, "supervisor_start", None, json.dumps(clock))]
    gone = max(instances // 10, 1)
    for k in range(instances + gone):
        zone = ZONES[k % len(ZONES)]
        launched = T0 + k * 0.1
        ended = launched + (k + 1) * sample_rows / (gone + 1) * 0.9 if k < gone else None
        rows.append((f"filled-{NODE}-{k:05d}", NODE, zone, "spot", SPOT[zone], ON_DEMAND, launched,
                     None if ended is None else ended - 60, ended, None if ended is None else "preempted",
                     f"peer-{k}"))
        events.append((launched, "launch", rows[-1][0], json.dumps({"zone": zone})))
        if ended is not None:
            events += [(ended - 60, "notice", rows[-1][0], None), (ended, "preempted", rows[-1][0], None)]
    progress = ((T0 + s, s // 10, 2.0 / (1 + s / 1e4), 1000.0 + s % 7, instances, s * 32)
                for s in range(sample_rows))
    try:
        with store.db:
            store.db.executemany("INSERT INTO instances VALUES (?,?,?,?,?,?,?,?,?,?,?)", rows)
            store.db.executemany("INSERT INTO events VALUES (?,?,?,?)", sorted(events))
            store.db.executemany("INSERT INTO progress VALUES (?,?,?,?,?,?)", progress)
    finally:
        store.close()
    return config.run_dir()


def _fetch(url: str) -> tuple[float, int]:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as answer:
        size = len(answer.read())
    return time.perf_counter() - started, size


def _first_and_median(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Seconds of the first call, and the median of ``repeats`` more."""
    started = time.perf_counter()
    fn()
    first = time.perf_counter() - started
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return first, statistics.median(times)


def measure_dashboard(run_dir: Path, repeats: int) -> dict[str, Any]:
    """Each page and ``/metrics`` over loopback HTTP from the dashboard as ``spotswarm dashboard`` serves it."""
    from orchestrator.ui.dashboard import DashboardServer

    pages: dict[str, dict[str, float]] = {}
    with DashboardServer(run_dir) as server:
        for path in (*PAGES, "/metrics"):
            url = server.url.rstrip("/") + path
            size = _fetch(url)[1]
            first, med = _first_and_median(lambda u=url: _fetch(u), repeats)
            pages[path] = {"first_s": first, "median_s": med, "bytes": size}
    dashboard = [p for path, p in pages.items() if path != "/metrics"]
    return {"dashboard_max_s": max(max(p["first_s"], p["median_s"]) for p in dashboard),
            "metrics_s": max(pages["/metrics"]["first_s"], pages["/metrics"]["median_s"]), "pages": pages}


def _cli(argv: list[str]) -> None:
    from orchestrator.cli.main import main

    with contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    if code != 0:
        raise RuntimeError(f"spotswarm {' '.join(argv)} exited {code}")


def measure_cli(run_dir: Path, small_run: Path, out: Path, repeats: int) -> dict[str, Any]:
    """``spotswarm status`` and ``spotswarm report`` through the CLI's ``main``, in this process; and
    the report of a run of three instances and ten rows, the cost of drawing its PNGs alone."""
    status_first, status = _first_and_median(lambda: _cli(["status", str(run_dir)]), repeats)
    report_first, report = _first_and_median(lambda: _cli(["report", str(run_dir), "--out", str(out)]), repeats)
    _, small = _first_and_median(lambda: _cli(["report", str(small_run), "--out", str(out / "small")]), repeats)
    return {"status_s": status, "status_first_s": status_first, "report_s": report, "report_first_s": report_first,
            "report_small_run_s": small}


def measure(instances: int = 1000, sample_rows: int = 1_000_000, quick: bool = False) -> dict:
    """Every figure of this benchmark, in a temporary directory removed afterwards."""
    repeats = 3 if quick else 5
    figures: dict[str, Any] = {"instances": instances, "sample_rows": sample_rows}
    with tempfile.TemporaryDirectory(prefix="spotswarm-scale-") as tmp:
        base = Path(tmp)
        figures.update(measure_policy(base / "policy", instances, ticks=20 if quick else 40))
        figures.update(measure_store(base / "writes", instances, rounds=repeats))
        started = time.perf_counter()
        run_dir = fill_run(base / "filled", instances, sample_rows)
        figures["fill_store_s"] = time.perf_counter() - started
        small_run = fill_run(base / "small", 3, 10)
        for run in (run_dir, small_run):
            run_pid.claim(run)  # this process drives the run: every reader treats it as up
        try:
            figures.update(measure_dashboard(run_dir, repeats))
            figures.update(measure_cli(run_dir, small_run, base / "report", repeats))
        finally:
            for run in (run_dir, small_run):
                run_pid.release(run)
    return figures


def print_figures(f: dict) -> None:
    n = f["instances"]
    rows = [
        (f"policy tick, {n} live (median)", fmt(f[f"policy_tick_ms_{n}"], ".2f"), "ms", "target <= 50 ms"),
        (f"policy tick, {n} live (max)", fmt(f[f"policy_tick_max_ms_{n}"], ".2f"), "ms", ""),
        ("fleet filled from nothing", fmt(f["policy_fill_s"], ".2f"), "s", f"{f['policy_fill_ticks']} ticks"),
        ("slowest tick of the fill", fmt(f["policy_fill_tick_max_ms"], ".1f"), "ms", ""),
        (f"{n} worker reports, batched", fmt(f[f"store_report_batch_ms_{n}"], ".2f"), "ms", ""),
        (f"{n} worker reports, a commit each", fmt(f[f"store_report_unbatched_ms_{n}"], ".1f"), "ms", ""),
        (f"store filled ({f['sample_rows']:,} sample rows)", fmt(f["fill_store_s"], ".1f"), "s", ""),
    ]
    rows += [(f"GET {path} (first / median)", f"{p['first_s']:.3f} / {p['median_s']:.3f}", "s",
              f"{p['bytes']:,} bytes") for path, p in f["pages"].items()]
    rows += [("spotswarm status (first / median)", f"{f['status_first_s']:.3f} / {f['status_s']:.3f}", "s",
              "target < 1 s"),
             ("spotswarm report (first / median)", f"{f['report_first_s']:.3f} / {f['report_s']:.3f}", "s",
              "target < 1 s"),
             ("spotswarm report, a run of 10 rows (median)", f"{f['report_small_run_s']:.3f}", "s",
              "its PNGs alone")]
    print_table(["<44", ">16", "<4"], ["figure", "value", ""], rows, rule=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="100,000 sample rows, fewer repeats")
    parser.add_argument("--instances", type=int, default=1000)
    parser.add_argument("--sample-rows", type=int, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = args.sample_rows if args.sample_rows is not None else (100_000 if args.quick else 1_000_000)
    figures = measure(args.instances, rows, quick=args.quick)
    print_figures(figures)
    print_json({k: v for k, v in figures.items() if k != "pages"}
               | {"pages": {path: p["median_s"] for path, p in figures["pages"].items()}})


if __name__ == "__main__":
    main()
