"""Multi-node benchmark: the local simulator's ``nodes`` mode (every instance its own Ray node, in a
network namespace with its own IP address, joined to a Ray head on a bridge) trains the
``synthetic`` task while one instance is preempted, against the same fleet in ``actors`` mode (every
instance a Ray actor on the driver's node, loopback only), measured side by side in one run.

Why: ``actors`` mode is what the other benchmarks and most tests use; ``nodes`` mode is the path a
real cluster takes (boot script, ``ray start``, a peer reached at its node's address).  This says
what that path costs in throughput and in recovery time, on one machine.

Each mode runs in a child process of this script (``--role nodes|actors``, one after the other;
what a child does is ``_multinode_roles.py``).
Each child has a time budget (``--budget-s``; full: duration + 60 s; ``--quick``: 36 s for nodes and
the rest of 58 s for actors): it cuts its run short to stop everything it started within it, and
says so.  A child still running 15 s past its budget gets SIGTERM, then SIGKILL for its whole
session; whatever it left (the Ray head's and nodes' sessions, namespaces) is removed by the parent
from the child's manifest, the run is reported as stopped, and the rest still runs.

A run: ``--instances`` (3) instances of one node type, a ``SupervisorCore`` in the child, a
replayable trace that preempts the first instance ``--kill-after-s`` after its launch
(``--notice-s`` before it comes its notice; default 0: a sudden kill, so the replacement boots
after the kill, as after a failure), training for ``--duration-s`` from the supervisor's start
(``--quick``: until ``--post-s`` after the replacement's first averaged step).  The ``nodes``
child builds ``instances + 1`` namespaces on a bridge (``_netns.py``; one spare, so that a
replacement launched during a notice finds a free one), starts a Ray head on the bridge address
with token authentication (a fresh token per run) and fast dead-node detection, connects to it,
and tears it all down at the end.  The ``actors`` child starts a local Ray of its own.

Figures, from the run store (``run.sqlite``; the supervisor's clock is the wall clock here):

- samples/s (steady): epochs x target batch per second over the windows where the whole fleet
  trains: from ``--warmup-s`` after the first epoch recorded with every instance's peer until the
  kill, and from ``--warmup-s`` after the replacement's first averaged step until the end (the
  survivors' epochs slow down for a few seconds after a kill, until the dead peer's progress record
  is no longer fresh); each window runs from its first to its last progress record, so no partial
  epoch is counted.  Also given: each window alone, and the whole run after the first warm-up (the
  kill and the recovery included);
- kill -> first step: the replacement's ``first_step`` event (its peer's first averaged step after
  joining) minus the victim's ``preempted`` event; also kill -> the survivors' next epoch, and the
  replacement's launch -> its first step;
- nodes: the worker actors are asked where they run while they run (Ray node id, the address
  their peer announces); ``distinct_nodes`` counts the Ray nodes that hosted a worker.

    python benchmarks/bench_multinode.py [--quick] [--only nodes|actors] [--serialize-launches] [--keep DIR]

``--quick`` (a smoke test, about 55 s here): the kill 13 s after launch, each run stopped 3 s after
the replacement's first step, 1-s warm-ups; its windows are a few seconds long, so its samples/s
are rough.  ``--serialize-launches`` launches the nodes mode's instances one at a time (see
``serialize_launches``).

Needs root for the namespaces (without it the ``nodes`` run is skipped, with the reason, and its
figures are null).  Every process and file it creates (namespaces, bridge, Ray head and nodes, their
temp dirs, all under one directory in /tmp) is removed at the end.  Prints a table, then one JSON
line of figures.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import _netns  # noqa: E402
from _common import Child, ChildTimeout, fmt, print_json, print_table  # noqa: E402
from _multinode_roles import MODES, NODE_TYPE, run_child  # noqa: E402

from orchestrator.host.processes import exited, kill_session, session_pids, session_still_ours  # noqa: E402
from orchestrator.host.wait import wait_for  # noqa: E402

STOP_GRACE_S = 30.0  # a child past its limit gets this long to clean up after SIGTERM
LIMIT_SLACK_S = 15.0  # a child's hard limit: its budget plus this
QUICK_TOTAL_S = 58.0  # --quick: both runs' budgets together
QUICK_NODES_S = 36.0  # --quick: the nodes run's budget (the actors run gets the rest, at least 20 s)


def _tail(path: Path, n: int = 8) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return "(no log)"
    return " | ".join(line.strip() for line in lines if line.strip())


def cleanup_from_manifest(path: Path, marker: str) -> list[str]:
    """Backstop after a SIGKILLed child: kill the Ray head's and the nodes' sessions (those still
    ours, see ``session_still_ours``), everything left in the namespaces, and delete the links and
    namespaces.  Returns what it had to remove."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    done = []
    sids = [data["head_sid"]] if data.get("head_sid") else []
    run_dir = data.get("run_dir")
    if run_dir:
        for pid_file in sorted(Path(run_dir, "nodes").glob("*.pid")):
            with contextlib.suppress(OSError, ValueError):
                sids.append(int(pid_file.read_text().strip()))
    for sid in sids:
        if session_pids(sid) and session_still_ours(sid, marker):
            kill_session(sid, grace_s=3.0)
            done.append(f"session {sid}")
    if data.get("namespaces"):
        fleet = _netns.NetnsFleet(data["head_ip"], data["bridge"], list(data["namespaces"]), list(data["ips"]),
                                  list(data["veths"]))
        listed = _netns._run(["ip", "netns", "list"], check=False).stdout.splitlines()
        existing = {line.split()[0] for line in listed if line.strip()}
        bridge = _netns._run(["ip", "link", "show", fleet.bridge], check=False).returncode == 0
        if bridge or existing & set(fleet.namespaces):
            done.append(f"namespaces {', '.join(sorted(existing & set(fleet.namespaces)))}, bridge {fleet.bridge}")
            _netns._teardown(fleet, created_bridge=bridge)
    return done


# ---- the parent: both runs, the table, the JSON ---------------------------------------------------------
@dataclass
class ChildRun:
    mode: str
    limit_s: float
    result: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    timed_out: bool = False
    skipped: str | None = None
    cleanup: list[str] = field(default_factory=list)
    log_tail: str = ""


def run_mode(mode: str, args: argparse.Namespace, base: Path, budget_s: float) -> ChildRun:
    """Run one mode's child with a time budget (it ends its run in time to clean up within it) and a
    hard limit a little past it; relay its progress lines."""
    limit_s = budget_s + LIMIT_SLACK_S
    run = ChildRun(mode, limit_s)
    child_base = base / mode[0]
    child_base.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(PYTHONUNBUFFERED="1", TMPDIR=str(child_base))  # Ray's and the nodes' temp dirs go under base
    if mode == "nodes":
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))  # read by Ray at import
    argv = [sys.executable, str(Path(__file__).resolve()), "--role", mode, "--base", str(child_base),
            "--budget-s", str(budget_s), *args.child_argv]
    err_path = child_base / "stderr.log"
    t0 = time.monotonic()
    child = Child(mode, argv, env=env, stdin=False, log_path=str(err_path))
    proc = child.proc
    last_json: dict[str, Any] | None = None
    hard_deadline = t0 + limit_s
    terminated_at: float | None = None
    exited_at: float | None = None
    while True:
        now = time.monotonic()
        if exited_at is None and exited(proc):
            exited_at = now
        if exited_at is not None and now > exited_at + 2.0:  # gone, and a process it left holds the pipe
            break
        if terminated_at is None and now >= hard_deadline:
            run.timed_out = True
            print(f"  [{mode}] past its {limit_s:.0f} s limit: stopping it (SIGTERM, {STOP_GRACE_S:.0f} s to clean up)",
                  flush=True)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            terminated_at = now
        if terminated_at is not None and now >= terminated_at + STOP_GRACE_S:
            print(f"  [{mode}] still running {STOP_GRACE_S:.0f} s after SIGTERM: killing its session", flush=True)
            kill_session(proc.pid)
            break
        try:
            line = child.next_line(now + 0.2)
        except ChildTimeout:
            continue
        if line is None:
            break
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                last_json = json.loads(line)
        elif line.startswith("["):  # the child's progress lines; Ray's own messages are left out
            print(f"  [{mode}] {line}", flush=True)
    # the child is not reaped yet, so its pid (its session's id) cannot be anyone else's meanwhile
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: exited(proc), 10.0, "the child to exit", every=0.1)
    run.wall_s = time.monotonic() - t0
    kill_session(proc.pid, grace_s=2.0)  # whatever is left of its session (Ray's processes of actors mode)
    child.kill()
    run.cleanup = cleanup_from_manifest(child_base / "manifest.json", str(child_base))
    if run.cleanup:
        print(f"  [{mode}] removed what the child left behind: {'; '.join(run.cleanup)}", flush=True)
    run.result = last_json or {}
    if last_json is None or proc.returncode not in (0, None) or run.result.get("error"):
        run.log_tail = _tail(err_path, 15)
    if last_json is None:
        run.result = {"error": f"no result (exit {proc.returncode}{', time limit' if run.timed_out else ''})"}
    return run


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def print_report(runs: dict[str, ChildRun], args: argparse.Namespace, wall_s: float) -> None:
    n, a = runs["nodes"].result, runs["actors"].result
    print()
    print(f"fleet: {args.instances} x {NODE_TYPE} instances training 'synthetic' (target batch "
          f"{args.target_batch_size}); first instance killed {args.kill_after_s:g} s after launch"
          + (f" ({args.notice_s:g} s notice)" if args.notice_s else " without notice")
          + f"; runs of {args.duration_s:g} s" + (f" (or {args.post_s:g} s after the replacement's first step)"
                                                  if args.post_s is not None else ""))
    for mode, run in runs.items():
        r = run.result
        if run.skipped:
            print(f"{mode}: SKIPPED: {run.skipped}")
        elif run.timed_out:
            print(f"{mode}: STOPPED at its {run.limit_s:.0f} s limit (figures measured before it, if any)")
        if r.get("error"):
            print(f"{mode}: FAILED: {r['error']}")
        for note in r.get("notes") or []:
            print(f"{mode}: {note}")
        if run.log_tail:
            print(f"{mode}: last log lines: {run.log_tail}")
    print()
    rows: list[tuple[str, Any, Any, str, bool]] = [
        ("samples/s, whole fleet (steady windows)", n.get("samples_s"), a.get("samples_s"), ".1f", True),
        ("  before the kill", n.get("samples_s_pre_kill"), a.get("samples_s_pre_kill"), ".1f", True),
        ("  after the replacement's first step", n.get("samples_s_post_recovery"),
         a.get("samples_s_post_recovery"), ".1f", True),
        ("samples/s, full fleet to end (the kill included)", n.get("samples_s_whole"), a.get("samples_s_whole"),
         ".1f", True),
        ("s per epoch (steady windows)", n.get("epoch_s"), a.get("epoch_s"), ".3f", True),
        ("kill -> replacement's first averaged step, s", n.get("kill_to_first_step_s"),
         a.get("kill_to_first_step_s"), ".1f", True),
        ("kill -> survivors' next epoch, s", n.get("kill_to_next_epoch_s"), a.get("kill_to_next_epoch_s"), ".1f",
         False),
        ("replacement launch -> its first step, s", n.get("replacement_launch_to_first_step_s"),
         a.get("replacement_launch_to_first_step_s"), ".1f", True),
        ("fleet boot: first launch -> full-fleet epoch, s", n.get("fleet_boot_s"), a.get("fleet_boot_s"), ".1f",
         True),
        ("steady window, s", n.get("steady_window_s"), a.get("steady_window_s"), ".1f", False),
        ("epochs in the run", n.get("epochs"), a.get("epochs"), "d", False),
        ("Ray head start, s", n.get("head_start_s"), None, ".1f", False),
        ("driver connect / local Ray start, s", n.get("ray_init_s"), a.get("ray_init_s"), ".1f", False),
        ("supervisor stop (release all), s", n.get("stop_s"), a.get("stop_s"), ".1f", False),
        ("Ray nodes that hosted a worker", n.get("distinct_nodes"), a.get("distinct_nodes"), "d", False),
        ("child wall time, s", runs["nodes"].wall_s or None, runs["actors"].wall_s or None, ".1f", False),
    ]
    print_table(["<48", ">10", ">10", ">14"], ["figure", "nodes", "actors", "nodes/actors"],
                [(name, fmt(x, spec), fmt(y, spec), fmt(_ratio(x, y), ".3f") if ratio else "")
                 for name, x, y, spec, ratio in rows], rule=True)
    workers = n.get("workers") or {}
    if workers:
        print()
        print("nodes mode, where each worker ran (as the worker actor said):")
        for inst, w in sorted(workers.items()):
            print(f"  {inst:<22} Ray node {w['node_id'][:12]}  node IP {w.get('node_ip') or '-':<12} "
                  f"peer announced at {w.get('peer_ip') or '-'}")
        if shared := n.get("instances_sharing_an_ip"):
            print(f"  WARNING: live instances {', '.join(shared)} ran in one network namespace (one IP): not the "
                  "intended one namespace per instance (see --serialize-launches)")
    print(f"wall {wall_s:.0f} s")


def figures_of(runs: dict[str, ChildRun], args: argparse.Namespace, wall_s: float) -> dict[str, Any]:
    n, a = runs["nodes"].result, runs["actors"].result
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": args.quick,
        "distinct_nodes": n.get("distinct_nodes"),
        "distinct_nodes_actors": a.get("distinct_nodes"),
        "node_ips": n.get("node_ips") or [],
        "distinct_node_ips": len(n.get("node_ips") or []) or None,
        "instances_sharing_an_ip": n.get("instances_sharing_an_ip"),
        "peer_ips": n.get("peer_ips") or [],
        "head_ip": n.get("head_ip"),
        "samples_s_nodes": n.get("samples_s"),
        "samples_s_actors": a.get("samples_s"),
        "samples_s_ratio_nodes_vs_actors": _ratio(n.get("samples_s"), a.get("samples_s")),
        "samples_s_pre_kill_nodes": n.get("samples_s_pre_kill"),
        "samples_s_pre_kill_actors": a.get("samples_s_pre_kill"),
        "samples_s_post_recovery_nodes": n.get("samples_s_post_recovery"),
        "samples_s_post_recovery_actors": a.get("samples_s_post_recovery"),
        "samples_s_whole_nodes": n.get("samples_s_whole"),
        "samples_s_whole_actors": a.get("samples_s_whole"),
        "kill_to_first_step_s": n.get("kill_to_first_step_s"),
        "kill_to_first_step_s_actors": a.get("kill_to_first_step_s"),
        "kill_to_next_epoch_s": n.get("kill_to_next_epoch_s"),
        "kill_to_next_epoch_s_actors": a.get("kill_to_next_epoch_s"),
        "replacement_launch_to_first_step_s": n.get("replacement_launch_to_first_step_s"),
        "replacement_launch_to_first_step_s_actors": a.get("replacement_launch_to_first_step_s"),
        "fleet_boot_s": n.get("fleet_boot_s"),
        "fleet_boot_s_actors": a.get("fleet_boot_s"),
        "steady_window_s": n.get("steady_window_s"),
        "steady_window_s_actors": a.get("steady_window_s"),
        "epoch_s": n.get("epoch_s"),
        "epoch_s_actors": a.get("epoch_s"),
        "head_start_s": n.get("head_start_s"),
        "ray_init_s": n.get("ray_init_s"),
        "ray_init_s_actors": a.get("ray_init_s"),
        "stop_s": n.get("stop_s"),
        "stop_s_actors": a.get("stop_s"),
        "run_s_nodes": n.get("run_s"),
        "run_s_actors": a.get("run_s"),
        "cleanup_s_nodes": n.get("cleanup_s"),
        "cleanup_s_actors": a.get("cleanup_s"),
        "wall_s_nodes": runs["nodes"].wall_s or None,
        "wall_s_actors": runs["actors"].wall_s or None,
        "wall_s": wall_s,
        "instances": args.instances,
        "target_batch_size": args.target_batch_size,
        "kill_after_s": args.kill_after_s,
        "notice_s": args.notice_s,
        "duration_s": args.duration_s,
        "post_s": args.post_s,
        "nodes_skipped": runs["nodes"].skipped,
        "nodes_error": n.get("error"),
        "actors_error": a.get("error"),
        "timed_out": [m for m, r in runs.items() if r.timed_out],
        "serialize_launches": args.serialize_launches,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="kill 13 s after launch, stop 3 s after the replacement's first step (a smoke test)")
    parser.add_argument("--only", choices=MODES, help="run one mode only (the other's figures are null)")
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--target-batch-size", type=int, default=64)
    parser.add_argument("--duration-s", type=float, help="each run, from the supervisor's start (120; quick 30)")
    parser.add_argument("--kill-after-s", type=float,
                        help="the first instance is killed this long after its launch (45; quick 13)")
    parser.add_argument("--notice-s", type=float, default=0.0, help="its preemption notice comes this long before")
    parser.add_argument("--post-s", type=float,
                        help="stop this long after the replacement's first step (quick 3; full: run the duration)")
    parser.add_argument("--warmup-s", type=float,
                        help="skipped after the fleet's first full epoch and the replacement's first step (5; quick 1)")
    parser.add_argument("--head-timeout-s", type=float, default=60.0, help="for the Ray head to start")
    parser.add_argument("--budget-s", type=float,
                        help=f"time budget of each run's child process, which cuts its run short to stay within it; "
                             f"the hard limit is {LIMIT_SLACK_S:g} s more (duration + 60; quick: {QUICK_NODES_S:g} for "
                             f"nodes, the rest of {QUICK_TOTAL_S:g} for actors)")
    parser.add_argument("--serialize-launches", action="store_true",
                        help="nodes mode: launch one instance at a time (works around instances sharing a namespace)")
    parser.add_argument("--keep", metavar="DIR", help="copy the runs' logs and stores to DIR")
    parser.add_argument("--role", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.instances < 2:
        parser.error("--instances must be at least 2 (a run trains on while one is replaced)")
    args.duration_s = args.duration_s or (30.0 if args.quick else 120.0)
    args.kill_after_s = args.kill_after_s if args.kill_after_s is not None else (13.0 if args.quick else 45.0)
    args.post_s = args.post_s if args.post_s is not None else (3.0 if args.quick else None)
    args.warmup_s = args.warmup_s if args.warmup_s is not None else (1.0 if args.quick else 5.0)
    if args.notice_s > args.kill_after_s:
        parser.error("--notice-s cannot exceed --kill-after-s")
    args.child_argv = ["--instances", str(args.instances), "--target-batch-size", str(args.target_batch_size),
                       "--duration-s", str(args.duration_s), "--kill-after-s", str(args.kill_after_s),
                       "--notice-s", str(args.notice_s), "--warmup-s", str(args.warmup_s),
                       "--head-timeout-s", str(args.head_timeout_s)]
    if args.serialize_launches:
        args.child_argv.append("--serialize-launches")
    if args.post_s is not None:
        args.child_argv += ["--post-s", str(args.post_s)]
    return args


def main() -> None:
    args = parse_args()
    if args.role:
        run_child(args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # everything it started is stopped; never wait for a pool thread stuck in a Ray call

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    wall0 = time.monotonic()
    base = Path(tempfile.mkdtemp(prefix="sswmn-", dir="/tmp" if os.path.isdir("/tmp") else None))
    runs = {m: ChildRun(m, 0.0) for m in MODES}
    try:
        for mode in MODES:
            if args.only and mode != args.only:
                runs[mode].skipped = "--only " + args.only
                continue
            if mode == "nodes" and (why := _netns.available()):
                runs[mode].skipped = f"network namespaces unavailable: {why}"
                print(f"nodes: skipped ({runs[mode].skipped})", flush=True)
                continue
            if args.budget_s:
                budget = args.budget_s
            elif not args.quick:
                budget = args.duration_s + 60.0
            elif mode == "nodes":
                budget = QUICK_NODES_S
            else:
                budget = max(QUICK_TOTAL_S - (time.monotonic() - wall0), 20.0)
            print(f"{mode}: running (budget {budget:.0f} s, hard limit {budget + LIMIT_SLACK_S:.0f} s) ...", flush=True)
            runs[mode] = run_mode(mode, args, base, budget)
    finally:
        if args.keep:
            shutil.copytree(base, Path(args.keep) / base.name, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("sockets", "*.sock", "session_latest"), symlinks=True)
        shutil.rmtree(base, ignore_errors=True)
    wall_s = time.monotonic() - wall0
    print_report(runs, args, wall_s)
    print_json(figures_of(runs, args, wall_s))


if __name__ == "__main__":
    main()
