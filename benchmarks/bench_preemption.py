"""Preemption benchmark: training throughput and cost of a spot fleet under preemptions, in the local
spot simulator, against the same fleet without preemptions and against a restart-from-checkpoint
baseline.

One local Ray session for everything.  Every run is a supervisor (``SupervisorCore``) in this
process, in its own temporary runs directory, keeping a fleet of ``--instances`` (3) simulated spot
instances of one node type training the ``synthetic`` task (``--device-ms MS`` pads every forward
pass with a sleep standing for an accelerator step; see ``_preemption_task.py``).  The simulated
clock runs ``--time-scale`` (10) times faster than the wall clock; times are simulated seconds
unless marked "real".

1. Calibration: a short no-preemption run (``--calibration-s`` 40 s real, extended until 10 epochs,
   at most 4x); it gives the epoch time E (simulated seconds per global epoch, epoch boundary to
   epoch boundary) and, with the other no-preemption runs, the boot time B (first launch to the
   fleet's first global epoch, minus E).
2. Cases ``none`` (no preemptions), ``L10``, ``L20``, ``L50`` (exponential instance lifetimes with
   mean 10, 20, 50 x E), run in ``--rounds`` interleaved rounds (3; the order rotates each round)
   because the machine is shared and its speed drifts by 2x within minutes.  Round r uses lifetime
   seed ``--seed + r`` for every case.  A preemption is a notice (``notice_period_s``: the worker
   trains through most of it and leaves between rounds; the supervisor asks for a replacement at
   once), then a SIGKILL of the instance's process; a replacement arrives ``provisioning_delay_s``
   later and must boot (real seconds: a Ray actor process, its worker forked from the
   simulator's warm image (``provider.warm_image``), the DHT, the state download).
   ``--warm-spares N`` keeps N more instances booted, joined and idle (the node type's
   ``warm_spares``): a notice hands the leaving trainer's place to one at once, and the replacement
   boots as the next spare.  Spares are billed at spot prices; the on-demand reference leaves out
   spares that never trained.

Throughput of a run = samples trained per second over its measured window: the window opens at the
run store's first progress record (the fleet's first global epoch; the initial boot is left out)
and lasts ``--window-s`` real seconds; samples = (epoch at the end - epoch at the start) x
target_batch_size, epochs from the run store's progress table (the epoch in progress at the end is
counted pro rata, interpolating between the progress records before and after the end; if none
comes within ``--tail-s`` it counts 0).  A case's throughput sums its rounds;
retained = throughput / throughput of ``none``.

Cost: on-demand $1.00/h per instance, spot 0.3 x on-demand in every zone (set in the generated
config).  Dollars are the instances' billed seconds inside the window (run store: launch to end of
each instance) times their price.  cost ratio = ($ per million samples of L20 at spot prices) /
($ per million samples of ``none`` at on-demand prices).

Restart baseline (SIMULATED, not run): what Ray Train and SkyPilot managed jobs do.  A discrete-event
simulation of the same fleet, per round, driven by the same lifetime draws
(one exponential draw per launch from ``launch_rng(seed, k)`` for the k-th launch, as
``LocalSpotProvider`` draws them), the measured no-preemption throughput, the runs' checkpoint interval
(``checkpoint.every_s`` = ``--checkpoint-epochs`` x E), the same provisioning delay, and the
measured boot time B.  Whenever any instance is killed the whole job stops and loses the work since
its last checkpoint (a checkpoint every ``every_s`` of training since the last restart, written for
free); the replacement is launched ``provisioning_delay_s`` after the kill; training restarts B
after the last instance arrived.  Its progress is counted as the run store counts ours: the furthest
epoch reached so far (lost work redone counts only beyond that).  The preemption notice is not used
(neither system acts on it by default).  Its window has the same length and the same offset from the
first launch (B + E) as the real runs'.  Also printed: its mean over 1000 seeds.

    python benchmarks/bench_preemption.py [--quick] [--device-ms MS]

``--quick`` is a smoke test, not a measurement: the calibration run doubles as ``none``, then
``L20`` alone, 8-s windows, forward passes padded by 5 ms (so that 20 E outlasts a boot) and 5 s
waited after a window; under a minute on this machine.
Prints tables, then one JSON line of figures.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from _common import WarningCounter, fmt, print_json, print_table, retry  # noqa: E402

from orchestrator.sim.actors import launch_rng  # noqa: E402

ON_DEMAND = 1.00  # $/h per instance
SPOT_RATIO = 0.3
ZONES = ["local-a", "local-b"]
NODE_TYPE = "sim-gpu"
LIFETIME_FACTORS = (10, 20, 50)


@dataclass
class Run:
    case: str  # "none", "L10", ...
    round: int
    seed: int
    factor: float | None = None  # mean lifetime / E
    mean_lifetime_s: float | None = None
    error: str | None = None
    t0: float = 0.0  # the measured window, simulated seconds
    t1: float = 0.0
    first_launch: float = 0.0
    epochs: float = 0.0  # global epochs in the window (the one in progress at its end interpolated)
    samples: float = 0.0
    spot_dollars: float = 0.0
    od_dollars: float = 0.0
    instance_seconds: float = 0.0
    launched: int = 0
    preempted_in_window: int = 0
    died: int = 0
    peer_seconds: float = 0.0  # integral of live peers over the window
    lifetime_check: str = ""
    rows: list = field(default_factory=list)  # progress (time, epoch, peers) up to t1
    after: tuple | None = None  # the first progress (time, epoch) after t1
    load: list = field(default_factory=list)  # 1-min load averages sampled during the window
    wall_s: float = 0.0

    @property
    def window(self) -> float:
        return self.t1 - self.t0

    @property
    def rate(self) -> float:
        return self.samples / self.window if self.window > 0 else 0.0


# ---- configs -----------------------------------------------------------------------------------
def make_config(name: str, args: argparse.Namespace, seed: int, mean_lifetime_s: float | None,
                checkpoint_s: float):
    from orchestrator.config.schema import ClusterConfig

    preemption = ({"distribution": "none"} if mean_lifetime_s is None
                  else {"distribution": "exponential", "mean_lifetime_s": mean_lifetime_s})
    return ClusterConfig.model_validate({
        "cluster_name": name,
        "provider": {"type": "local", "zones": ZONES, "time_scale": args.time_scale,
                     "provisioning_delay_s": args.provisioning_s, "seed": seed},
        "available_node_types": {NODE_TYPE: {
            "node_config": {"InstanceType": "sim.gpu"}, "resources": {"CPU": 1},
            "min_workers": args.instances, "max_workers": args.instances, "warm_spares": args.warm_spares,
            "spot": True,
            "on_demand_price_per_hour": ON_DEMAND,
            "spot_price_per_hour": {z: SPOT_RATIO * ON_DEMAND for z in ZONES},
            "preemption": preemption}},
        "spot": {"market": "spot", "notice_period_s": args.notice_s, "fallback_to_on_demand_after": None},
        "budget": {},
        "training": {"task": args.task_spec, "target_batch_size": args.target_batch_size,
                     "averaging": "collaborative", "compression": "none", "averaging_timeout_s": 20.0,
                     "min_matchmaking_time_s": 1.0},
        "checkpoint": {"every_s": checkpoint_s, "keep": 2},
        "dashboard": {"enabled": False},
    })


# ---- one run -----------------------------------------------------------------------------------
def _ro(run_dir: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{run_dir / 'run.sqlite'}?mode=ro", uri=True, timeout=30)


def run_one(run: Run, config, base: Path, args: argparse.Namespace, window_real_s: float, min_epochs: int = 0,
            max_window_real_s: float | None = None) -> None:
    """One supervisor run; the window lasts ``window_real_s``, or longer (up to ``max_window_real_s``)
    until ``min_epochs`` epochs are done."""
    from orchestrator.fleet.supervisor import SupervisorCore
    from orchestrator.runs.store import RunStore

    started = time.monotonic()
    RunStore.create(config, base).close()
    run_dir = config.run_dir(base)
    sup = SupervisorCore(config, run_dir)
    scale = config.provider.time_scale
    try:
        sup.start()
        db = _ro(run_dir)
        deadline = time.monotonic() + args.boot_timeout_s
        first = None
        while time.monotonic() < deadline:
            first = db.execute("SELECT MIN(time) FROM progress").fetchone()[0]
            if first is not None:
                break
            time.sleep(0.25)
        if first is None:
            run.error = f"no global epoch within {args.boot_timeout_s:.0f} s (real) of start"
            db.close()
            return
        run.t0, run.t1 = first, first + window_real_s * scale
        longest = first + max(window_real_s, max_window_real_s or 0.0) * scale
        next_load = 0.0
        while True:
            now = sup.clock()
            if now >= run.t1 + 0.5 * scale:  # half a real second more, for the last progress row to land
                done = db.execute("SELECT MAX(epoch) - MIN(epoch) FROM progress WHERE time <= ?",
                                  (run.t1,)).fetchone()[0] or 0
                if done >= min_epochs or run.t1 >= longest:
                    break
                run.t1 = min(run.t1 + scale, longest)  # one more real second
            if time.monotonic() >= next_load:
                run.load.append(os.getloadavg()[0])
                next_load = time.monotonic() + 5.0
            time.sleep(min(0.5, max((run.t1 + 0.5 * scale - now) / scale, 0.01)))
        run.rows = db.execute("SELECT time, epoch, peers FROM progress WHERE time <= ? ORDER BY time",
                              (run.t1,)).fetchall()
        # the first epoch after the window, to interpolate the epoch in progress at its end
        wait_until = time.monotonic() + args.tail_s
        while run.after is None and time.monotonic() < wait_until:
            run.after = db.execute("SELECT time, epoch FROM progress WHERE time > ? ORDER BY time LIMIT 1",
                                   (run.t1,)).fetchone()
            if run.after is None:
                time.sleep(0.25)
        db.close()
    finally:
        sup.stop()
        run.wall_s = time.monotonic() - started
    if run.error is None:
        _analyze(run, config, run_dir)


def _epoch_at(rows: list, t: float) -> int:
    return max((epoch for time_, epoch, _ in rows if time_ <= t), default=0)


def _analyze(run: Run, config, run_dir: Path) -> None:
    db = _ro(run_dir)
    try:
        inst = db.execute("SELECT id, price_per_hour, on_demand_price_per_hour, launched_at, ended_at, end_reason "
                          "FROM instances ORDER BY launched_at").fetchall()
        events = db.execute("SELECT kind, instance_id FROM events WHERE kind IN ('standby', 'activated')").fetchall()
    finally:
        db.close()
    t0, t1 = run.t0, run.t1
    end = float(_epoch_at(run.rows, t1))
    if run.after is not None and run.rows:  # part of the epoch in progress at t1, linearly
        t_last = max(t for t, _, _ in run.rows)
        end += (run.after[1] - end) * (t1 - t_last) / (run.after[0] - t_last)
    run.epochs = end - _epoch_at(run.rows, t0)
    run.samples = run.epochs * config.training.target_batch_size
    run.launched = len(inst)
    run.first_launch = min((r[3] for r in inst), default=t0)
    # warm spares that never trained: paid for at spot prices, but an on-demand fleet needs none
    idle_spares = {i for kind, i in events if kind == "standby"} - {i for kind, i in events if kind == "activated"}
    for _id, price, od, launched, ended, reason in inst:
        overlap = max(0.0, min(ended if ended is not None else t1, t1) - max(launched, t0))
        run.instance_seconds += overlap
        run.spot_dollars += overlap / 3600 * price
        if _id not in idle_spares:
            run.od_dollars += overlap / 3600 * od
        if reason == "preempted" and ended is not None and t0 <= ended <= t1:
            run.preempted_in_window += 1
        elif reason == "died":
            run.died += 1
    pts = [(t, p) for t, _, p in run.rows if t >= t0]  # live peers, as recorded with each epoch
    for i, (t, p) in enumerate(pts):
        run.peer_seconds += p * ((pts[i + 1][0] if i + 1 < len(pts) else t1) - t)
    if run.mean_lifetime_s is not None:
        run.lifetime_check = _check_lifetimes(inst, run.mean_lifetime_s, config)


def _check_lifetimes(inst: list, mean: float, config) -> str:
    """The killed instances' recorded lifetimes against the draws the provider should have made."""
    late = [ended - launched - launch_rng(config.provider.seed, int(iid.rsplit("-", 1)[1])).expovariate(1.0 / mean)
            for iid, _p, _od, launched, ended, reason in inst if reason in ("preempted", "died") and ended]
    if not late:
        return "no kills"
    scale = config.provider.time_scale
    return f"{len(late)} kills {min(late) / scale:+.2f}..{max(late) / scale:+.2f}s"


# ---- the restart-from-checkpoint baseline (simulated) -----------------------------------------
def simulate_restart(seed: int, mean_lifetime: float, n: int, rate: float, checkpoint_s: float,
                     provisioning_s: float, boot_s: float, t0: float, t1: float) -> dict:
    """Discrete-event simulation; times in simulated seconds from the first launch."""
    launches = itertools.count()  # launch k's lifetime is drawn as the provider draws it

    def draw() -> float:
        return launch_rng(seed, next(launches)).expovariate(1.0 / mean_lifetime)
    slots = []  # [launch, kill] of the instance in each slot
    bills = []  # every instance's [launch, kill]
    for _ in range(n):
        life = draw()
        slots.append([0.0, life])
        bills.append([0.0, life])
    segs = []  # training segments: (start, end, progress at start, progress kept after the end)
    base = 0.0
    ready = boot_s
    restarts = 0
    while True:
        i = min(range(n), key=lambda j: slots[j][1])
        kill = slots[i][1]
        if kill >= ready:  # the job trains from ready until this kill
            if ready >= t1:
                break
            if kill >= t1:
                segs.append((ready, t1, base, base + rate * (t1 - ready)))
                break
            kept = math.floor((kill - ready) / checkpoint_s) * checkpoint_s
            segs.append((ready, kill, base, base + rate * kept))
            base += rate * kept
            restarts += 1
        elif kill >= t1:
            break
        launch = kill + provisioning_s
        life = draw()
        slots[i] = [launch, launch + life]
        bills.append([launch, launch + life])
        ready = max(s[0] for s in slots) + boot_s

    def progress(t: float) -> float:
        """The furthest the job has been by time t: what the run store records (the supervisor keeps
        the highest epoch seen, so work redone after a restart counts once it goes further)."""
        value = 0.0
        for s, e, b, _after in segs:
            if s <= t:
                value = max(value, b + rate * (min(t, e) - s))
        return value

    samples = progress(t1) - progress(t0)
    inst_s = sum(max(0.0, min(k, t1) - max(lau, t0)) for lau, k in bills)
    return {"retained": samples / (rate * (t1 - t0)), "samples": samples, "window": t1 - t0,
            "instance_seconds": inst_s, "restarts": restarts}


def _rate_by_peers(runs: list[Run], tbs: int) -> dict[int, tuple[float, float]]:
    """Samples per simulated second while p peers were live: epochs whose record and the one before
    both counted p (an epoch across a departure or an arrival mixes the leaver's samples with its
    replacement's, and with replacements up in a second or two, most epochs counting fewer peers are
    such; counted, they made 2 peers look 0.95 as fast as 3 where 2 instances alone train 0.72)."""
    acc: dict[int, list[float]] = {}
    for r in runs:
        rows = [x for x in r.rows if x[0] >= r.t0]
        for (ta, ea, pa), (tb, eb, pb) in zip(rows, rows[1:], strict=False):
            if pa != pb:
                continue
            a = acc.setdefault(int(pb), [0.0, 0.0])
            a[0] += (eb - ea) * tbs
            a[1] += tb - ta
    return {p: (s / t, t) for p, (s, t) in acc.items() if t > 0}


# ---- reporting ---------------------------------------------------------------------------------
def _warning_key(record: logging.LogRecord) -> str:
    key = f"{record.levelname} {record.name}: {record.getMessage()[:160]}"
    if record.exc_info and record.exc_info[0] is not None:
        key += f" [{record.exc_info[0].__name__}: {str(record.exc_info[1])[:100]}]"
    return key


def _quiet_worker_deaths(counter: dict) -> None:
    """Count, instead of printing, Ray's "A worker died or was killed" lines: every preemption is a
    SIGKILL of an actor's process, so each one prints a screenful."""
    import ray._private.worker as rw

    original = rw.print_to_stdstream

    def filtered(data, ignore_prefix):  # noqa: ANN001 - Ray's signature
        lines = [ln for ln in data.get("lines", []) if "A worker died or was killed" not in ln]
        counter["worker_deaths"] += len(data.get("lines", [])) - len(lines)
        if lines:
            original({**data, "lines": lines}, ignore_prefix)

    rw.print_to_stdstream = filtered


# ---- the benchmark's steps ---------------------------------------------------------------------
@dataclass
class Bench:
    """What the steps share: the arguments, the runs so far, E, and what the report needs."""

    args: argparse.Namespace
    wall0: float
    base: Path | None = None
    runs: list[Run] = field(default_factory=list)
    epoch_s: float = 0.0
    checkpoint_s: float = 0.0
    ray_up_s: float = 0.0
    session_dir: str | None = None
    counter: dict = field(default_factory=lambda: {"worker_deaths": 0})
    collect: WarningCounter = field(default_factory=lambda: WarningCounter(_warning_key))

    @property
    def scale(self) -> float:
        return self.args.time_scale

    def stamp(self) -> str:
        return f"[{time.monotonic() - self.wall0:6.1f}s load {os.getloadavg()[0]:4.1f}]"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="calibration as none, then L20, 8-s windows, --device-ms 5 (smoke test)")
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--warm-spares", type=int, default=0,
                        help="warm spares kept besides the instances (booted, joined, idle until a notice; billed)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds of the four cases (3; quick 1)")
    parser.add_argument("--window-s", type=float, help="measured window per run, real seconds (60; quick 8)")
    parser.add_argument("--calibration-s", type=float,
                        help="window of the calibration run, real seconds (40, longer until 10 epochs, at most 4x)")
    parser.add_argument("--target-batch-size", type=int, help="global batch per epoch (32768; quick 8192)")
    parser.add_argument("--device-ms", type=float,
                        help="pad each forward pass with this much sleep (an accelerator step); 0 = plain synthetic "
                             "(0; quick 5: plain epochs are so short that lifetimes of 20 E are all churn)")
    parser.add_argument("--time-scale", type=float, default=10.0, help="simulated seconds per real second")
    parser.add_argument("--provisioning-s", type=float, default=20.0, help="simulated seconds")
    parser.add_argument("--notice-s", type=float, default=30.0, help="preemption notice, simulated seconds")
    parser.add_argument("--checkpoint-epochs", type=float, default=5.0, help="checkpoint interval, in epochs E")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--boot-timeout-s", type=float, default=150.0, help="real seconds to the first epoch")
    parser.add_argument("--tail-s", type=float,
                        help="real seconds to wait after a window for its next epoch, to interpolate (30; quick 5)")
    parser.add_argument("--keep-runs", metavar="DIR", help="keep the run directories under DIR")
    args = parser.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.window_s = args.window_s or (8.0 if args.quick else 60.0)
    args.calibration_s = args.calibration_s or (args.window_s if args.quick else 40.0)
    args.target_batch_size = args.target_batch_size or (8192 if args.quick else 32768)
    args.device_ms = args.device_ms if args.device_ms is not None else (5.0 if args.quick else 0.0)
    args.tail_s = args.tail_s if args.tail_s is not None else (5.0 if args.quick else 30.0)
    if args.device_ms > 0:
        from _preemption_task import task_spec
        args.task_spec = task_spec(args.device_ms)
    else:
        args.task_spec = "synthetic"
    return args


def start_ray(b: Bench) -> None:
    """One local Ray session for every run (three tries); Ray's 'worker died' lines counted, not printed."""
    import ray

    retry(lambda: ray.init(include_dashboard=False, num_cpus=2, log_to_driver=False, configure_logging=False,
                           namespace="spotswarm-bench-preemption"))
    b.ray_up_s = time.monotonic() - b.wall0
    _quiet_worker_deaths(b.counter)
    try:
        b.session_dir = ray._private.worker._global_node.get_session_dir_path()
    except Exception:
        b.session_dir = None


def calibrate(b: Bench) -> None:
    """Step 1: the epoch time E, from a run without preemptions (exits if it fails)."""
    args = b.args
    cal = Run("none" if args.quick else "calibration", 0, args.seed)
    b.runs.append(cal)
    print(f"{b.stamp()} calibration: no preemptions, {args.calibration_s:g} s window ...", flush=True)
    run_one(cal, make_config("bp-cal", args, args.seed, None, 300.0), b.base, args, args.calibration_s,
            min_epochs=0 if args.quick else 10, max_window_real_s=None if args.quick else 4 * args.calibration_s)
    if cal.error or cal.epochs == 0:
        why = cal.error or "no epoch in the window"
        print(f"the calibration run failed: {why}")
        print_json({"error": f"calibration failed: {why}", "quick": args.quick})
        sys.exit(1)
    # E from epoch boundary to epoch boundary: the first record of the window's last epoch
    last = max(e for t, e, _ in cal.rows)
    t_last = min(t for t, e, _ in cal.rows if e == last)
    counted = last - _epoch_at(cal.rows, cal.t0)
    b.epoch_s = (t_last - cal.t0) / counted
    b.checkpoint_s = args.checkpoint_epochs * b.epoch_s
    print(f"{b.stamp()} E = {b.epoch_s:.1f} s ({b.epoch_s / b.scale:.2f} s real) over {counted} epochs", flush=True)


def run_cases(b: Bench) -> None:
    """Step 2: the cases, in interleaved rounds (the order rotates each round)."""
    args = b.args
    cases = [("L20", 20)] if args.quick else [("none", None)] + [(f"L{k}", k) for k in LIFETIME_FACTORS]
    for r in range(args.rounds):
        seed = args.seed + r
        for name, k in cases[r % len(cases):] + cases[: r % len(cases)]:
            mean = k * b.epoch_s if k else None
            run = Run(name, r, seed, k, mean)
            b.runs.append(run)
            life = f"mean lifetime {mean:.0f} s ({mean / b.scale:.0f} s real)" if mean else "no preemptions"
            print(f"{b.stamp()} round {r + 1}/{args.rounds} {name}: {life} ...", flush=True)
            run_one(run, make_config(f"bp-{name.lower()}-r{r}", args, seed, mean, b.checkpoint_s), b.base, args,
                    args.window_s)
            if run.error:
                print(f"    failed: {run.error}", flush=True)


def agg_rate(rs: list[Run]) -> float:
    return sum(r.samples for r in rs) / sum(r.window for r in rs)


@dataclass
class Summary:
    """The runs by case, against the no-preemption reference, and the simulated restart baseline."""

    ok: list[Run]
    by_case: dict[str, list[Run]]
    ref_rate: float
    od_per_ms: float  # $ per million samples of none at on-demand prices
    boot_s: float
    baseline: dict[str, dict]
    cases: dict[str, dict] = field(default_factory=dict)  # retained and $ ratio per case that ran

    def retained(self, name: str) -> float | None:
        return self.cases.get(name, {}).get("retained")


def summarize(b: Bench) -> Summary:
    ok = [r for r in b.runs if r.error is None and r.case != "calibration"]
    by_case: dict[str, list[Run]] = {}
    for r in ok:
        by_case.setdefault(r.case, []).append(r)
    nones = by_case.get("none", [])
    if not nones or sum(r.samples for r in nones) == 0:
        print_json({"error": "no successful no-preemption run", "quick": b.args.quick})
        sys.exit(1)
    ref_rate = agg_rate(nones)
    boots = [r.t0 - r.first_launch - b.epoch_s for r in b.runs if r.error is None and r.factor is None]
    boot_s = max(statistics.fmean(boots), 0.0)
    return Summary(ok, by_case, ref_rate, sum(r.od_dollars for r in nones) / sum(r.samples for r in nones) * 1e6,
                   boot_s, restart_baselines(b, by_case, ref_rate, boot_s))


def restart_baselines(b: Bench, by_case: dict[str, list[Run]], ref_rate: float, boot_s: float) -> dict[str, dict]:
    """The restart baseline per lifetime, simulated on the rounds' seeds and on 1000 seeds."""
    args = b.args
    w0 = boot_s + b.epoch_s
    w1 = w0 + args.window_s * b.scale
    baseline: dict[str, dict] = {}
    for name, k in [(f"L{k}", k) for k in LIFETIME_FACTORS]:
        mean = k * b.epoch_s
        seeds = [r.seed for r in by_case.get(name, [])] or [args.seed + r for r in range(args.rounds)]
        sims = [simulate_restart(s, mean, args.instances, ref_rate, b.checkpoint_s, args.provisioning_s, boot_s,
                                 w0, w1) for s in seeds]
        samples = sum(s["samples"] for s in sims)
        inst_s = sum(s["instance_seconds"] for s in sims)
        many = [simulate_restart(s, mean, args.instances, ref_rate, b.checkpoint_s, args.provisioning_s, boot_s,
                                 w0, w1)["retained"] for s in range(1000)]
        baseline[name] = {
            "retained": samples / (ref_rate * sum(s["window"] for s in sims)),
            "mean_1000_seeds": statistics.fmean(many),
            "restarts": sum(s["restarts"] for s in sims),
            "dpm": inst_s / 3600 * SPOT_RATIO * ON_DEMAND / samples * 1e6 if samples > 0 else None,
        }
    return baseline


def print_setup(b: Bench, s: Summary) -> None:
    args, scale, epoch_s = b.args, b.scale, b.epoch_s
    print()
    spares = (f" + {args.warm_spares} warm spare{'s' if args.warm_spares != 1 else ''} (billed at spot prices; "
              "the on-demand reference has none)" if args.warm_spares else "")
    print(f"fleet: {args.instances} x {NODE_TYPE} spot instances{spares}, task {args.task_spec}, target_batch_size "
          f"{args.target_batch_size}, time_scale {scale:g} (simulated s per real s); one Ray session")
    print(f"E = {epoch_s:.1f} s ({epoch_s / scale:.2f} s real, calibration run); B = {s.boot_s:.0f} s "
          f"({s.boot_s / scale:.1f} s real) = {s.boot_s / epoch_s:.1f} E; provisioning {args.provisioning_s:g} s; "
          f"notice {args.notice_s:g} s; checkpoint every {b.checkpoint_s:.0f} s = {args.checkpoint_epochs:g} E")
    print(f"window {args.window_s * scale:.0f} s ({args.window_s:g} s real) per run, {args.rounds} round(s); prices: "
          f"on-demand ${ON_DEMAND:.2f}/h, spot ${SPOT_RATIO * ON_DEMAND:.2f}/h")
    print()


def print_runs(b: Bench, s: Summary) -> None:
    nones = s.by_case["none"]
    rows = []
    for r in b.runs:
        if r.error:
            rows.append((r.round + 1, r.case, f"  FAILED: {r.error}"))
            continue
        same = [x for x in nones if x.round == r.round]
        vs = r.rate / same[0].rate if same and same[0].rate > 0 and r.case != "calibration" else None
        rows.append((r.round + 1, r.case, fmt(r.factor, "g") if r.factor else "-", r.preempted_in_window,
                     f"{r.peer_seconds / r.window:.2f}", f"{r.epochs:.1f}", f"{r.rate * b.scale:.0f}", fmt(vs),
                     f"{statistics.fmean(r.load) if r.load else 0:.1f}", f"{r.wall_s:.0f}", r.lifetime_check))
    print_table(["<6", "<12", ">7", ">8", ">6", ">7", ">11", ">8", ">6", ">6"],
                ["round", "case", "life/E", "preempt", "peers", "epochs", "samples/s", "vs none", "load", "wall",
                 "kill time - drawn lifetime (real)"], rows, note_sep="  ", rule=True)
    print("(samples/s per real second; preempt = preemptions in the window; peers = mean live peers;"
          " vs none = against the same round's none; load = 1-min load average during the window)")
    print()


def print_cases(b: Bench, s: Summary) -> None:
    """Per case, against none and the restart baseline; fills ``s.cases``."""
    hdr = (f"{'case':<6}{'preempt':>8}{'samples/s':>11}{'retained':>9}{'$/Msample':>11}{'vs OD':>7}"
           f"   restart baseline (simulated): {'retained':>8}{'1000 seeds':>11}{'restarts':>9}{'vs OD':>7}")
    print(hdr)
    print("-" * len(hdr))
    for name in ["none"] + [f"L{k}" for k in LIFETIME_FACTORS]:
        rs = s.by_case.get(name)
        bl = s.baseline.get(name)
        btxt = (f"   {'':>30}{bl['retained']:>8.3f}{bl['mean_1000_seeds']:>11.3f}{bl['restarts']:>9}"
                f"{fmt(bl['dpm'] / s.od_per_ms if bl['dpm'] else None):>7}") if bl else ""
        if not rs:
            print(f"{name:<6}{'not run':>35}{btxt}")
            continue
        rate = agg_rate(rs)
        samples = sum(r.samples for r in rs)
        dpm = sum(r.spot_dollars for r in rs) / samples * 1e6 if samples else None
        s.cases[name] = {"retained": rate / s.ref_rate, "dpm_ratio": dpm / s.od_per_ms if dpm else None}
        print(f"{name:<6}{sum(r.preempted_in_window for r in rs):>8}{rate * b.scale:>11.0f}{rate / s.ref_rate:>9.3f}"
              f"{fmt(dpm, '.4f'):>11}{fmt(dpm / s.od_per_ms if dpm else None):>7}{btxt}")
    print(f"{'none at on-demand prices':<34}{s.od_per_ms:>11.4f}{1.0:>7.3f}")


def print_checks(s: Summary) -> None:
    r20, b20 = s.retained("L20"), s.baseline["L20"]["retained"]
    print()
    checks = [
        ("retained at lifetime 20 x E", r20, ">= 0.80", lambda v: v >= 0.8),
        ("restart baseline at 20 x E (simulated)", b20, "", None),
        ("retained / restart baseline at 20 x E", r20 / b20 if r20 is not None and b20 > 0 else None,
         "well above 1 (>= 1.5)", lambda v: v >= 1.5),
        ("$/Msample L20 spot / none on-demand", s.cases.get("L20", {}).get("dpm_ratio"), "<= 0.40", lambda v: v <= 0.4),
    ]
    print(f"{'figure':<44}{'value':>9}   target")
    for name, value, target, good in checks:
        mark = "" if good is None or value is None else ("  ok" if good(value) else "  MISSED")
        print(f"{name:<44}{fmt(value):>9}   {target}{mark}")
    print()


def print_notes(b: Bench, by_peers: dict[int, tuple[float, float]], load0: tuple, load1: tuple, wall: float) -> None:
    n, scale = b.args.instances, b.scale
    print("samples/s by live peers, all runs (epochs in steady stretches: the same count at both ends): "
          + ", ".join(f"{p} peers {rt * scale:.0f} ({sec / scale:.0f} s real)"
                      for p, (rt, sec) in sorted(by_peers.items())))
    full = by_peers.get(n, (0.0, 0.0))[0]
    fewer = by_peers.get(n - 1, (0.0, 0.0))[0]
    if full > 0 and fewer > 0 and fewer / full > (n - 1) / n + 0.15:
        print(f"WARNING: {n - 1} live peers trained {fewer / full:.2f}x as fast as {n} (linear scaling: "
              f"{(n - 1) / n:.2f}): the peers share this machine's CPU, so losing one costs little and 'retained' "
              "says more about CPU contention than about preemptions; --device-ms gives each peer its own capacity")
    print(f"instances killed by the simulator (Ray 'worker died' notices, not printed): {b.counter['worker_deaths']}")
    if b.collect.counts:
        print(f"warnings logged in this process ({sum(b.collect.counts.values())}):")
        for msg, count in b.collect.counts.most_common(12):
            print(f"  {count:>4} x {msg}")
    if b.session_dir:
        print(f"instance (Ray actor) logs: {b.session_dir}/logs")
    print(f"wall {wall:.0f} s (Ray start {b.ray_up_s:.0f} s); load average at start {load0[0]:.2f} {load0[1]:.2f} "
          f"{load0[2]:.2f}, at end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    if b.args.quick:
        print(f"--quick: a smoke test, not a measurement (calibration run doubles as none; L20 only; 8-s windows; "
              f"forward passes padded by {b.args.device_ms:g} ms)")


def figures_of(b: Bench, s: Summary, by_peers: dict[int, tuple[float, float]], load0: tuple, load1: tuple,
               wall: float) -> dict:
    args, scale = b.args, b.scale
    return {
        "retained_l10": s.retained("L10"), "retained_l20": s.retained("L20"), "retained_l50": s.retained("L50"),
        "restart_baseline_l20": s.baseline["L20"]["retained"],
        "restart_baseline_l20_mean_1000_seeds": s.baseline["L20"]["mean_1000_seeds"],
        "restart_baseline_l10": s.baseline["L10"]["retained"], "restart_baseline_l50": s.baseline["L50"]["retained"],
        "restart_baseline_simulated": True,
        "cost_per_msample_ratio_vs_ondemand": s.cases.get("L20", {}).get("dpm_ratio"),
        "samples_per_s_none": s.ref_rate * scale,
        "preemptions_in_window": {c: sum(r.preempted_in_window for r in rs)
                                  for c, rs in s.by_case.items() if c != "none"},
        "epoch_time_s": b.epoch_s, "epoch_time_real_s": b.epoch_s / scale, "boot_s": s.boot_s,
        "checkpoint_every_s": b.checkpoint_s, "provisioning_delay_s": args.provisioning_s,
        "notice_period_s": args.notice_s, "time_scale": scale, "window_real_s": args.window_s, "rounds": args.rounds,
        "instances": args.instances, "warm_spares": args.warm_spares, "task": args.task_spec,
        "target_batch_size": args.target_batch_size,
        "spot_price_ratio": SPOT_RATIO, "seed": args.seed, "quick": args.quick, "wall_s": wall,
        "ray_start_s": b.ray_up_s, "load_avg_start": list(load0), "load_avg_end": list(load1),
        "samples_per_s_by_peers": {str(p): rt * scale for p, (rt, _) in sorted(by_peers.items())},
        "failed_runs": [f"{r.case}/r{r.round + 1}" for r in b.runs if r.error],
    }


def main() -> None:
    b = Bench(parse_args(), time.monotonic())
    for name in ("orchestrator", "workers", "dht", "averaging", "p2p"):
        logging.getLogger(name).addHandler(b.collect)
        logging.getLogger(name).propagate = False
    load0 = os.getloadavg()
    import ray

    b.base = Path(b.args.keep_runs) if b.args.keep_runs else Path(tempfile.mkdtemp(prefix="bench-preemption-"))
    b.base.mkdir(parents=True, exist_ok=True)
    try:
        start_ray(b)
        calibrate(b)
        run_cases(b)
    finally:
        ray.shutdown()
        if not b.args.keep_runs:
            shutil.rmtree(b.base, ignore_errors=True)
    s = summarize(b)
    print_setup(b, s)
    print_runs(b, s)
    print_cases(b, s)
    print_checks(s)
    by_peers = _rate_by_peers(s.ok, b.args.target_batch_size)
    wall = time.monotonic() - b.wall0
    load1 = os.getloadavg()
    print_notes(b, by_peers, load0, load1, wall)
    print_json(figures_of(b, s, by_peers, load0, load1, wall))


if __name__ == "__main__":
    main()
