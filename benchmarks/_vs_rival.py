"""What the head-to-head benchmarks share (``bench_vs_raytrain.py``, ``bench_vs_torchft.py``): the
preemption trace, spotswarm's contender, a rival's child run to its target, the figures, the table
and the plot.

The trace is one exponential lifetime per launch, in launch order (``random.Random(--seed)``), mean
L x E for each L in ``--lifetimes``; E is one global step of the rival's no-preemption run (real
seconds).  Every instance, replacements included, is usable ``--provisioning-s`` after its launch,
lives its lifetime from then on and costs from then to its end ($0.30/h, a spot price).  Every
micro-batch sleeps ``--device-ms`` for an accelerator step, in every contender, so each instance
brings its own capacity although all share this machine's cores.

spotswarm's contender is the supervisor with the local provider (actors mode) replaying the trace,
in a child process (``python _vs_rival.py --child ...``): instances train with the collaborative
optimizer (target batch = the global batch); a preempted instance gets its notice ``--notice-s``
before the kill and leaves; its replacement is launched at the notice.

A rival's child appends JSON lines to a log (``launch``, ``arrive``, ``kill`` from its fleet,
``start`` and ``step`` from its workers); the parent reads it, stops the child through a stop file
once the target loss is reached, and kills its whole process tree at the end.  A contender that
trains no step within its limit is an error naming the last lines of its stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import logging
import os
import random
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from _common import BENCH_PY, ChildFailed, emit, fmt, kill_tree, print_table, process_tree, run_for_json  # noqa: E402

PRICE_PER_HOUR = 0.30  # spot, per instance, every contender
TIME_SCALE = 10.0  # the supervisor's simulated seconds per real second
SMOOTH = 5  # steps averaged for "the loss now"
STDERR_TAIL = 2000  # characters of a failed child's stderr quoted in its error


def smoothed(losses: list[float]) -> float | None:
    return statistics.fmean(losses[-SMOOTH:]) if len(losses) >= SMOOTH else None


def trace(seed: int, mean_s: float, n: int = 500) -> list[float]:
    rng = random.Random(seed)
    return [rng.expovariate(1.0 / mean_s) for _ in range(n)]


def global_batch(args: argparse.Namespace) -> int:
    return args.workers * args.accum * args.batch_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every head-to-head benchmark takes (the fleet, the task, the trace, the budget)."""
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--task", choices=["charlm", "synthetic"], default="charlm")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="per micro-batch")
    parser.add_argument("--accum", type=int, default=24, help="micro-batches per worker per global step")
    parser.add_argument("--device-ms", type=float, default=60.0, help="sleep per micro-batch (an accelerator step)")
    parser.add_argument("--lifetimes", default="10,20,50", help="mean instance lifetimes, in global steps E")
    parser.add_argument("--budget-s", type=float, default=150.0, help="the no-preemption runs' time; sets the target")
    parser.add_argument("--limit-factor", type=float, default=3.0, help="a preempted run's limit, x budget")
    parser.add_argument("--provisioning-s", type=float, default=3.0)
    parser.add_argument("--notice-s", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--plot", default=None, help="write the loss curves at L20 here (PNG; needs .bench-venv)")


# ---- ours: a supervisor in a child process -----------------------------------------------------
def ours_config(base: Path, args: argparse.Namespace, trace_file: Path | None) -> Any:
    from orchestrator.config.schema import ClusterConfig

    # no warm image: every worker imports torch for itself, as the rivals' (re)started workers do
    provider: dict[str, Any] = {"type": "local", "zones": ["a"], "time_scale": TIME_SCALE,
                                "provisioning_delay_s": args.provisioning_s * TIME_SCALE, "seed": args.seed,
                                "warm_image": False}
    if trace_file is not None:
        provider["trace_file"] = str(trace_file)
    return ClusterConfig.model_validate({
        "cluster_name": "ours", "runs_dir": str(base), "provider": provider,
        "available_node_types": {"gpu": {
            "min_workers": args.workers, "max_workers": args.workers, "resources": {"CPU": 1},
            "on_demand_price_per_hour": 1.0, "spot_price_per_hour": {"a": PRICE_PER_HOUR},
            "preemption": {"distribution": "none"}}},
        "spot": {"market": "spot", "notice_period_s": args.notice_s * TIME_SCALE, "fallback_to_on_demand_after": None},
        "training": {"task": f"_preemption_task:{args.task}_device_{int(args.device_ms)}",
                     "task_options": {"batch_size": args.batch_size}, "target_batch_size": global_batch(args),
                     "averaging": "collaborative", "compression": "none", "averaging_timeout_s": 20.0,
                     "min_matchmaking_time_s": 1.0},
        "checkpoint": {"every_s": 1e6},
        "dashboard": {"enabled": False},
    })


def write_trace_csv(path: Path, lifetimes: list[float], notice_s: float) -> None:
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["notice_after_s", "kill_after_s"])
        for life in lifetimes:
            out.writerow([max(life - notice_s, 0.0) * TIME_SCALE, life * TIME_SCALE])


def ours_child(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.WARNING)
    from orchestrator.fleet.ray_session import start_ray
    from orchestrator.fleet.supervisor import SupervisorCore
    from orchestrator.runs.store import RunStore

    base = Path(tempfile.mkdtemp(prefix="bench-vs-rival-"))
    trace_file = None
    if args.trace:
        trace_file = base / "trace.csv"
        write_trace_csv(trace_file, json.loads(Path(args.trace).read_text()), args.notice_s)
    config = ours_config(base, args, trace_file)
    start_ray()
    RunStore.create(config).close()
    run_dir = config.run_dir()
    core = SupervisorCore(config, run_dir)
    started = time.monotonic()
    core.start()
    try:
        while time.monotonic() - started < args.limit_s:
            losses = [r[0] for r in _rows(run_dir, "SELECT loss FROM progress WHERE loss IS NOT NULL ORDER BY epoch")]
            now = smoothed(losses)
            if args.target is not None and now is not None and now <= args.target:
                break
            if args.target is None and time.monotonic() - started >= args.budget_s:
                break
            time.sleep(0.5)  # polling the run store
    finally:
        core.stop()
    first = _rows(run_dir, "SELECT MIN(launched_at) FROM instances")[0][0]

    def real(t: float) -> float:
        return (t - first) / TIME_SCALE

    steps = [(real(t), e, loss) for t, e, loss in
             _rows(run_dir, "SELECT time, epoch, loss FROM progress WHERE loss IS NOT NULL ORDER BY epoch")]
    instances = [(real(a), None if b is None else real(b), reason, i) for i, a, b, reason in
                 _rows(run_dir, "SELECT id, launched_at, ended_at, end_reason FROM instances ORDER BY launched_at")]
    first_steps = {i: real(t) for t, i in
                   _rows(run_dir, "SELECT time, instance_id FROM events WHERE kind = 'first_step'")}
    emit({"steps": steps, "instances": instances, "first_steps": first_steps})
    shutil.rmtree(base, ignore_errors=True)


def _rows(run_dir: Path, sql: str) -> list:
    with contextlib.closing(sqlite3.connect(f"file:{run_dir / 'run.sqlite'}?mode=ro", uri=True, timeout=30)) as db:
        return db.execute(sql).fetchall()


def run_ours(args: argparse.Namespace, lifetimes: list[float] | None, target: float | None, limit_s: float) -> dict:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", *child_flags(args),
            "--limit-s", str(limit_s), "--budget-s", str(args.budget_s)]
    with tempfile.TemporaryDirectory() as d:
        if lifetimes is not None:
            Path(d, "trace.json").write_text(json.dumps(lifetimes))
            argv += ["--trace", str(Path(d, "trace.json"))]
        if target is not None:
            argv += ["--target", str(target)]
        raw = run_for_json("ours", argv, limit_s + 120, log_path=str(Path(d, "stderr")))
        steps = [(t, e, loss) for t, e, loss in raw["steps"]]
        if not steps:
            raise ChildFailed(f"ours trained no step in {limit_s:.0f} s; the end of its stderr:\n"
                              f"{stderr_tail(Path(d, 'stderr'))}")
    instances = [(a, b) for a, b, *_ in raw["instances"]]
    kills = [b for _, b, reason, _ in raw["instances"] if reason == "preempted" and b is not None]
    # a replacement (any instance after the first fleet) arrives at its launch: the provisioning came before
    joins = [raw["first_steps"][i] - a for a, _, _, i in raw["instances"][args.workers:] if i in raw["first_steps"]]
    out = summarize("ours", steps, instances, target, args, kills=len(kills), lost_steps=None, restarts=0)
    out.update(recovery([t for t, _, _ in steps], kills, joins))
    return out


def child_flags(args: argparse.Namespace) -> list[str]:
    return ["--task", args.task, "--workers", str(args.workers), "--batch-size", str(args.batch_size),
            "--accum", str(args.accum), "--device-ms", str(args.device_ms),
            "--provisioning-s", str(args.provisioning_s), "--notice-s", str(args.notice_s), "--seed", str(args.seed)]


# ---- a rival: its own virtualenv -----------------------------------------------------------------
def run_rival(name: str, script: str, flags: list[str], args: argparse.Namespace, lifetimes: list[float] | None,
              target: float | None, limit_s: float, env: dict[str, str] | None = None) -> list[dict]:
    """Run a rival's child (``script`` in the benchmark virtualenv) until the target or its limit; the
    records of its log.  ChildFailed, with the last lines of its stderr, if it trained no step."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as d:
        log, stop, stderr = Path(d, "log.jsonl"), Path(d, "stop"), Path(d, "stderr")
        argv = [BENCH_PY, str(HERE / script), "--root", str(ROOT), "--task", args.task,
                "--batch-size", str(args.batch_size), "--workers", str(args.workers), "--accum", str(args.accum),
                "--device-ms", str(args.device_ms), "--provisioning-s", str(args.provisioning_s), "--log", str(log),
                "--stop-file", str(stop), "--limit-s", str(limit_s), *flags]
        if lifetimes is not None:
            Path(d, "trace.json").write_text(json.dumps(lifetimes))
            argv += ["--trace", str(Path(d, "trace.json"))]
        env = {**os.environ, "PYTHONPATH": str(HERE), "OMP_NUM_THREADS": "1", **(env or {})}
        with stderr.open("wb") as err:
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True, env=env,
                                    cwd=d)
        started, known, timed_out = time.monotonic(), {}, False
        try:
            while proc.poll() is None:
                known.update(process_tree(proc.pid))
                records = read_log(log)
                losses = [loss for _, _, loss in global_steps(records)]
                now = smoothed(losses)
                budget_spent = bool(losses) and time.time() - records[0]["t"] >= args.budget_s  # from the first launch
                if (target is not None and now is not None and now <= target) or (target is None and budget_spent):
                    stop.touch()
                if time.monotonic() - started > limit_s + 90:  # it did not stop at its own limit: killed, and said so
                    timed_out = True
                    break
                time.sleep(0.5)  # polling the log
        finally:
            kill_tree(proc.pid, known)
            proc.wait()
        records = read_log(log)
        if not any(r["kind"] == "step" for r in records):
            killed = " (killed past its limit)" if timed_out else ""
            raise ChildFailed(f"{name} trained no step in {limit_s:.0f} s{killed}; the end of its stderr:\n"
                              f"{stderr_tail(stderr)}")
    for r in records:
        r["timed_out"] = timed_out
    return records


def stderr_tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace")[-STDERR_TAIL:].splitlines()[-lines:]) if path.exists() else ""


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def global_steps(records: list[dict]) -> list[tuple[float, int, float]]:
    """(time, step, loss) per step of the whole fleet: a step's first report, with the mean loss of the
    workers that took part in it (one report a step for Ray Train; one per replica for torchft, where a
    replica still healing reports the loss of the model it had before the recovery)."""
    by_step: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        if r["kind"] == "step" and r.get("committed", True) and r.get("participating", True):
            by_step[r["step"]].append(r)
    return sorted((min(r["t"] for r in rs), step, statistics.fmean(r["loss"] for r in rs))
                  for step, rs in by_step.items())


def rival_summary(name: str, records: list[dict], target: float | None, args: argparse.Namespace) -> dict:
    """The figures of a rival's run, its times from the first fleet's arrival (as spotswarm's are)."""
    launches = [r for r in records if r["kind"] == "launch"]
    t0 = min(r["usable"] for r in launches)
    steps = [(t - t0, step, loss) for t, step, loss in global_steps(records)]
    kills = [r["t"] - t0 for r in records if r["kind"] == "kill"]
    restarts, lost, best = -1, 0, 0
    for r in sorted(records, key=lambda r: r["t"]):
        if r["kind"] == "start" and "slot" not in r:  # a whole group (re)started from a checkpoint
            restarts += 1
            lost += max(best - r["step"], 0)
        elif r["kind"] == "step":
            best = max(best, r["step"])
    instances = [(r["usable"] - t0, r["usable"] - t0 + r["lifetime"]) for r in launches]
    out = summarize(name, steps, instances, target, args, kills=len(kills),
                    lost_steps=lost if restarts >= 0 else None, restarts=max(restarts, 0))
    out.update(recovery([t for t, _, _ in steps], kills, [j for j in joined(records) if j is not None]))
    out["timed_out"] = records[-1].get("timed_out", False)
    out["uncommitted_steps"] = sum(1 for r in records if r["kind"] == "step" and r.get("committed") is False)
    return out


def joined(records: list[dict]) -> list[float | None]:
    """Per replacement (an arrival after its slot's first): from its arrival to the first step it took
    part in (its own steps where workers report with their slot, else the group's next step)."""
    seen: set[int] = set()
    out = []
    for arrival in (r for r in records if r["kind"] == "arrive"):
        if arrival["slot"] not in seen:
            seen.add(arrival["slot"])
            continue
        counted = (r["t"] for r in records if r["kind"] == "step" and r["t"] > arrival["t"]
                   and r.get("slot", arrival["slot"]) == arrival["slot"]
                   and r.get("committed", True) and r.get("participating", True))
        first = next(iter(sorted(counted)), None)
        out.append(None if first is None else first - arrival["t"])
    return out


def recovery(step_times: list[float], kills: list[float], joins: list[float]) -> dict:
    """How a contender rides a failure: from each kill to the fleet's next step (median), and from each
    replacement's arrival to its first step that counted (median)."""
    after = [next((t - k for t in step_times if t > k), None) for k in kills]
    gaps = [g for g in after if g is not None]
    return {"kill_to_next_step_s": statistics.median(gaps) if gaps else None, "kill_gaps": gaps,
            "join_to_first_step_s": statistics.median(joins) if joins else None, "joins": joins}


# ---- figures -------------------------------------------------------------------------------------
def summarize(name: str, steps: list[tuple[float, int, float]], instances: list[tuple[float, float | None]],
              target: float | None, args: argparse.Namespace, **extra: Any) -> dict:
    """Time, dollars and steps at the target (or at the end of the budget for a run without one)."""
    losses = [loss for _, _, loss in steps]
    best = max((step for _, step, _ in steps), default=0)
    reached_at, reached_step = reached(steps, target) or (None, None)
    end = reached_at if reached_at is not None else (steps[-1][0] if steps else None)
    dollars = None if end is None else dollars_at(instances, end)
    final_step = reached_step if reached_step is not None else best
    gaps = [b[0] - a[0] for a, b in zip(steps, steps[1:], strict=False) if b[1] == a[1] + 1]
    return {"name": name, "reached": reached_at is not None, "time_s": end, "dollars": dollars,
            "first_step_s": steps[0][0] if steps else None,
            "steps_done": final_step, "samples_per_second": final_step * global_batch(args) / end if end else None,
            "step_s": statistics.median(gaps) if gaps else None, "loss_now": smoothed(losses),
            "curve": [(round(t, 2), round(loss, 4)) for t, _, loss in steps],
            "instances": instances, **extra}


def dollars_at(instances: list[tuple[float, float | None]], t: float) -> float:
    """What the fleet cost up to ``t``: every instance from its arrival to its end (or ``t``)."""
    seconds = sum(max(min(end if end is not None else t, t) - launch, 0.0) for launch, end in instances)
    return seconds / 3600 * PRICE_PER_HOUR


def reached(steps: list[tuple[float, int, float]], target: float | None) -> tuple[float, int] | None:
    """When the smoothed loss first reached ``target``, and the furthest step done by then."""
    losses: list[float] = []
    best = 0
    for t, step, loss in steps:
        losses.append(loss)
        best = max(best, step)
        now = smoothed(losses)
        if target is not None and now is not None and now <= target:
            return t, best
    return None


def describe(run: dict | None, error: str | None) -> str:
    if run is None:
        return f"failed: {error}"
    return (f"{'reached' if run['reached'] else 'ended'} at {fmt(run['time_s'], '.1f')} s, {run['steps_done']} steps, "
            f"${fmt(run['dollars'], '.4f')}, loss {fmt(run['loss_now'], '.4f')}, kills {run.get('kills')}, "
            f"restarts {run.get('restarts')}, kill->next step {fmt(run.get('kill_to_next_step_s'), '.1f')} s, "
            f"join->first step {fmt(run.get('join_to_first_step_s'), '.1f')} s")


class Contest:
    """The runs of one benchmark: each attempted in turn, a failure recorded with its reason (the rest
    still run), the table printed at the end."""

    def __init__(self) -> None:
        self.runs: dict[str, dict | None] = {}
        self.errors: dict[str, str] = {}

    def attempt(self, key: str, fn: Callable[..., dict], *fn_args: Any) -> dict | None:
        try:
            self.runs[key] = fn(*fn_args)
        except ChildFailed as e:
            self.runs[key], self.errors[key] = None, str(e)[-STDERR_TAIL:]
        print(f"  {key}: {describe(self.runs[key], self.errors.get(key))}", flush=True)
        return self.runs[key]

    def fail(self, key: str, reason: str) -> None:
        """A comparison that could not be made: an error, not a blank."""
        self.errors[key] = reason

    def failed(self) -> bool:
        """Whether a contender failed or a comparison could not be made (not merely left out)."""
        return any(run is None for run in self.runs.values()) or "comparison" in self.errors

    def no_reference(self, reference: dict | None) -> None:
        """The preempted runs need E and the target from a run without preemptions: say why there are none."""
        self.fail("comparison", "no preempted run: the reference run without preemptions " + (
            "failed (above)" if reference is None else
            f"did {reference['steps_done']} step(s) in its budget, too few to set E and the target loss "
            "(raise --budget-s)"))

    def table(self, args: argparse.Namespace, baseline: Callable[[dict], dict | None]) -> None:
        rows = []
        for key, run in self.runs.items():
            if run is None:
                rows.append([key, "failed", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-"])
                continue
            base = baseline(run)
            retained = (run["samples_per_second"] / base["samples_per_second"]
                        if base and base["samples_per_second"] and run["samples_per_second"] else None)
            run["retained"] = retained
            lost = "n/a" if run.get("lost_steps") is None else run["lost_steps"] * global_batch(args)
            rows.append([key, "reached" if run["reached"] else ("budget" if "none" in key else "NOT reached"),
                         fmt(run["time_s"], ".1f"), fmt(run["dollars"], ".4f"), fmt(run["first_step_s"], ".1f"),
                         fmt(run["step_s"], ".2f"), fmt(run["samples_per_second"], ".1f"), fmt(retained),
                         f"{run.get('kills', 0)}/{run.get('restarts', 0)}", fmt(run.get("kill_to_next_step_s"), ".1f"),
                         fmt(run.get("join_to_first_step_s"), ".1f"), lost])
        print_table(["<24", "<12", ">9", ">9", ">10", ">8", ">11", ">9", ">12", ">11", ">11", ">13"],
                    ["run", "target", "time s", "$", "1st step", "step s", "samples/s", "retained", "kills/rest.",
                     "kill->step", "join->step", "lost samples"], rows)
        for key, error in self.errors.items():
            print(f"{key}: {error}")


def plot(out: str, title: str, target: float | None, runs: list[tuple[str, dict | None]]) -> None:
    """Loss against wall time and against instance-dollars (matplotlib, from the benchmark virtualenv)."""
    curves = {}
    for label, run in runs:
        if run is not None:
            times = [t for t, _ in run["curve"]]
            curves[label] = {"t": times, "loss": [v for _, v in run["curve"]],
                             "dollars": [dollars_at(run["instances"], t) for t in times]}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"curves": curves, "target": target, "out": out, "title": title}, f)
    try:
        subprocess.run([BENCH_PY, str(HERE / "_plot_vs_rival.py"), f.name], check=True, timeout=120)
        print(f"plot: {out}")
    except (subprocess.SubprocessError, OSError) as e:
        print(f"plot failed: {e}")
    finally:
        os.unlink(f.name)


def main() -> None:
    """The spotswarm contender's child process (``run_ours`` starts it)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--child", action="store_true", required=True)
    parser.add_argument("--trace", default=None)
    parser.add_argument("--target", type=float, default=None)
    parser.add_argument("--limit-s", type=float, default=600.0)
    ours_child(parser.parse_args())


if __name__ == "__main__":
    main()
