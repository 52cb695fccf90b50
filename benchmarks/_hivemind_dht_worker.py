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

import collections
import json
import os
import signal
import sys
import threading
import time

CREATE_TIMEOUT = 60.0  # one peer's start (its p2pd included) and bootstrap
OP_TIMEOUT = 15.0
SHUTDOWN_BUDGET = 120.0


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def wait_parent() -> None:
    if not sys.stdin.readline():
        raise SystemExit("parent went away")


def pct(samples: list[float], q: float) -> float | None:
    if not samples:
        return None
    s = sorted(samples)
    return s[min(len(s) - 1, int(len(s) * q))] * 1e3


def main() -> None:
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    deadline = float(sys.argv[2]) if len(sys.argv) > 2 else 580.0

    def watchdog() -> None:  # bench_dht.py starts us as a process-group leader: the group is our DHTs and p2pds
        emit({"event": "result", "error": f"hivemind worker passed {deadline:.0f} s"})
        if os.getpgid(0) == os.getpid():
            os.killpg(0, signal.SIGKILL)
        os._exit(3)

    timer = threading.Timer(deadline, watchdog)
    timer.daemon = True
    timer.start()

    import hivemind  # noqa: E402  (after the watchdog: importing torch takes a while)
    from hivemind.utils import get_dht_time  # noqa: E402

    emit({"event": "baseline", "pid": os.getpid(), "hivemind": hivemind.__version__})
    wait_parent()

    n, n_keys, n_new = plan["n"], plan["n_keys"], plan["n_new"]
    keys, values = plan["keys"], plan["values"]
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
    start_total = time.perf_counter() - t_start
    emit({"event": "up"})
    wait_parent()

    errors: collections.Counter = collections.Counter()

    def timed(call) -> tuple[float, object]:
        t0 = time.perf_counter()
        fut = call()
        try:
            result = fut.result(timeout=OP_TIMEOUT)
        except Exception as e:  # noqa: BLE001  (a timeout or the library's error: counted as a failure)
            fut.cancel()
            errors[type(e).__name__] += 1
            result = e
        return time.perf_counter() - t0, result

    def ok_get(result: object, j: int) -> bool:
        return result is not None and not isinstance(result, BaseException) and result.value == values[j]

    exp = get_dht_time() + 3600
    t_ops = time.perf_counter()
    store_lat, store_ok = [], 0
    for j in range(n_keys):
        d = dhts[plan["store_from"][j]]
        dt, r = timed(lambda d=d, j=j: d.store(keys[j], values[j], exp, return_future=True))
        store_lat.append(dt)
        store_ok += r is True
    get_lat, get_ok = [], 0
    for j in range(n_keys):
        d = dhts[plan["get_from"][j]]
        dt, r = timed(lambda d=d, j=j: d.get(keys[j], return_future=True))
        get_lat.append(dt)
        get_ok += ok_get(r, j)
    t_ops = time.perf_counter() - t_ops
    emit({"event": "progress", "what": f"0% churn done in {t_ops:.1f} s"})

    t_kill = time.perf_counter()
    for i in plan["killed"]:
        dhts[i].shutdown()  # stops the node and its p2pd; nobody is told
    t_kill = time.perf_counter() - t_kill

    t_churn = time.perf_counter()
    churn_get_lat, churn_old_ok = [], 0
    for j in range(n_keys):
        d = dhts[plan["churn_get_from"][j]]
        dt, r = timed(lambda d=d, j=j: d.get(keys[j], return_future=True))
        churn_get_lat.append(dt)
        churn_old_ok += ok_get(r, j)
    churn_store_lat, churn_store_ok, churn_new_ok = [], 0, 0
    for j in range(n_new):
        k = n_keys + j
        d = dhts[plan["new_store_from"][j]]
        dt, r = timed(lambda d=d, k=k: d.store(keys[k], values[k], exp, return_future=True))
        churn_store_lat.append(dt)
        churn_store_ok += r is True
        d = dhts[plan["new_get_from"][j]]
        dt, r = timed(lambda d=d, k=k: d.get(keys[k], return_future=True))
        churn_get_lat.append(dt)
        churn_new_ok += ok_get(r, k)
    t_churn = time.perf_counter() - t_churn

    t_stop = time.perf_counter()
    dead = set(plan["killed"])
    for i, d in enumerate(dhts):
        if i not in dead and time.perf_counter() - t_stop < SHUTDOWN_BUDGET:
            d.shutdown()
    t_stop = time.perf_counter() - t_stop

    emit({
        "event": "result",
        "version": hivemind.__version__,
        "n_peers": n,
        "n_keys": n_keys,
        "n_new_keys_churn": n_new,
        "start_ms_per_peer": sum(start_lat) / n * 1e3,
        "start_p99_ms": pct(start_lat, 0.99),
        "start_total_s": start_total,
        "store_p50_ms": pct(store_lat, 0.5),
        "store_p99_ms": pct(store_lat, 0.99),
        "store_accepted": store_ok / n_keys,
        "get_p50_ms": pct(get_lat, 0.5),
        "get_p99_ms": pct(get_lat, 0.99),
        "get_success": get_ok / n_keys,
        "killed": len(dead),
        "get_success_churn10": (churn_old_ok + churn_new_ok) / (n_keys + n_new),
        "get_success_churn10_old": churn_old_ok / n_keys,
        "get_success_churn10_new": churn_new_ok / n_new if n_new else None,
        "get_p50_ms_churn10": pct(churn_get_lat, 0.5),
        "get_p99_ms_churn10": pct(churn_get_lat, 0.99),
        "store_p50_ms_churn10": pct(churn_store_lat, 0.5),
        "store_p99_ms_churn10": pct(churn_store_lat, 0.99),
        "ops_s": t_ops,
        "churn_ops_s": t_churn,
        "kill_s": t_kill,
        "shutdown_s": t_stop,
        "op_errors": dict(errors),
    })
    timer.cancel()


if __name__ == "__main__":
    main()
