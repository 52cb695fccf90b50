"""spotswarm against torchft's fault-tolerant DDP: the same fleet, the same preemption trace, the same
model, data, optimizer and global batch, to the same loss.

Contenders, each in its own child process with a time limit, one after the other:

- ``ours``: the supervisor with the local provider (actors mode) replaying the trace, training with
  the collaborative optimizer (``_vs_rival.py``).  A preempted instance gets its notice ``--notice-s``
  before the kill and leaves; its replacement is launched at the notice and loads the state from a
  peer.
- ``torchft``: ``torchft.Manager`` + ``DistributedDataParallel`` + ``Optimizer``, one replica group
  per instance, ``min_replica_size=1``, its lighthouse where our supervisor runs, configured as its
  README and ``train_ddp.py`` example do (``_torchft_child.py`` states every setting), run with the
  benchmark-only virtualenv (``make bench-env``).  A quorum forms every step; a dead replica is
  dropped from the next one; a replacement recovers live from a healthy replica.  torchft ignores
  notices: its replica is SIGKILLed at the trace's time.

The trace, the fleet's costs and the padding of every micro-batch are ``_vs_rival.py``'s, shared with
``bench_vs_raytrain.py``.  E is one global step of torchft's run without preemptions, which also sets
the target loss (its loss after ``--budget-s``).  At ``--notice-lifetime`` (20 E) ours runs once more
with no notice (``--notice-s 0``): how much of the difference notices account for.

Figures per lifetime: wall time and instance-dollars to the target, useful samples/s retained against
the contender's own run without preemptions, steps lost to failures (torchft's uncommitted steps),
the time from a kill to the fleet's next step and from a replacement's arrival to its first step
that counted, and each contender's step time without preemptions.

    python benchmarks/bench_vs_torchft.py [--quick] [--task charlm|synthetic] [--workers 3]
           [--lifetimes 10,20,50] [--budget-s 150] [--plot docs/images/vs_torchft.png]

``--quick`` (a smoke test, under 60 s): both contenders without preemptions for a short budget, the
step-time ratio alone.  Prints a table, then one JSON line.  A contender that trains nothing is an
error: it is named with the end of its stderr, and the benchmark exits 1 after printing the rest.

DiLoCo against ``torchft.local_sgd.DiLoCo`` (part (b) of the comparison) runs once spotswarm has a
DiLoCo mode; until then the JSON says so (``diloco``).
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
    rival_summary,
    run_ours,
    run_rival,
    trace,
)

DILOCO = "not run: spotswarm has no DiLoCo mode yet (training over slow links), so part (b) waits for it"


def run_torchft(args: argparse.Namespace, lifetimes: list[float] | None, target: float | None,
                limit_s: float) -> dict:
    records = run_rival("torchft", "_torchft_child.py", [], args, lifetimes, target, limit_s)
    return rival_summary("torchft", records, target, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.add_argument("--notice-lifetime", type=float, default=20.0,
                        help="the lifetime at which ours also runs without notices (0: never)")
    args = parser.parse_args()
    if args.quick:
        args.budget_s, args.lifetimes, args.accum, args.notice_lifetime = 16.0, "", 6, 0.0
    have_torchft = Path(BENCH_PY).exists()
    lifetimes = [float(x) for x in args.lifetimes.split(",") if x]
    contest = Contest()
    print(f"global batch {global_batch(args)} ({args.workers} workers x {args.accum} x {args.batch_size}), "
          f"{args.device_ms:g} ms per micro-batch; budget {args.budget_s:g} s", flush=True)
    base_ft = contest.attempt("torchft none", run_torchft, args, None, None, args.budget_s) if have_torchft else None
    if not have_torchft:
        contest.errors["torchft"] = f"torchft skipped: {BENCH_PY} is missing (run `make bench-env`)"
    contest.attempt("ours none", run_ours, args, None, None, args.budget_s)
    e_s, target = (base_ft or {}).get("step_s"), (base_ft or {}).get("loss_now")
    if e_s and target is not None:
        print(f"E = {e_s:.2f} s per global step (torchft, no preemptions); target loss {target:.4f}", flush=True)
        limit = args.limit_factor * args.budget_s
        for life in lifetimes:
            lives = trace(args.seed, life * e_s)
            contest.attempt(f"ours L{life:g}", run_ours, args, lives, target, limit)
            contest.attempt(f"torchft L{life:g}", run_torchft, args, lives, target, limit)
            if life == args.notice_lifetime:
                silent = argparse.Namespace(**{**vars(args), "notice_s": 0.0})
                contest.attempt(f"ours L{life:g} no notice", run_ours, silent, lives, target, limit)
    elif have_torchft and lifetimes:
        contest.no_reference(base_ft)
    report(args, contest, lifetimes, e_s, target)
    sys.exit(1 if contest.failed() else 0)


def report(args: argparse.Namespace, contest: Contest, lifetimes: list[float], e_s: float | None,
           target: float | None) -> None:
    runs = contest.runs
    contest.table(args, lambda run: runs.get(f"{run['name']} none"))
    figures: dict[str, Any] = {"e_s": e_s, "target_loss": target, "global_batch": global_batch(args),
                               "task": args.task, "workers": args.workers, "quick": args.quick}
    ours_base, ft_base = runs.get("ours none"), runs.get("torchft none")
    for name, base in (("ours", ours_base), ("torchft", ft_base)):
        if base is not None:
            figures[f"step_s_{name}"], figures[f"first_step_s_{name}"] = base["step_s"], base["first_step_s"]
    if ours_base and ft_base and ours_base["step_s"] and ft_base["step_s"]:
        figures["step_ratio_no_preemption_ftddp"] = ours_base["step_s"] / ft_base["step_s"]
    for life in lifetimes:
        tag = f"l{life:g}"
        ours, ft = runs.get(f"ours L{life:g}"), runs.get(f"torchft L{life:g}")
        for name, run in (("ours", ours), ("torchft", ft)):
            if run is not None:
                figures[f"retained_{tag}_{name}"] = run.get("retained")
        if ours and ft and ours["reached"] and ours["time_s"] and ft["time_s"]:
            # a torchft run that never reached the target counts with its whole (shorter) time: a lower bound
            figures[f"time_ratio_{tag}_ftddp"] = ours["time_s"] / ft["time_s"]
            figures[f"dollar_ratio_{tag}_ftddp"] = ours["dollars"] / ft["dollars"] if ft["dollars"] else None
            figures[f"torchft_reached_{tag}"] = ft["reached"]
            print(f"L{life:g}: ours {ours['time_s']:.1f} s / ${ours['dollars']:.4f}; torchft {ft['time_s']:.1f} s / "
                  f"${ft['dollars']:.4f}{'' if ft['reached'] else ' (never reached: at least)'}; ratio "
                  f"{figures[f'time_ratio_{tag}_ftddp']:.3f} time, {fmt(figures[f'dollar_ratio_{tag}_ftddp'])} dollars")
        silent = runs.get(f"ours L{life:g} no notice")
        if silent and ft and silent["reached"] and ft["time_s"]:
            figures[f"time_ratio_{tag}_ftddp_no_notice"] = silent["time_s"] / ft["time_s"]
    for name in ("ours", "torchft"):  # over every preempted run of the contender
        preempted = [run for key, run in runs.items() if run and run["name"] == name and "none" not in key]
        gaps = [g for run in preempted for g in run["kill_gaps"]]
        joins = [j for run in preempted for j in run["joins"]]
        figures[f"kill_to_next_step_s_{name}"] = statistics.median(gaps) if gaps else None
        figures[f"join_to_first_step_s_{name}"] = statistics.median(joins) if joins else None
    figures["uncommitted_steps_torchft"] = sum(run.get("uncommitted_steps", 0) for key, run in runs.items()
                                               if run and run["name"] == "torchft")
    figures["diloco"] = DILOCO
    print(f"diloco: {DILOCO}")
    figures["errors"] = contest.errors or None
    if args.plot and Path(BENCH_PY).exists() and lifetimes:
        life = 20.0 if 20.0 in lifetimes else lifetimes[0]
        plot(args.plot, f"{args.task}, {args.workers} instances, global batch {global_batch(args)}", target,
             [("spotswarm, no preemptions", ours_base), ("torchft, no preemptions", ft_base),
              (f"spotswarm, lifetime {life:g} E", runs.get(f"ours L{life:g}")),
              (f"torchft, lifetime {life:g} E", runs.get(f"torchft L{life:g}"))])
    print_json(figures)


if __name__ == "__main__":
    main()
