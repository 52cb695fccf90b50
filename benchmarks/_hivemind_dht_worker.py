"""hivemind side of ``bench_dht.py --vs-hivemind``.  Run ONLY with ``.bench-venv/bin/python``.

    .bench-venv/bin/python benchmarks/_hivemind_dht_worker.py PLAN.json

PLAN.json is written by bench_dht.py (``make_plan``): peers, bootstrap choices, keys, values, which
peer stores and which reads each key, which peers are killed.  Each peer is a ``hivemind.DHT`` (a
forked process that starts its own p2pd).  This script never imports the project, and the project
never imports hivemind.

Protocol on stdout, one JSON object a line: {"event": "baseline", "pid": ...} once hivemind is
imported, then waits for a line on stdin (the parent measures this process tree's memory);
{"event": "up"} once every peer is up, waits again; {"event": "result", ...figures} at the end.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from _common import emit
from _dht_sequence import Tally, operations, start_figures

CREATE_TIMEOUT = 60.0  # one peer's start (its p2pd included) and bootstrap
OP_TIMEOUT = 15.0
SHUTDOWN_BUDGET = 120.0


def wait_parent() -> None:
    if not sys.stdin.readline():
        raise SystemExit("parent went away")


def start_watchdog(deadline: float) -> threading.Timer:
    def fire() -> None:  # bench_dht.py starts us as a process-group leader: the group is our DHTs and p2pds
        emit({"event": "result", "error": f"hivemind worker passed {deadline:.0f} s"})
        if os.getpgid(0) == os.getpid():
            os.killpg(0, signal.SIGKILL)
        os._exit(3)

    timer = threading.Timer(deadline, fire)
    timer.daemon = True
    timer.start()
    return timer


def start_swarm(hivemind, plan: dict) -> tuple[list, list[float], float]:
    """Peer i bootstraps from the plan's earlier peers; the DHTs, each one's start time, and the total."""
    n = plan["n"]
    dhts: list = []
    maddrs: list[list[str]] = []
    start_lat: list[float] = []
    t_start = time.perf_counter()
    for i in range(n):
        peers = [a for b in plan["bootstrap"][i] for a in maddrs[b]]
        t0 = time.perf_counter()
        dht = hivemind.DHT(initial_peers=peers or None, start=True, await_ready=False)
        dhts.append(dht)
        dht.wait_until_ready(timeout=CREATE_TIMEOUT)
        start_lat.append(time.perf_counter() - t0)
        maddrs.append([str(m) for m in dht.get_visible_maddrs()])
        if (i + 1) % max(n // 4, 1) == 0:
            emit({"event": "progress", "what": f"{i + 1}/{n} peers up, {time.perf_counter() - t_start:.1f} s"})
    return dhts, start_lat, time.perf_counter() - t_start


def run_operations(dhts: list, plan: dict, tally: Tally, after_kill: bool, expiration: float) -> float:
    """One stage of the sequence, one operation at a time; returns its seconds."""
    keys, values = plan["keys"], plan["values"]
    t_stage = time.perf_counter()
    for phase, op, peer, j in operations(plan, after_kill):
        d = dhts[peer]
        t0 = time.perf_counter()
        fut = (d.store(keys[j], values[j], expiration, return_future=True) if op == "store"
               else d.get(keys[j], return_future=True))
        try:
            result = fut.result(timeout=OP_TIMEOUT)
        except Exception as e:  # noqa: BLE001  (a timeout or the library's error: counted as a failure)
            fut.cancel()
            result = e
        tally.add(phase, op, j, time.perf_counter() - t0, result)
    return time.perf_counter() - t_stage


def main() -> None:
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    timer = start_watchdog(float(sys.argv[2]) if len(sys.argv) > 2 else 580.0)

    import hivemind  # noqa: E402  (after the watchdog: importing torch takes a while)
    from hivemind.utils import get_dht_time  # noqa: E402

    emit({"event": "baseline", "pid": os.getpid(), "hivemind": hivemind.__version__})
    wait_parent()
    dhts, start_lat, start_total = start_swarm(hivemind, plan)
    emit({"event": "up"})
    wait_parent()

    tally = Tally(plan)
    expiration = get_dht_time() + 3600
    t_ops = run_operations(dhts, plan, tally, False, expiration)
    emit({"event": "progress", "what": f"0% churn done in {t_ops:.1f} s"})
    t_kill = time.perf_counter()
    for i in plan["killed"]:
        dhts[i].shutdown()  # stops the node and its p2pd; nobody is told
    t_kill = time.perf_counter() - t_kill
    t_churn = run_operations(dhts, plan, tally, True, expiration)
    t_stop = time.perf_counter()
    dead = set(plan["killed"])
    for i, d in enumerate(dhts):
        if i not in dead and time.perf_counter() - t_stop < SHUTDOWN_BUDGET:
            d.shutdown()
    t_stop = time.perf_counter() - t_stop
    emit({"event": "result", "version": hivemind.__version__, **start_figures(plan, start_lat, start_total),
          **tally.figures(), "ops_s": t_ops, "churn_ops_s": t_churn, "kill_s": t_kill, "shutdown_s": t_stop})
    timer.cancel()


if __name__ == "__main__":
    main()
