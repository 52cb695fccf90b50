"""Hundreds of peers: what the control plane costs a peer as the swarm grows, and the orchestrator and
mixture-of-experts at scale.

Swarm part: N peers of the real DHT and progress stack (loopback TCP, the run's validators, the
progress tree sized for N) in processes of at most 64 peers, one event loop each
(``_scale_peers.py``).  Peers add samples at speeds that differ 4x, a tenth of them in client mode,
and step their epoch when their view says the global batch is complete.  Churn: one process
holding about 5% of the peers is SIGKILLed and replaced, and about 5% more are closed without a
word inside the others and replaced.  Control-plane traffic is counted per view refresh (both
ends of every DHT call), never per second of a saturated loop.

Training part: N real collaborative peers (``_scale_trainers.py``: DHT, progress tree and roster,
matchmaking, all-reduce in groups of 16 and groups of groups beyond, state hand-off to newcomers,
a tiny regression model), many per process on one event loop, compute differing 4x, a tenth in
client mode, under the same churn.  Counted per peer and global epoch: control-plane messages and
bytes (DHT calls and matchmaking joins, both ends), and the parameter spread over the peers that
stepped to each epoch (0 when every one of them holds the same bits).

Orchestrator part: ``_scale_orchestrator.measure`` (a policy tick over 1,000 instances, the store,
the dashboard and the CLI over 10^6 sample rows).  Mixture-of-experts part: ``_scale_moe.measure``
when present.

``--quick``: N = 16 and 64 (training: 16), short runs, the orchestrator over 20,000 sample rows, no
mixture-of-experts part (``_scale_moe.py --quick`` runs it alone in about a minute); under 60 s.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import (  # noqa: E402
    ONE_THREAD_ENV,
    Child,
    ChildFailed,
    exit_on_sigterm,
    fmt,
    guarded,
    kill_all,
    print_json,
    print_table,
    stop_all,
)

PER_PROCESS = 64
TRAINER_VIEW_S = 3.0  # the training part's view interval at pace 1
CHILD = [sys.executable, "-m", "benchmarks._scale_peers"]


def settings(n: int, capacity: int, duration: float, seed: int, initial: list[str], **extra: Any) -> dict:
    # a global batch of about 5 s of the swarm's samples (2.3 a second per peer), whatever its size;
    # views refresh every second, when a step's report wakes them, and when they expect the batch full
    out = {"n": n, "capacity": capacity, "initial": initial, "client_fraction": 0.1, "seed": seed,
           "refresh": 1.0, "target": int(capacity * 12), "speed": 1.0, "duration": duration,
           "warmup": min(4.0, duration / 3), **extra}
    if out.pop("flat", False):
        out["capacity"] = 16  # one key
    return out


def trainer_settings(n: int, capacity: int, duration: float, seed: int, initial: list[str], **extra: Any) -> dict:
    # micro-steps of 4 samples every 1.2, 0.6 or 0.3 s (7.8 samples a second per peer on average): a
    # global batch of about 8 s of the swarm's samples; groups of 16; reports and views every 3 s, and
    # records fresh for 15 s (two cores hold 256 such peers only at this pace)
    pace = extra.pop("pace", 1.0)  # --training-pace: every interval that many times longer, the batch as long
    out = {"n": n, "capacity": capacity, "initial": initial, "client_fraction": 0.1, "seed": seed,
           "refresh": TRAINER_VIEW_S * pace, "report": 3.0 * pace, "fresh_for": 15.0 * pace,
           "target": int(capacity * 62),
           "tick": 1.2 * pace, "group_size": 16, "averaging_timeout": 30.0 * pace, "duration": duration,
           "warmup": min(10.0 * pace, duration / 3), **extra}
    out.pop("flat", None)
    return out


PARTS = {"swarm": (CHILD, settings), "training": ([sys.executable, "-m", "benchmarks._scale_trainers"],
                                                  trainer_settings)}


def swarm(n: int, duration: float, churn: bool, limit_s: float, flat: bool = False, part: str = "swarm",
          pace: float = 1.0) -> dict:
    """One run of ``n`` peers; its figures, or why it failed.  ``flat``: every record under one key,
    as every run had before the progress tree (the layout sized for 16 peers).  ``part``: ``swarm``
    (progress views alone) or ``training`` (real collaborative peers)."""
    argv, make_settings = PARTS[part]

    def settings(*args: Any, **extra: Any) -> dict:
        return make_settings(*args, **extra, **({"pace": pace} if part == "training" else {}))

    logs = os.environ.get("SPOTSWARM_SCALE_LOGS")  # a folder: each child's log there, its peers' INFO lines too

    def start(name: str, config: dict) -> Child:
        return Child(name, [*argv, json.dumps(config)], env=ONE_THREAD_ENV,
                     log_path=os.path.join(logs, f"{part}{n}-{name}.log") if logs else None)

    deadline = time.monotonic() + limit_s
    victim_n = max(1, round(n * 0.05)) if churn else 0
    rest = n - victim_n
    procs = max(1, math.ceil(rest / PER_PROCESS))
    sizes = [rest // procs + (i < rest % procs) for i in range(procs)]
    closes = max(1, round(n * 0.05)) if churn else 0
    children: list[Child] = []
    try:
        first = start("peers0", settings(sizes[0], n, duration, 0, [], close_at=duration / 2,
                                         close_count=min(closes, sizes[0] - 1), flat=flat))
        children.append(first)
        initial = first.recv("ready", deadline)["ready"]
        for i, size in enumerate(sizes[1:], 1):
            children.append(start(f"peers{i}", settings(size, n, duration, i, initial, flat=flat)))
        victim = start("victim", settings(victim_n, n, duration, 99, initial, flat=flat)) if victim_n else None
        if victim:
            children.append(victim)
        for child in children[1:]:
            initial += child.recv("ready", deadline)["ready"][:1]  # a replacement joins through any of them
        t0 = time.time() + 1.0
        for child in children:
            child.send(f"go {t0}")
        results = []
        if victim:
            time.sleep(max(t0 + duration / 2 - time.time(), 0.0))  # the trace's moment of the kill
            victim.kill()  # SIGKILL of the whole process: its peers vanish mid-call
            late = {"newcomers": True, "warmup": 0.0} if part == "training" else {}  # they load the state
            replacement = start("replacement", settings(victim_n, n, duration / 2 - 1, 98, initial, flat=flat, **late))
            children.append(replacement)
            replacement.recv("ready", deadline)
            replacement.send(f"go {time.time()}")
        for child in children:
            if child is not victim:
                try:
                    results.append(child.recv("result", deadline)["result"])
                except ChildFailed as e:
                    raise ChildFailed(f"{e}{child.tail()}") from None
    except ChildFailed as e:
        return {"error": str(e)}
    finally:
        stop_all(children, grace=5.0)
    return figures(n, results) if part == "swarm" else training_figures(results, TRAINER_VIEW_S * pace)


def figures(n: int, results: list[dict]) -> dict:
    peers = sum(r["peers"] for r in results)
    refreshes = sum(r["refreshes"] for r in results) or 1
    seconds = max(r["seconds"] for r in results)
    msgs, nbytes = sum(r["messages"] for r in results), sum(r["bytes"] for r in results)
    steps: dict[int, list[float]] = {}
    for r in results:
        for epoch, when, _live in r["steps"]:
            steps.setdefault(epoch, []).append(when)
    # how long after the first peer stepped epoch e every live peer's view showed e + 1 (the peers
    # there at that step: a replacement that joined later shows it from its first read)
    lags = []
    for epoch, times in sorted(steps.items())[1:-1]:  # the first and last epochs are cut by the run
        first = min(times)
        seen = [s["epochs"].get(str(epoch + 1)) for r in results for s in r["seen"] if s["joined"] < first]
        if seen and all(x is not None for x in seen):
            lags.append(max(seen) - first)
    epochs = sorted(steps)
    durations = [b - a for a, b in zip([min(steps[e]) for e in epochs], [min(steps[e]) for e in epochs[1:]],
                                       strict=False)]
    return {
        "peers": peers, "epochs": len(epochs),
        "epoch_s": statistics.median(durations) if durations else None,
        "epoch_seen_lag_s": statistics.median(lags) if lags else None,
        "epoch_seen_lag_max_s": max(lags) if lags else None,
        "msgs_per_refresh": msgs / refreshes, "bytes_per_refresh": nbytes / refreshes,
        "refreshes_per_peer_s": refreshes / peers / seconds,
        "msgs_per_peer_s": msgs / peers / seconds, "bytes_per_peer_s": nbytes / peers / seconds,
        "cpu_s_per_peer_s": sum(r["cpu_s"] for r in results) / peers / seconds,
        "mem_mb_per_peer": sum(r["rss"] for r in results) / peers / 2**20,
        "violations": sum(r["violation_count"] for r in results),
        "violation_examples": [v for r in results for v in r["violations"]][:3],
    }


def training_figures(results: list[dict], view_interval: float) -> dict:
    """The training part's figures: epoch time, control plane per peer and epoch (and per view refresh at
    the configured rate, ``view_interval``: a busy loop's slower refreshes do not make it look cheaper),
    parameter spread."""
    peers = sum(r["peers"] for r in results)
    peer_epochs = sum(r["peer_epochs"] for r in results) or 1
    seconds = max(r["seconds"] for r in results)
    msgs, nbytes = sum(r["messages"] for r in results), sum(r["bytes"] for r in results)
    steps = any(r["rounds"] for r in results)
    firsts: dict[int, float] = {}
    for r in results:
        for epoch, when in r["steps"]:
            firsts[epoch] = min(when, firsts.get(epoch, when))
    epochs = sorted(firsts)
    durations = [firsts[b] - firsts[a] for a, b in zip(epochs, epochs[1:], strict=False) if b == a + 1]
    by_epoch: dict[str, list[list[float]]] = {}
    for r in results:
        for stepped in r["stepped"]:
            for epoch, params in stepped.items():
                by_epoch.setdefault(epoch, []).append(params)
    spreads = [_spread(p) for p in by_epoch.values()]
    return {
        "peers": peers, "epochs": len(epochs), "epoch_s": statistics.median(durations) if durations else None,
        "stepped_per_epoch": statistics.median(len(p) for p in by_epoch.values()) if by_epoch else 0,
        "loaded": sum(r["loaded"] for r in results),
        "matchmaking_s": statistics.median(m for r in results for m, _ in r["rounds"]) if steps else None,
        "allreduce_s": statistics.median(a for r in results for _, a in r["rounds"]) if steps else None,
        "control_msgs_per_peer_epoch": msgs / peer_epochs, "control_bytes_per_peer_epoch": nbytes / peer_epochs,
        "control_msgs_per_peer_s": msgs / peers / seconds, "control_bytes_per_peer_s": nbytes / peers / seconds,
        "control_msgs_per_peer_refresh": msgs / peers / seconds * view_interval,
        "control_bytes_per_peer_refresh": nbytes / peers / seconds * view_interval,
        "cpu_s_per_peer_s": sum(r["cpu_s"] for r in results) / peers / seconds,
        "mem_mb_per_peer": sum(r["rss"] for r in results) / peers / 2**20,
        "control_bytes_per_peer_epoch_by_method": {
            m: sum(r["bytes_by_method"].get(m, 0) for r in results) / peer_epochs
            for m in sorted({m for r in results for m in r["bytes_by_method"]})},
        "param_spread": max(spreads, default=None),
        "violations": sum(s > 0 for s in spreads) + sum(r["stuck"] for r in results),
        "errors": [e for r in results for e in r["errors"]][:3],
    }


def _spread(params: list[list[float]]) -> float:
    """max_i ||theta_i - mean|| / ||mean|| over the peers that stepped to one epoch."""
    mean = [sum(col) / len(col) for col in zip(*params, strict=True)]
    norm = math.sqrt(sum(v * v for v in mean)) or 1.0
    return max(math.sqrt(sum((a - b) ** 2 for a, b in zip(p, mean, strict=True))) for p in params) / norm


def print_training(trained: dict[int, dict]) -> None:
    if not trained:
        return
    cells = [("peers", "d"), ("epochs", "d"), ("epoch_s", ".2f"), ("matchmaking_s", ".2f"), ("allreduce_s", ".2f"),
             ("stepped_per_epoch", ".0f"), ("loaded", "d"),
             ("control_msgs_per_peer_epoch", ".0f"), ("control_bytes_per_peer_epoch", ".0f"),
             ("control_msgs_per_peer_refresh", ".1f"), ("control_bytes_per_peer_refresh", ".0f"),
             ("cpu_s_per_peer_s", ".3f"), ("mem_mb_per_peer", ".1f"), ("param_spread", ".1e"), ("violations", "d")]
    rows = [(n, *(fmt(f.get(key), spec) for key, spec in cells), f.get("error", "") or "; ".join(f.get("errors", [])))
            for n, f in trained.items()]
    print("training: real collaborative peers (groups of 16), under churn")
    print_table([">6"] + [">15"] * len(cells),
                ["N", "peers", "epochs", "epoch s", "matchmake s", "all-reduce s", "stepped/ep", "loaded",
                 "ctl msgs/ep", "ctl bytes/ep", "ctl msgs/refr", "ctl bytes/refr",
                 "cpu s/s/peer", "MB/peer", "param spread", "violations"], rows, rule=True)


def optional_part(module: str, kwargs: dict) -> dict:
    """A part that lives in its own module, if that module exists here."""
    try:
        measure = importlib.import_module(module).measure
    except ImportError as e:
        return {"skipped": f"{module}: {e}"}
    return measure(**kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 16 and 64, short runs, no experts part (< 60 s)")
    parser.add_argument("--sizes", default=None, help="comma-separated N (default 16,64,256)")
    parser.add_argument("--duration", type=float, default=None, help="seconds each swarm trains")
    parser.add_argument("--flat", action="store_true", help="every progress record under one key (the old layout)")
    parser.add_argument("--parts", default=None,
                        help="swarm,training,orchestrator,moe (quick: swarm,training,orchestrator)")
    parser.add_argument("--training-sizes", default=None, help="N of the training part (default: --sizes; quick: 16)")
    parser.add_argument("--training-duration", type=float, default=None, help="seconds each training swarm trains")
    parser.add_argument("--training-pace", type=float, default=None,
                        help="the training part's intervals (micro-steps, reports, views, freshness) this many times "
                             "longer, its epochs as much: more peers on the same cores (default 2, quick: 1; two "
                             "cores hold 256 peers at 2)")
    args = parser.parse_args()
    exit_on_sigterm()
    sizes = [int(x) for x in (args.sizes or ("16,64" if args.quick else "16,64,256")).split(",")]
    duration = args.duration or (5.0 if args.quick else 40.0)
    parts = set((args.parts or ("swarm,training,orchestrator" if args.quick else
                                "swarm,training,orchestrator,moe")).split(","))
    training_sizes = [int(x) for x in (args.training_sizes or ("16" if args.quick else ",".join(map(str, sizes))))
                      .split(",")]
    training_duration = args.training_duration or (12.0 if args.quick else 150.0)
    training_pace = args.training_pace or (1.0 if args.quick else 2.0)
    out: dict = {"sizes": sizes, "training_pace": training_pace}
    by_n: dict[int, dict] = {}
    trained: dict[int, dict] = {}
    try:
        if "swarm" in parts:
            for n in sizes:
                by_n[n] = guarded(f"swarm_{n}", swarm, n, duration, True, duration + 90 + n / 2, args.flat)
        if "training" in parts:
            for n in training_sizes:
                trained[n] = guarded(f"training_{n}", swarm, n, training_duration, True,
                                     training_duration + 120 + n, False, "training", training_pace)
        if "orchestrator" in parts:
            kwargs = {"instances": 1000, "sample_rows": 20_000 if args.quick else 1_000_000, "quick": args.quick}
            out["orchestrator"] = guarded("orchestrator", optional_part, "benchmarks._scale_orchestrator", kwargs)
        if "moe" in parts:
            out["moe"] = guarded("moe", optional_part, "benchmarks._scale_moe", {"quick": args.quick})
    finally:
        kill_all()
    cells = [("peers", "d"), ("epochs", "d"), ("epoch_s", ".2f"), ("epoch_seen_lag_s", ".2f"),
             ("msgs_per_refresh", ".1f"), ("bytes_per_refresh", ".0f"), ("refreshes_per_peer_s", ".2f"),
             ("cpu_s_per_peer_s", ".3f"), ("mem_mb_per_peer", ".1f"), ("violations", "d")]
    rows = [(n, *(fmt(f.get(key), spec) for key, spec in cells), f.get("error", "")) for n, f in by_n.items()]
    print_table([">6"] + [">13"] * len(cells),
                ["N", "peers", "epochs", "epoch s", "seen lag s", "msgs/refr", "bytes/refr", "refr/peer/s",
                 "cpu s/s/peer", "MB/peer", "violations"], rows, rule=True)
    out["swarm"] = by_n
    print_training(trained)
    out["training"] = trained
    small, large = by_n.get(16, {}), by_n.get(max(sizes), {})
    if "msgs_per_refresh" in small and "msgs_per_refresh" in large:
        out[f"control_msgs_per_peer_ratio_{max(sizes)}_16"] = large["msgs_per_refresh"] / small["msgs_per_refresh"]
        out[f"control_bytes_per_peer_ratio_{max(sizes)}_16"] = large["bytes_per_refresh"] / small["bytes_per_refresh"]
    out["peers_max"] = max((f.get("peers", 0) for f in by_n.values()), default=0)
    out["churn_invariant_violations"] = sum(f.get("violations", 0) for f in by_n.values())
    out[f"mem_per_peer_mb_{max(sizes)}"] = large.get("mem_mb_per_peer")
    orchestrator = out.get("orchestrator", {})
    if "policy_tick_ms_1000" in orchestrator:
        out["policy_tick_ms_1000"] = orchestrator["policy_tick_ms_1000"]
    for key in ("moe_beam_search_ratio_1024_64", "moe_kmin_fraction_churn"):
        if key in out.get("moe", {}):
            out[key] = out["moe"][key]
    top = max(trained, default=None)
    if top is not None:
        out[f"param_spread_{top}"] = trained[top].get("param_spread")
        out["churn_invariant_violations"] += sum(f.get("violations", 0) for f in trained.values())
        out["training_peers_max"] = max(f.get("peers", 0) for f in trained.values())
        base = trained.get(16, {})
        if top != 16 and "control_msgs_per_peer_epoch" in base and "control_msgs_per_peer_epoch" in trained[top]:
            for kind in ("msgs", "bytes"):
                key = f"control_{kind}_per_peer_epoch"
                out[f"training_control_{kind}_per_peer_ratio_{top}_16"] = trained[top][key] / base[key]
                key = f"control_{kind}_per_peer_refresh"
                out[f"training_control_{kind}_per_peer_refresh_ratio_{top}_16"] = trained[top][key] / base[key]
    for name, part in (("orchestrator", orchestrator), ("moe", out.get("moe", {}))):
        print(f"{name}: " + ", ".join(f"{k} {fmt(v, '.3f') if isinstance(v, float) else v}"
                                      for k, v in part.items()))
    print_json(out)


if __name__ == "__main__":
    main()
