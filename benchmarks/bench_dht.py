"""DHT benchmark: N peers in one process, stores and gets from random peers, then 10% of peers killed.

Every peer is a ``DHTNode`` with its own P2P endpoint listening on 127.0.0.1 (real TCP), all on one
uvloop event loop.  Peer i > 0 bootstraps from two random earlier peers.  Then a fixed, seeded
sequence runs one operation at a time: stores from random peers, gets of every key from other
random peers (at 0% churn), then 10% of the peers are shut down without telling anyone, and the old
keys are read again and new store + get pairs run among the survivors.

    python benchmarks/bench_dht.py [--quick] [--peers N] [--vs-hivemind [--hivemind-peers K]]

``--vs-hivemind`` runs the same sequence (same seed, same keys and values, same peer choices) on
the reference library with ``.bench-venv/bin/python benchmarks/_hivemind_dht_worker.py``; when K is
smaller than N, our DHT runs again at K peers (in a child process, for a clean memory figure) so the
two columns compare like with like.

Prints a table, then one JSON line of figures.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import resource
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402
import uvloop  # noqa: E402
from _common import (  # noqa: E402
    BENCH_PY,
    HERE,
    Child,
    ChildFailed,
    ChildTimeout,
    WarningCounter,
    kill_all,
    print_json,
    print_table,
    run_for_json,
)
from _dht_sequence import Tally, make_plan, operations, start_figures  # noqa: E402

from dht import DHTNode  # noqa: E402

HIVEMIND_WORKER = os.path.join(HERE, "_hivemind_dht_worker.py")
MB = 1 << 20
CORE_KEYS = ("n_peers", "start_ms_per_peer", "mem_per_peer_mb", "store_p50_ms", "store_p99_ms", "get_p50_ms",
             "get_p99_ms", "get_success", "get_success_churn10", "get_p50_ms_churn10", "error")

CREATE_TIMEOUT = 15.0  # one peer's start and bootstrap
OP_TIMEOUT = 15.0  # one store or one get
SHUTDOWN_TIMEOUT = 10.0
FD_BUDGET = 16000  # in-process fds we allow ourselves (hard limit is 20000 here)


def _warning_key(record: logging.LogRecord) -> str:
    """Addresses and ids collapsed, so that the same complaint counts once."""
    words = [w if not any(ch.isdigit() for ch in w) else "#" for w in record.getMessage().split()[:8]]
    return f"{record.levelname} {record.name}: {' '.join(words)}"


# ---- our DHT ------------------------------------------------------------------------------------
async def start_swarm(plan: dict, p2p_options: dict, progress: bool) -> tuple[list[DHTNode], list[float]]:
    """Peer i bootstraps from the plan's earlier peers; returns the nodes and each one's start time."""
    n = plan["n"]
    proc = psutil.Process()
    nodes: list[DHTNode] = []
    start_lat: list[float] = []
    t_start = time.perf_counter()
    for i in range(n):
        peers = [str(nodes[b].address) for b in plan["bootstrap"][i]]
        t0 = time.perf_counter()
        try:
            node = await asyncio.wait_for(
                DHTNode.create(peers, host="127.0.0.1", p2p_options=p2p_options), CREATE_TIMEOUT)
        except (Exception, asyncio.TimeoutError) as e:
            raise RuntimeError(f"peer {i} failed to start: {e!r}") from e
        start_lat.append(time.perf_counter() - t0)
        nodes.append(node)
        if progress and (i + 1) % max(n // 10, 1) == 0:
            print(f"  started {i + 1}/{n} peers, {time.perf_counter() - t_start:.1f} s,"
                  f" {proc.num_fds()} fds", file=sys.stderr, flush=True)
    return nodes, start_lat


async def run_operations(nodes: list[DHTNode], plan: dict, tally: Tally, after_kill: bool) -> float:
    """One stage of the sequence, one operation at a time; returns its seconds."""
    keys, values, exp = plan["keys"], plan["values"], time.time() + 3600
    t_stage = time.perf_counter()
    for phase, op, peer, j in operations(plan, after_kill):
        call = nodes[peer].store(keys[j], values[j], exp) if op == "store" else nodes[peer].get(keys[j])
        t0 = time.perf_counter()
        try:
            result = await asyncio.wait_for(call, OP_TIMEOUT)
        except (Exception, asyncio.TimeoutError) as e:
            result = e
        tally.add(phase, op, j, time.perf_counter() - t0, result)
    return time.perf_counter() - t_stage


async def run_ours(plan: dict, max_connections: int, idle_timeout: float, progress: bool) -> dict:
    n = plan["n"]
    proc = psutil.Process()
    gc.collect()
    rss0 = proc.memory_info().rss
    t_start = time.perf_counter()
    nodes, start_lat = await start_swarm(plan, {"max_connections": max_connections, "idle_timeout": idle_timeout},
                                         progress)
    start_total = time.perf_counter() - t_start
    await asyncio.sleep(0.2)
    gc.collect()
    rss1 = proc.memory_info().rss
    conns = [nd.p2p.num_connections for nd in nodes]
    out = {**start_figures(plan, start_lat, start_total), "mem_per_peer_mb": (rss1 - rss0) / n / MB,
           "rss_mb": rss1 / MB, "fds_after_start": proc.num_fds(),
           "routing_table_mean": sum(len(nd.routing) for nd in nodes) / n, "connections_mean": sum(conns) / n,
           "connections_max": max(conns)}
    tally = Tally(plan)
    out["ops_s"] = await run_operations(nodes, plan, tally, after_kill=False)  # 0% churn
    t_kill = time.perf_counter()  # kill 10%, tell nobody
    dead = set(plan["killed"])
    await asyncio.wait_for(asyncio.gather(*(nodes[i].shutdown() for i in dead), return_exceptions=True),
                           SHUTDOWN_TIMEOUT)
    out["kill_s"] = time.perf_counter() - t_kill
    out["churn_ops_s"] = await run_operations(nodes, plan, tally, after_kill=True)
    t_stop = time.perf_counter()
    survivors = [nd for i, nd in enumerate(nodes) if i not in dead]
    try:
        await asyncio.wait_for(asyncio.gather(*(nd.shutdown() for nd in survivors), return_exceptions=True),
                               SHUTDOWN_TIMEOUT * 3)
    except asyncio.TimeoutError:
        tally.errors["shutdown timeout"] += 1
    out["shutdown_s"] = time.perf_counter() - t_stop
    return {**out, **tally.figures()}


# ---- hivemind (separate venv, separate process) ------------------------------------------------
def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _tree_memory(pid: int) -> tuple[int, int, int]:
    """(summed RSS, summed USS, process count) of ``pid`` and all its descendants."""
    rss = uss = count = 0
    for p in _tree(pid):
        try:
            info = p.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss += info.rss
        uss += info.uss
        count += 1
    return rss, uss, count


def run_hivemind(plan: dict, deadline_s: float) -> dict:
    """Run the worker; it pauses twice so that we can measure its process tree's memory."""
    if not os.path.exists(BENCH_PY):
        return {"error": f"{BENCH_PY} is missing: run `make bench-env` to create it"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(plan, f)
        plan_path = f.name
    worker = Child("hivemind worker", [BENCH_PY, HIVEMIND_WORKER, plan_path, str(deadline_s - 20)])
    end = time.monotonic() + deadline_s
    out: dict = {}
    try:
        rss0 = uss0 = 0
        while True:
            msg = worker.recv("event", end)
            worker.remember_tree()  # its DHT processes and p2pd daemons, killed with it at the end
            event = msg.pop("event")
            if event == "baseline":
                rss0, uss0, _ = _tree_memory(worker.proc.pid)
                worker.send("go")
            elif event == "up":
                time.sleep(0.5)
                rss1, uss1, count = _tree_memory(worker.proc.pid)
                n = plan["n"]
                out.update(mem_per_peer_mb=(rss1 - rss0) / n / MB, uss_per_peer_mb=(uss1 - uss0) / n / MB,
                           processes=count)
                worker.send("go")
            elif event == "progress":
                print(f"  hivemind: {msg.get('what')}", file=sys.stderr, flush=True)
            elif event == "result":
                out.update(msg)
                worker.finish(time.monotonic() + 30)
                break
    except ChildTimeout:
        out["error"] = f"hivemind worker passed its {deadline_s:.0f} s budget"
    except ChildFailed:
        out.setdefault("error", f"hivemind worker exited (rc={worker.proc.poll()}) without figures")
    finally:  # whatever is left of the worker's tree (p2pd daemons included) goes now
        tail = worker.tail(40)
        worker.kill()
        os.unlink(plan_path)
    if "error" in out:
        out["stderr_tail"] = tail[-3000:]
    return out


# ---- our DHT at another size, in a child process (clean RSS) ----------------------------------
def run_ours_child(n: int, n_keys: int, n_new: int, seed: int, deadline_s: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--peers", str(n), "--keys", str(n_keys),
           "--new-keys", str(n_new), "--seed", str(seed), "--no-table"]
    try:
        return run_for_json(f"our DHT at {n} peers", cmd, deadline_s)
    except ChildFailed as e:
        error, _, tail = str(e).partition("\n")
        return {"error": error, "stderr_tail": tail[-3000:]}


# ---- output -------------------------------------------------------------------------------------
def _fmt(v: object, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "%":
        return f"{v * 100:.1f}%"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


ROWS = [
    ("peers", "n_peers", "", ""),
    ("start per peer (ms)", "start_ms_per_peer", "", ""),
    ("start, all peers (s)", "start_total_s", "", ""),
    ("memory per peer (MB)", "mem_per_peer_mb", "", "<= 5"),
    ("store p50 (ms)", "store_p50_ms", "", ""),
    ("store p99 (ms)", "store_p99_ms", "", ""),
    ("get p50 (ms)", "get_p50_ms", "", "<= 10 at N=1000"),
    ("get p99 (ms)", "get_p99_ms", "", ""),
    ("get success, 0% churn", "get_success", "%", "100%"),
    ("get success, 10% killed", "get_success_churn10", "%", ">= 99%"),
    ("  old keys", "get_success_churn10_old", "%", ""),
    ("  new keys", "get_success_churn10_new", "%", ""),
    ("get p50, 10% killed (ms)", "get_p50_ms_churn10", "", ""),
    ("get p99, 10% killed (ms)", "get_p99_ms_churn10", "", ""),
    ("store p50, 10% killed (ms)", "store_p50_ms_churn10", "", ""),
]


def _check(key: str, v: object, n: int) -> str:
    if v is None:
        return ""
    passed = {"mem_per_peer_mb": lambda: v <= 5, "get_success": lambda: v >= 1.0,
              "get_success_churn10": lambda: v >= 0.99,
              "get_p50_ms": lambda: v <= 10 if n >= 1000 else None}.get(key, lambda: None)()
    return "" if passed is None else ("ok" if passed else "MISSED")


def print_columns(columns: list[tuple[str, dict]]) -> None:
    ratio = len(columns) >= 2 and columns[-1][0].startswith("hivemind")
    rows = []
    for label, key, unit, target in ROWS:
        vals = [col.get(key) for _, col in columns]
        row = [label, *(_fmt(v, unit) for v in vals)]
        if ratio:
            a, b = vals[-2], vals[-1]
            numeric = isinstance(a, (int, float)) and isinstance(b, (int, float)) and a and key != "n_peers"
            row.append(f"{b / a:.1f}x" if numeric else "-")
        verdict = _check(key, vals[0], columns[0][1].get("n_peers", 0))
        rows.append([*row, target + (f" [{verdict}]" if verdict else "")])
    print_table(["<28"] + [">18"] * len(columns) + ([">15"] if ratio else []),
                ["figure", *(name for name, _ in columns), *(["hivemind/ours"] if ratio else []), "target"], rows)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="128 peers, 200 keys: under 60 s")
    parser.add_argument("--peers", type=int, help="peers (default 1000, quick 128)")
    parser.add_argument("--keys", type=int, help="keys stored then read at 0%% churn (default 500, quick 200)")
    parser.add_argument("--new-keys", type=int, help="store+get pairs after the kill (default keys/2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-connections", type=int, help="P2P max_connections per peer (default from N)")
    parser.add_argument("--idle-timeout", type=float, default=20.0, help="P2P idle_timeout (s)")
    parser.add_argument("--vs-hivemind", action="store_true", help="also run hivemind from .bench-venv")
    parser.add_argument("--hivemind-peers", type=int, default=32, help="hivemind's N (about 290 MB per peer)")
    parser.add_argument("--no-table", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--progress", action="store_true", help="report start-up progress on stderr")
    args = parser.parse_args()
    args.peers = args.peers or (128 if args.quick else 1000)
    args.keys = args.keys or (200 if args.quick else 500)
    args.new_keys = args.new_keys if args.new_keys is not None else args.keys // 2
    # each connection costs one fd at each end, plus one listening socket per peer: N * (M + 1) fds
    args.max_connections = args.max_connections or max(4, min(32, FD_BUDGET * 3 // 4 // args.peers))
    return args


def start_watchdog(figures: dict, limit_s: float) -> threading.Timer:
    """The last resort, for an await without a timeout somewhere below us: the figures so far, then exit."""
    def fire() -> None:
        figures["error"] = f"watchdog: run passed {limit_s:.0f} s"
        kill_all()
        print_json(figures, digits=3)
        os._exit(3)

    timer = threading.Timer(limit_s, fire)
    timer.daemon = True
    timer.start()
    return timer


def vs_hivemind(args: argparse.Namespace, plan: dict, figures: dict, columns: list[tuple[str, dict]]) -> None:
    """hivemind at K peers, and ours again at K (in a child) when K < N; adds their columns and figures."""
    n, k = args.peers, min(args.hivemind_peers, args.peers)
    if not os.path.exists(BENCH_PY):
        msg = f"--vs-hivemind: {BENCH_PY} not found; run `make bench-env` to create it"
        print(msg, file=sys.stderr)
        figures["hivemind_error"] = msg
        return
    if k < n:
        at_k = run_ours_child(k, args.keys, args.new_keys, args.seed, deadline_s=240)
        figures.update({f"ours_n{k}_{key}": v for key, v in at_k.items() if key in CORE_KEYS})
        columns.append((f"ours N={k}", at_k))
    hm = run_hivemind(plan if k == n else make_plan(k, args.keys, args.new_keys, args.seed), deadline_s=600)
    figures.update({f"hivemind_{key}": v for key, v in hm.items() if key != "stderr_tail"})
    columns.append((f"hivemind N={k}", hm))
    if "error" in hm:
        print(f"hivemind run failed: {hm['error']}\n{hm.get('stderr_tail', '')}", file=sys.stderr)


def print_report(args: argparse.Namespace, figures: dict, columns: list[tuple[str, dict]],
                 counter: WarningCounter) -> None:
    print_columns(columns)
    if args.vs_hivemind and len(columns) > 1:
        print("hivemind/ours ratio compares the last two columns (same N, same sequence).")
    if "hivemind_error" in figures:
        print(f"hivemind column missing: {figures['hivemind_error']}")
    print(f"{'wall-clock (s)':<28}{figures['wall_s']:>18.1f}")
    if counter.counts:
        print("log warnings (counted, not printed):")
        for msg, c in counter.counts.most_common(6):
            print(f"  {c:>6} x {msg}")


def main() -> None:
    args = parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    counter = WarningCounter(_warning_key)
    logging.basicConfig(level=logging.WARNING, handlers=[counter], force=True)
    figures: dict = {"quick": args.quick}
    timer = start_watchdog(figures, 58.0 if args.quick and not args.vs_hivemind else (300.0 if args.quick else 1200.0))
    t0 = time.perf_counter()
    plan = make_plan(args.peers, args.keys, args.new_keys, args.seed)
    try:
        figures.update(uvloop.run(run_ours(plan, args.max_connections, args.idle_timeout, args.progress)))
    except Exception as e:  # a peer that would not start: report it in the figures, exit non-zero
        figures.update(n_peers=args.peers, error=f"{type(e).__name__}: {e}")
        print_json(figures, digits=3)
        os._exit(1)  # skips waiting on the half-built swarm's sockets
    figures.update(max_connections=args.max_connections, idle_timeout=args.idle_timeout, seed=args.seed,
                   fd_limit=[soft, hard])
    columns: list[tuple[str, dict]] = [(f"ours N={args.peers}", figures)]
    if args.vs_hivemind:
        vs_hivemind(args, plan, figures, columns)
    figures["wall_s"] = time.perf_counter() - t0
    timer.cancel()
    if counter.counts:
        figures["log_warnings"] = sum(counter.counts.values())
    if not args.no_table:
        print_report(args, figures, columns, counter)
    print_json(figures, digits=3)


if __name__ == "__main__":
    main()
