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

The trace, the fleet's costs and the padding of every micro-batch are ``_vs_rival.py``'s, shared with
``bench_vs_torchft.py``; E is one global step of the no-preemption Ray Train run.

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
Prints a table, then one JSON line.  A contender that trains nothing is an error: it is named with the
end of its stderr, and the benchmark exits 1 after printing the rest.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import BENCH_PY, fmt, print_json  # noqa: E402
from _vs_rival import (  # noqa: E402
    Contest,
    add_arguments,
    global_batch,
    plot,
    reached,
    rival_summary,
    run_ours,
    run_rival,
    trace,
)


def run_raytrain(args: argparse.Namespace, lifetimes: list[float] | None, k: int, target: float | None,
                 limit_s: float) -> dict:
    records = run_rival("raytrain", "_raytrain_child.py", ["--checkpoint-every", str(k)], args, lifetimes, target,
                        limit_s, env={"RAY_TRAIN_V2_ENABLED": "1"})
    out = rival_summary("raytrain", records, target, args)
    out["checkpoint_every"] = k
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.add_argument("--checkpoint-every", default="1,5", help="Ray Train checkpoint intervals (steps) to try")
    args = parser.parse_args()
    if args.quick:
        args.budget_s, args.lifetimes, args.limit_factor, args.accum = 16.0, "20", 1.5, 6
        args.checkpoint_every = args.checkpoint_every.split(",")[0]
    have_raytrain = Path(BENCH_PY).exists() and not args.quick
    lifetimes = [float(x) for x in args.lifetimes.split(",")]
    ks = [int(x) for x in args.checkpoint_every.split(",")]
    contest = Contest()
    errors = contest.errors

    print(f"global batch {global_batch(args)} ({args.workers} workers x {args.accum} x {args.batch_size}), "
          f"{args.device_ms:g} ms per micro-batch; budget {args.budget_s:g} s", flush=True)
    base_rt = contest.attempt("raytrain none", run_raytrain, args, None, ks[0], None, args.budget_s) \
        if have_raytrain else None
    if not have_raytrain:
        errors["raytrain"] = ("Ray Train left out of --quick" if args.quick else
                              f"Ray Train skipped: {BENCH_PY} is missing (run `make bench-env`)")
    base_ours = contest.attempt("ours none", run_ours, args, None, None, args.budget_s)
    # Ray Train's run sets E and the target; without Ray Train (--quick, no bench-env) ours does
    reference = base_rt if have_raytrain else base_ours
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
            contest.attempt(f"ours L{life:g}", run_ours, args, lives, target, limit)
            if have_raytrain:
                for k in ks:
                    contest.attempt(f"raytrain L{life:g} k{k}", run_raytrain, args, lives, k, target, limit)
    elif lifetimes:
        contest.no_reference(reference)
    report(args, contest, lifetimes, ks, e_s, target)
    sys.exit(1 if contest.failed() else 0)


def best_raytrain(runs: dict, life: float, ks: list[int]) -> dict | None:
    """Ray Train's best checkpoint interval at this lifetime (the fastest to the target)."""
    done = [r for k in ks if (r := runs.get(f"raytrain L{life:g} k{k}")) is not None]
    reached = [r for r in done if r["reached"]]
    return min(reached, key=lambda r: r["time_s"]) if reached else (done[0] if done else None)


def report(args: argparse.Namespace, contest: Contest, lifetimes: list[float], ks: list[int],
           e_s: float | None, target: float | None) -> None:
    runs = contest.runs
    contest.table(args, lambda run: runs.get("ours none") if run["name"] == "ours" else runs.get("raytrain none"))
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
    for name in ("ours", "raytrain"):
        gaps = [g for key, run in runs.items() if run and run["name"] == name for g in run.get("kill_gaps", [])]
        joins = [j for key, run in runs.items() if run and run["name"] == name for j in run.get("joins", [])]
        figures[f"kill_to_next_step_s_{name}"] = statistics.median(gaps) if gaps else None
        figures[f"join_to_first_step_s_{name}"] = statistics.median(joins) if joins else None
    figures["errors"] = contest.errors or None
    if args.plot and Path(BENCH_PY).exists():
        life = 20.0 if 20.0 in lifetimes else lifetimes[0]
        plot(args.plot, f"{args.task}, {args.workers} instances, global batch {global_batch(args)}", target,
             [("spotswarm, no preemptions", runs.get("ours none")),
              ("Ray Train, no preemptions", runs.get("raytrain none")),
              (f"spotswarm, lifetime {life:g} E", runs.get(f"ours L{life:g}")),
              (f"Ray Train, lifetime {life:g} E", best_raytrain(runs, life, ks))])
    print_json(figures)


if __name__ == "__main__":
    main()
