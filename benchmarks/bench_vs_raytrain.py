"""spotswarm against Ray Train with checkpoint-restart: the same fleet, the same preemption trace, the
same model, data, optimizer and global batch, to the same loss.

Contenders, each in its own child process with its own Ray session, one after the other:

- ``ours``: the supervisor with the local provider (actors mode) replaying the trace: instances train
  with the collaborative optimizer (target batch = the global batch); a preempted instance gets its
  notice ``--notice-s`` before the kill and leaves; its replacement is launched at the notice.
- ``raytrain``: ``TorchTrainer`` (Ray Train V2, DistributedDataParallel over gloo),
  ``FailureConfig(max_failures=-1)``, a checkpoint every k steps (``--checkpoint-every``, two values
  by default; see ``_raytrain_child.py``), run with the benchmark-only virtualenv (``make bench-env``).
  k = 1 is what Young's rule, sqrt(2 x checkpoint cost x MTBF), gives here (a checkpoint costs about
  0.1 s, the group's MTBF is L x E / workers); k = 5 is the second value.  The figures use the better.
  An instance that ends has its worker SIGKILLed; Ray Train restarts the whole group from the last
  checkpoint once the replacement is usable.  Ray Train does not act on preemption notices.

The trace: one exponential lifetime per launch, in launch order (``random.Random(--seed)``), mean
L x E for L in ``--lifetimes``; E is one global step of the no-preemption Ray Train run (real
seconds).  Every instance, replacements included, is usable ``--provisioning-s`` after its launch and
costs from its launch to its end ($0.30/h, a spot price).  Every micro-batch sleeps ``--device-ms``
for an accelerator step, in both contenders, so each instance brings its own capacity although all
share this machine's cores.

First both contenders run without preemptions for ``--budget-s`` from their start; the target loss is
the Ray Train run's at that time (mean of its last 5 steps).  Then each lifetime, each contender runs
until its loss (mean of the last 5 steps) reaches the target, or ``--limit-factor`` x budget.
Figures per run: wall time and instance-dollars to the target, useful samples/s (global batch x steps
at the target / time) retained against the contender's own no-preemption run, and for Ray Train the
samples computed and then discarded by restarts (steps redone after a restore x global batch).

    python benchmarks/bench_vs_raytrain.py [--quick] [--task charlm|synthetic] [--workers 3]
           [--lifetimes 10,20,50] [--checkpoint-every 1,5] [--budget-s 150] [--plot docs/images/vs_raytrain.png]

``--quick`` (a smoke test, ~60 s): a short budget, ours alone (no preemptions, then L20 with E from
that run); Ray Train is left out, its worker group alone takes ~25 s to start on this machine.
Prints a table, then one JSON line.
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
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from _common import BENCH_PY, ChildFailed, emit, fmt, print_json, print_table, run_for_json  # noqa: E402

PRICE_PER_HOUR = 0.30  # spot, per instance, both contenders
TIME_SCALE = 10.0  # the supervisor's simulated seconds per real second
SMOOTH = 5  # steps averaged for "the loss now"


def smoothed(losses: list[float]) -> float | None:
    return statistics.fmean(losses[-SMOOTH:]) if len(losses) >= SMOOTH else None


def trace(seed: int, mean_s: float, n: int = 500) -> list[float]:
    rng = random.Random(seed)
    return [rng.expovariate(1.0 / mean_s) for _ in range(n)]


# ---- ours: a supervisor in a child process -----------------------------------------------------
def ours_config(base: Path, args: argparse.Namespace, trace_file: Path | None) -> Any:
    from orchestrator.config import ClusterConfig

    # no warm image: every worker imports torch for itself, as Ray Train's restarted workers do
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
    from orchestrator.cluster import start_ray
    from orchestrator.run_store import RunStore
    from orchestrator.supervisor import SupervisorCore

    base = Path(tempfile.mkdtemp(prefix="bench-vs-raytrain-"))
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
    steps = [((t - first) / TIME_SCALE, e, loss) for t, e, loss in
             _rows(run_dir, "SELECT time, epoch, loss FROM progress WHERE loss IS NOT NULL ORDER BY epoch")]
    instances = [((a - first) / TIME_SCALE, None if b is None else (b - first) / TIME_SCALE, reason) for a, b, reason in
                 _rows(run_dir, "SELECT launched_at, ended_at, end_reason FROM instances ORDER BY launched_at")]
    emit({"steps": steps, "instances": instances})
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
        raw = run_for_json("ours", argv, limit_s + 120)
    steps = [(t, e, loss) for t, e, loss in raw["steps"]]
    instances = [(a, b) for a, b, _ in raw["instances"]]
    kills = sum(1 for *_, reason in raw["instances"] if reason == "preempted")
    return summarize("ours", steps, instances, target, args, kills=kills, lost_steps=None, restarts=0)


def child_flags(args: argparse.Namespace) -> list[str]:
    return ["--task", args.task, "--workers", str(args.workers), "--batch-size", str(args.batch_size),
            "--accum", str(args.accum), "--device-ms", str(args.device_ms),
            "--provisioning-s", str(args.provisioning_s), "--notice-s", str(args.notice_s), "--seed", str(args.seed)]


# ---- Ray Train: its own virtualenv ---------------------------------------------------------------
def run_raytrain(args: argparse.Namespace, lifetimes: list[float] | None, k: int, target: float | None,
                 limit_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-raytrain-") as d:
        log, stop = Path(d, "log.jsonl"), Path(d, "stop")
        argv = [BENCH_PY, str(HERE / "_raytrain_child.py"), "--root", str(ROOT), "--task", args.task,
                "--batch-size", str(args.batch_size), "--workers", str(args.workers), "--accum", str(args.accum),
                "--device-ms", str(args.device_ms), "--checkpoint-every", str(k),
                "--provisioning-s", str(args.provisioning_s), "--log", str(log), "--stop-file", str(stop),
                "--limit-s", str(limit_s), "--storage", str(Path(d, "storage"))]
        if lifetimes is not None:
            Path(d, "trace.json").write_text(json.dumps(lifetimes))
            argv += ["--trace", str(Path(d, "trace.json"))]
        env = {**os.environ, "RAY_TRAIN_V2_ENABLED": "1", "PYTHONPATH": str(HERE), "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(Path(d, "stderr"), "wb"),
                                start_new_session=True, env=env)
        started = time.monotonic()
        timed_out = False
        try:
            while proc.poll() is None:
                records = read_log(log)
                losses = [r["loss"] for r in records if r["kind"] == "step"]
                now = smoothed(losses)
                elapsed = time.monotonic() - started
                if (target is not None and now is not None and now <= target) or \
                        (target is None and records and records[-1]["t"] - records[0]["t"] >= args.budget_s):
                    stop.touch()
                if elapsed > limit_s + 90:  # it did not stop at its own limit: killed, and said so
                    timed_out = True
                    break
                time.sleep(0.5)  # polling the log
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait()
        records = read_log(log)
        error = None if records else f"Ray Train wrote nothing: {Path(d, 'stderr').read_text()[-2000:]}"
    if error:
        raise ChildFailed(error)
    t0 = records[0]["t"]
    steps, restored, lost, restarts, best = [], [], 0, -1, 0
    kills = sum(1 for r in records if r["kind"] == "kill")
    for r in records:
        if r["kind"] == "start":
            restarts += 1
            lost += max(best - r["step"], 0)
            restored.append(r["t"] - t0)
        elif r["kind"] == "step":
            best = max(best, r["step"])
            steps.append((r["t"] - t0, r["step"], r["loss"]))
    launches = [r for r in records if r["kind"] == "launch"]
    instances = [(r["t"] - t0, (r["t"] - t0) + r["lifetime"]) for r in launches]
    out = summarize("raytrain", steps, instances, target, args, kills=kills, lost_steps=lost, restarts=max(restarts, 0))
    out["timed_out"] = timed_out
    out["checkpoint_every"] = k
    return out


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


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
    """What the fleet cost up to ``t``: every instance from its launch to its end (or ``t``)."""
    seconds = sum(max(min(end if end is not None else t, t) - launch, 0.0) for launch, end in instances)
    return seconds / 3600 * PRICE_PER_HOUR


def global_batch(args: argparse.Namespace) -> int:
    return args.workers * args.accum * args.batch_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--task", choices=["charlm", "synthetic"], default="charlm")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="per micro-batch")
    parser.add_argument("--accum", type=int, default=24, help="micro-batches per worker per global step")
    parser.add_argument("--device-ms", type=float, default=60.0, help="sleep per micro-batch (an accelerator step)")
    parser.add_argument("--lifetimes", default="10,20,50", help="mean instance lifetimes, in global steps E")
    parser.add_argument("--checkpoint-every", default="1,5", help="Ray Train checkpoint intervals (steps) to try")
    parser.add_argument("--budget-s", type=float, default=150.0, help="the no-preemption runs' time; sets the target")
    parser.add_argument("--limit-factor", type=float, default=3.0, help="a preempted run's limit, x budget")
    parser.add_argument("--provisioning-s", type=float, default=3.0)
    parser.add_argument("--notice-s", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--plot", default=None, help="write the loss curves at L20 here (PNG; needs .bench-venv)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trace", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--target", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--limit-s", type=float, default=600.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        ours_child(args)
        return
    if args.quick:
        args.budget_s, args.lifetimes, args.limit_factor, args.accum = 16.0, "20", 1.5, 6
        args.checkpoint_every = args.checkpoint_every.split(",")[0]
    have_raytrain = Path(BENCH_PY).exists() and not args.quick
    lifetimes = [float(x) for x in args.lifetimes.split(",")]
    ks = [int(x) for x in args.checkpoint_every.split(",")]
    runs: dict[str, dict | None] = {}
    errors: dict[str, str] = {}

    def attempt(key: str, fn: Any, *fn_args: Any) -> dict | None:
        try:
            runs[key] = fn(*fn_args)
        except ChildFailed as e:
            runs[key], errors[key] = None, str(e)[-600:]
        print(f"  {key}: {describe(runs[key], errors.get(key))}", flush=True)
        return runs[key]

    print(f"global batch {global_batch(args)} ({args.workers} workers x {args.accum} x {args.batch_size}), "
          f"{args.device_ms:g} ms per micro-batch; budget {args.budget_s:g} s", flush=True)
    base_rt = attempt("raytrain none", run_raytrain, args, None, ks[0], None, args.budget_s) if have_raytrain else None
    if not have_raytrain:
        errors["raytrain"] = ("Ray Train left out of --quick" if args.quick else
                              f"Ray Train skipped: {BENCH_PY} is missing (run `make bench-env`)")
    base_ours = attempt("ours none", run_ours, args, None, None, args.budget_s)
    reference = base_rt or base_ours
    e_s = (reference or {}).get("step_s")
    target = (reference or {}).get("loss_now")
    if base_ours is not None and base_rt is not None and target is not None:
        base_ours["to_target_s"] = (reached([(t, 0, loss) for t, loss in base_ours["curve"]], target) or (None,))[0]
    if e_s and target is not None:
        print(f"E = {e_s:.2f} s per global step ({reference['name']}, no preemptions); target loss {target:.4f}",
              flush=True)
        for life in lifetimes:
            lives = trace(args.seed, life * e_s)
            limit = args.limit_factor * args.budget_s
            attempt(f"ours L{life:g}", run_ours, args, lives, target, limit)
            if have_raytrain:
                for k in ks:
                    attempt(f"raytrain L{life:g} k{k}", run_raytrain, args, lives, k, target, limit)
    report(args, runs, errors, lifetimes, ks, e_s, target)


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
            f"restarts {run.get('restarts')}")


def best_raytrain(runs: dict, life: float, ks: list[int]) -> dict | None:
    """Ray Train's best checkpoint interval at this lifetime (the fastest to the target)."""
    done = [r for k in ks if (r := runs.get(f"raytrain L{life:g} k{k}")) is not None]
    reached = [r for r in done if r["reached"]]
    return min(reached, key=lambda r: r["time_s"]) if reached else (done[0] if done else None)


def report(args: argparse.Namespace, runs: dict, errors: dict, lifetimes: list[float], ks: list[int],
           e_s: float | None, target: float | None) -> None:
    rows = []
    for key, run in runs.items():
        if run is None:
            rows.append([key, "failed", "-", "-", "-", "-", "-", "-"])
            continue
        base = runs.get("ours none") if run["name"] == "ours" else runs.get("raytrain none")
        retained = (run["samples_per_second"] / base["samples_per_second"]
                    if base and base["samples_per_second"] and run["samples_per_second"] else None)
        run["retained"] = retained
        lost = "n/a" if run.get("lost_steps") is None else run["lost_steps"] * global_batch(args)
        rows.append([key, "reached" if run["reached"] else ("budget" if "none" in key else "NOT reached"),
                     fmt(run["time_s"], ".1f"), fmt(run["dollars"], ".4f"), fmt(run["first_step_s"], ".1f"),
                     fmt(run["step_s"], ".2f"), fmt(run["samples_per_second"], ".1f"),
                     fmt(retained), f"{run.get('kills', 0)}/{run.get('restarts', 0)}", lost])
    print_table(["<20", "<12", ">9", ">9", ">10", ">8", ">11", ">9", ">12", ">12"],
                ["run", "target", "time s", "$", "1st step", "step s", "samples/s", "retained", "kills/rest.",
                 "lost samples"], rows)
    figures: dict[str, Any] = {"e_s": e_s, "target_loss": target, "global_batch": global_batch(args),
                               "task": args.task, "workers": args.workers, "quick": args.quick}
    for name in ("ours", "raytrain"):
        if (base := runs.get(f"{name} none")) is not None:
            figures[f"step_s_{name}"], figures[f"first_step_s_{name}"] = base["step_s"], base["first_step_s"]
    base_ours = runs.get("ours none")
    if base_ours and base_ours.get("to_target_s") is not None:
        rt = runs.get("raytrain none")
        figures["no_preemption_time_ratio"] = base_ours["to_target_s"] / rt["time_s"] if rt else None
    for life in lifetimes:
        ours, rt = runs.get(f"ours L{life:g}"), best_raytrain(runs, life, ks)
        tag = f"l{life:g}"
        if ours is not None:
            figures[f"retained_{tag}_ours"] = ours.get("retained")
        if rt is not None:
            figures[f"retained_{tag}_raytrain"] = rt.get("retained")
            figures[f"raytrain_k_{tag}"] = rt.get("checkpoint_every")
        if ours and rt and ours["reached"] and ours["time_s"] and rt["time_s"]:
            # a Ray Train run that never reached the target counts with its whole (shorter) time: a lower bound
            figures[f"time_ratio_{tag}"] = ours["time_s"] / rt["time_s"]
            figures[f"dollar_ratio_{tag}"] = ours["dollars"] / rt["dollars"] if rt["dollars"] else None
            figures[f"raytrain_reached_{tag}"] = rt["reached"]
            never = "" if rt["reached"] else " (never reached: at least)"
            print(f"L{life:g}: ours {ours['time_s']:.1f} s / ${ours['dollars']:.4f}; Ray Train "
                  f"(k={rt['checkpoint_every']}) {rt['time_s']:.1f} s / ${rt['dollars']:.4f}{never}; "
                  f"ratio {figures[f'time_ratio_{tag}']:.3f} time, {fmt(figures[f'dollar_ratio_{tag}'])} dollars")
    for key, error in errors.items():
        print(f"{key}: {error}")
    figures["errors"] = errors or None
    if args.plot and Path(BENCH_PY).exists():
        plot(args, runs, lifetimes, ks, figures)
    print_json(figures)


def plot(args: argparse.Namespace, runs: dict, lifetimes: list[float], ks: list[int], figures: dict) -> None:
    life = 20.0 if 20.0 in lifetimes else lifetimes[0]
    curves = {}
    for label, run in (("spotswarm, no preemptions", runs.get("ours none")),
                       ("Ray Train, no preemptions", runs.get("raytrain none")),
                       (f"spotswarm, lifetime {life:g} E", runs.get(f"ours L{life:g}")),
                       (f"Ray Train, lifetime {life:g} E", best_raytrain(runs, life, ks))):
        if run is not None:
            times = [t for t, _ in run["curve"]]
            curves[label] = {"t": times, "loss": [v for _, v in run["curve"]],
                             "dollars": [dollars_at(run["instances"], t) for t in times]}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"curves": curves, "target": figures.get("target_loss"), "out": args.plot,
                   "title": f"{args.task}, {args.workers} instances, global batch {global_batch(args)}"}, f)
    try:
        subprocess.run([BENCH_PY, str(HERE / "_plot_vs_raytrain.py"), f.name], check=True, timeout=120)
        print(f"plot: {args.plot}")
    except (subprocess.SubprocessError, OSError) as e:
        print(f"plot failed: {e}")
    finally:
        os.unlink(f.name)


if __name__ == "__main__":
    main()
