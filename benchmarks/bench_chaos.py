"""Chaos soak: a local ``nodes``-mode run (every instance its own Ray node) under a fault every ~15 s
for 20 minutes (``spotswarm chaos``: SIGKILL of a worker, of a whole node, of the supervisor then a
resume, SIGSTOP of a worker for 2-20 steps, one peer's link at 1 Mbit/s, the run directory's disk
full, one peer's clock stepped), against the same run without faults, measured one after the other
in one invocation.

Figures: faults survived by kind and by the phase they hit (matchmaking, all-reduce, state download,
checkpoint write, idle), stalls (the longest and the 99th percentile wait for a new epoch, leaving
out the time no supervisor ran), samples/s retained against the run without faults, invariant
violations (target 0) and ERROR lines or tracebacks in the run's logs (target 0).

Each run is ``spotswarm chaos`` in a child process of its own with a time limit (its window plus
``--grace-s``): past it the child gets SIGTERM (a clean stop), then SIGKILL, and every Ray node its
run left is killed; the run is reported as cut short and the rest still prints.

    python benchmarks/bench_chaos.py [--quick] [--duration S] [--every S] [--seed N] [--baseline-s S]

``--quick`` (about 60 s): a 22-s window with a fault every 4 s (three faults: the last 10 s of a
window are left calm, to see the run recover), no run without faults (retained is null).  Needs
root for the full-disk fault (a tmpfs under the run directory); without it that kind is reported
as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import ROOT, Child, fmt, print_json, print_table  # noqa: E402
from orchestrator.host.processes import kill_session, processes_mentioning  # noqa: E402
from orchestrator.runs.chaos_report import FAULT_KINDS as KINDS  # noqa: E402
from orchestrator.runs.chaos_report import PHASES, REPORT  # noqa: E402

CONFIG = os.path.join(ROOT, "cluster_configs", "local-chaos.yaml")
SPOTSWARM = os.path.join(os.path.dirname(sys.executable), "spotswarm")


def write_config(base: Path, name: str) -> tuple[Path, Path]:
    """The shipped chaos config with its runs under ``base``; (the YAML, the run directory)."""
    config = yaml.safe_load(Path(CONFIG).read_text())
    config["cluster_name"] = name
    config["runs_dir"] = str(base / "runs")
    config["dashboard"] = {"enabled": False}  # `spotswarm dashboard RUN` serves the report afterwards
    path = base / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, base / "runs" / name


def kill_left_nodes(cluster: str) -> int:
    """SIGKILL the sessions of Ray nodes a cut-short run left (they are detached, not its children)."""
    sessions = set()
    for proc in processes_mentioning(f"spotswarm-instance-{cluster}-"):
        with contextlib.suppress(OSError):  # gone meanwhile
            sessions.add(os.getsid(proc.pid))
    for sid in sessions:
        kill_session(sid)
    return len(sessions)


def run_chaos(base: Path, name: str, window_s: float, every_s: float, seed: int, kinds: str, grace_s: float,
              log: Path) -> dict:
    """One ``spotswarm chaos`` run in a child; its report (``chaos.json``) plus how it ended."""
    config, run_dir = write_config(base, name)
    argv = [SPOTSWARM, "chaos", str(config), "--duration", str(window_s), "--every", str(every_s),
            "--seed", str(seed), "--kinds", kinds]
    started = time.monotonic()
    child = Child(name, argv, stdin=False, log_path=str(log), quit_line=None)
    deadline = started + window_s + grace_s
    cut = False
    try:
        child.proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
    except Exception:  # noqa: BLE001 - past its time: stop it cleanly, then for sure
        cut = True
        child.proc.send_signal(signal.SIGTERM)
    finally:
        child.finish(time.monotonic() + (120 if cut else 10))
        left = kill_left_nodes(name)
    report_path = run_dir / REPORT
    report = json.loads(report_path.read_text()) if report_path.exists() else {"faults": [], "violations": [],
                                                                                 "summary": {}}
    report.update(wall_s=time.monotonic() - started, cut_short=cut, left_nodes=left, rc=child.proc.returncode,
                  run_dir=str(run_dir))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 22-s window, three faults, no baseline")
    parser.add_argument("--duration", type=float, default=1200.0, help="seconds of faults (default 1200)")
    parser.add_argument("--every", type=float, default=15.0, help="mean seconds between faults (default 15)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--baseline-s", type=float, default=300.0, help="seconds of the run without faults")
    parser.add_argument("--grace-s", type=float, default=300.0, help="time limit past a run's window")
    parser.add_argument("--keep", metavar="DIR", help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.every, args.grace_s = 22.0, 4.0, 90.0
    base = Path(args.keep or tempfile.mkdtemp(prefix="bench-chaos-"))
    base.mkdir(parents=True, exist_ok=True)
    print(f"runs in {base}; child logs next to them", flush=True)

    baseline = None
    if not args.quick:
        baseline = run_chaos(base, "chaos-baseline", args.baseline_s, args.every, args.seed, "none", args.grace_s,
                             base / "baseline.log")
    chaos = run_chaos(base, "chaos-soak", args.duration, args.every, args.seed, ",".join(KINDS), args.grace_s,
                      base / "soak.log")

    summary = chaos.get("summary", {})
    faults = [f for f in chaos["faults"] if f.get("outcome") == "injected"]
    print(f"\nfaults survived by kind and phase ({len(faults)} injected, "
          f"{len(chaos['faults']) - len(faults)} skipped; window {args.duration:.0f} s, one every ~{args.every:.0f} s)")
    rows = [[kind, *(sum(f["kind"] == kind and f["phase"] == p for f in faults) for p in PHASES),
             sum(f["kind"] == kind for f in chaos["faults"]) - sum(f["kind"] == kind for f in faults)]
            for kind in KINDS]
    print_table(["<18"] + [">17"] * (len(PHASES) + 1), ["kind", *PHASES, "skipped"], rows, rule=True)
    for f in chaos["faults"]:
        if f.get("outcome") != "injected":
            print(f"  {f['kind']}: {f['outcome']}")

    base_rate = (baseline or {}).get("summary", {}).get("samples_per_second")
    rate = summary.get("samples_per_second")
    retained = rate / base_rate if rate and base_rate else None
    print()
    print_table(["<34", ">14"], ["figure", "value"], [
        ["faults injected", len(faults)],
        ["invariant violations (target 0)", summary.get("invariant_violations")],
        ["ERROR lines / tracebacks (target 0)", summary.get("error_tracebacks")],
        ["max stall, s", fmt(summary.get("max_stall_s"), ".1f")],
        ["p99 stall, s", fmt(summary.get("p99_stall_s"), ".2f")],
        ["recovered after the last fault, s", fmt(summary.get("recovery_s"), ".1f")],
        ["samples/s under faults", fmt(rate, ".1f")],
        ["samples/s without faults", fmt(base_rate, ".1f")],
        ["retained", fmt(retained, ".3f")],
        ["epochs under faults", summary.get("epochs")],
    ], rule=True)
    for run in (baseline, chaos):
        if run is not None and (run["cut_short"] or run["rc"] not in (0, 1)):
            print(f"{Path(run['run_dir']).name}: cut short or failed (rc {run['rc']}, cut_short {run['cut_short']}, "
                  f"{run['left_nodes']} nodes left and killed); see {base}")
    for v in chaos["violations"][:20]:
        print(f"  violation {v['invariant']}: {v['detail'][:200]}")
    print_json({
        "faults": len(faults), "skipped": len(chaos["faults"]) - len(faults),
        "invariant_violations": summary.get("invariant_violations"),
        "error_tracebacks": summary.get("error_tracebacks"), "max_stall_s": summary.get("max_stall_s"),
        "p99_stall_s": summary.get("p99_stall_s"), "recovery_s": summary.get("recovery_s"), "retained": retained,
        "samples_per_second": rate, "samples_per_second_baseline": base_rate,
        "by_kind": summary.get("by_kind"), "by_phase": summary.get("by_phase"),
        "window_s": args.duration, "every_s": args.every, "seed": args.seed,
        "cut_short": bool(chaos["cut_short"] or (baseline or {}).get("cut_short")),
    })


if __name__ == "__main__":
    main()
