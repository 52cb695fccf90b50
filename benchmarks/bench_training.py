"""Training benchmark: seconds per global epoch of collaborative training, and its scaling with peers.

Every peer is a separate process started with the ``worker`` command
(``python -m orchestrator.cli.main worker --task synthetic --target-batch-size 128 --min-peers N
--max-epochs E --report-file F --seed i [--initial-peers ADDR]``); the first one bootstraps the
others.  Every peer appends one JSON line per global epoch to its report file (epoch, loss,
samples_per_second, peers, params digest, time); all figures come from those files:

- epoch time: an epoch happened at the median of its peers' report times (epochs that fewer than a
  majority of the peers reported are left out); the first ``warm-up`` epochs after the swarm formed
  (the first epoch with all N peers in it) are skipped, and the median and mean of the seconds
  between consecutive epochs are taken over the rest (the "steady window");
- correctness: at every epoch of the window, every peer must have reported it, with the same
  ``params`` digest (synchronous data-parallel training keeps the parameters bit-identical; a run
  whose peers diverge or drop out is reported as such: "params equal" NO, the missing reports and
  differing digests listed under the table, with the workers' own log lines about it);
- "full groups": intervals whose epoch every peer reported with a group of all N peers;
  "synced p50": the median over the intervals whose both ends are full groups with equal params;
- scaling: samples/s = target batch size / mean epoch time, for 1, 2 and 4 peers (the 4-peer
  figure comes from the epoch-time run).  "processed/s" is the sum over peers of the samples each
  one computed per second (the worker's own samples_per_second), which also counts samples beyond
  the target batch and samples thrown away by a peer that fell behind.

Micro-step overhead (``_microstep.py``, one process, two peers on loopback, the charlm model): the
median time of ``CollaborativeOptimizer.step`` on a micro-step (no global step due) against what a
local loop over the wrapped torch optimizer does instead (adding the gradients into accumulators);
the difference is the overhead.  Also the time of one blocking DHT read of the swarm's progress,
what a micro-step would pay if it looked the progress up.

``--vs-hivemind``: the same 4-peer run with ``hivemind.Optimizer`` (``_training_hivemind_peer.py``,
run by ``.bench-venv/bin/python`` from ``make bench-env``; the task is re-implemented there).
hivemind peers start alone (each races through epochs of its own until their progress trackers
see each other, then they load the most advanced state), so their window starts ``warm-up``
epochs after the first epoch that a majority of them reported with 4 peers; they run until the
window is complete.  hivemind's all-reduce adds (average - local) to each peer's own copy and
averages parameters in the background, so its digests are not expected to match bit for bit.

    python benchmarks/bench_training.py [--quick] [--vs-hivemind] [--keep-dir DIR] [--device auto|cpu|cuda]

``--device``: where our peers and the micro-step train (``auto``, the default, is a GPU when torch
sees one); hivemind's peers stay on the CPU.

``--quick`` finishes within 60 s without ``--vs-hivemind`` (each run also has a time budget; a
run stopped by it is reported as such).  Peers run one torch thread each (OMP_NUM_THREADS=1):
N peers share this machine's cores; on a real swarm each has its own.  Every child process runs in
its own session and is killed with its whole process tree when its run ends, whatever happens.
Prints tables, then one JSON line of figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project, not installed

from _common import (  # noqa: E402
    BENCH_PY,
    HERE,
    HIVEMIND_MISSING,
    ONE_THREAD_ENV,
    Child,
    ChildFailed,
    exit_on_sigterm,
    fmt,
    guarded,
    kill_all,
    median,
    print_json,
    print_table,
    process_tree,
    rounded,
    run_for_json,
    stop_all,
)

HIVEMIND_PEER = os.path.join(HERE, "_training_hivemind_peer.py")
TARGET_BATCH = 128
TASK = "synthetic"
MICROSTEP = os.path.join(HERE, "_microstep.py")
# The runs' budgets in --quick (start-up, training, leaving; not the final kills).  Four workers take
# 10-13 s to start here (each imports torch on two shared cores) and the 4-peer run overruns its
# budget by ~2 s leaving, so 47 s gives the 2-peer run ~13 s, a few seconds past its ~9-s start.
QUICK_TOTAL_S = 47.0


# ---- child processes ---------------------------------------------------------------------------
class Peer(Child):
    """One peer process: its first stdout line gives its address; SIGTERM makes it leave."""

    def __init__(self, name: str, argv: Sequence[str], log_path: str, stdin: bool) -> None:
        super().__init__(name, argv, env=ONE_THREAD_ENV, stdin=stdin, log_path=log_path)
        self._sockets: set[str] = set()

    def address(self, deadline: float) -> str:
        """From ``worker <id> listening at <address>``; ChildFailed on timeout or exit."""
        while " listening at " not in (line := self.line(deadline, "address")):
            pass
        return line.rsplit(" listening at ", 1)[1].strip()

    def ask_to_stop(self) -> None:
        """SIGTERM to the peer itself: it leaves gracefully and stops its own helpers."""
        self.remember_tree()
        self._sockets = _hivemind_sockets(self.known)
        if self.running:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass

    def kill(self) -> None:
        if self.killed:
            return
        sockets = self._sockets | _hivemind_sockets({**self.known, **process_tree(self.proc.pid)})
        super().kill()
        for path in sockets:  # hivemind leaves its daemons' unix sockets behind when it is killed
            try:
                os.remove(path)
            except OSError:
                pass


def _hivemind_sockets(tree: dict[int, int | None]) -> set[str]:
    """Paths of the /tmp/hivemind-*.sock unix sockets that processes of ``tree`` hold open."""
    inodes: set[str] = set()
    for pid in tree:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    paths = set()
    try:
        with open("/proc/net/unix") as f:
            for line in f:
                cols = line.split()
                if len(cols) >= 8 and cols[6] in inodes and cols[7].startswith("/tmp/hivemind-"):
                    paths.add(cols[7])
    except OSError:
        pass
    return paths


# ---- one swarm run -----------------------------------------------------------------------------
@dataclass
class RunResult:
    impl: str
    n: int
    warmup: int
    epochs_wanted: int
    wall_s: float = 0.0
    start_s: float = 0.0  # from the first spawn until every peer reported its first epoch
    reports: list[list[dict]] = field(default_factory=list)
    error: str | None = None
    # derived
    intervals: list[float] = field(default_factory=list)
    window: tuple[int, int] | None = None
    digests_ok: bool = False
    digest_problems: list[str] = field(default_factory=list)
    full_groups: int = 0
    processed_per_s: float | None = None
    final_loss: float | None = None
    note: str | None = None  # e.g. stopped by the time budget before the last epoch
    synced_intervals: list[float] = field(default_factory=list)  # both ends: all peers, one group, same params
    stalls: list[str] = field(default_factory=list)  # the workers' "could not average" log lines

    @property
    def median_s(self) -> float | None:
        return median(self.intervals)

    @property
    def mean_s(self) -> float | None:
        return statistics.fmean(self.intervals) if self.intervals else None

    @property
    def samples_per_s(self) -> float | None:
        return TARGET_BATCH / self.mean_s if self.mean_s else None


def peer_argv(impl: str, i: int, n: int, run_id: str, report: str, initial: str | None, max_epochs: int,
              max_seconds: float, opts: dict) -> list[str]:
    """One peer's command line; ``opts``: ours' device, or hivemind's matchmaking and averaging timeouts."""
    if impl == "ours":
        argv = [sys.executable, "-m", "orchestrator.cli.main", "worker", "--run", run_id, "--task", TASK,
                "--target-batch-size", str(TARGET_BATCH), "--min-peers", str(n), "--max-epochs", str(max_epochs),
                "--max-seconds", str(max_seconds), "--seed", str(i), "--report-file", report,
                "--device", opts["device"]]
    else:
        argv = [BENCH_PY, HIVEMIND_PEER, "--run", run_id, "--target-batch-size", str(TARGET_BATCH),
                "--max-epochs", "1000000", "--max-seconds", str(max_seconds), "--seed", str(i),
                "--report-file", report, "--matchmaking-time", str(opts["matchmaking_time"]),
                "--averaging-timeout", str(opts["averaging_timeout"]), "--min-peers", str(n)]
    if initial:
        argv += ["--initial-peers", initial]
    return argv


def read_reports(paths: Sequence[str]) -> list[list[dict]]:
    out = []
    for path in paths:
        records = []
        try:
            with open(path) as f:
                for line in f:
                    try:
                        records.append(json.loads(line))
                    except ValueError:
                        pass  # a line cut short by a kill
        except OSError:
            pass
        out.append(records)
    return out


def run_swarm(impl: str, n: int, warmup: int, measure: int, budget_s: float, tmp: str,
              opts: dict, progress: bool = True) -> RunResult:
    """Start n peers, let them train warmup + measure epochs (or until budget_s), read their reports."""
    epochs = warmup + measure
    res = RunResult(impl, n, warmup, epochs)
    run_id = f"bt{impl[:2]}{n}x{os.getpid()}x{int(time.time() * 1000) % 100000}"
    reports = [os.path.join(tmp, f"{run_id}-{i}.jsonl") for i in range(n)]
    peers: list[Peer] = []
    t0 = time.monotonic()
    deadline = t0 + budget_s
    try:
        start_deadline = min(deadline, t0 + 90.0)
        argv = peer_argv(impl, 0, n, run_id, reports[0], None, epochs, budget_s, opts)
        peers.append(Peer(f"{impl} peer 0", argv, os.path.join(tmp, f"{run_id}-0.log"), stdin=impl != "ours"))
        first = peers[0].address(start_deadline)
        for i in range(1, n):
            argv = peer_argv(impl, i, n, run_id, reports[i], first, epochs, budget_s, opts)
            peers.append(Peer(f"{impl} peer {i}", argv, os.path.join(tmp, f"{run_id}-{i}.log"), stdin=impl != "ours"))
        if impl != "ours":  # hivemind peers wait for 'go' once everyone is up (our --min-peers)
            for p in peers[1:]:
                p.address(start_deadline)
            for p in peers:
                p.send("go")
        first_epoch_seen = False
        last_note = 0.0
        while True:
            if all(p.proc.poll() is not None for p in peers):
                break
            if time.monotonic() >= deadline:
                res.note = f"stopped by the {budget_s:.0f} s budget before epoch {epochs}"
                break
            by_peer = [{r["epoch"]: r for r in recs} for recs in read_reports(reports)]
            if not first_epoch_seen and all(by_peer):
                res.start_s = time.monotonic() - t0
                first_epoch_seen = True
            if impl == "ours":
                if all(d and max(d) >= epochs for d in by_peer):  # done: let them leave on their own
                    for p in peers:
                        try:
                            p.proc.wait(timeout=max(min(3.0, deadline - time.monotonic()), 0.1))
                        except subprocess.TimeoutExpired:
                            break
                    break
            elif window_reached(by_peer, n, epochs):  # hivemind peers run until told to stop
                break
            dead = [p for p in peers if p.proc.poll() not in (None, 0)]
            if dead:
                raise ChildFailed(f"{dead[0].name} exited with rc={dead[0].proc.poll()}{dead[0].tail()}")
            if progress and time.monotonic() - last_note > 10:
                last_note = time.monotonic()
                done = min((max(d, default=0) for d in by_peer), default=0)
                print(f"  [{impl} x{n}] {time.monotonic() - t0:5.1f} s, epoch reached by all: {done}/{epochs}",
                      file=sys.stderr, flush=True)
            time.sleep(0.2)
        bad = [p for p in peers if p.proc.poll() not in (None, 0)]
        if bad and res.error is None:
            res.error = f"{bad[0].name} exited with rc={bad[0].proc.poll()}{bad[0].tail()}"
    except ChildFailed as e:
        res.error = str(e)
    finally:
        stop_all(peers, grace=2.0 if impl == "ours" else 8.0)
    res.wall_s = time.monotonic() - t0
    res.reports = read_reports(reports)
    for i in range(n):
        try:
            with open(os.path.join(tmp, f"{run_id}-{i}.log")) as f:
                res.stalls += [f"peer {i}: {line.split(': ', 1)[-1].strip()}" for line in f
                               if "could not average" in line or "behind:" in line]
        except OSError:
            pass
    analyse(res)
    return res


def majority(n: int) -> int:
    return n // 2 + 1


def epoch_times(by_peer: list[dict[int, dict]], n: int) -> dict[int, float]:
    """When each epoch happened: the median of its peers' report times, for epochs that a majority
    of the peers reported (a peer that fell behind and skips epochs by loading state does not
    stall the figure; it shows up in the "params equal" and "full groups" columns instead)."""
    reported: dict[int, list[float]] = {}
    for d in by_peer:
        for e, r in d.items():
            reported.setdefault(e, []).append(r["time"])
    return {e: statistics.median(ts) for e, ts in reported.items() if len(ts) >= majority(n)}


def formation_epoch(by_peer: list[dict[int, dict]], n: int) -> int | None:
    """The first epoch that a majority of the peers reported, each with all n peers in it (hivemind
    peers begin alone, each racing through epochs of its own until their trackers see each other)."""
    counts: dict[int, int] = {}
    for d in by_peer:
        for e, r in d.items():
            if r["peers"] >= n:
                counts[e] = counts.get(e, 0) + 1
    formed = [e for e, c in counts.items() if c >= majority(n)]
    return min(formed) if formed else None


def window_reached(by_peer: list[dict[int, dict]], n: int, epochs: int) -> bool:
    formed = formation_epoch(by_peer, n)
    times = epoch_times(by_peer, n)
    return formed is not None and bool(times) and max(times) >= formed - 1 + epochs


def analyse(res: RunResult) -> None:
    """Epoch times over the steady window, and whether the peers agree on the parameters there."""
    by_peer = [{r["epoch"]: r for r in recs} for recs in res.reports]
    times = epoch_times(by_peer, res.n)
    if not times:
        res.digest_problems.append("no epoch reported by a majority of the peers")
        return
    last = max(times)
    formed = formation_epoch(by_peer, res.n)
    if formed is None:
        res.digest_problems.append(f"no epoch had all {res.n} peers in it")
    lo = (formed - 1 if formed else 0) + res.warmup  # intervals (lo, lo+1], ..., (last-1, last]
    if last - lo < 2:
        lo = max(min(times), last - 2)  # short run: take what there is, say so
        res.digest_problems.append(f"only {last} epochs: warm-up shortened to {lo}")
    window = list(range(lo, last + 1))
    res.window = (lo, last)
    res.intervals = [times[e] - times[e - 1] for e in window[1:] if e in times and e - 1 in times]
    missing = [(i, e) for e in window for i, d in enumerate(by_peer) if e not in d]
    for i, e in missing[:4]:
        res.digest_problems.append(f"peer {i} did not report epoch {e}")
    if len(missing) > 4:
        res.digest_problems.append(f"... {len(missing)} (peer, epoch) reports missing in the window")
    differ = [e for e in window if len({d[e]["params"] for d in by_peer if e in d}) > 1]
    for e in differ[:4]:
        res.digest_problems.append(
            f"epoch {e}: digests differ: {[d[e]['params'] if e in d else None for d in by_peer]}")
    if len(differ) > 4:
        res.digest_problems.append(f"... digests differ at {len(differ)} of {len(window)} epochs")
    res.digests_ok = len(window) >= 2 and not missing and not differ

    def full(e: int) -> bool:
        return all(e in d and d[e]["peers"] == res.n for d in by_peer)

    def synced(e: int) -> bool:
        return full(e) and len({d[e]["params"] for d in by_peer}) == 1

    res.full_groups = sum(1 for e in window[1:] if full(e))
    res.synced_intervals = [times[e] - times[e - 1] for e in window[1:]
                            if synced(e) and synced(e - 1) and e in times and e - 1 in times]
    rates = [sum(d[e]["samples_per_second"] for d in by_peer if e in d) for e in window[1:]]
    res.processed_per_s = median(rates)
    losses = [d[last]["loss"] for d in by_peer if last in d]
    res.final_loss = statistics.fmean(losses) if losses else None


# ---- output ------------------------------------------------------------------------------------
def print_runs(title: str, runs: Sequence[RunResult]) -> None:
    print(title)
    rows = []
    for r in runs:
        window = f"{r.window[0]}..{r.window[1]}" if r.window else "-"
        groups = f"{r.full_groups}/{len(r.intervals)}" if r.window else "-"
        rows.append((r.impl, r.n, window, fmt(r.median_s), fmt(r.mean_s), fmt(r.samples_per_s, ".1f"),
                     fmt(r.processed_per_s, ".1f"), groups, "yes" if r.digests_ok else "NO",
                     fmt(median(r.synced_intervals)), fmt(r.final_loss, ".4f"), fmt(r.start_s, ".1f"),
                     f"{r.wall_s:.1f}"))
    print_table(["<9", ">6", ">11", ">13", ">14", ">11", ">13", ">13", ">14", ">12", ">9", ">9", ">8"],
                ["impl", "peers", "window", "epoch s p50", "epoch s mean", "samples/s", "processed/s", "full groups",
                 "params equal", "synced p50", "loss", "start s", "wall s"], rows)
    for r in runs:
        tag = f"  {r.impl} x{r.n}:"
        if r.error:
            print(f"{tag} ERROR {r.error}")
        if r.note:
            print(f"{tag} {r.note}")
        for p in r.digest_problems:
            print(f"{tag} {p}")
        for line in r.stalls[:6]:
            print(f"{tag} {line}")
        if len(r.stalls) > 6:
            print(f"{tag} ... {len(r.stalls)} such log lines in all")
    print("  (full groups: intervals whose epoch every peer reported with a group of all of them; synced p50: median"
          " over intervals whose both ends are full groups with equal params)")


@dataclass
class Runs:
    ours: dict[int, RunResult] = field(default_factory=dict)
    hm: RunResult | None = None
    hivemind_note: str | None = None
    microstep: dict = field(default_factory=dict)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer epochs, under 60 s (without --vs-hivemind)")
    parser.add_argument("--vs-hivemind", action="store_true", help="also run hivemind.Optimizer from .bench-venv")
    parser.add_argument("--hivemind-matchmaking-time", type=float, default=5.0,
                        help="hivemind.Optimizer matchmaking_time (default 5: its docs say '3-5s for small local "
                             "runs'; it must exceed hivemind's 3 s request_timeout, and at 3.5 every round timed out "
                             "under load here)")
    parser.add_argument("--hivemind-averaging-timeout", type=float, default=30.0,
                        help="hivemind.Optimizer averaging_timeout (ours: the worker's averaging_timeout, 30.0)")
    parser.add_argument("--keep-dir", metavar="DIR", help="write the peers' reports and logs here (kept)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where our peers and the micro-step train (auto: a GPU when torch sees one; "
                             "hivemind's peers stay on the CPU)")
    return parser.parse_args()


def resolve_device(name: str) -> str:
    """``auto`` as the workers resolve it, so the report names the device that ran."""
    if name == "cpu":
        return name
    from p2p.devices import pick_device  # imports torch: only when the answer depends on it

    try:
        return pick_device(name).type
    except ValueError as exc:
        raise SystemExit(f"bench_training: {exc}") from None


def run_all(args: argparse.Namespace, hm_opts: dict, t_all: float) -> Runs:
    """Ours at 4, 2 and 1 peers, then hivemind at 4; every child is killed at the end, whatever happens."""
    # (warm-up epochs, measured epochs, budget in seconds) per run
    if args.quick:
        # a lone newcomer with nothing to load waits one freshness period (5 s) before stepping alone
        plan = {4: (5, 100, 17.0), 2: (5, 300, 13.0), 1: (5, 800, 15.0)}
        hm_plan = (3, 6, 150.0)
    else:
        plan = {4: (10, 1000, 300.0), 2: (10, 2000, 150.0), 1: (10, 5000, 90.0)}
        hm_plan = (5, 30, 420.0)
    runs = Runs()
    if args.keep_dir:
        os.makedirs(args.keep_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench_training-") as tmpdir:
        tmp = args.keep_dir or tmpdir
        try:
            for n in (4, 2, 1):
                warmup, measure, budget = plan[n]
                if args.quick:  # within QUICK_TOTAL_S in all: time the earlier runs leave unused goes to the last
                    left = t_all + QUICK_TOTAL_S - time.monotonic()
                    later = sum(plan[m][2] for m in (2, 1) if m < n)
                    budget = max(left if n == 1 else min(budget, left - later), 5.0)
                runs.ours[n] = run_swarm("ours", n, warmup, measure, budget, tmp, {"device": args.device_used})
            if args.vs_hivemind and not os.access(BENCH_PY, os.X_OK):
                runs.hivemind_note = HIVEMIND_MISSING
            elif args.vs_hivemind:
                runs.hm = run_swarm("hivemind", 4, *hm_plan, tmp, hm_opts)
        finally:
            kill_all()
    runs.microstep = guarded("microstep", microstep_figures, 500 if args.quick else 5000, args.device_used)
    return runs


def microstep_figures(steps: int, device: str) -> dict:
    """A micro-step's cost over plain gradient accumulation (``_microstep.py``, bounded)."""
    return run_for_json("microstep", [sys.executable, MICROSTEP, "--steps", str(steps), "--device", device], 60.0,
                        env=ONE_THREAD_ENV)


def print_report(args: argparse.Namespace, runs: Runs, hm_opts: dict, wall: float) -> None:
    ours, hm = runs.ours, runs.hm
    print(f"task {TASK} on {args.device_used}, target batch {TARGET_BATCH}, 32 samples per local step, one torch"
          f" thread per peer; epoch time = seconds between consecutive epochs (median of the peers' report times),"
          f" warm-up skipped")
    print_runs("scaling (ours; each row a separate run of worker processes)", [ours[n] for n in (1, 2, 4)])
    if args.vs_hivemind:
        print()
        if hm is not None:
            print_runs(f"4 peers, ours vs hivemind.Optimizer (matchmaking_time={hm_opts['matchmaking_time']},"
                       f" averaging_timeout={hm_opts['averaging_timeout']})", [ours[4], hm])
            if ours[4].median_s and hm.median_s:
                print(f"  hivemind / ours (median epoch s): {hm.median_s / ours[4].median_s:.2f}x")
            print("  (hivemind: 'peers' is its tracker's num_peers; its all-reduce adds (average - local) to each"
                  " peer's own copy, so bit-equal params are not expected)")
        else:
            print(runs.hivemind_note)
    print()
    r4 = ours[4]
    print_table(["<36", ">10"], ["figure", "value", "target"], [
        ("epoch s, 4 peers (median)", fmt(r4.median_s), "<= 1.5 (hivemind reference ~7.5)"),
        ("params identical across 4 peers", "yes" if r4.digests_ok else "NO", "yes"),
        ("micro-step overhead us (median)", fmt(runs.microstep.get("overhead_us_p50"), ".1f"), "<= 50"),
        ("  micro-step us / accumulate us", f"{fmt(runs.microstep.get('step_us_p50'), '.1f')} / "
                                            f"{fmt(runs.microstep.get('accumulate_us_p50'), '.1f')}"),
        ("  a DHT progress read us (avoided)", fmt(runs.microstep.get("dht_read_us_p50"), ".1f")),
        *((f"samples/s, {n} peer(s)", fmt(ours[n].samples_per_s, ".1f")) for n in (1, 2, 4)),
        ("wall s", f"{wall:.1f}")])


def figures_of(args: argparse.Namespace, runs: Runs, wall: float) -> dict:
    ours, hm, r4 = runs.ours, runs.hm, runs.ours[4]
    figures: dict = {
        "epoch_s_4peers": r4.median_s, "epoch_s_4peers_mean": r4.mean_s,
        "params_identical_4peers": r4.digests_ok,
        "samples_s_1peer": rounded(ours[1].samples_per_s, 1), "samples_s_2peers": rounded(ours[2].samples_per_s, 1),
        "samples_s_4peers": rounded(ours[4].samples_per_s, 1),
        "params_identical_2peers": ours[2].digests_ok,
        "epochs_measured_4peers": len(r4.intervals),
        "full_groups_4peers": f"{r4.full_groups}/{len(r4.intervals)}",
        "epoch_s_4peers_synced": median(r4.synced_intervals),
        "microstep_overhead_us": runs.microstep.get("overhead_us_p50"),
        "microstep_us": runs.microstep.get("step_us_p50"),
        "microstep_dht_read_us": runs.microstep.get("dht_read_us_p50"),
    }
    if "microstep_error" in runs.microstep:
        figures["microstep_error"] = runs.microstep["microstep_error"]
    if args.vs_hivemind:
        figures["hivemind_epoch_s_4peers"] = hm.median_s if hm is not None else None
        figures["hivemind_epoch_s_4peers_mean"] = hm.mean_s if hm is not None else None
        figures["hivemind_epochs_measured"] = len(hm.intervals) if hm is not None else 0
        if runs.hivemind_note:
            figures["hivemind_note"] = runs.hivemind_note
    errors = {f"{r.impl}_{r.n}": r.error.splitlines()[0] for r in [*ours.values(), *([hm] if hm else [])]
              if r.error}
    if errors:
        figures["errors"] = errors
    figures.update(device=args.device_used, quick=args.quick, wall_s=rounded(wall, 1))
    return figures


def main() -> None:
    args = parse_args()
    exit_on_sigterm()
    args.device_used = resolve_device(args.device)  # before the clock: --quick's budgets are for the runs
    t_all = time.monotonic()
    hm_opts = {"matchmaking_time": args.hivemind_matchmaking_time,
               "averaging_timeout": args.hivemind_averaging_timeout}
    runs = run_all(args, hm_opts, t_all)
    wall = time.monotonic() - t_all
    print_report(args, runs, hm_opts, wall)
    print_json(figures_of(args, runs, wall), digits=3)


if __name__ == "__main__":
    main()
