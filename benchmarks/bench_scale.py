"""Hundreds of peers: what the control plane costs a peer as the swarm grows, and the orchestrator and
mixture-of-experts at scale.

Swarm part: N peers of the real DHT and progress stack (loopback TCP, the run's validators, the
progress tree sized for N) in processes of at most 64 peers, one event loop each
(``_scale_peers.py``).  Peers add samples at speeds that differ 4x, a tenth of them in client mode,
and step their epoch when their view says the global batch is complete.  Churn: one process
holding about 5% of the peers is SIGKILLed and replaced, and about 5% more are closed without a
word inside the others and replaced.  Control-plane traffic is counted per view refresh (both
ends of every DHT call), never per second of a saturated loop.  What this part does not run yet:
all-reduce, matchmaking and state hand-off (grouped DeDLOC averaging is not built), so parameter
spread is not measured.

Orchestrator part: ``_scale_orchestrator.measure`` (a policy tick over 1,000 instances, the store,
the dashboard and the CLI over 10^6 sample rows).  Mixture-of-experts part: ``_scale_moe.measure``
when present.

``--quick``: N = 16 and 64, short runs, the orchestrator over 20,000 sample rows, no
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


def start(name: str, config: dict) -> Child:
    return Child(name, [*CHILD, json.dumps(config)], env=ONE_THREAD_ENV)


def swarm(n: int, duration: float, churn: bool, limit_s: float, flat: bool = False) -> dict:
    """One run of ``n`` peers; its figures, or why it failed.  ``flat``: every record under one key,
    as every run had before the progress tree (the layout sized for 16 peers)."""
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
            replacement = start("replacement", settings(victim_n, n, duration / 2 - 1, 98, initial, flat=flat))
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
    return figures(n, results)


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
    parser.add_argument("--parts", default=None, help="swarm,orchestrator,moe (quick: swarm,orchestrator)")
    args = parser.parse_args()
    exit_on_sigterm()
    sizes = [int(x) for x in (args.sizes or ("16,64" if args.quick else "16,64,256")).split(",")]
    duration = args.duration or (6.0 if args.quick else 40.0)
    parts = set((args.parts or ("swarm,orchestrator" if args.quick else "swarm,orchestrator,moe")).split(","))
    out: dict = {"sizes": sizes}
    by_n: dict[int, dict] = {}
    try:
        if "swarm" in parts:
            for n in sizes:
                by_n[n] = guarded(f"swarm_{n}", swarm, n, duration, True, duration + 90 + n / 2, args.flat)
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
    print_table([">6"] + [">12"] * len(cells),
                ["N", "peers", "epochs", "epoch s", "seen lag s", "msgs/refr", "bytes/refr", "refr/peer/s",
                 "cpu s/s/peer", "MB/peer", "violations"], rows, rule=True)
    out["swarm"] = by_n
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
    out["param_spread_256"] = None  # needs grouped DeDLOC averaging, not built yet
    for name, part in (("orchestrator", orchestrator), ("moe", out.get("moe", {}))):
        print(f"{name}: " + ", ".join(f"{k} {fmt(v, '.3f') if isinstance(v, float) else v}"
                                      for k, v in part.items()))
    print_json(out)


if __name__ == "__main__":
    main()
