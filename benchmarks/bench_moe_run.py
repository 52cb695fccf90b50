"""A mixture-of-experts run under the supervisor, with and without expert-server preemptions.

The run of ``cluster_configs/local-moe.yaml`` shrunk to fit this machine: 2 trainers train
``moe-charlm`` (one transformer block whose feed-forward layer is a mixture over a 2 x 4 grid of
``ffn`` experts, k_best 4, k_min 2), 3 expert servers hold every expert twice.  Two runs, one
after the other in one child process with one local Ray:

1. ``steady``: nobody is preempted.  Its global step time E (seconds per collaborative epoch,
   measured over the window) sets the second run's lifetimes;
2. ``preempted``: expert servers live ``--lifetime-steps`` x E on average (exponential; a notice
   ``--notice-s`` before each kill) and are replaced; trainers are never preempted.

Each run is measured over the same window, ``--window-s`` real seconds, starting once every expert
has its replicas and the trainers finished their first epoch.  Figures:

- ``retained``: the preempted run's trainer samples/s over the steady run's (epochs x target
  batch over the window, from the run store);
- ``kmin_fraction``: of the preempted run's forward passes (every mixture call of every trainer
  in the window), the fraction in which every row got k_min answers;
- ``loss_ratio``: the preempted run's mean loss over epochs N-4..N over the steady run's over the
  same epochs, N the last epoch both reached (each run starts from the same weights and data order);
- preemptions of expert servers in the window, hand-offs from a live replica / a checkpoint / fresh
  (all of the run), and calls that went to another replica after one failed.

The child has a time limit (``--limit-s``; past it it is killed with its whole tree, and the table
says so).  ``--quick``: 4-s windows, a smoke test (a few epochs each: its ratios are rough).

    python benchmarks/bench_moe_run.py [--quick] [--window-s 120] [--lifetime-steps 20] [--target-batch 1024]
                                       [--seed 7] [--keep DIR]

The global batch sets E, and with it how long a server lives against how long a replacement takes
to boot here (about 5-8 s for an actor that imports torch on this 2-core machine, while the others
train): at 1024 (E about 4 s) a lifetime of 20 x E is about 15 boots, closer to a cloud's ratio
(minutes per step, minutes per boot, hours per lifetime) than 256 (E about 1 s, a lifetime of
2-3 boots, when two of the three servers are often down at once).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from _common import ChildFailed, emit, fmt, print_json, print_table, run_for_json  # noqa: E402

from orchestrator.host.wait import wait_for  # noqa: E402

TIME_SCALE = 10.0  # simulated seconds per real second
LOSS_EPOCHS = 5  # the loss ratio compares the mean loss of the last this many epochs both runs reached


def config_data(run_dir: Path, name: str, lifetime_s: float | None, notice_s: float, target_batch: int,
                seed: int = 7) -> dict:
    prices = {"on_demand_price_per_hour": 0.40, "spot_price_per_hour": {"a": 0.12}}
    server_preemption = {"distribution": "none"} if lifetime_s is None else \
        {"distribution": "exponential", "mean_lifetime_s": lifetime_s * TIME_SCALE}
    return {
        "cluster_name": name, "runs_dir": str(run_dir),
        "provider": {"type": "local", "zones": ["a"], "time_scale": TIME_SCALE, "provisioning_delay_s": 10.0,
                     "seed": seed},
        "available_node_types": {
            "srv": {"role": "experts", "min_workers": 3, "max_workers": 3, "preemption": server_preemption,
                    **prices},
            "trn": {"min_workers": 2, "max_workers": 2, "preemption": {"distribution": "none"}, **prices}},
        "spot": {"notice_period_s": notice_s * TIME_SCALE},
        "training": {"task": "moe-charlm", "task_options": {"layers": 1, "context": 16, "batch_size": 8},
                     "target_batch_size": target_batch, "min_matchmaking_time_s": 0.5, "averaging_timeout_s": 10.0},
        "experts": {"grid": [2, 4], "hidden_dim": 32, "k_best": 4, "k_min": 2, "replicas": 2,
                    "average_every_s": 5.0, "declare_period_s": 1.0},
        "checkpoint": {"every_s": 100.0},
        "dashboard": {"enabled": False},
    }


def _rows(run_dir: Path, sql: str, *args: Any) -> list:
    with contextlib.closing(sqlite3.connect(run_dir / "run.sqlite")) as db:
        return db.execute(sql, args).fetchall()


def cpu_seconds(core: Any) -> dict[str, float]:
    """CPU seconds used so far by the machine (every core, busy time) and by the trainers' processes."""
    import psutil

    times = psutil.cpu_times()
    trainers = 0.0
    provider = core.policy.provider
    # an instance's actor process, and the worker forked for it from the warm image (which trains)
    for instance_id, process in [*provider.processes.items(), *provider.workers.items()]:
        if instance_id in provider.instances and provider.instances[instance_id].node_type == "trn":
            with contextlib.suppress(psutil.Error):
                t = process.cpu_times()
                trainers += t.user + t.system
    return {"machine": times.user + times.system + getattr(times, "nice", 0.0), "trainers": trainers}


def one_run(base: Path, name: str, window_s: float, lifetime_s: float | None, notice_s: float,
            target_batch: int, seed: int) -> dict:
    """One run under a supervisor in this process: its figures over ``window_s`` real seconds."""
    from orchestrator.config.schema import ClusterConfig
    from orchestrator.fleet.supervisor import SupervisorCore
    from orchestrator.runs.store import RunStore

    config = ClusterConfig.model_validate(config_data(base, name, lifetime_s, notice_s, target_batch, seed))
    RunStore.create(config).close()
    run_dir = config.run_dir()
    core = SupervisorCore(config, run_dir)
    core.start()
    try:
        replicas = config.experts.replicas
        wait_for(lambda: core.experts.summary()["min_replicas"] >= replicas, 120, "every expert placed", every=0.2)
        wait_for(lambda: _rows(run_dir, "SELECT 1 FROM progress"), 120, "the first epoch", every=0.2)
        # the trainers' mixture counts sampled since that epoch, so the window leaves out the calls made
        # while the first experts were still being declared
        wait_for(lambda: core.experts.summary()["calls"] > 0, 60, "the trainers' first mixture counts", every=0.2)
        start, t0, cpu0 = core.experts.summary(), core.clock(), cpu_seconds(core)
        time.sleep(window_s)  # the measurement window itself
        end, t1, cpu1 = core.experts.summary(), core.clock(), cpu_seconds(core)
    finally:
        core.stop()
    scale = config.provider.time_scale
    progress = _rows(run_dir, "SELECT time, epoch, loss, samples FROM progress ORDER BY time")
    window = [r for r in progress if t0 <= r[0] <= t1]
    calls = end["calls"] - start["calls"]
    met = end["calls_meeting_k_min"] - start["calls_meeting_k_min"]
    handoffs = [json.loads(d)["source"] for (d,) in _rows(run_dir, "SELECT detail FROM events "
                                                              "WHERE kind = 'expert_handoff'")]
    preempted = _rows(run_dir, "SELECT COUNT(*) FROM instances WHERE end_reason = 'preempted' AND node_type = 'srv' "
                               "AND ended_at BETWEEN ? AND ?", t0, t1)
    span = (window[-1][0] - window[0][0]) / scale if len(window) > 1 else None
    return {
        "samples_per_second": (window[-1][3] - window[0][3]) / span if span else None,
        "epoch_s": span / (window[-1][1] - window[0][1]) if span and window[-1][1] > window[0][1] else None,
        "losses": {int(e): loss for _, e, loss, _ in progress if loss is not None},
        "kmin_fraction": met / calls if calls else None, "calls": calls,
        "failovers": end["failovers"] - start["failovers"],
        "preemptions": preempted[0][0], "handoffs": {s: handoffs.count(s) for s in ("replica", "checkpoint", "fresh")},
        "window_s": (t1 - t0) / scale,
        "trainer_cpus": (cpu1["trainers"] - cpu0["trainers"]) / ((t1 - t0) / scale),  # cores the trainers used
        "cpu_share_trainers": (cpu1["trainers"] - cpu0["trainers"]) / max(cpu1["machine"] - cpu0["machine"], 1e-9),
        "cpu_busy": (cpu1["machine"] - cpu0["machine"]) / ((t1 - t0) / scale) / (psutil_cpus() or 1),
    }


def psutil_cpus() -> int | None:
    import psutil

    return psutil.cpu_count()


def child(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.WARNING)
    from orchestrator.fleet.ray_session import start_ray

    base = Path(args.keep or tempfile.mkdtemp(prefix="bench-moe-run-"))
    start_ray()
    steady = one_run(base, "steady", args.window_s, None, args.notice_s, args.target_batch, args.seed)
    emit({"steady": steady})
    lifetime = args.lifetime_steps * (steady["epoch_s"] or 1.0)
    preempted = one_run(base, "preempted", args.window_s, lifetime, args.notice_s, args.target_batch, args.seed)
    emit({"steady": steady, "preempted": preempted, "lifetime_s": lifetime})
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)


def loss_ratio(steady: dict, preempted: dict) -> tuple[int | None, float | None]:
    a = {int(e): loss for e, loss in steady["losses"].items()}  # JSON made the epochs strings
    b = {int(e): loss for e, loss in preempted["losses"].items()}
    common = sorted(set(a) & set(b))[-LOSS_EPOCHS:]  # one epoch's loss is noisy: the last few both reached
    if not common:
        return None, None
    return common[-1], sum(b[n] for n in common) / sum(a[n] for n in common)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--window-s", type=float, default=120.0)
    parser.add_argument("--lifetime-steps", type=float, default=20.0, help="mean server lifetime, in global steps")
    parser.add_argument("--notice-s", type=float, default=3.0, help="real seconds between notice and kill")
    parser.add_argument("--target-batch", type=int, default=None,
                        help="global batch per step, which sets E (default 1024; quick 256)")
    parser.add_argument("--seed", type=int, default=7, help="the spot market's seed (which lifetimes are drawn)")
    parser.add_argument("--limit-s", type=float, default=None, help="the child's time limit")
    parser.add_argument("--keep", default=None, help="keep the runs' directories here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.window_s = min(args.window_s, 4.0)
    if args.target_batch is None:
        args.target_batch = 256 if args.quick else 1024
    if args.child:
        child(args)
        return
    limit = args.limit_s or (55.0 if args.quick else 2 * args.window_s + 240.0)
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--window-s", str(args.window_s),
            "--lifetime-steps", str(args.lifetime_steps), "--notice-s", str(args.notice_s),
            "--target-batch", str(args.target_batch), "--seed", str(args.seed)]
    if args.keep:
        argv += ["--keep", args.keep]
    error = None
    try:
        result = run_for_json("moe-run", argv, limit)
    except ChildFailed as e:
        result, error = {}, str(e)
    steady, preempted = result.get("steady"), result.get("preempted")
    rows = []
    for name, run in (("steady", steady), ("preempted", preempted)):
        if run is None:
            rows.append([name, "stopped", None, None, None, None, None, None])
            continue
        h = run["handoffs"]
        rows.append([name, "done", fmt(run["samples_per_second"], ".1f"), fmt(run["epoch_s"]),
                     fmt(run["kmin_fraction"], ".4f"),
                     run["preemptions"], f"{h['replica']}/{h['checkpoint']}/{h['fresh']}", run["failovers"]])
    print_table(["<10", "<8", ">10", ">8", ">8", ">9", ">16", ">10"],
                ["run", "status", "samples/s", "E (s)", "k_min", "preempts", "handoffs r/c/f", "failovers"], rows)
    retained = n = ratio = per_cpu = None
    if steady and preempted:
        if steady["samples_per_second"] and preempted["samples_per_second"] is not None:
            retained = preempted["samples_per_second"] / steady["samples_per_second"]
            if steady["trainer_cpus"] and preempted["trainer_cpus"]:
                per_cpu = retained * steady["trainer_cpus"] / preempted["trainer_cpus"]
        n, ratio = loss_ratio(steady, preempted)
        print(f"mean server lifetime {result['lifetime_s']:.1f} s ({args.lifetime_steps:g} x E); retained "
              f"{fmt(retained)} (target >= 0.8); k_min met in {fmt(preempted['kmin_fraction'], '.4f')} of forward "
              f"passes (target >= 0.99); loss over epochs {n - LOSS_EPOCHS + 1 if n else '-'}-{n}: {fmt(ratio)} x the "
              f"steady run's")
    for name, run in (("steady", steady), ("preempted", preempted)):
        if run is not None:
            print(f"{name}: the machine's cores busy {fmt(run['cpu_busy'])} of the window, the trainers' processes "
                  f"{fmt(run['cpu_share_trainers'])} of that ({fmt(run['trainer_cpus'])} cores)")
    if per_cpu is not None:
        print(f"samples per trainer CPU-second retained: {fmt(per_cpu)} (the rest of the loss is CPU the replacements "
              f"took from the trainers on this machine's shared cores)")
    if error:
        print(f"the runs did not finish: {error}")
    print_json({"retained": retained, "kmin_fraction": preempted["kmin_fraction"] if preempted else None,
                "loss_ratio": ratio, "loss_epoch": n, "lifetime_s": result.get("lifetime_s"),
                "steady_samples_per_second": steady["samples_per_second"] if steady else None,
                "preempted_samples_per_second": preempted["samples_per_second"] if preempted else None,
                "server_preemptions": preempted["preemptions"] if preempted else None,
                "handoffs": preempted["handoffs"] if preempted else None,
                "failovers": preempted["failovers"] if preempted else None, "retained_per_trainer_cpu": per_cpu,
                "target_batch": args.target_batch, "seed": args.seed,
                "window_s": args.window_s, "quick": args.quick, "error": error})


if __name__ == "__main__":
    main()
