"""Mixture-of-experts at scale: beam search over 64 and 1,024 experts on 64 servers, and k_min under churn.

Issue 50 ("Hundreds of peers"): 64 expert servers in 4 child processes, each server with its own
P2P endpoint and DHT node, all servers of a process on one event loop and sharing one torch thread
(``ExpertServer.create(runtime=...)``).  Every server hosts one expert of an 8 x 8 grid (``small``,
64 experts) and 16 of a 32 x 32 grid (``large``, 1,024 experts), in contiguous blocks as an
``--expert-pattern`` would give (server s holds ``small.{s//8}.{s%8}`` and half of row ``s//2`` of
``large``).  Both grids live in the same 64-node DHT, so the comparison is of the grid alone.
Experts are tiny (``ffn``, hidden 16), so what is measured is finding and calling them.

One trainer (this process; a client-mode DHT peer) runs ``RemoteMixtureOfExperts`` forward and
backward on both grids in turn (k_best 4, k_min 2, a fresh batch of 32 rows each pass) and reads,
per forward pass, the beam search's time (``last_call.search_seconds``) and its DHT cost (the
trainer node's ``stats``: ``get_many`` calls, keys traversed, ``dht.find`` RPCs).  Two mixtures per
grid: a cached one, which reuses prefix records for ``prefix_cache_s=10`` s (re-read in the
background after 5 s: these grids' experts stay where they are), and a cold one (``prefix_cache_s=0``,
the default) that reads every prefix on every pass.
The headline ratio is of the default mixtures' mean search time (cache refreshes included); their
median and the cold mixtures' medians are reported too.  Before measuring, every server declares
its experts again once all have joined (``redeclare``): the first ones declared into a DHT of a few
peers, whose records then sit away from the keys' nearest peers until the next periodic
re-declaration (measured: a read of every replica listed 16 of the 32 first coordinates).
Then it SIGKILLs the child holding 6 of the 64 servers (9.4%: 6 of the 64 small experts, 96 of the
1,024 large ones, whole rows of both grids) without any withdrawal, so their records stay in the DHT
until they expire (60 s), and counts the forward passes of the default mixtures that still met
k_min on every row (``take_stats``) right after the kill.

``--quick`` runs 16 servers (3 children holding 9, 5 and 2; the 2 die: 12.5%) with the same grids
(4 and 64 experts per server) and fewer passes, within 60 s.  Every child has a time limit of its
own (a watchdog, then SIGALRM), and the parent kills what is left at its end; past ``time_limit``
the benchmark says so and prints the figures it has.

    python benchmarks/_scale_moe.py [--quick] [--time-limit S]

Prints a table, then one JSON line of figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: idle OpenMP threads sleep

from _common import ONE_THREAD_ENV, Child, ChildFailed, emit, kill_all, print_json, print_table  # noqa: E402

HIDDEN = 16
GRIDS = {"small": (8, 8), "large": (32, 32)}  # 64 and 1,024 experts
K_BEST, K_MIN, ROWS = 4, 2, 32
FULL = {"children": [20, 19, 19, 6], "warmup": 3, "passes": 30, "churn_passes": 40}
QUICK = {"children": [9, 5, 2], "warmup": 1, "passes": 6, "churn_passes": 10}
STOP_S = 8.0  # kept from the time limit for stopping the children


# ---- the servers' side (a child process) -------------------------------------------------------
def placement(server: int, servers: int, grid: tuple[int, int]) -> list[str]:
    """The uids server ``server`` of ``servers`` hosts on ``grid``: a contiguous block of the grid."""
    total = grid[0] * grid[1]
    per = total // servers
    prefix = next(name for name, g in GRIDS.items() if g == grid)
    return [f"{prefix}.{flat // grid[1]}.{flat % grid[1]}" for flat in range(server * per, (server + 1) * per)]


async def _serve(first: int, count: int, servers: int, initial_peers: list[str], limit_s: float) -> None:
    """Start ``count`` servers on this loop, report their addresses, serve until told to stop
    (``quit`` or the end of stdin); ``redeclare`` declares every server's experts again."""
    import torch

    from experts import ExpertBackend, ExpertServer
    from experts.runtime import Runtime

    torch.set_num_threads(1)
    runtime = Runtime()  # one torch thread for every server of this process
    started: list[ExpertServer] = []
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[str] = asyncio.Queue()
    loop.add_reader(sys.stdin.fileno(), lambda: commands.put_nowait(sys.stdin.readline().strip() or "quit"))
    try:
        peers = list(initial_peers)
        for s in range(first, first + count):
            uids = [u for grid in GRIDS.values() for u in placement(s, servers, grid)]
            backends = [ExpertBackend.from_kind(u, "ffn", HIDDEN, optimizer=lambda p: torch.optim.SGD(p, lr=1e-3))
                        for u in uids]
            server = await ExpertServer.create(backends, initial_peers=peers, runtime=runtime)
            started.append(server)
            if not peers:  # the very first server started the DHT: the others join through it
                peers = [server.address]
        emit({"ready": [s.address for s in started]})
        until = loop.time() + limit_s
        while (command := await asyncio.wait_for(commands.get(), max(until - loop.time(), 0))) != "quit":
            if command == "redeclare":
                emit({"redeclared": all(await asyncio.gather(*(s.redeclare() for s in started)))})
    except asyncio.TimeoutError:
        print(f"servers {first}..{first + count - 1}: past the {limit_s:.0f} s limit, stopping",
              file=sys.stderr, flush=True)
    finally:
        await asyncio.gather(*(s.shutdown(withdraw=False) for s in started), return_exceptions=True)
        runtime.shutdown()


def serve_main(spec: dict) -> None:
    """A child: its servers, a watchdog past its limit, and SIGALRM (the default: exit) as a backstop."""
    import uvloop

    signal.alarm(int(spec["limit_s"]) + 15)
    uvloop.run(_serve(spec["first"], spec["count"], spec["servers"], spec["initial_peers"], spec["limit_s"]))


# ---- the trainer's side (this process) ---------------------------------------------------------
class Fleet:
    """The server children; ``kill(i)`` SIGKILLs child i with its whole tree."""

    def __init__(self, sizes: Sequence[int], limit_s: float, deadline: float) -> None:
        self.sizes, self.children, self.addresses = list(sizes), [], []
        servers = sum(sizes)
        env = {**ONE_THREAD_ENV, "PYTHONPATH": ROOT, "OMP_WAIT_POLICY": "PASSIVE"}
        first = 0
        for i, count in enumerate(sizes):
            spec = {"first": first, "count": count, "servers": servers, "limit_s": limit_s,
                    "initial_peers": self.addresses[:3]}
            child = Child(f"servers-{i}", [sys.executable, __file__, "--serve", json.dumps(spec)], env=env)
            self.children.append(child)
            if i == 0:  # the DHT's first node: the others need its address
                self.addresses += child.recv("ready", deadline)["ready"]
            first += count
        for child in self.children[1:]:
            self.addresses += child.recv("ready", deadline)["ready"]

    def redeclare(self, deadline: float) -> None:
        """Every server declares its experts again, now that all have joined: the first servers
        declared into a DHT of a few peers, so their records sit on peers that are no longer the
        nearest to the keys (a running swarm gets there by its periodic re-declarations).  A shared
        prefix subkey that another server wrote later is refused, so a child's "all accepted" may be
        False while every expert is listed."""
        for child in self.children:
            child.send("redeclare")
        for child in self.children:
            child.recv("redeclared", deadline)

    def kill(self, i: int) -> None:
        self.children[i].kill()

    def stop(self, grace: float = 10.0) -> None:
        from _common import stop_all
        stop_all(self.children, grace)


def _dht_cost(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in ("get_many", "keys_traversed", "dht.find")}


def _passes(dht: Any, moe: Any, batches: Any, n: int, deadline: float) -> list[dict]:
    """``n`` forward + backward passes (fewer past ``deadline``): search time and DHT cost of each."""
    out = []
    for _ in range(n):
        if time.monotonic() > deadline:
            break
        x = next(batches)
        before = dict(dht.node.stats)
        y = moe(x)
        cost = _dht_cost(before, dict(dht.node.stats))
        y.pow(2).mean().backward()
        out.append({"search_ms": moe.last_call.search_seconds * 1e3, **cost})
    return out


def _summary(name: str, passes: list[dict], how: str) -> dict:
    """Per-forward figures of one mixture: ``how`` is "mean" (amortized) or "median"."""
    avg = statistics.fmean if how == "mean" else statistics.median
    get = (lambda key: avg(p[key] for p in passes)) if passes else (lambda key: None)
    return {f"moe_{name}_passes": len(passes), f"moe_{name}_search_ms": get("search_ms"),
            f"moe_{name}_search_ms_median": statistics.median(p["search_ms"] for p in passes) if passes else None,
            f"moe_{name}_get_many_per_forward": get("get_many"),
            f"moe_{name}_keys_per_forward": get("keys_traversed"),
            f"moe_{name}_find_rpcs_per_forward": get("dht.find")}


def _ratio(figures: dict, key: str) -> float | None:
    """``key`` of the 1,024-expert grid over that of the 64-expert one."""
    small, large = figures.get(key.format("small")), figures.get(key.format("large"))
    return large / small if small and large else None


def _churn(moes: dict, batches: Any, n: int, deadline: float) -> dict:
    """Forward passes right after the kill: the fraction that met k_min on every row, per grid, and
    how many experts a second wave called in all."""
    for moe in moes.values():
        moe.take_stats()
    started = time.monotonic()
    fallbacks = dict.fromkeys(moes, 0)
    for _ in range(n):
        if time.monotonic() > deadline:
            break
        for name, moe in moes.items():
            moe(next(batches)).pow(2).mean().backward()
            fallbacks[name] += moe.last_call.fallbacks
    out: dict[str, Any] = {"moe_churn_seconds": time.monotonic() - started}
    met = calls = 0
    for name, moe in moes.items():
        stats = moe.take_stats()
        met, calls = met + stats["calls_meeting_k_min"], calls + stats["calls"]
        calls_ = stats["calls"]
        out[f"moe_{name}_kmin_fraction_churn"] = stats["calls_meeting_k_min"] / calls_ if calls_ else None
        out[f"moe_{name}_churn_passes"] = stats["calls"]
        out[f"moe_{name}_churn_fallback_experts"] = fallbacks[name]
    out["moe_kmin_fraction_churn"] = met / calls if calls else None  # both grids' passes
    return out


def measure(quick: bool = False, time_limit: float = 240.0) -> dict:
    """Beam-search time and DHT lookups per forward at 64 and 1,024 experts, then k_min under churn.
    Past ``time_limit`` the parts not run are reported as such, with the figures so far."""
    cfg = QUICK if quick else FULL
    t0 = time.monotonic()
    deadline = t0 + time_limit
    servers = sum(cfg["children"])
    victim = len(cfg["children"]) - 1
    figures: dict[str, Any] = {"moe_scale_load_before": os.getloadavg()[0], "moe_scale_servers": servers,
                               "moe_scale_processes": len(cfg["children"]),
                               "moe_scale_killed_servers": cfg["children"][victim],
                               "moe_scale_experts": {g: a * b for g, (a, b) in GRIDS.items()},
                               "moe_scale_quick": quick}
    fleet = None
    try:
        fleet = Fleet(cfg["children"], limit_s=time_limit + 30, deadline=deadline)
        fleet.redeclare(deadline)  # whether it went through shows in moe_*_experts_visible
        figures["moe_scale_startup_s"] = time.monotonic() - t0
        figures.update(_trainer(fleet, cfg, victim, deadline - STOP_S))
    except ChildFailed as e:
        figures["moe_scale_error"] = str(e).splitlines()[0]
    finally:
        if fleet is not None:
            fleet.stop(grace=max(min(STOP_S, deadline - time.monotonic()), 1.0))
        kill_all()
    planned = [cfg["passes"]] * 2 * len(GRIDS) + [cfg["churn_passes"]] * len(GRIDS)
    done = [figures.get(f"moe_{n}_passes", 0) for n in [*GRIDS, *(f"{g}_cold" for g in GRIDS)]]
    done += [figures.get(f"moe_{g}_churn_passes", 0) for g in GRIDS]
    if done != planned:
        figures["moe_scale_cut_short"] = f"{sum(done)} of {sum(planned)} passes ran within the time limit"
    if time.monotonic() > deadline:
        figures["moe_scale_past_time_limit"] = True
    figures["moe_scale_seconds"] = time.monotonic() - t0
    figures["moe_scale_load_after"] = os.getloadavg()[0]
    return figures


def _trainer(fleet: Fleet, cfg: dict, victim: int, deadline: float) -> dict:
    """The trainer's part: warm-up, the timed passes on both grids in turn, the kill, the churn passes."""
    import torch

    from dht import DHT
    from experts import RemoteMixtureOfExperts

    torch.manual_seed(0)
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    dht = DHT(initial_peers=fleet.addresses[:3], client_mode=True)
    batches = iter(lambda: torch.randn(ROWS, HIDDEN), None)  # a fresh batch every pass, endless

    def mixture(name: str, **options: Any) -> Any:
        return RemoteMixtureOfExperts(HIDDEN, GRIDS[name], name, k_best=K_BEST, k_min=K_MIN, forward_timeout=10,
                                      timeout_after_k_min=1.0, backward_timeout=10, dht=dht,
                                      allow_zero_outputs=True, **options)
    try:
        for name, grid in GRIDS.items():
            out[f"moe_{name}_experts_visible"] = _visible(dht, name, grid)
        moes = {name: mixture(name, prefix_cache_s=10.0) for name in GRIDS}
        cold = {f"{name}_cold": mixture(name, prefix_cache_s=0) for name in GRIDS}
        every = {**moes, **cold}
        for moe in every.values():  # warm-up: connections to the DHT nodes and the servers
            _passes(dht, moe, batches, cfg["warmup"], deadline)
        runs: dict[str, list[dict]] = {name: [] for name in every}
        timed_until = time.monotonic() + 0.6 * (deadline - time.monotonic())  # the rest is the churn's
        for _ in range(cfg["passes"]):  # in turn, so every mixture sees the same load
            for name, moe in every.items():
                runs[name] += _passes(dht, moe, batches, 1, timed_until)
        for name, passes in runs.items():
            out.update(_summary(name, passes, "median" if name.endswith("_cold") else "mean"))
        out["moe_beam_search_ratio_1024_64"] = _ratio(out, "moe_{}_search_ms")
        out["moe_beam_search_median_ratio_1024_64"] = _ratio(out, "moe_{}_search_ms_median")
        out["moe_cold_beam_search_ratio_1024_64"] = _ratio(out, "moe_{}_cold_search_ms")
        out["moe_find_rpcs_ratio_1024_64"] = _ratio(out, "moe_{}_find_rpcs_per_forward")
        out["moe_cold_find_rpcs_ratio_1024_64"] = _ratio(out, "moe_{}_cold_find_rpcs_per_forward")
        if time.monotonic() < deadline:
            fleet.kill(victim)
            out.update(_churn(moes, batches, cfg["churn_passes"], deadline))
    finally:
        dht.shutdown()
    return out


def _visible(dht: Any, prefix: str, grid: tuple[int, int]) -> int:
    """How many of the grid's experts the prefix records list, read from every replica."""
    keys = [f"{prefix}.{i}." for i in range(grid[0])]
    found = dht.get_many(keys, latest=True)
    return sum(len(v.value) for v in found.values() if v is not None and isinstance(v.value, dict))


def print_report(f: dict) -> None:
    """The figures as a table."""
    print(f"MoE at scale: {f['moe_scale_servers']} servers in {f['moe_scale_processes']} processes, "
          f"trainer k_best={K_BEST} k_min={K_MIN}, {ROWS} rows per forward"
          + (" (quick)" if f.get("moe_scale_quick") else "")
          + f"; load average {f['moe_scale_load_before']:.1f} before, {f.get('moe_scale_load_after', 0):.1f} after")
    rows = []
    for grid in GRIDS:
        n = f["moe_scale_experts"][grid]
        for name, label in ((grid, "mean, cached"), (f"{grid}_cold", "median, cold")):
            rows.append([f"{n} experts ({label})", _cell(f.get(f"moe_{name}_search_ms"), ".2f"),
                         _cell(f.get(f"moe_{name}_search_ms_median"), ".2f"),
                         _cell(f.get(f"moe_{name}_get_many_per_forward"), ".2f"),
                         _cell(f.get(f"moe_{name}_keys_per_forward"), ".1f"),
                         _cell(f.get(f"moe_{name}_find_rpcs_per_forward"), ".1f"),
                         _cell(f.get(f"moe_{name}_kmin_fraction_churn"), ".3f")])
    print("experts the DHT's prefix records list (every replica asked): "
          + ", ".join(f"{f.get(f'moe_{g}_experts_visible', '-')} of {n}" for g, n in f["moe_scale_experts"].items()))
    print_table(["<30", ">10", ">8", ">10", ">7", ">11", ">15"],
                ["per forward pass", "search ms", "median", "get_many", "keys", "find RPCs", "k_min (churn)"],
                rows, rule=True)
    ratio, kmin = f.get("moe_beam_search_ratio_1024_64"), f.get("moe_kmin_fraction_churn")
    print(f"beam search 1,024 / 64 experts: {_cell(ratio, '.2f')} mean (target <= 2: {_verdict(ratio, 2, False)}), "
          f"{_cell(f.get('moe_beam_search_median_ratio_1024_64'), '.2f')} median; "
          f"cold {_cell(f.get('moe_cold_beam_search_ratio_1024_64'), '.2f')}; find RPCs "
          f"{_cell(f.get('moe_find_rpcs_ratio_1024_64'), '.2f')}, cold "
          f"{_cell(f.get('moe_cold_find_rpcs_ratio_1024_64'), '.2f')}")
    print(f"k_min met after killing {f['moe_scale_killed_servers']} of {f['moe_scale_servers']} servers: "
          f"{_cell(kmin, '.3f')} of passes (target >= 0.99: {_verdict(kmin, 0.99, True)})")
    for key in ("moe_scale_error", "moe_scale_cut_short", "moe_scale_past_time_limit"):
        if key in f:
            print(f"{key}: {f[key]}")


def _verdict(value: float | None, target: float, at_least: bool) -> str:
    if value is None:
        return "not measured"
    return "met" if (value >= target if at_least else value <= target) else "NOT met"


def _cell(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds (default 240, quick 55)")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # a server child's spec (JSON)
    args = parser.parse_args()
    if args.serve:
        serve_main(json.loads(args.serve))
        return
    limit = args.time_limit if args.time_limit is not None else (55.0 if args.quick else 240.0)
    figures = measure(args.quick, limit)
    print_report(figures)
    print_json(figures)


if __name__ == "__main__":
    main()
