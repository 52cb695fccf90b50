"""All-reduce benchmark: DecentralizedAverager rounds between peer processes, against raw sockets.

Part 1, loopback: N peer processes (``_allreduce_peer.py``) each average one float32 vector of
``size`` elements per round; the parent starts every round at once (``prep`` then ``go`` lines on
the peers' stdin) and checks that every peer ends with the mean of the vectors it was given
(sampled elements, the float64 sum, and bit-identical buffers).  A raw-socket baseline
(``_allreduce_raw_peer.py``) moves the same bytes an all-reduce moves between N processes with
``sendall`` / ``recv_into`` and no arithmetic, in the same run.  Each configuration first runs one
warm-up round, checked but left out of the figures: ours then splits by measured bandwidths, and
the reference library's DHT has converged (its first matchmaking sometimes found no group, which
left a configuration without a figure).

Part 2, shaped links: every peer in its own network namespace (``arbench-*``, 10.77.0.0/24, made
and removed by this script), joined by a bridge in another one, its egress and ingress shaped with
tbf to its bandwidth; measured rounds are compared with the bandwidth-optimal bound of the
load-balancing LP (``averaging.load_balancing.optimal_shares``), and so is a raw-socket exchange
of the same parts.  Four cases: equal links, mixed links with every peer told its bandwidth, the
same mixed links with none told (each measures its own, the default: ``averaging/bandwidth.py``;
its figure is the median of the rounds after the first, which splits by the default and measures),
and those again with every peer probing its upload to two others before the first round (as a
collaborative newcomer does; not in ``--quick``): its first round is the figure to compare.
Needs root and iproute2; otherwise it prints "skipped: <reason>".

``--vs-hivemind``: the same Part 1 rounds with the reference library's averager
(``_allreduce_hivemind_peer.py``, run by ``.bench-venv/bin/python`` from ``make bench-env``).

    python benchmarks/bench_allreduce.py [--quick] [--vs-hivemind] [--skip-shaped]

Prints tables, then one JSON line of figures (medians over rounds; a round's matchmaking and
all-reduce times are the slowest peer's ``StepResult.matchmaking_time`` / ``allreduce_time``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from _common import (
    BENCH_PY,
    HERE,
    HIVEMIND_MISSING,
    ONE_THREAD_ENV,
    ROOT,
    Child,
    ChildFailed,
    PeakSampler,
    descendants,
    exit_on_sigterm,
    fmt,
    median,
    print_json,
    print_table,
    stop_all,
)


def _load_balancing():
    """averaging/load_balancing.py by path: the parent needs only its LP (numpy), not torch."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_load_balancing",
                                                  os.path.join(ROOT, "averaging", "load_balancing.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_lb = _load_balancing()
optimal_shares, part_sizes = _lb.optimal_shares, _lb.part_sizes

PEER = os.path.join(HERE, "_allreduce_peer.py")
RAW_PEER = os.path.join(HERE, "_allreduce_raw_peer.py")
HIVEMIND_PEER = os.path.join(HERE, "_allreduce_hivemind_peer.py")
M = 1_000_000
NS = "arbench-"  # every namespace this benchmark creates starts with this
SUBNET = "10.77.0"


def tree_pss_kb(pids: Sequence[int]) -> int:
    """Sum of Pss over the processes and all their descendants (shared pages counted once)."""
    total = 0
    for p in {q for pid in pids for q in [pid, *descendants(pid)]}:
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total += next((int(line.split()[1]) for line in f if line.startswith("Pss:")), 0)
        except (OSError, ValueError):
            pass
    return total


# ---- averaging runs (ours or hivemind) ---------------------------------------------------------
@dataclass
class AvgRun:
    impl: str
    n: int
    size: int
    rounds: list[dict] = field(default_factory=list)  # per round: mm, ar, span, checks
    rss_kb: list[int] = field(default_factory=list)
    peak_pss_kb: int = 0
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what went wrong in the reference's warm-up rounds
    part_sizes: list[int] = field(default_factory=list)
    probed: list[float | None] = field(default_factory=list)  # Mbit/s each member's probe measured

    def median(self, key: str) -> float | None:
        return median([r[key] for r in self.rounds if r.get("ok")])

    @property
    def all_correct(self) -> bool:
        return bool(self.rounds) and all(r["ok"] for r in self.rounds) and not self.errors


def _check_round(impl: str, size: int, pre: list[dict], post: list[dict], n: int) -> list[str]:
    """Every peer must hold the mean of the pre-round vectors (within float32 rounding)."""
    problems = []
    expect = np.mean([p["samples"] for p in pre], axis=0)
    expect_sum = float(np.mean([p["sum"] for p in pre]))
    sum_tol = 1e-3 + 1e-7 * size
    for i, r in enumerate(post):
        if r["group_size"] != n or r["failed"]:
            problems.append(f"peer {i}: group of {r['group_size']}, {r['failed']} failed {r.get('error') or ''}")
            continue
        err = float(np.max(np.abs(np.asarray(r["samples"]) - expect)))
        if err > 1e-5:
            problems.append(f"peer {i}: sampled elements off the mean by up to {err:.3g}")
        if abs(r["sum"] - expect_sum) > sum_tol:
            problems.append(f"peer {i}: sum {r['sum']:.6f} != mean of sums {expect_sum:.6f}")
    # our reducers broadcast one buffer per part, so every peer must hold the very same bits;
    # hivemind adds (average - local) to each local copy, which rounds differently per peer
    if impl == "ours" and len({r["crc"] for r in post}) > 1 and not problems:
        problems.append("peers hold different bits after the round")
    return problems


class PeerSet:
    """n peer processes whose DHT nodes form one swarm; runs averaging configurations on subsets of them.

    Ours: one set serves several configurations (``avg`` gives members a fresh averager), which saves
    the processes' start-up (torch import) on this 2-core machine.  hivemind: its averager is made
    at start for the whole set, so one set serves one configuration.
    """

    def __init__(self, impl: str, n: int, size: int, *, namespaces: Sequence[str] | None = None,
                 hosts: Sequence[str] | None = None, clients: Sequence[int] = (), round_timeout: float = 120.0,
                 profile_dir: str = "", extra_args: Sequence[str] = ()) -> None:
        self.impl, self.n, self.size, self.round_timeout = impl, n, size, round_timeout
        self.children: list[Child] = []
        self.addrs: list[str | None] = [None] * n  # each peer's listening address (None: client mode)
        self.rss_kb: list[int] = []
        try:
            for i in range(n):
                if impl == "hivemind":
                    argv = [BENCH_PY, HIVEMIND_PEER, "--group-size", str(n), "--prefix", f"hm{n}x{size}"]
                else:
                    argv = [sys.executable, PEER, "--host", hosts[i] if hosts else "127.0.0.1", *extra_args]
                    if i in clients:
                        argv.append("--client-mode")
                    if profile_dir:
                        argv += ["--profile", os.path.join(profile_dir, f"peer{i}.prof")]
                argv += ["--size", str(size), "--seed", str(7919 * (i + 1)),
                         "--allreduce-timeout", str(round_timeout), "--step-timeout", str(round_timeout + 30)]
                if namespaces:
                    argv = ["ip", "netns", "exec", namespaces[i], *argv]
                self.children.append(Child(f"{impl} peer {i}", argv, env=ONE_THREAD_ENV))
            deadline = time.monotonic() + 120
            for c in self.children:
                c.recv("hello", deadline)
            # the first non-client peer bootstraps the DHT; the others join it
            first = next(i for i in range(n) if i not in clients)
            self.children[first].send("init -")
            boot = self.addrs[first] = self.children[first].recv("ready", deadline)["addr"]
            others = [c for i, c in enumerate(self.children) if i != first]
            for c in others:
                c.send(f"init {boot}")
            for i, c in enumerate(self.children):
                if i != first:
                    self.addrs[i] = c.recv("ready", deadline)["addr"]
        except BaseException:
            self.close()
            raise

    def run(self, members: Sequence[int], rounds: int, prefix: str, bandwidths: Sequence[float] | None = None,
            sample_pss: bool = False, probe: bool = False, warmup: int = 0) -> AvgRun:
        """``rounds`` synchronized rounds of the group ``members``; every result is checked.  ``probe``:
        before the first round, each member in turn probes its upload to two of the others (as a
        collaborative newcomer does to the peers it loads state from).  ``warmup`` rounds come first
        and stay out of the figures: a wrong result in one of ours is still an error, the reference
        library's (its first matchmaking may find no group while its DHT converges) only a note."""
        n, size = len(members), self.size
        run = AvgRun(self.impl, n, size)
        peers = [self.children[i] for i in members]
        try:
            if self.impl == "ours":
                deadline = time.monotonic() + 30
                for k, c in enumerate(peers):
                    c.send(f"avg {prefix} {n} {bandwidths[k] if bandwidths else 'measured'}")
                for c in peers:
                    c.recv("avg_ready", deadline)
                if probe:
                    listening = [(i, self.addrs[i]) for i in members if self.addrs[i] is not None]
                    for k, c in zip(members, peers, strict=True):  # one at a time, as newcomers arrive
                        targets = [a for i, a in listening if i != k][:2]
                        c.send(f"probe {','.join(targets)}")
                        run.probed.append(c.recv("probed", time.monotonic() + 60)["probed"])
            pids = [c.proc.pid for c in peers]
            sampler = PeakSampler(lambda: tree_pss_kb(pids)) if sample_pss else None
            for rnd in range(warmup + rounds):
                deadline = time.monotonic() + 60 + (size * 4 * n) / 20e6  # generous: refill + checksums
                for c in peers:
                    c.send(f"prep {rnd}")
                pre = [c.recv("prepped", deadline) for c in peers]
                for c in peers:
                    c.send(f"go {rnd}")
                deadline = time.monotonic() + self.round_timeout + 60
                post = [c.recv("round", deadline) for c in peers]
                problems = _check_round(self.impl, size, pre, post, n)
                run.part_sizes = post[0].get("part_sizes") or []
                what = f"warm-up round {rnd}" if rnd < warmup else f"round {rnd - warmup}"
                log = run.notes if rnd < warmup and self.impl != "ours" else run.errors
                log.extend(f"{what}: {p}" for p in problems)
                for k, c in enumerate(peers):  # what the peers said about it (warnings, tracebacks)
                    if any(p.startswith(f"peer {k}:") for p in problems) and c.tail(3):
                        log.append(f"{what}: peer {k} stderr:{c.tail(3)}")
                if rnd < warmup:
                    continue  # checked, not in the figures
                matched = [r["t_end"] - r["allreduce_time"] for r in post]
                run.rounds.append({
                    "ok": not problems, "problems": problems,
                    "mm": max(r["matchmaking_time"] for r in post),
                    "ar": max(r["allreduce_time"] for r in post),
                    "span": max(r["t_end"] for r in post) - min(matched),
                    "round": max(r["t_end"] for r in post) - min(r["t_start"] for r in post),
                    "cpu": sum(r.get("cpu_s") or 0.0 for r in post),
                    "peers": [{k: r.get(k) for k in ("t_start", "t_end", "matchmaking_time", "allreduce_time",
                                                      "my_index", "diag", "bandwidth")} for r in post],
                })
            if sampler is not None:
                run.peak_pss_kb = sampler.stop()
        except ChildFailed as e:
            run.errors.append(str(e))
        return run

    def close(self) -> list[int]:
        """Stop every peer; returns each one's peak RSS (kB) if all reported it."""
        try:
            for c in self.children:
                if c.proc.poll() is None:
                    c.send("quit")
            deadline = time.monotonic() + 30
            self.rss_kb = [c.recv("rss_kb", deadline)["rss_kb"] for c in self.children]
        except ChildFailed:
            self.rss_kb = []
        finally:
            stop_all(self.children, grace=15)
        return self.rss_kb


def run_averaging(impl: str, configs: Sequence[tuple[int, int]], rounds: int, *, sample_pss: bool = False,
                  round_timeout: float = 120.0, profile_dir: str = "",
                  warmup: int = 1) -> dict[tuple[int, int], AvgRun]:
    """Loopback runs of the (n, size) configs, each ``warmup`` rounds then ``rounds`` measured ones;
    ours runs configs of one size on one set of processes."""
    out: dict[tuple[int, int], AvgRun] = {}
    groups: list[list[tuple[int, int]]] = []
    for n, size in configs:
        same = next((g for g in groups if g[0][1] == size), None) if impl == "ours" else None
        if same is None:
            groups.append([(n, size)])
        else:
            same.append((n, size))
    for group in groups:
        size = group[0][1]
        largest = max(n for n, _ in group)
        peers = None
        try:
            peers = PeerSet(impl, largest, size, round_timeout=round_timeout, profile_dir=profile_dir)
            for n, _ in sorted(group):
                out[n, size] = peers.run(range(n), rounds, prefix=f"o{n}x{size}", sample_pss=sample_pss,
                                         warmup=warmup)
        except ChildFailed as e:
            for key in group:
                out.setdefault(key, AvgRun(impl, key[0], size)).errors.append(str(e))
        finally:
            if peers is not None:
                rss = peers.close()
                for n, _ in group:
                    if (n, size) in out and len(rss) == n:  # peak RSS only means something for the whole set
                        out[n, size].rss_kb = rss
    return out


def memory_floor(n: int, size: int) -> int | None:
    """Summed peak RSS (kB) of n peer processes that import everything and fill their vector but
    never average: what any torch-based peer holding ``size`` float32 costs before a round."""
    children = [Child(f"floor {i}", [sys.executable, PEER, "--floor", "--size", str(size), "--seed", str(i + 1)],
                      env=ONE_THREAD_ENV) for i in range(n)]
    try:
        deadline = time.monotonic() + 120
        return sum(c.recv("rss_kb", deadline)["rss_kb"] for c in children)
    except ChildFailed:
        return None
    finally:
        stop_all(children, grace=10)


# ---- raw-socket baseline -----------------------------------------------------------------------
def run_raw(parts: Sequence[int], reps: int, *, namespaces: Sequence[str] | None = None,
            hosts: Sequence[str] | None = None, clients: Sequence[int] = (), overlap: bool = False,
            timeout: float = 120.0) -> dict:
    """Median (over reps) of common start to last finish; the processes start together on 'go'."""
    n = len(parts)
    children: list[Child] = []
    times, cpus, errors = [], [], []
    try:
        for i in range(n):
            argv = [sys.executable, RAW_PEER, "--index", str(i), "--parts", ",".join(map(str, parts)),
                    "--host", hosts[i] if hosts else "127.0.0.1", "--client", ",".join(map(str, clients))]
            if overlap:
                argv.append("--overlap")
            if namespaces:
                argv = ["ip", "netns", "exec", namespaces[i], *argv]
            children.append(Child(f"raw peer {i}", argv, env=ONE_THREAD_ENV))
        deadline = time.monotonic() + 60
        ports = [c.recv("port", deadline)["port"] for c in children]
        addrs = ",".join(f"{hosts[i] if hosts else '127.0.0.1'}:{p}" for i, p in enumerate(ports))
        for c in children:
            c.send(f"peers {addrs}")
        for c in children:
            c.recv("connected", deadline)
        for k in range(reps):
            for c in children:
                c.send(f"go {k}")
            deadline = time.monotonic() + timeout
            res = [c.recv("go", deadline) for c in children]
            for r in res:
                errors.extend(r["errors"])
            times.append(max(r["t_end"] for r in res) - min(r["t_start"] for r in res))
            cpus.append(sum(r["cpu_s"] for r in res))
    except ChildFailed as e:
        errors.append(str(e))
    finally:
        stop_all(children, grace=10)
    ok = bool(times) and not errors
    return {"s": statistics.median(times) if ok else None, "cpu": statistics.median(cpus) if ok else None,
            "all": times, "errors": errors}


# ---- shaped links (Part 2) ---------------------------------------------------------------------
def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=20, check=check)


def _our_namespaces() -> list[str]:
    try:
        out = _sh("ip", "netns", "list").stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(NS)]


def cleanup_namespaces() -> None:
    """Delete every namespace this benchmark made (its veths and bridge go with it)."""
    for ns in _our_namespaces():
        _sh("ip", "netns", "delete", ns, check=False)


def shaping_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "not root (network namespaces need CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode != 0:
            return f"`{tool}` (iproute2) is not installed"
    return None


def setup_star(n: int) -> tuple[list[str], list[str]]:
    """Namespaces arbench-p<i> (address 10.77.0.<i+1>, device eth0) bridged in arbench-hub."""
    hub = f"{NS}hub"
    _sh("ip", "netns", "add", hub)
    _sh("ip", "-n", hub, "link", "set", "lo", "up")
    _sh("ip", "-n", hub, "link", "add", "br0", "type", "bridge", "forward_delay", "0", "stp_state", "0")
    _sh("ip", "-n", hub, "link", "set", "br0", "up")
    names, hosts = [], []
    for i in range(n):
        ns, host = f"{NS}p{i}", f"{SUBNET}.{i + 1}"
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"h{i}", "netns", hub)
        _sh("ip", "-n", ns, "addr", "add", f"{host}/24", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        _sh("ip", "-n", hub, "link", "set", f"h{i}", "master", "br0")
        _sh("ip", "-n", hub, "link", "set", f"h{i}", "up")
        # Reno inside our namespaces (a per-namespace setting): with tbf's drop-tail queues (this kernel
        # has no fq / fq_codel) the raw-socket baseline reached ~0.82-0.86 of the bound with the host's
        # BBR or with 50-100 ms of queue, ~0.93 with Reno and 500 ms (the other ~4.5% are packet headers)
        _sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.tcp_congestion_control=reno", check=False)
        names.append(ns)
        hosts.append(host)
    return names, hosts


def shape_links(names: Sequence[str], rates_mbit: Sequence[float]) -> None:
    """tbf at ``rate`` on each peer's egress (its eth0) and ingress (its port on the bridge)."""
    for i, (ns, rate) in enumerate(zip(names, rates_mbit, strict=True)):
        shape = ["root", "tbf", "rate", f"{rate}mbit", "burst", "64kb", "latency", "500ms"]
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "eth0", *shape)
        _sh("ip", "netns", "exec", f"{NS}hub", "tc", "qdisc", "replace", "dev", f"h{i}", *shape)


SHAPED_CASES = [  # label, link rates (Mbit/s), whether the last peer is in client mode, whether the
    # peers are told their links (else each measures its own: the default, averaging/bandwidth.py)
    ("equal", [100.0, 100.0, 100.0, 100.0], False, True),
    ("mixed", [200.0, 100.0, 50.0, 100.0], True, True),
    ("measured", [200.0, 100.0, 50.0, 100.0], True, False),
    ("probed", [200.0, 100.0, 50.0, 100.0], True, False),  # measured, each peer probing before round 1
]


def run_shaped(size: int, rounds: int, raw_reps: int, stages: dict[str, float], quick: bool = False) -> list[dict]:
    """Both shaped cases on one star: processes 0-3 listen in p0-p3; process 4, a client-mode peer in
    p3 (same link), stands in for peer 3 in the mixed case."""
    cleanup_namespaces()
    results = []
    peers = None
    try:
        names, hosts = setup_star(4)
        shape_links(names, SHAPED_CASES[0][1])
        t0 = time.monotonic()
        peers = PeerSet("ours", 5, size, namespaces=[*names, names[3]], hosts=[*hosts, hosts[3]], clients=(4,),
                        round_timeout=60)
        stages["shaped start"] = time.monotonic() - t0
        for label, links, last_is_client, told in SHAPED_CASES:
            if quick and label == "probed":
                continue  # --quick keeps to its minute
            t0 = time.monotonic()
            shape_links(names, links)
            clients = [3] if last_is_client else []
            lb_bw = [0.0 if i in clients else b for i, b in enumerate(links)]
            shares, per_element = optimal_shares(lb_bw)
            # the LP leaves out client-mode peers (they reduce nothing), but they still send and
            # receive their whole vector over their own link
            per_element = max([per_element] + [1.0 / links[i] for i in clients])
            bound = per_element * size * 4 * 8 / 1e6  # T/P is in 1/(Mbit/s): P elements * 32 bit
            members = [0, 1, 2, 4] if last_is_client else [0, 1, 2, 3]
            # measured: the first round splits by the default bandwidth and measures; the figure is the
            # median of the rounds after it
            run = peers.run(members, rounds if told else rounds + 1, prefix=f"s{label}",
                            bandwidths=links if told else None, probe=label == "probed")
            # the LP's bound assumes a reducer can return each averaged byte as soon as it arrived: the
            # raw run sends all-gather bytes without waiting, the pure transport's time for these parts
            raw = run_raw(part_sizes(size, shares), raw_reps, namespaces=names, hosts=hosts, clients=clients,
                          overlap=True)
            settled = run.rounds if told else run.rounds[1:]
            times = [r["ar"] for r in settled if r["ok"]]
            measured = statistics.median(times) if times else None
            declared = [p.get("bandwidth") for p in run.rounds[-1]["peers"]] if run.rounds else []
            results.append({"label": label, "links": list(links), "clients": clients, "bound_s": bound,
                            "told": told, "declared": declared,
                            "first_round_s": None if told or not run.rounds else run.rounds[0]["ar"],
                            "shares": [float(x) for x in shares], "run": run, "raw": raw,
                            "measured_s": measured, "fraction": bound / measured if measured else None,
                            "raw_fraction": bound / raw["s"] if raw["s"] else None})
            stages[f"shaped {label}"] = time.monotonic() - t0
    finally:
        if peers is not None:
            peers.close()
        cleanup_namespaces()
    return results


# ---- report ------------------------------------------------------------------------------------
def _label(n: int, size: int) -> str:
    return f"{n}x{size // M}M"


def print_errors(run: AvgRun) -> None:
    for e in run.errors[:6]:
        print(f"  !! {run.impl} {_label(run.n, run.size)}: {e}")
    for e in run.notes[:3]:
        print(f"  .. {run.impl} {_label(run.n, run.size)} (not in the figures): {e}")


def _gb(kb: float | None) -> float | None:
    return kb / 1e6 if kb else None


def _rss_gb(run: AvgRun) -> float | None:
    """Peak RSS summed over the set, if every process of it reported one."""
    return sum(run.rss_kb) / 1e6 if len(run.rss_kb) == run.n else None


@dataclass
class Loopback:
    """Part 1's runs: ours, the raw-socket baseline and hivemind, by (peers, size)."""

    configs: list[tuple[int, int]]
    rounds: int
    ours: dict[tuple[int, int], AvgRun] = field(default_factory=dict)
    raws: dict[tuple[int, int], dict] = field(default_factory=dict)
    hms: dict[tuple[int, int], AvgRun] = field(default_factory=dict)
    floor_kb: int | None = None
    hivemind_note: str = ""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller run, under 60 s")
    parser.add_argument("--vs-hivemind", action="store_true", help="also run hivemind from .bench-venv")
    parser.add_argument("--skip-shaped", action="store_true", help="leave out Part 2 (network namespaces)")
    parser.add_argument("--profile-dir", default="", help="cProfile every peer of our runs into this folder")
    return parser.parse_args()


def run_loopback(args: argparse.Namespace, stages: dict[str, float]) -> Loopback:
    """Part 1: ours (one set of processes per size), the memory floor, raw sockets, hivemind."""
    configs = [(4, 10 * M), (8, 10 * M)] + ([] if args.quick else [(4, 100 * M)])
    lb = Loopback(configs, 3 if args.quick else 5)
    for size in sorted({size for _, size in configs}):
        big = size >= 100 * M
        sub = os.path.join(args.profile_dir, f"{size // M}M") if args.profile_dir else ""
        if sub:
            os.makedirs(sub, exist_ok=True)
        t0 = time.monotonic()
        lb.ours.update(run_averaging("ours", [c for c in configs if c[1] == size], lb.rounds, sample_pss=big,
                                     round_timeout=300 if big else 120, profile_dir=sub))
        stages[f"ours {size // M}M"] = time.monotonic() - t0
    if (4, 100 * M) in configs:
        t0 = time.monotonic()
        lb.floor_kb = memory_floor(4, 100 * M)
        stages["floor 4x100M"] = time.monotonic() - t0
    for n, size in configs:
        t0 = time.monotonic()
        lb.raws[n, size] = run_raw(part_sizes(size, np.ones(n)), lb.rounds)
        stages[f"raw {_label(n, size)}"] = time.monotonic() - t0
    if args.vs_hivemind and not os.access(BENCH_PY, os.X_OK):
        lb.hivemind_note = HIVEMIND_MISSING
    elif args.vs_hivemind:
        for n, size in configs:
            big = size >= 100 * M
            t0 = time.monotonic()
            lb.hms.update(run_averaging("hivemind", [(n, size)], lb.rounds, sample_pss=big,
                                        round_timeout=300 if big else 120))
            stages[f"hivemind {_label(n, size)}"] = time.monotonic() - t0
    return lb


LOOPBACK_TARGETS = {(4, 10 * M): "<=0.25", (8, 10 * M): "<=0.5", (4, 100 * M): ""}


def print_loopback(lb: Loopback) -> None:
    print("Part 1: loopback, peers as processes (seconds per round, median of "
          f"{lb.rounds} after a warm-up round; matchmaking / all-reduce = slowest peer's StepResult times)")
    rows = []
    for n, size in lb.configs:
        raw = lb.raws[n, size]
        for run in (lb.ours[n, size], lb.hms.get((n, size))):
            if run is None:
                continue
            ar = run.median("ar")
            frac = raw["s"] / ar if raw["s"] and ar else None
            rows.append((run.impl, _label(n, size), fmt(run.median("mm")), fmt(ar),
                         LOOPBACK_TARGETS[n, size] if run.impl == "ours" else "", fmt(run.median("span")),
                         fmt(run.median("cpu"), ".2f"), fmt(frac, ".3f"), fmt(_rss_gb(run), ".2f"),
                         fmt(_gb(run.peak_pss_kb), ".2f"), "yes" if run.all_correct else "NO"))
        rows.append(("raw", _label(n, size), "", fmt(raw["s"]), "", "", fmt(raw["cpu"], ".2f")))
    print_table(["<9", "<8", ">12", ">11", ">8", ">9", ">7", ">8", ">12", ">12"],
                ["impl", "config", "matchmaking", "all-reduce", "target", "ar span", "CPU s", "raw/ar",
                 "peak RSS GB", "peak PSS GB", "correct"], rows, note_sep="  ")
    checks = []
    for (n, size), limit in (((4, 10 * M), 0.25), ((8, 10 * M), 0.5)):
        ar = lb.ours[n, size].median("ar") if (n, size) in lb.ours and lb.ours[n, size].all_correct else None
        checks.append(f"all-reduce {_label(n, size)} {fmt(ar)} s vs <= {limit} s "
                      f"({'met' if ar is not None and ar <= limit else 'missed'})")
    if (4, 100 * M) in lb.ours:
        big = lb.ours[4, 100 * M]
        rss, pss, floor = _rss_gb(big), _gb(big.peak_pss_kb), _gb(lb.floor_kb)
        added = rss - floor if rss and floor else None
        checks.append(f"peak RSS 4x100M {fmt(rss, '.2f')} GB vs <= 2.5 GB "
                      f"({'met' if rss is not None and rss <= 2.5 else 'missed'}; floor without averaging "
                      f"{fmt(floor, '.2f')} GB, so averaging added {fmt(added, '.2f')}"
                      f" GB; peak PSS {fmt(pss, '.2f')} GB: {'met' if pss is not None and pss <= 2.5 else 'missed'})")
    print("targets: " + "; ".join(checks) + ".  Reference library measured here earlier: ~2.0 s (4x10M), "
          "3.3-4.2 s (8x10M), 4.6 GB (4x100M).")
    print("ar span = first peer matched to last peer done; CPU s = CPU seconds of one round summed over the "
          "peers' processes; raw = the same bytes over plain sockets between as many processes, no "
          "arithmetic (common start to last finish); raw/ar = raw time / all-reduce time.  RSS = ru_maxrss "
          "(VmHWM) summed over every process of the set that ran the configuration (ours runs 4x10M on 4 of "
          "the 8x10M processes, so only 8x10M shows that set's RSS); PSS = sampled peak of the summed "
          "proportional set size (shared pages counted once).  Floor = summed peak RSS of 4 processes that import "
          "the same modules (torch alone is ~0.22 GB each) and fill their 100M vector, without averaging.")
    for run in [*lb.ours.values(), *lb.hms.values()]:
        print_errors(run)
    for key, raw in lb.raws.items():
        for e in raw["errors"][:3]:
            print(f"  !! raw {_label(*key)}: {e}")
    if lb.hivemind_note:
        print(lb.hivemind_note)


def loopback_figures(lb: Loopback, vs_hivemind: bool) -> dict:
    figures: dict = {}
    for n, size in lb.configs:
        run = lb.ours[n, size]
        raw_s = lb.raws[n, size]["s"]
        tag = _label(n, size)
        ar = run.median("ar") if run.all_correct else None
        if size == 10 * M:
            figures[f"allreduce_s_{tag}"] = ar
            figures[f"matchmaking_s_{tag}"] = run.median("mm") if run.all_correct else None
            figures[f"raw_fraction_{tag}"] = raw_s / ar if raw_s and ar else None
            figures[f"cpu_s_{tag}"] = run.median("cpu") if run.all_correct else None  # all peers, one round
            figures[f"raw_cpu_s_{tag}"] = lb.raws[n, size]["cpu"]
            if n == 4:
                figures["raw_s_4x10M"] = raw_s
        else:
            figures["allreduce_s_4x100M"] = ar
            figures["peak_rss_gb_4x100M"] = _rss_gb(run)
            figures["peak_pss_gb_4x100M"] = _gb(run.peak_pss_kb)
            figures["rss_floor_gb_4x100M"] = _gb(lb.floor_kb)
            figures["raw_s_4x100M"] = raw_s
    for n, size in lb.configs if vs_hivemind else []:
        run = lb.hms.get((n, size))
        tag = _label(n, size)
        ok = run is not None and run.all_correct
        if size == 10 * M:
            figures[f"hivemind_allreduce_s_{tag}"] = run.median("ar") if ok else None
            figures[f"hivemind_matchmaking_s_{tag}"] = run.median("mm") if ok else None
        else:
            figures["hivemind_allreduce_s_4x100M"] = run.median("ar") if ok else None
            figures["hivemind_peak_rss_gb_4x100M"] = _rss_gb(run) if run is not None else None
            figures["hivemind_peak_pss_gb_4x100M"] = _gb(run.peak_pss_kb) if run is not None else None
    return figures


def run_part2(args: argparse.Namespace, stages: dict[str, float]) -> tuple[int, int, list[dict]]:
    """Part 2's cases (none if it is skipped or fails: it says why); the vector size and rounds."""
    size, rounds = (2 * M, 2) if args.quick else (4 * M, 3)
    reason = "--skip-shaped" if args.skip_shaped else shaping_unavailable()
    if reason:
        print(f"Part 2 (shaped links) skipped: {reason}")
        return size, rounds, []
    try:
        return size, rounds, run_shaped(size, rounds, 1 if args.quick else rounds, stages, quick=args.quick)
    except (subprocess.SubprocessError, OSError) as e:
        err = getattr(e, "stderr", "") or e
        print(f"Part 2 (shaped links) skipped: namespace setup failed: {str(err).strip()}")
    except ChildFailed as e:
        print(f"Part 2 (shaped links) failed: {e}")
    return size, rounds, []


def print_shaped(size: int, rounds: int, cases: list[dict]) -> None:
    print(f"Part 2: shaped links (tbf on each peer's egress and ingress; {size // M}M float32, "
          f"median of {rounds} rounds; bound = load-balancing LP's optimum)")
    print(f"{'case':<9}{'links Mbit/s':<22}{'LP shares':<28}{'bound s':>8}{'ours s':>8}{'bound/ours':>11}"
          f"{'raw s':>7}{'bound/raw':>10}  correct")
    for c in cases:
        links = "/".join(f"{b:g}{'c' if i in c['clients'] else ''}" for i, b in enumerate(c["links"]))
        shares = "/".join(f"{x:.3f}" for x in c["shares"])
        print(f"{c['label']:<9}{links:<22}{shares:<28}{c['bound_s']:>8.3f}{fmt(c['measured_s']):>8}"
              f"{fmt(c['fraction'], '.3f'):>11}{fmt(c['raw']['s']):>7}{fmt(c['raw_fraction'], '.3f'):>10}"
              f"  {'yes' if c['run'].all_correct else 'NO'}")
        print_errors(c["run"])
        for e in c["raw"]["errors"][:3]:
            print(f"  !! raw {c['label']}: {e}")
        if c["run"].part_sizes:
            print(f"       parts used by the group (leader first): {c['run'].part_sizes}")
        if c["run"].probed:
            probed = "/".join(fmt(b, ".0f") for b in c["run"].probed)
            print(f"       probed before the first round: {probed} Mbit/s (links 200/100/50/100c, in that order); the "
                  f"first round, split by those, took {fmt(c['first_round_s'])} s")
        elif not c["told"]:
            declared = "/".join(fmt(b, ".0f") for b in c["declared"])
            print(f"       no bandwidths configured: the peers measured {declared} Mbit/s (links 200/100/50/100c, "
                  "in that order); "
                  f"the first round, split by the default 100 each, took {fmt(c['first_round_s'])} s")
    print("'c' = client-mode peer (reduces nothing; its own link still carries its whole vector both ways)."
          "  target: bound/ours >= 0.9")


def shaped_figures(cases: list[dict]) -> dict:
    figures: dict = {f"shaped_fraction_of_bound_{label}": None for label in ("equal", "mixed", "measured")}
    figures["shaped_fraction_of_bound"] = None
    for c in cases:
        ok = c["run"].all_correct
        figures[f"shaped_fraction_of_bound_{c['label']}"] = c["fraction"] if ok else None
        figures[f"shaped_bound_s_{c['label']}"] = c["bound_s"]
        figures[f"shaped_s_{c['label']}"] = c["measured_s"] if ok else None
        figures[f"shaped_raw_fraction_of_bound_{c['label']}"] = c["raw_fraction"]
        if not c["told"]:
            figures[f"shaped_declared_mbit_{c['label']}"] = c["declared"]
            figures[f"shaped_first_round_s_{c['label']}"] = c["first_round_s"] if ok else None
        if c["run"].probed:
            figures[f"shaped_probed_mbit_{c['label']}"] = c["run"].probed
    figures["shaped_fraction_of_bound"] = figures["shaped_fraction_of_bound_mixed"]
    return figures


def main() -> None:
    args = parse_args()
    exit_on_sigterm()  # run the finally blocks: kill peers, drop namespaces
    wall0 = time.monotonic()
    load_start = os.getloadavg()[0]
    if args.profile_dir:
        os.makedirs(args.profile_dir, exist_ok=True)
    stages: dict[str, float] = {}
    lb = run_loopback(args, stages)
    print_loopback(lb)
    figures = loopback_figures(lb, args.vs_hivemind)
    print()
    size, rounds, cases = run_part2(args, stages)
    if cases:
        print_shaped(size, rounds, cases)
    figures.update(shaped_figures(cases))
    print("wall time: " + ", ".join(f"{k} {v:.1f} s" for k, v in stages.items()))
    load_end = os.getloadavg()[0]
    print(f"1-min load average: {load_start:.2f} at start, {load_end:.2f} at end ({os.cpu_count()} CPUs; "
          "other work on the machine slows every figure)")
    figures.update(loadavg_start=load_start, loadavg_end=load_end)
    figures["correct"] = all(r.all_correct for r in lb.ours.values())
    figures.update(quick=args.quick, rounds=lb.rounds, wall_s=time.monotonic() - wall0)
    print_json(figures)


if __name__ == "__main__":
    main()
