"""The local simulator's ``nodes`` mode: each instance is its own Ray node on this machine.

A launch runs the instance's boot script (``ray start --address=<head> --block``) as a process
group of its own, detached from the supervisor like a real machine (it survives a supervisor
restart and is adopted by the next one), optionally inside a network namespace so that it has
its own IP address.  A preemption is a notice, then SIGKILL of every process in the node's session:
raylet, worker actor and all.  Each instance's record (tags, price, schedule, session leader) is a JSON
file in the run's ``nodes/`` directory: the simulated cloud's own inventory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from contextlib import suppress
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

from orchestrator.config.schema import ClusterConfig
from orchestrator.host.processes import session_pids, session_processes, signal_session
from orchestrator.host.wait import wait_for
from orchestrator.providers.base import Instance, LaunchSpec, NodeProvider, PreemptionNotice
from orchestrator.providers.bootstrap import ray_auth_token
from orchestrator.sim.actors import SimulatedMarket, _Schedule

logger = logging.getLogger(__name__)

# the group leader records its pid, then becomes the boot script (never unrecorded: it could not be found)
_WRAPPER = 'echo $$ > "$1" && exec bash "$2"'


def boot_detached(script: str, state_dir: Path, name: str, env: dict[str, str], namespace: str | None = None,
                  log_path: Path | None = None) -> int:
    """Run a boot script as a machine would: a session of its own whose parent is not us (``setsid
    -f``), optionally in a network namespace; returns the session leader's pid.  Its output goes
    to ``log_path`` (default ``<state_dir>/<name>.log``)."""
    script_path = state_dir / f"{name}.sh"
    script_path.write_text(script)
    pid_file = state_dir / f"{name}.pid"
    pid_file.unlink(missing_ok=True)
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    command = ["setsid", "-f", *prefix, "bash", "-c", _WRAPPER, "boot", str(pid_file), str(script_path)]
    with open(log_path or state_dir / f"{name}.log", "ab") as log:
        subprocess.run(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, check=True, timeout=30, env=env)
    return _read_pid(pid_file)


def _read_pid(pid_file: Path, timeout: float = 10.0) -> int:
    def pid() -> int | None:
        try:
            text = pid_file.read_text().strip()
        except FileNotFoundError:
            text = ""
        return int(text) if text else None

    try:  # the detached boot process writes it within milliseconds
        return wait_for(pid, timeout, f"the boot process to start (its {pid_file.name})", every=0.01)
    except TimeoutError:
        raise RuntimeError(f"the boot process did not start within {timeout:.0f} s (no {pid_file.name})") from None


def worker_pids(leader: int, marker: str = "WorkerActor") -> list[int]:
    """The processes of a node whose command line names ``marker`` (Ray titles an actor's process
    ``ray::WorkerActor``...): what a fault injector kills or pauses without the rest of the machine."""
    found = []
    for proc in session_processes(leader):
        with suppress(psutil.Error):
            if marker in " ".join(proc.cmdline()):
                found.append(proc.pid)
    return found


def node_alive(leader: int) -> bool:
    """Whether any process of the node lives.  While the session's leader (the boot script) runs,
    it does, and asking the leader alone spares a scan of every process on the machine: the local
    provider asks this of every instance on every poll.  (The node is its session: Ray gives each
    worker a process group of its own, so the node's process group alone would leave the actors.)"""
    with suppress(psutil.Error, OSError):
        if os.getsid(leader) == leader and psutil.Process(leader).status() != psutil.STATUS_ZOMBIE:
            return True
    return bool(session_pids(leader))


class LocalNodeProvider(SimulatedMarket, NodeProvider):
    def __init__(self, config: ClusterConfig, clock: Any, state_dir: Path) -> None:
        super().__init__(config, clock)
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.instances: dict[str, Instance] = {}
        self.stop_timeout = 30.0
        self._lock = threading.Lock()
        self._namespace_of: dict[str, str] = {}  # instance id -> the network namespace it holds

    # ---- launching -------------------------------------------------------------------------------
    def launch(self, spec: LaunchSpec) -> Instance:
        if spec.boot_script is None:
            raise ValueError(f"{spec.instance_id}: the nodes mode needs a boot script to run")
        namespace = self._reserve_namespace(spec.instance_id)
        try:
            return self._boot(spec, namespace)
        except BaseException:
            self._release_namespace(spec.instance_id)
            raise

    def _boot(self, spec: LaunchSpec, namespace: str | None) -> Instance:
        # the machine's console output is on its own disk (a full run directory does not stop it)
        temp = self._temp_dir(spec.instance_id)
        temp.mkdir(parents=True, exist_ok=True)
        leader = boot_detached(spec.boot_script, self.state_dir, spec.instance_id, self._boot_env(spec.instance_id),
                               namespace, log_path=temp / "boot.log")
        now = self.clock()
        inst = Instance(spec.instance_id, spec.node_type, spec.zone, spec.market,
                        self.price(spec.node_type, spec.zone, spec.market), now, tags=dict(spec.tags), handle=leader,
                        region=self.config.region_of(spec.node_type))
        self.schedule(spec, now)
        self.instances[inst.id] = inst
        try:
            self._save(inst, namespace)
        except BaseException:  # unrecorded, nobody could find it again: the launch fails without a machine
            signal_session(leader, signal.SIGKILL)
            self.instances.pop(inst.id, None)
            raise
        logger.info("instance %s: Ray node starting as session %d%s", inst.id, leader,
                    f" in network namespace {namespace}" if namespace else "")
        return inst

    def _temp_dir(self, instance_id: str) -> Path:
        """Short (Ray's socket paths must fit in 107 bytes), and unique per run and instance."""
        digest = hashlib.sha1(f"{self.state_dir.resolve()}/{instance_id}".encode()).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / f"ssw-{digest}"

    def _boot_env(self, instance_id: str) -> dict[str, str]:
        env = dict(os.environ)
        env["SPOTSWARM_NODE_TMP"] = str(self._temp_dir(instance_id))
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # our ray first
        token = ray_auth_token()
        if token:
            env["RAY_AUTH_TOKEN"] = token
        return env

    def _reserve_namespace(self, instance_id: str) -> str | None:
        """A namespace no other instance holds; launches run concurrently, so it is taken under a
        lock before the boot starts and given back only when the instance is gone."""
        namespaces = self.config.provider.namespaces
        if not namespaces:
            return None
        with self._lock:
            for name in namespaces:
                if name not in self._namespace_of.values():
                    self._namespace_of[instance_id] = name
                    return name
        raise RuntimeError(f"every network namespace of provider.namespaces is in use ({len(namespaces)})")

    def _release_namespace(self, instance_id: str) -> None:
        with self._lock:
            self._namespace_of.pop(instance_id, None)

    # ---- the simulated cloud's inventory ---------------------------------------------------------
    def _record_path(self, instance_id: str) -> Path:
        return self.state_dir / f"{instance_id}.json"

    def _save(self, inst: Instance, namespace: str | None) -> None:
        sched = self.schedules.get(inst.id)
        record = {"id": inst.id, "node_type": inst.node_type, "zone": inst.zone, "region": inst.region,
                  "market": inst.market,
                  "price_per_hour": inst.price_per_hour, "launched_at": inst.launched_at, "tags": inst.tags,
                  "leader": inst.handle, "namespace": namespace, "schedule": asdict(sched) if sched else None}
        tmp = self._record_path(inst.id).with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(self._record_path(inst.id))

    def _load(self, instance_id: str) -> dict:
        try:
            return json.loads(self._record_path(instance_id).read_text())
        except (OSError, ValueError):
            return {}

    def _forget(self, instance_id: str) -> None:
        self.instances.pop(instance_id, None)
        self._release_namespace(instance_id)
        self._record_path(instance_id).unlink(missing_ok=True)
        self._keep_worker_logs(instance_id)
        shutil.rmtree(self._temp_dir(instance_id), ignore_errors=True)  # the machine's disk goes with it

    def _keep_worker_logs(self, instance_id: str) -> None:
        """What the node's Python processes wrote to stderr (the worker's log), kept in the run's
        ``nodes/<id>-logs/`` where ``spotswarm check`` reads logs; Ray's own logs go with the machine."""
        with suppress(OSError):
            shutil.copyfile(self._temp_dir(instance_id) / "boot.log", self.state_dir / f"{instance_id}.log")
        for log in self._temp_dir(instance_id).glob("session_*/logs/worker-*.err"):
            with suppress(OSError):  # best effort: a full disk keeps only what fits
                if log.stat().st_size:
                    kept = self.state_dir / f"{instance_id}-logs"
                    kept.mkdir(exist_ok=True)
                    shutil.copyfile(log, kept / f"{log.stem}.log")

    def list(self, tag_filters: dict[str, str]) -> list[Instance]:
        """Every live instance on record with these tags, including those a previous supervisor
        launched (they are taken over: polled, preempted and released from now on)."""
        out = []
        for path in sorted(self.state_dir.glob("*.json")):
            record = self._load(path.stem)
            if not record or not all(record["tags"].get(k) == v for k, v in tag_filters.items()):
                continue
            if not node_alive(record["leader"]):
                self._forget(record["id"])
                continue
            inst = self.instances.get(record["id"])
            if inst is None:
                inst = Instance(record["id"], record["node_type"], record["zone"], record["market"],
                                record["price_per_hour"], record["launched_at"], tags=record["tags"],
                                handle=record["leader"], region=record.get("region", ""))
                self.instances[inst.id] = inst
                if record.get("namespace"):
                    with self._lock:
                        self._namespace_of[inst.id] = record["namespace"]
                if record.get("schedule"):
                    self.schedules[inst.id] = _Schedule(**record["schedule"])
            out.append(inst)
        return out

    # ---- market events ---------------------------------------------------------------------------
    def poll_notices(self, now: float) -> list[PreemptionNotice]:
        notices = self.due_notices(list(self.instances), now)
        for notice in notices:  # remembered, so a restarted supervisor does not notice twice
            inst = self.instances.get(notice.instance_id)
            if inst is not None:
                self._save(inst, self._namespace_of.get(inst.id))
        return notices

    def poll_terminated(self, now: float) -> list[str]:
        gone = []
        for instance_id, inst in list(self.instances.items()):
            if self.due_kill(instance_id, now):
                signal_session(inst.handle, signal.SIGKILL)  # a real preemption: the machine just stops
                logger.info("preempted %s: killed its Ray node (session %d)", instance_id, inst.handle)
            elif node_alive(inst.handle):
                continue
            self._forget(instance_id)
            gone.append(instance_id)
        return gone

    def terminate(self, instance: Instance) -> None:
        """Stop the node (``ray start --block`` stops its processes on SIGTERM), then make sure."""
        leader = instance.handle
        with suppress(ProcessLookupError):
            os.kill(leader, signal.SIGTERM)
        with suppress(TimeoutError):
            wait_for(lambda: not node_alive(leader), self.stop_timeout, f"node {instance.id} to stop", every=0.1)
        signal_session(leader, signal.SIGKILL)
        self._forget(instance.id)
