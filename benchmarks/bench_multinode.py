"""Multi-node benchmark: the local simulator's ``nodes`` mode (every instance its own Ray node, in a
network namespace with its own IP address, joined to a Ray head on a bridge) trains the
``synthetic`` task while one instance is preempted, against the same fleet in ``actors`` mode (every
instance a Ray actor on the driver's node, loopback only), measured side by side in one run.

Why: ``actors`` mode is what the other benchmarks and most tests use; ``nodes`` mode is the path a
real cluster takes (boot script, ``ray start``, a peer reached at its node's address).  This says
what that path costs in throughput and in recovery time, on one machine.

Each mode runs in a child process of this script (``--role nodes|actors``, one after the other).
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
import re
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import _netns  # noqa: E402
from _common import Child, ChildTimeout, emit, fmt, print_json, print_table, retry  # noqa: E402

log = logging.getLogger("bench_multinode")

NODE_TYPE = "small"
MODES = ("nodes", "actors")
SUBNETS = ("10.214.0", "10.215.0", "10.216.0", "10.217.0")  # the first free one is used
STOP_GRACE_S = 30.0  # a child past its limit gets this long to clean up after SIGTERM
LIMIT_SLACK_S = 15.0  # a child's hard limit: its budget plus this
QUICK_TOTAL_S = 58.0  # --quick: both runs' budgets together
QUICK_NODES_S = 36.0  # --quick: the nodes run's budget (the actors run gets the rest, at least 20 s)
CLEANUP_RESERVE_S = {"nodes": 8.0, "actors": 3.0}  # of a child's budget, for stopping what it started
CLEANUP_AFTER_STOP_S = {"nodes": 4.0, "actors": 1.0}  # of that, for what comes after the supervisor's stop


# ---- small helpers ---------------------------------------------------------------------------------
def _sessions(sid: int) -> list[int]:
    """Every live (not zombie) process of session ``sid`` (a process group leader's whole tree,
    including processes that made process groups of their own, as Ray's workers do)."""
    import psutil

    out = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(proc.pid) == sid:
                out.append(proc.pid)
        except (OSError, psutil.Error):
            continue
    return out


def _kill_session(sid: int, grace_s: float = 10.0) -> None:
    """SIGTERM every process of session ``sid``, wait (bounded), then SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = _sessions(sid)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while _sessions(sid) and time.monotonic() < deadline:
            time.sleep(0.1)  # bounded polling for the processes to exit
    if left := _sessions(sid):
        log.warning("session %d: processes %s survived SIGKILL", sid, left)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _wait(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    """Poll ``predicate`` until it returns something true; TimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)


class _Stopped(BaseException):
    """SIGTERM from the parent: the child's time is up; clean up and exit."""


_TERMINATED = threading.Event()


def _on_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the cleanup must not be interrupted again
    _TERMINATED.set()
    raise _Stopped()


def _catch_sigterm() -> None:
    """(Re)install our SIGTERM handler, unless one SIGTERM came already (``ray.init`` installs its own)."""
    if not _TERMINATED.is_set():
        signal.signal(signal.SIGTERM, _on_sigterm)


class Manifest:
    """What a child created that outlives it if it is SIGKILLed (detached sessions, namespaces):
    a JSON file the parent reads to clean up after a child that could not."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {}

    def update(self, **items: Any) -> None:
        self.data.update(items)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        tmp.replace(self.path)


def _exited(proc: subprocess.Popen) -> bool:
    """Whether the child exited, without reaping it (a reaped pid may be reused at once)."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _ours(sid: int, marker: str) -> bool:
    """Whether session ``sid`` is still one we started: its leader (pid ``sid``) is gone or a zombie,
    or runs with ``marker`` (our directory) in its command line.  A live leader without it is some
    other program that got the pid after ours exited, leading a session of its own."""
    try:
        state = Path(f"/proc/{sid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = Path(f"/proc/{sid}/cmdline").read_bytes()
    except (OSError, IndexError):
        return True
    return state == "Z" or marker.encode() in cmdline


def cleanup_from_manifest(path: Path, marker: str) -> list[str]:
    """Backstop after a SIGKILLed child: kill the Ray head's and the nodes' sessions (those still
    ours, see ``_ours``), everything left in the namespaces, and delete the links and namespaces.
    Returns what it had to remove."""
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
        if _sessions(sid) and _ours(sid, marker):
            _kill_session(sid, grace_s=3.0)
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


# ---- the child: one run of one mode -------------------------------------------------------------------
@dataclass
class Head:
    """A Ray head in a session of its own (``ray start --head --block``)."""

    proc: subprocess.Popen
    address: str
    log_path: Path

    def wait_ready(self, timeout: float) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start --head exited with {self.proc.returncode}: {_tail(self.log_path)}")
            return "Ray runtime started" in self.log_path.read_text(errors="replace")

        _wait(ready, timeout, "the Ray head to start")

    def stop(self) -> None:
        _kill_session(self.proc.pid, grace_s=2.0)  # the driver and the nodes are gone: nothing to keep
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


def start_head(ip: str, temp_dir: Path, manifest: Manifest) -> Head:
    """Start (not wait for) the head on ``ip`` with a short temp dir of its own (socket paths are
    capped at 107 bytes) and dead nodes declared within about a second."""
    port, client_port, agent_port = _free_port(ip), _free_port(ip), _free_port(ip)
    env = dict(os.environ)
    env.update(RAY_health_check_initial_delay_ms="1000", RAY_health_check_period_ms="500",
               RAY_health_check_timeout_ms="500", RAY_health_check_failure_threshold="2",
               RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")  # a SIGTERMed head would drain for 30 s first
    ray_bin = str(Path(sys.executable).with_name("ray"))
    cmd = [ray_bin, "start", "--head", f"--node-ip-address={ip}", f"--port={port}", "--num-cpus=2",
           "--include-dashboard=false", "--disable-usage-stats", f"--ray-client-server-port={client_port}",
           f"--dashboard-agent-listen-port={agent_port}", f"--temp-dir={temp_dir}", "--block"]
    log_path = temp_dir.parent / "head.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    manifest.update(head_sid=proc.pid)
    return Head(proc, f"{ip}:{port}", log_path)


def _tail(path: Path, n: int = 8) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return "(no log)"
    return " | ".join(line.strip() for line in lines if line.strip())


def enter_fleet(stack: contextlib.ExitStack, n: int) -> _netns.NetnsFleet:
    """``_netns.netns_cluster(n)`` on the first of ``SUBNETS`` nobody uses, torn down with ``stack``."""
    for subnet in SUBNETS[:-1]:
        try:
            return stack.enter_context(_netns.netns_cluster(n, subnet=subnet))
        except _netns.NetnsError as e:
            if "already in use" not in str(e):
                raise
    return stack.enter_context(_netns.netns_cluster(n, subnet=SUBNETS[-1]))


def make_config(mode: str, base: Path, args: argparse.Namespace, namespaces: list[str]) -> Any:
    from orchestrator.config.schema import ClusterConfig

    trace = base / "trace.csv"
    notice_after = max(args.kill_after_s - args.notice_s, 0.0)
    # row i is the run's instance number i: only the first one is preempted
    trace.write_text(f"notice_after_s,kill_after_s\n{notice_after:g},{args.kill_after_s:g}\n"
                     + ",\n" * (args.instances + 4))
    provider: dict[str, Any] = {"type": "local", "mode": mode, "zones": ["a"], "time_scale": 1.0,
                                "provisioning_delay_s": 0.0, "trace_file": str(trace)}
    if mode == "nodes":
        provider["namespaces"] = namespaces
    else:  # no warm image: actors mode's workers boot as the nodes mode's do, so the two compare
        provider["warm_image"] = False
    return ClusterConfig.model_validate({
        "cluster_name": f"mn-{mode}", "runs_dir": str(base / "runs"),
        "provider": provider,
        "available_node_types": {NODE_TYPE: {"min_workers": args.instances, "max_workers": args.instances,
                                             "resources": {"CPU": 1}, "on_demand_price_per_hour": 1.0}},
        "spot": {"notice_period_s": args.notice_s},  # the trace gives the times; this is only the default
        "training": {"task": "synthetic", "target_batch_size": args.target_batch_size,
                     "min_matchmaking_time_s": 0.5, "averaging_timeout_s": 10.0},
        "checkpoint": {"every_s": 3600.0},
        "dashboard": {"enabled": False},
    })


@dataclass
class Observed:
    """Where each worker ran, as the worker actors themselves said while they ran."""

    workers: dict[str, dict] = field(default_factory=dict)  # instance id -> node_id, node_ip, peer_ip
    shared_ip: list[str] = field(default_factory=list)  # live instances seen sharing one node IP

    def poll(self, core: Any, ray: Any) -> None:
        from orchestrator.instance.actor import worker_actor_name

        todo = [i for i, inst in list(core.live.items()) if inst.tags.get("peer_id") and i not in self.workers]
        if not todo:
            return
        node_ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        for instance_id in todo:
            try:
                status = ray.get(ray.get_actor(worker_actor_name(instance_id)).status.remote(), timeout=5)
            except Exception as e:  # killed meanwhile, or slow: asked again next time
                log.debug("status of %s: %s", instance_id, e)
                continue
            address = status.get("address") or ""
            m = re.search(r"@(.+):\d+$", address)
            self.workers[instance_id] = {"node_id": status["node_id"], "node_ip": node_ips.get(status["node_id"]),
                                         "peer_ip": m.group(1) if m else None}
        by_ip: dict[str, list[str]] = {}
        for instance_id in list(core.live):
            if (w := self.workers.get(instance_id)) and w["node_ip"]:
                by_ip.setdefault(w["node_ip"], []).append(instance_id)
        for ids in by_ip.values():
            if len(ids) > 1:
                self.shared_ip = sorted(set(self.shared_ip) | set(ids))


def serialize_launches(core: Any) -> None:
    """One provider launch at a time.  The policy launches a fleet's instances concurrently, and
    ``LocalNodeProvider.launch`` picks a free namespace from the instances it has finished
    launching, so concurrent launches can all pick the same one; this measures the intended layout
    (one namespace, one IP, per instance) until the provider guards that choice itself."""
    provider = core.policy.provider
    launch, lock = provider.launch, threading.Lock()

    def serialized(spec: Any) -> Any:
        with lock:
            return launch(spec)

    provider.launch = serialized


def _q(db: sqlite3.Connection, sql: str, *params: Any) -> list[tuple]:
    return db.execute(sql, params).fetchall()


def _window(rows: list[tuple[float, int]], t0: float, t1: float) -> tuple[float, int] | None:
    """(seconds, epochs) between the first progress record at or after t0 and the last at or before t1."""
    inside = [(t, e) for t, e in rows if t0 <= t <= t1]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return inside[-1][0] - inside[0][0], inside[-1][1] - inside[0][1]


def analyze(run_dir: Path, args: argparse.Namespace, victim: str, end: float) -> dict[str, Any]:
    """The run's figures from its run store (times are wall-clock epoch seconds: time_scale 1)."""
    db = sqlite3.connect(f"file:{run_dir / 'run.sqlite'}?mode=ro", uri=True, timeout=30)
    try:
        rows_p = _q(db, "SELECT time, epoch, peers FROM progress WHERE time <= ? ORDER BY time", end)
        events = _q(db, "SELECT time, kind, instance_id FROM events ORDER BY time")
        instances = _q(db, "SELECT id, launched_at, ended_at, end_reason FROM instances ORDER BY launched_at")
    finally:
        db.close()
    tbs = args.target_batch_size
    rows = [(t, e) for t, e, _ in rows_p]
    out: dict[str, Any] = {"epochs": (rows[-1][1] - rows[0][1]) if rows else 0,
                           "instances_launched": len(instances)}

    def first(kind: str, instance_id: str | None) -> float | None:
        return next((t for t, k, i in events if k == kind and i == instance_id), None)

    launches = [t for t, k, _ in events if k == "launch"]
    t_full = next((t for t, _, p in rows_p if p >= args.instances), None)
    t_noticed = first("notice", victim)
    t_kill = first("preempted", victim)
    replacement = next((i for i, launched, _, _ in instances if t_noticed is not None and launched >= t_noticed
                        and i != victim), None)
    t_repl_launch = first("launch", replacement) if replacement else None
    t_repl_step = first("first_step", replacement) if replacement else None
    out.update(victim=victim, victim_end_reason=next((r for i, _, _, r in instances if i == victim), None),
               replacement=replacement)
    out["fleet_boot_s"] = t_full - min(launches) if t_full is not None and launches else None
    out["kill_to_first_step_s"] = t_repl_step - t_kill if t_repl_step is not None and t_kill is not None else None
    out["replacement_launch_to_first_step_s"] = (t_repl_step - t_repl_launch
                                                 if t_repl_step is not None and t_repl_launch is not None else None)
    out["notice_to_kill_s"] = t_kill - t_noticed if t_kill is not None and t_noticed is not None else None
    after_kill = next((t for t, _ in rows if t_kill is not None and t > t_kill), None)
    out["kill_to_next_epoch_s"] = after_kill - t_kill if after_kill is not None and t_kill is not None else None

    windows = {}
    if t_full is not None:
        windows["pre_kill"] = _window(rows, t_full + args.warmup_s, t_kill if t_kill is not None else end)
    if t_repl_step is not None:
        windows["post_recovery"] = _window(rows, t_repl_step + args.warmup_s, end)
    for name, w in windows.items():
        out[f"samples_s_{name}"] = w[1] * tbs / w[0] if w else None
        out[f"window_{name}_s"] = w[0] if w else None
        out[f"epochs_{name}"] = w[1] if w else None
    steady = [w for w in windows.values() if w]
    secs, epochs = sum(w[0] for w in steady), sum(w[1] for w in steady)
    out["samples_s"] = epochs * tbs / secs if secs > 0 else None
    out["steady_window_s"] = secs if secs > 0 else None
    out["epoch_s"] = secs / epochs if epochs > 0 else None
    whole = _window(rows, t_full + args.warmup_s, end) if t_full is not None else None
    out["samples_s_whole"] = whole[1] * tbs / whole[0] if whole else None
    out["whole_window_s"] = whole[0] if whole else None
    return out


@dataclass
class ModeRun:
    """One mode's run in the child: what its steps share, and the figures it reports."""

    args: argparse.Namespace
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # undone in reverse at the end
    wall0: float = field(default_factory=time.monotonic)
    result: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    stopped: dict[str, float] = field(default_factory=dict)  # seconds each cleanup step took
    observed: Observed = field(default_factory=Observed)
    run_dir: Path | None = None
    end: float = field(default_factory=time.time)  # the end of the measured run: the monitoring loop's last pass

    def __post_init__(self) -> None:
        self.mode, self.base = self.args.role, Path(self.args.base)
        self.manifest = Manifest(self.base / "manifest.json")
        self.victim = f"mn-{self.mode}-{NODE_TYPE}-0000"
        self.result["mode"] = self.mode

    def say(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.wall0:5.1f}s] {msg}", flush=True)

    def at_exit(self, name: str, fn: Callable[[], Any]) -> None:
        """Undo ``fn`` when the run ends, timed into ``stopped[name]``."""
        def step() -> None:
            t = time.monotonic()
            try:
                fn()
            finally:
                self.stopped[name] = round(time.monotonic() - t, 2)
        self.stack.callback(step)

    def start_head(self) -> tuple[_netns.NetnsFleet, Head]:
        """Nodes mode: the namespaces on a bridge, and a Ray head on the bridge's address."""
        fleet_stack = self.stack.enter_context(contextlib.ExitStack())
        self.at_exit("netns_teardown", fleet_stack.close)
        fleet = enter_fleet(fleet_stack, self.args.instances + 1)
        self.manifest.update(head_ip=fleet.head_ip, bridge=fleet.bridge, namespaces=fleet.namespaces,
                             ips=fleet.ips, veths=fleet.veths)
        self.say(f"bridge {fleet.bridge} {fleet.head_ip}; namespaces "
                 + ", ".join(f"{ns}={ip}" for ns, ip in zip(fleet.namespaces, fleet.ips, strict=True)))
        (self.base / "h").mkdir()
        t = time.monotonic()
        head = start_head(fleet.head_ip, self.base / "h", self.manifest)
        self.at_exit("head_stop", head.stop)
        import orchestrator.fleet.supervisor  # noqa: F401 - torch and Ray load while the head starts

        head.wait_ready(self.args.head_timeout_s)
        self.result["head_start_s"] = time.monotonic() - t
        self.result["head_ip"] = fleet.head_ip
        self.say(f"Ray head up at {head.address} in {self.result['head_start_s']:.1f} s (token auth)")
        return fleet, head

    def connect(self, cluster: tuple[_netns.NetnsFleet, Head] | None) -> Any:
        """``ray.init``: to the head in nodes mode, else a local Ray of its own (three tries)."""
        import ray

        t = time.monotonic()
        if cluster is not None:
            retry(lambda: ray.init(address=cluster[1].address, _node_ip_address=cluster[0].head_ip,
                                   log_to_driver=False, configure_logging=False, namespace="spotswarm-bench-multinode"))
        else:
            retry(lambda: ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                                   configure_logging=False, _temp_dir=str(self.base / "a"),
                                   namespace="spotswarm-bench-multinode"))
        _catch_sigterm()  # ray.init installed its own (sys.exit)

        def shutdown() -> None:
            ray.shutdown()
            _catch_sigterm()

        self.at_exit("ray_shutdown", shutdown)
        self.result["ray_init_s"] = time.monotonic() - t
        self.say(f"driver connected in {self.result['ray_init_s']:.1f} s")
        return ray

    def make_supervisor(self, namespaces: list[str]) -> Any:
        """The supervisor of this mode's fleet (not started), stopped within the budget at the end."""
        from orchestrator.fleet.supervisor import SupervisorCore
        from orchestrator.runs.store import RunStore

        args = self.args
        config = make_config(self.mode, self.base, args, namespaces)
        RunStore.create(config).close()
        self.run_dir = config.run_dir()
        self.manifest.update(run_dir=str(self.run_dir))
        core = SupervisorCore(config, self.run_dir)

        def stop_core() -> None:
            """``core.stop()``, but never past the budget: releasing an instance whose worker is still
            starting waits for the start (up to 30 s); what it leaves is killed right after anyway."""
            limit = max(self.wall0 + args.budget_s - time.monotonic() - CLEANUP_AFTER_STOP_S[self.mode], 2.0)
            thread = threading.Thread(target=core.stop, name="supervisor-stop", daemon=True)
            thread.start()
            thread.join(limit)
            if thread.is_alive():
                self.notes.append(f"the supervisor's stop took over {limit:.0f} s; what it had not released yet is "
                                  "killed instead")

        self.at_exit("supervisor_stop", stop_core)
        if args.serialize_launches and self.mode == "nodes":
            serialize_launches(core)
            self.notes.append("launches serialized by the benchmark (--serialize-launches)")
        return core

    def monitor(self, core: Any, ray: Any, t_start: float) -> None:
        """Relay the run's events until the duration, the budget, or ``--post-s`` after the recovery."""
        args, victim = self.args, self.victim
        db = sqlite3.connect(f"file:{self.run_dir / 'run.sqlite'}?mode=ro", uri=True, timeout=30)
        self.stack.callback(db.close)
        budget_end = self.wall0 + args.budget_s - CLEANUP_RESERVE_S[self.mode]
        deadline = min(t_start + args.duration_s, budget_end)
        seen: set[str] = set()
        replacement: str | None = None  # the first instance launched after the victim's notice
        recovered = False  # the replacement made its first averaged step
        stop_at = deadline
        while time.monotonic() < stop_at:
            self.end = time.time()
            self.observed.poll(core, ray)
            for kind, inst in _q(db, "SELECT kind, instance_id FROM events WHERE kind IN "
                                     "('launch', 'notice', 'preempted', 'died', 'first_step') ORDER BY time"):
                key = f"{kind}:{inst}"
                if key in seen:
                    continue
                seen.add(key)
                self.say(f"{kind} {inst} (epoch {core.epoch})")
                if kind == "launch" and replacement is None and f"notice:{victim}" in seen:
                    replacement = inst
                if kind == "first_step" and inst == replacement:
                    recovered = True
                    if args.post_s is not None:
                        stop_at = min(deadline, time.monotonic() + args.post_s)
            time.sleep(0.5)  # bounded polling of the run store and the workers
        self.end = time.time()
        if stop_at == deadline and budget_end < t_start + args.duration_s:
            self.notes.append(f"run cut to {time.monotonic() - t_start:.0f} s by the child's budget "
                              f"({args.budget_s:.0f} s in all)")
        if f"preempted:{victim}" not in seen:
            self.notes.append(f"{victim} was not preempted in the run")
        elif not recovered:
            self.notes.append("the replacement made no averaged step in the run")

    def run(self) -> None:
        with self.stack:
            cluster = self.start_head() if self.mode == "nodes" else None
            ray = self.connect(cluster)
            core = self.make_supervisor(list(cluster[0].namespaces) if cluster else [])
            t_start = time.monotonic()
            core.start()
            notice = f" ({self.args.notice_s:g} s notice)" if self.args.notice_s else ""
            self.say(f"supervisor started: {self.args.instances} x {NODE_TYPE} in {self.mode} mode; {self.victim} "
                     f"is killed {self.args.kill_after_s:g} s after its launch{notice}")
            self.monitor(core, ray, t_start)
            self.result["run_s"] = time.monotonic() - t_start
            self.say(f"stopping (epoch {core.epoch}) ...")

    def report(self) -> dict[str, Any]:
        """The run's figures (from its run store, if it got that far) and what the workers said."""
        result, run_dir = self.result, self.run_dir
        if run_dir is not None and (run_dir / "run.sqlite").exists():
            try:
                result.update(analyze(run_dir, self.args, self.victim, self.end))
            except Exception as e:
                log.exception("analysis failed")
                result.setdefault("error", f"analysis: {type(e).__name__}: {e}")
        result["stop_s"] = self.stopped.get("supervisor_stop")
        result["cleanup_s"] = self.stopped
        result["workers"] = workers = self.observed.workers
        result["instances_sharing_an_ip"] = self.observed.shared_ip
        result["distinct_nodes"] = len({w["node_id"] for w in workers.values()}) if workers else None
        result["node_ips"] = sorted({w["node_ip"] for w in workers.values() if w.get("node_ip")})
        result["peer_ips"] = sorted({w["peer_ip"] for w in workers.values() if w.get("peer_ip")})
        result["notes"] = self.notes
        result["child_wall_s"] = time.monotonic() - self.wall0
        return result


def run_child(args: argparse.Namespace) -> None:
    """One mode's run; prints progress lines, then one JSON line of its figures."""
    _catch_sigterm()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    m = ModeRun(args)
    try:
        m.run()
    except _Stopped:
        m.notes.append("stopped by the parent: time limit")
    except Exception as e:
        log.exception("the %s run failed", m.mode)
        m.result["error"] = f"{type(e).__name__}: {e}"
    result = m.report()
    m.say(f"done in {result['child_wall_s']:.1f} s (cleanup: "
          + ", ".join(f"{k} {v:.1f} s" for k, v in m.stopped.items()) + ")")
    emit(result)


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
        if exited_at is None and _exited(proc):
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
            _kill_session(proc.pid, grace_s=0.0)
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
        _wait(lambda: _exited(proc), 10.0, "the child to exit", every=0.1)
    run.wall_s = time.monotonic() - t0
    _kill_session(proc.pid, grace_s=2.0)  # whatever is left of its session (Ray's processes of actors mode)
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
