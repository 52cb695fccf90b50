"""Training over slow links: 4 peers in 2 emulated regions (``_regions.py``: 1 Gbit/s within a region,
50 Mbit/s and 100 ms RTT between them), the ``charlm`` task, in the three modes side by side:

- ``collaborative``: the whole gradient all-reduced every global batch of ``--collab-batch`` samples;
- ``moshpit``: parameters averaged in Moshpit groups every ``--inner-steps`` local steps;
- ``diloco``: ``--inner-steps`` inner Adam steps per peer, then the averaged pseudo-gradients and an
  outer Nesterov step (``workers/diloco.py``);
- ``diloco-overlap``: the same with ``overlap: true``, each round all-reduced while the next inner
  phase trains (its communication counts only where the training waited for it).

Each mode runs without preemptions and under one seeded preemption trace: every peer slot's
lifetimes are exponential with mean 20 x E (E: the collaborative mode's median epoch here, measured
in its run without preemptions); a preempted peer is SIGKILLed (no notice) and its slot starts a
newcomer ``--restart-s`` later, which loads the others' state.

Figures, from every worker's report (a line per epoch, and one a second with the training loss since
the last: ``report_every_s``): time to ``--target`` loss (the live peers' mean of their latest loss,
from the moment all four listen), bytes sent per sample trained (every call a peer made: averaging,
state hand-off, DHT), the swarm's loss at equal samples, and the time split into compute and
communication (averaging and state downloads).  Every worker runs
with a time limit; a run past its limit is stopped and reported, and the others still run.
Needs root for the namespaces; without, it says so and prints what it can (nothing measured).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import Child, ChildFailed, fmt, kill_all, print_json, print_table  # noqa: E402
from benchmarks._netns import available  # noqa: E402
from benchmarks._regions import Regions, regions  # noqa: E402

MODES = ("collaborative", "moshpit", "diloco", "diloco-overlap")  # the last: diloco with overlap: true
PEERS_PER_REGION = (2, 2)
SLOTS = [(r, k) for r, n in enumerate(PEERS_PER_REGION) for k in range(n)]
START_S = 60.0  # a worker prints its address within this
LINK_MBIT = 50.0  # between the regions
RTT_MS = 100.0
PROGRESS_S = 1.0  # every worker reports its training loss this often, whatever its mode's epoch


@dataclass
class Process:
    """One worker process of a slot: its report file and when it started."""

    slot: int
    report: Path
    started: float
    records: list[dict] = field(default_factory=list)

    def read(self) -> list[dict]:
        if self.report.exists():
            self.records = [json.loads(line) for line in self.report.read_text().splitlines() if line.strip()]
        return self.records


@dataclass
class RunResult:
    mode: str
    trace: str
    processes: list[Process]
    t0: float  # wall time (time.time()) when every first worker listened
    wall_s: float
    seconds: float = 0.0  # how long it was to train
    preemptions: int = 0
    error: str | None = None


def worker_argv(world: Regions, slot: int, mode: str, args: argparse.Namespace, seconds: float, report: Path,
                initial: str | None, seed: int) -> list[str]:
    region, k = SLOTS[slot]
    overlap = mode == "diloco-overlap"
    mode = "diloco" if overlap else mode
    argv = [*world.exec_prefix(region), sys.executable, "-m", "orchestrator.cli.main", "worker",
            *world.worker_flags(region, k), "--run", f"wan-{mode}{'-overlap' if overlap else ''}", "--task",
            "charlm", "--mode", mode,
            "--report-file", str(report), "--seed", str(seed), "--max-seconds", str(seconds),
            "--min-matchmaking-time", str(args.min_matchmaking_time), "--averaging-timeout", "30",
            "--target-batch-size", str(args.collab_batch), "--averaging-period", str(args.inner_steps),
            "--inner-steps", str(args.inner_steps), "--round-peers", str(len(SLOTS)), "--device", "cpu",
            # declared as a node type's bandwidth would be: no newcomer spends megabytes measuring it
            "--bandwidth", str(LINK_MBIT),
            "--report-every-s", str(PROGRESS_S),
            "--compression", args.diloco_compression if mode == "diloco" else "none"]
    if overlap:
        argv.append("--overlap")
    if initial is None:
        argv += ["--min-peers", str(len(SLOTS))]
    else:
        argv += ["--initial-peers", initial, "--min-peers", str(len(SLOTS))]
    return argv


def preemption_trace(seed: int, mean_lifetime_s: float, duration_s: float) -> list[tuple[float, int]]:
    """(seconds after the start, slot) of every preemption: exponential lifetimes per slot."""
    rng = random.Random(seed)
    out = []
    for slot in range(len(SLOTS)):
        t = rng.expovariate(1.0 / mean_lifetime_s)
        while t < duration_s - 5.0:
            out.append((t, slot))
            t += rng.expovariate(1.0 / mean_lifetime_s)
    return sorted(out)


def run_mode(world: Regions, mode: str, args: argparse.Namespace, seconds: float, trace: list[tuple[float, int]],
             label: str, tmp: Path) -> RunResult:
    """Four workers train for ``seconds``; the trace's preemptions kill and replace them."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    children: dict[int, Child] = {}
    processes: list[Process] = []
    serial = 0

    def launch(slot: int, initial: str | None, left_s: float) -> Child:
        nonlocal serial
        serial += 1
        report = tmp / f"{mode}-{label}-{slot}-{serial}.jsonl"
        child = Child(f"{mode} peer {slot}", worker_argv(world, slot, mode, args, left_s, report, initial, serial),
                      env=env, stdin=False, log_path=str(tmp / f"{mode}-{label}-{slot}-{serial}.log"))
        processes.append(Process(slot, report, time.time()))
        children[slot] = child
        return child

    result = RunResult(mode, label, processes, 0.0, 0.0, seconds)
    addresses: dict[int, str] = {}  # slot -> its live worker's address (it prints ``worker <address>``)

    def listening(slot: int) -> None:
        addresses[slot] = children[slot].line(time.monotonic() + START_S, "address").split()[-1]

    try:
        launch(0, None, seconds)
        listening(0)
        for slot in range(1, len(SLOTS)):
            launch(slot, addresses[0], seconds)
        for slot in range(1, len(SLOTS)):
            listening(slot)
        result.t0 = time.time()
        started = time.monotonic()
        pending = list(trace)
        while time.monotonic() - started < seconds + 30 and any(c.running for c in children.values()):
            while pending and pending[0][0] <= time.monotonic() - started:
                _, slot = pending.pop(0)
                children[slot].kill()  # SIGKILL, no notice: its work since the last round is lost
                result.preemptions += 1
                time.sleep(args.restart_s)
                alive = [s for s, c in children.items() if c.running]
                left = seconds - (time.monotonic() - started)
                if alive and left > 5:
                    launch(slot, addresses[alive[0]], left)
                    listening(slot)
            time.sleep(0.2)
        if any(c.running for c in children.values()):
            result.error = f"ran past {seconds + 30:.0f} s and was stopped"
    except ChildFailed as e:
        result.error = str(e).splitlines()[0]
    finally:
        result.wall_s = time.time() - result.t0 if result.t0 else 0.0
        for child in children.values():
            child.kill()
    for p in processes:
        p.read()
    return result


# ---- figures -----------------------------------------------------------------------------------
def swarm_curve(result: RunResult, step_s: float = 0.5) -> list[tuple[float, int, float]]:
    """(seconds since t0, samples trained by the whole swarm, the live peers' mean latest loss)."""
    records = sorted(((r["time"], i, r) for i, p in enumerate(result.processes) for r in p.records),
                     key=lambda x: x[0])
    if not records:
        return []
    latest: dict[int, dict] = {}
    done: dict[int, int] = {}  # samples of processes whose records ended (killed or finished)
    out, k, t = [], 0, result.t0
    end = records[-1][0]
    while t <= end + step_s:
        while k < len(records) and records[k][0] <= t:
            latest[records[k][1]] = records[k][2]
            k += 1
        fresh = [r for r in latest.values() if t - r["time"] < 10.0]
        samples = sum(r["samples_total"] for r in latest.values()) + sum(done.values())
        if fresh:
            out.append((t - result.t0, samples, statistics.fmean(r["loss"] for r in fresh)))
        t += step_s
    return out


def time_to(curve: list[tuple[float, int, float]], target: float) -> float | None:
    return next((t for t, _, loss in curve if loss <= target), None)


def loss_at(curve: list[tuple[float, int, float]], samples: int) -> float | None:
    before = [loss for _, s, loss in curve if s <= samples]
    return before[-1] if before else None


def totals(result: RunResult) -> dict:
    """Samples, bytes and seconds, summed over every process of the run."""
    samples = bytes_sent = 0
    comm = busy = 0.0
    for p in result.processes:
        if not p.records:
            continue
        last = p.records[-1]
        samples += last["samples_total"]
        bytes_sent += last["bytes_sent"]
        comm += last["comm_s"]
        busy += max(last["time"] - p.started, 1e-9)
    return {"samples": samples, "bytes": bytes_sent, "comm_s": comm, "busy_s": busy,
            "bytes_per_sample": bytes_sent / samples if samples else None,
            "comm_fraction": comm / busy if busy else None}


def epoch_interval(result: RunResult) -> float | None:
    """The median time between a process's consecutive epoch records."""
    epochs = [[r for r in p.records if r.get("kind") != "progress"] for p in result.processes]
    gaps = [b["time"] - a["time"] for records in epochs for a, b in zip(records, records[1:], strict=False)]
    return statistics.median(gaps) if gaps else None


def params_agree(result: RunResult) -> tuple[int, int]:
    """(epochs recorded by two or more processes, of those the ones whose digests differ)."""
    by_epoch: dict[int, set[str]] = {}
    counts: dict[int, int] = {}
    for p in result.processes:
        for r in p.records:
            if "params" in r:
                by_epoch.setdefault(r["epoch"], set()).add(r["params"])
                counts[r["epoch"]] = counts.get(r["epoch"], 0) + 1
    shared = [e for e, c in counts.items() if c >= 2]
    return len(shared), sum(1 for e in shared if len(by_epoch[e]) > 1)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---- main --------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="10 s runs of collaborative and diloco (H 40), no preemption trace (within 60 s)")
    parser.add_argument("--seconds", type=float, default=None, help="each run's training time")
    parser.add_argument("--target", type=float, default=None, help="the loss to reach")
    parser.add_argument("--inner-steps", type=int, default=None,
                        help="DiLoCo's H and Moshpit's averaging period (default 300; --quick: 40)")
    parser.add_argument("--diloco-compression", default="blockwise8", help="the codec of DiLoCo's pseudo-gradients")
    parser.add_argument("--collab-batch", type=int, default=256, help="collaborative: samples per global step")
    parser.add_argument("--min-matchmaking-time", type=float, default=2.0)
    parser.add_argument("--preempted-seconds", type=float, default=None,
                        help="each preempted run's training time (default: 1.5 x --seconds)")
    parser.add_argument("--collab-preempted-seconds", type=float, default=None,
                        help="the collaborative mode's preempted run's, on the same trace (default: 3 x --seconds)")
    parser.add_argument("--restart-s", type=float, default=2.0, help="a preempted slot's newcomer starts after this")
    parser.add_argument("--seed", type=int, default=0, help="the preemption trace's")
    parser.add_argument("--modes", default=None, help=f"default {','.join(MODES)} (--quick: collaborative,diloco)")
    parser.add_argument("--logs", metavar="DIR", help="keep every worker's log and epoch records here")
    args = parser.parse_args()
    if args.logs:
        os.makedirs(args.logs, exist_ok=True)
    seconds = args.seconds or (10.0 if args.quick else 90.0)
    args.inner_steps = args.inner_steps or (40 if args.quick else 300)
    target = args.target or (3.0 if args.quick else 2.4)
    modes = [m for m in (args.modes or ("collaborative,diloco" if args.quick else ",".join(MODES))).split(",") if m]
    print(f"bench_wan: 4 peers in 2 regions (50 Mbit/s, 100 ms RTT between them), charlm, {seconds:.0f} s a run, "
          f"target loss {target}, H = {args.inner_steps} ({args.diloco_compression} pseudo-gradients), collaborative "
          f"global batch {args.collab_batch} (uncompressed)")
    figures: dict = {"seconds": seconds, "target_loss": target, "inner_steps": args.inner_steps,
                     "collab_batch": args.collab_batch, "diloco_compression": args.diloco_compression}
    why = available(need_tc=True)
    if why:
        print(f"skipped: network namespaces unavailable ({why})")
        figures["skipped"] = why
        print_json(figures)
        return
    results: dict[tuple[str, str], RunResult] = {}
    try:
        with (contextlib.nullcontext(args.logs) if args.logs else tempfile.TemporaryDirectory(prefix="bench-wan-")) \
                as tmp, regions(PEERS_PER_REGION, link_mbit=LINK_MBIT, rtt_ms=RTT_MS) as world:
            for mode in modes:
                results[(mode, "none")] = run_mode(world, mode, args, seconds, [], "none", Path(tmp))
            if not args.quick:
                e = epoch_interval(results[("collaborative", "none")]) if "collaborative" in modes else None
                mean_life = 20 * (e or 1.0)
                long = args.preempted_seconds or 1.5 * seconds  # kills cost collaborative epochs: time to reach
                # collaborative reaches the target latest under kills: its run gets longer, on the same trace
                collab_long = args.collab_preempted_seconds or 3 * seconds
                trace = preemption_trace(args.seed, mean_life, max(long, collab_long))
                figures["preemption_mean_lifetime_s"] = mean_life
                figures["preemptions_in_trace"] = len([t for t, _ in trace if t < long - 5.0])
                for mode in modes:
                    length = collab_long if mode == "collaborative" else long
                    results[(mode, "preempted")] = run_mode(world, mode, args, length,
                                                            [(t, s) for t, s in trace if t < length - 5.0], "preempted",
                                                            Path(tmp))
    finally:
        kill_all()
    report(results, target, figures)


def report(results: dict[tuple[str, str], RunResult], target: float, figures: dict) -> None:
    rows, per = [], {}
    common_samples = min((totals(r)["samples"] for (m, t), r in results.items()
                          if t == "none" and m in ("collaborative", "diloco")), default=0)
    for (mode, trace), r in results.items():
        curve = swarm_curve(r)
        tot = totals(r)
        shared, differ = params_agree(r)
        entry = {"time_to_target_s": time_to(curve, target), "final_loss": curve[-1][2] if curve else None,
                 "loss_at_equal_samples": loss_at(curve, common_samples), **tot,
                 "epochs": max((rec["epoch"] for p in r.processes for rec in p.records), default=0),
                 "preemptions": r.preemptions, "epochs_compared": shared, "epochs_differing": differ,
                 "seconds": r.seconds, "samples_per_second": tot["samples"] / r.seconds if r.seconds else None,
                 "error": r.error}
        per[f"{mode}_{trace}"] = entry
        rows.append([mode, trace, fmt(entry["time_to_target_s"], ".1f"), fmt(entry["final_loss"], ".3f"),
                     fmt(entry["loss_at_equal_samples"], ".3f"), tot["samples"],
                     fmt(tot["bytes_per_sample"], ".0f"),
                     fmt(None if tot["comm_fraction"] is None else 100 * tot["comm_fraction"], ".0f"),
                     entry["epochs"], r.preemptions, r.error or ""])
    print()
    print_table(["<14", "<10", ">10", ">8", ">10", ">9", ">10", ">7", ">7", ">6"],
                ["mode", "trace", "to target", "loss", "loss@eq", "samples", "B/sample", "comm%", "epochs",
                 "kills", "note"], rows, rule=True)
    print(f"(loss@eq: the swarm's loss at {common_samples} samples, the fewer that collaborative or diloco trained; "
          "to target: seconds from the moment all four listened)")

    def get(mode: str, trace: str, key: str):
        return per.get(f"{mode}_{trace}", {}).get(key)

    diloco_shared = sum(get("diloco", t, "epochs_compared") or 0 for t in ("none", "preempted"))
    diloco_differ = sum(get("diloco", t, "epochs_differing") or 0 for t in ("none", "preempted"))
    figures.update({
        "runs": per,
        "time_ratio_diloco_vs_collab_wan": ratio(get("diloco", "none", "time_to_target_s"),
                                                 get("collaborative", "none", "time_to_target_s")),
        "bytes_per_sample_ratio_diloco_vs_collab": ratio(get("diloco", "none", "bytes_per_sample"),
                                                         get("collaborative", "none", "bytes_per_sample")),
        "loss_ratio_diloco_vs_collab_equal_samples": ratio(get("diloco", "none", "loss_at_equal_samples"),
                                                           get("collaborative", "none", "loss_at_equal_samples")),
        "time_ratio_diloco_vs_collab_wan_preempted": ratio(get("diloco", "preempted", "time_to_target_s"),
                                                           get("collaborative", "preempted", "time_to_target_s")),
        # a collaborative run that never reached the target bounds the ratio: below diloco's time over its length
        "time_ratio_diloco_vs_collab_wan_preempted_at_most": ratio(
            get("diloco", "preempted", "time_to_target_s"),
            get("collaborative", "preempted", "time_to_target_s") or get("collaborative", "preempted", "seconds")),
        "params_identical_after_outer_steps": diloco_shared > 0 and diloco_differ == 0,
        "diloco_epochs_compared": diloco_shared,
        "time_ratio_overlap_vs_diloco_wan": ratio(get("diloco-overlap", "none", "time_to_target_s"),
                                                  get("diloco", "none", "time_to_target_s")),
        "samples_per_second_ratio_overlap_vs_diloco": ratio(get("diloco-overlap", "none", "samples_per_second"),
                                                            get("diloco", "none", "samples_per_second")),
        "overlap_params_identical_after_outer_steps": (
            sum(get("diloco-overlap", t, "epochs_compared") or 0 for t in ("none", "preempted")) > 0
            and not sum(get("diloco-overlap", t, "epochs_differing") or 0 for t in ("none", "preempted"))),
    })
    for key in ("time_ratio_diloco_vs_collab_wan", "bytes_per_sample_ratio_diloco_vs_collab",
                "loss_ratio_diloco_vs_collab_equal_samples", "time_ratio_diloco_vs_collab_wan_preempted",
                "time_ratio_diloco_vs_collab_wan_preempted_at_most", "time_ratio_overlap_vs_diloco_wan",
                "samples_per_second_ratio_overlap_vs_diloco"):
        value = figures[key]
        print(f"{key}: {fmt(value, '.3f')}")
    print(f"params_identical_after_outer_steps: {figures['params_identical_after_outer_steps']} "
          f"({diloco_shared} outer rounds compared)")
    print_json(figures)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
