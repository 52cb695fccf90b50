"""The child roles of ``bench_multinode.py``: one run of one mode (``--role nodes|actors``), in a child
process of that script.  It starts what its mode needs (nodes: the network namespaces on a bridge and
a Ray head on the bridge's address; actors: a local Ray), a supervisor over the fleet, relays the
run's events as progress lines, stops everything within its budget, and prints one JSON line of the
run's figures (from its run store).  What it starts that could outlive it is written to a manifest,
which the parent reads to clean up after a child it had to kill."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import sqlite3
import sys
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
from _common import emit, retry  # noqa: E402

from orchestrator.host.ray_head import RayHead  # noqa: E402

log = logging.getLogger("bench_multinode")

NODE_TYPE = "small"
MODES = ("nodes", "actors")
SUBNETS = ("10.214.0", "10.215.0", "10.216.0", "10.217.0")  # the first free one is used
CLEANUP_RESERVE_S = {"nodes": 8.0, "actors": 3.0}  # of a child's budget, for stopping what it started
CLEANUP_AFTER_STOP_S = {"nodes": 4.0, "actors": 1.0}  # of that, for what comes after the supervisor's stop
# dead nodes declared within about a second; a SIGTERMed head would drain for 30 s first
HEAD_ENV = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "500",
            "RAY_health_check_timeout_ms": "500", "RAY_health_check_failure_threshold": "2",
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}


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


def start_head(ip: str, temp_dir: Path, manifest: Manifest) -> RayHead:
    """Start (not wait for) the head on ``ip``, with token authentication (the child's environment)
    and dead nodes declared within about a second; its session goes into the manifest at once."""
    head = RayHead(temp_dir, temp_dir.parent / "head.log", {**os.environ, **HEAD_ENV}, num_cpus=2, node_ip=ip)
    manifest.update(head_sid=head.pid)
    return head


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

    def start_head(self) -> tuple[_netns.NetnsFleet, RayHead]:
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
        self.at_exit("head_stop", lambda: head.stop(grace_s=2.0))  # the driver and the nodes are gone
        import orchestrator.fleet.supervisor  # noqa: F401 - torch and Ray load while the head starts

        head.wait_ready(self.args.head_timeout_s)
        self.result["head_start_s"] = time.monotonic() - t
        self.result["head_ip"] = fleet.head_ip
        self.say(f"Ray head up at {head.address} in {self.result['head_start_s']:.1f} s (token auth)")
        return fleet, head

    def connect(self, cluster: tuple[_netns.NetnsFleet, RayHead] | None) -> Any:
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
