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
import collections
import gc
import json
import logging
import os
import queue
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402
import uvloop  # noqa: E402

from dht import DHTNode  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_PYTHON = os.path.join(ROOT, ".bench-venv", "bin", "python")
HIVEMIND_WORKER = os.path.join(ROOT, "benchmarks", "_hivemind_dht_worker.py")
MB = 1 << 20
_CHILDREN: list[subprocess.Popen] = []  # killed (with their process groups) if the watchdog fires
CORE_KEYS = ("n_peers", "start_ms_per_peer", "mem_per_peer_mb", "store_p50_ms", "store_p99_ms", "get_p50_ms",
             "get_p99_ms", "get_success", "get_success_churn10", "get_p50_ms_churn10", "error")

CREATE_TIMEOUT = 15.0  # one peer's start and bootstrap
OP_TIMEOUT = 15.0  # one store or one get
SHUTDOWN_TIMEOUT = 10.0
FD_BUDGET = 16000  # in-process fds we allow ourselves (hard limit is 20000 here)


# ---- the sequence both libraries run -----------------------------------------------------------
def make_plan(n: int, n_keys: int, n_new: int, seed: int) -> dict:
    """Everything random about a run, drawn up front from one seeded RNG (JSON-serializable)."""
    rng = random.Random(seed)
    bootstrap = [[]] + [rng.sample(range(i), min(i, 2)) for i in range(1, n)]
    keys = [f"bench/{seed}/key/{j}" for j in range(n_keys + n_new)]
    values = [{"j": j, "writer": 0, "score": round(rng.random(), 6), "tag": f"v{rng.randrange(1 << 30):08x}"}
              for j in range(n_keys + n_new)]
    store_from = [rng.randrange(n) for _ in range(n_keys)]
    for j, p in enumerate(store_from):
        values[j]["writer"] = p
    get_from = [rng.randrange(n) for _ in range(n_keys)]
    killed = sorted(rng.sample(range(n), max(1, round(n / 10)) if n >= 5 else 0))
    dead = set(killed)
    alive = [i for i in range(n) if i not in dead]
    churn_get_from = [rng.choice(alive) for _ in range(n_keys)]
    new_store_from = [rng.choice(alive) for _ in range(n_new)]
    for j, p in enumerate(new_store_from):
        values[n_keys + j]["writer"] = p
    new_get_from = [rng.choice(alive) for _ in range(n_new)]
    return {"n": n, "n_keys": n_keys, "n_new": n_new, "seed": seed, "bootstrap": bootstrap,
            "keys": keys, "values": values, "store_from": store_from, "get_from": get_from,
            "killed": killed, "churn_get_from": churn_get_from,
            "new_store_from": new_store_from, "new_get_from": new_get_from}


def pct(samples: list[float], q: float) -> float | None:
    if not samples:
        return None
    s = sorted(samples)
    return s[min(len(s) - 1, int(len(s) * q))]


def summarize(prefix: str, lat_s: list[float]) -> dict:
    return {f"{prefix}_p50_ms": _ms(pct(lat_s, 0.50)), f"{prefix}_p99_ms": _ms(pct(lat_s, 0.99))}


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


# ---- log accounting: warnings are counted, not printed (thousands under churn) ----------------
class _CountingHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: collections.Counter = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        # collapse addresses/ids so the same complaint counts once
        words = [w if not any(ch.isdigit() for ch in w) else "#" for w in msg.split()[:8]]
        self.counts[f"{record.levelname} {record.name}: {' '.join(words)}"] += 1


# ---- our DHT ------------------------------------------------------------------------------------
async def run_ours(plan: dict, max_connections: int, idle_timeout: float, progress: bool) -> dict:
    n, n_keys, n_new = plan["n"], plan["n_keys"], plan["n_new"]
    keys, values = plan["keys"], plan["values"]
    proc = psutil.Process()
    gc.collect()
    rss0 = proc.memory_info().rss
    p2p_options = {"max_connections": max_connections, "idle_timeout": idle_timeout}
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
    start_total = time.perf_counter() - t_start
    await asyncio.sleep(0.2)
    gc.collect()
    rss1 = proc.memory_info().rss
    fds_up = proc.num_fds()
    routing_sizes = [len(nd.routing) for nd in nodes]
    conns = [nd.p2p.num_connections for nd in nodes]

    async def timed(coro) -> tuple[float, object]:
        t0 = time.perf_counter()
        try:
            result = await asyncio.wait_for(coro, OP_TIMEOUT)
        except (Exception, asyncio.TimeoutError) as e:
            result = e
        return time.perf_counter() - t0, result

    exp = time.time() + 3600

    def ok_get(result: object, j: int) -> bool:
        return result is not None and not isinstance(result, BaseException) and result.value == values[j]

    errors: collections.Counter = collections.Counter()

    def note(result: object) -> None:
        if isinstance(result, BaseException):
            errors[type(result).__name__] += 1

    # 0% churn: stores, then gets
    t_ops = time.perf_counter()
    store_lat, store_ok = [], 0
    for j in range(n_keys):
        dt, r = await timed(nodes[plan["store_from"][j]].store(keys[j], values[j], exp))
        note(r)
        store_lat.append(dt)
        store_ok += r is True
    get_lat, get_ok = [], 0
    for j in range(n_keys):
        dt, r = await timed(nodes[plan["get_from"][j]].get(keys[j]))
        note(r)
        get_lat.append(dt)
        get_ok += ok_get(r, j)
    t_ops = time.perf_counter() - t_ops

    # kill 10%, tell nobody
    t_kill = time.perf_counter()
    killed = plan["killed"]
    await asyncio.wait_for(asyncio.gather(*(nodes[i].shutdown() for i in killed), return_exceptions=True),
                           SHUTDOWN_TIMEOUT)
    t_kill = time.perf_counter() - t_kill

    t_churn = time.perf_counter()
    churn_get_lat, churn_old_ok = [], 0
    for j in range(n_keys):
        dt, r = await timed(nodes[plan["churn_get_from"][j]].get(keys[j]))
        note(r)
        churn_get_lat.append(dt)
        churn_old_ok += ok_get(r, j)
    churn_store_lat, churn_store_ok, churn_new_ok = [], 0, 0
    for j in range(n_new):
        k = n_keys + j
        dt, r = await timed(nodes[plan["new_store_from"][j]].store(keys[k], values[k], exp))
        note(r)
        churn_store_lat.append(dt)
        churn_store_ok += r is True
        dt, r = await timed(nodes[plan["new_get_from"][j]].get(keys[k]))
        note(r)
        churn_get_lat.append(dt)
        churn_new_ok += ok_get(r, k)
    t_churn = time.perf_counter() - t_churn

    t_stop = time.perf_counter()
    dead = set(killed)
    survivors = [nd for i, nd in enumerate(nodes) if i not in dead]
    try:
        await asyncio.wait_for(asyncio.gather(*(nd.shutdown() for nd in survivors), return_exceptions=True),
                               SHUTDOWN_TIMEOUT * 3)
    except asyncio.TimeoutError:
        errors["shutdown timeout"] += 1
    t_stop = time.perf_counter() - t_stop

    out = {
        "n_peers": n,
        "n_keys": n_keys,
        "n_new_keys_churn": n_new,
        "start_ms_per_peer": sum(start_lat) / n * 1e3,
        "start_p99_ms": _ms(pct(start_lat, 0.99)),
        "start_total_s": start_total,
        "mem_per_peer_mb": (rss1 - rss0) / n / MB,
        "rss_mb": rss1 / MB,
        "fds_after_start": fds_up,
        "routing_table_mean": sum(routing_sizes) / n,
        "connections_mean": sum(conns) / n,
        "connections_max": max(conns),
        **summarize("store", store_lat),
        "store_accepted": store_ok / n_keys,
        **summarize("get", get_lat),
        "get_success": get_ok / n_keys,
        "killed": len(killed),
        "get_success_churn10": (churn_old_ok + churn_new_ok) / (n_keys + n_new),
        "get_success_churn10_old": churn_old_ok / n_keys,
        "get_success_churn10_new": churn_new_ok / n_new if n_new else None,
        "ops_s": t_ops,
        "churn_ops_s": t_churn,
        "kill_s": t_kill,
        "shutdown_s": t_stop,
        "op_errors": dict(errors),
    }
    out.update({"get_p50_ms_churn10": _ms(pct(churn_get_lat, 0.5)),
                "get_p99_ms_churn10": _ms(pct(churn_get_lat, 0.99)),
                "store_p50_ms_churn10": _ms(pct(churn_store_lat, 0.5)),
                "store_p99_ms_churn10": _ms(pct(churn_store_lat, 0.99))})
    return out


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
    if not os.path.exists(BENCH_PYTHON):
        return {"error": f"{BENCH_PYTHON} is missing: run `make bench-env` to create it"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(plan, f)
        plan_path = f.name
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen([BENCH_PYTHON, HIVEMIND_WORKER, plan_path, str(deadline_s - 20)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1,
                            start_new_session=True)
    _CHILDREN.append(proc)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)], daemon=True).start()
    end = time.monotonic() + deadline_s
    seen: set[int] = set()
    out: dict = {}
    try:
        rss0 = uss0 = 0
        while True:
            try:
                line = lines.get(timeout=max(end - time.monotonic(), 0.1))
            except queue.Empty:
                out["error"] = f"hivemind worker passed its {deadline_s:.0f} s budget"
                break
            if line is None:
                out.setdefault("error", f"hivemind worker exited (rc={proc.wait(timeout=10)}) without figures")
                break
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            seen.update(p.pid for p in _tree(proc.pid))
            event = msg.pop("event", None)
            if event == "baseline":
                rss0, uss0, _ = _tree_memory(proc.pid)
                proc.stdin.write("go\n")
                proc.stdin.flush()
            elif event == "up":
                time.sleep(0.5)
                rss1, uss1, count = _tree_memory(proc.pid)
                n = plan["n"]
                out["mem_per_peer_mb"] = (rss1 - rss0) / n / MB
                out["uss_per_peer_mb"] = (uss1 - uss0) / n / MB
                out["processes"] = count
                proc.stdin.write("go\n")
                proc.stdin.flush()
            elif event == "progress":
                print(f"  hivemind: {msg.get('what')}", file=sys.stderr, flush=True)
            elif event == "result":
                out.update(msg)
                break
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    finally:  # whatever is left of the worker's tree (p2pd daemons included) goes now
        try:
            os.killpg(proc.pid, 9)
        except OSError:
            pass
        for pid in seen:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        if proc.poll() is None:
            proc.wait(timeout=10)
        log.seek(0)
        tail = log.read()[-3000:]
        log.close()
        os.unlink(log.name)
        os.unlink(plan_path)
    if "error" in out:
        out["stderr_tail"] = tail
    return out


# ---- our DHT at another size, in a child process (clean RSS) ----------------------------------
def run_ours_child(n: int, n_keys: int, n_new: int, seed: int, deadline_s: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--peers", str(n), "--keys", str(n_keys),
           "--new-keys", str(n_new), "--seed", str(seed), "--no-table"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    _CHILDREN.append(proc)
    try:
        stdout, stderr = proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"error": f"our DHT at {n} peers passed its {deadline_s:.0f} s budget"}
    try:
        return json.loads(stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"our DHT at {n} peers printed no figures (rc={proc.returncode})",
                "stderr_tail": stderr[-3000:]}


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


def print_table(columns: list[tuple[str, dict]]) -> None:
    head = f"{'figure':<28}" + "".join(f"{name:>18}" for name, _ in columns)
    ratio = len(columns) >= 2 and columns[-1][0].startswith("hivemind")
    if ratio:
        head += f"{'hivemind/ours':>15}"
    print(head + "   target")
    for label, key, unit, target in ROWS:
        vals = [col.get(key) for _, col in columns]
        line = f"{label:<28}" + "".join(f"{_fmt(v, unit):>18}" for v in vals)
        if ratio:
            a, b = vals[-2], vals[-1]
            numeric = isinstance(a, (int, float)) and isinstance(b, (int, float)) and a and key != "n_peers"
            r = f"{b / a:.1f}x" if numeric else "-"
            line += f"{r:>15}"
        verdict = _check(key, vals[0], columns[0][1].get("n_peers", 0))
        print(line + f"   {target}" + (f" [{verdict}]" if verdict else ""))


def _round(obj: object) -> object:
    if isinstance(obj, float):
        return round(obj, 3)
    if isinstance(obj, dict):
        return {k: _round(v) for k, v in obj.items()}
    return obj


def main() -> None:
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

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    n = args.peers or (128 if args.quick else 1000)
    n_keys = args.keys or (200 if args.quick else 500)
    n_new = args.new_keys if args.new_keys is not None else n_keys // 2
    # each connection costs one fd at each end, plus one listening socket per peer: N * (M + 1) fds
    max_conn = args.max_connections or max(4, min(32, FD_BUDGET * 3 // 4 // n))
    hard_limit_s = 58.0 if args.quick and not args.vs_hivemind else (300.0 if args.quick else 1200.0)

    counter = _CountingHandler()
    logging.basicConfig(level=logging.WARNING, handlers=[counter], force=True)
    figures: dict = {"quick": args.quick}

    def watchdog() -> None:  # the last resort: an await without a timeout somewhere below us
        figures["error"] = f"watchdog: run passed {hard_limit_s:.0f} s"
        for child in _CHILDREN:
            try:
                os.killpg(child.pid, 9)
            except OSError:
                pass
        print(json.dumps(_round(figures)), flush=True)
        os._exit(3)

    timer = threading.Timer(hard_limit_s, watchdog)
    timer.daemon = True
    timer.start()
    t0 = time.perf_counter()

    plan = make_plan(n, n_keys, n_new, args.seed)
    try:
        figures.update(uvloop.run(run_ours(plan, max_conn, args.idle_timeout, args.progress)))
    except Exception as e:  # a peer that would not start: report it in the figures, exit non-zero
        figures.update(n_peers=n, error=f"{type(e).__name__}: {e}")
        print(json.dumps(_round(figures)), flush=True)
        os._exit(1)  # skips waiting on the half-built swarm's sockets
    figures.update(max_connections=max_conn, idle_timeout=args.idle_timeout, seed=args.seed,
                   fd_limit=[soft, hard])
    columns: list[tuple[str, dict]] = [(f"ours N={n}", figures)]

    if args.vs_hivemind:
        k = min(args.hivemind_peers, n)
        if not os.path.exists(BENCH_PYTHON):
            msg = f"--vs-hivemind: {BENCH_PYTHON} not found; run `make bench-env` to create it"
            print(msg, file=sys.stderr)
            figures["hivemind_error"] = msg
        else:
            hm_plan = plan if k == n else make_plan(k, n_keys, n_new, args.seed)
            if k < n:
                at_k = run_ours_child(k, n_keys, n_new, args.seed, deadline_s=240)
                figures.update({f"ours_n{k}_{key}": v for key, v in at_k.items() if key in CORE_KEYS})
                columns.append((f"ours N={k}", at_k))
            hm = run_hivemind(hm_plan, deadline_s=600)
            figures.update({f"hivemind_{key}": v for key, v in hm.items() if key != "stderr_tail"})
            columns.append((f"hivemind N={k}", hm))
            if "error" in hm:
                print(f"hivemind run failed: {hm['error']}\n{hm.get('stderr_tail', '')}", file=sys.stderr)
    figures["wall_s"] = time.perf_counter() - t0
    timer.cancel()

    if counter.counts:
        figures["log_warnings"] = sum(counter.counts.values())
    if not args.no_table:
        print_table(columns)
        if args.vs_hivemind and len(columns) > 1:
            print("hivemind/ours ratio compares the last two columns (same N, same sequence).")
        if "hivemind_error" in figures:
            print(f"hivemind column missing: {figures['hivemind_error']}")
        print(f"{'wall-clock (s)':<28}{figures['wall_s']:>18.1f}")
        if counter.counts:
            print("log warnings (counted, not printed):")
            for msg, c in counter.counts.most_common(6):
                print(f"  {c:>6} x {msg}")
    print(json.dumps(_round(figures)))


if __name__ == "__main__":
    main()
