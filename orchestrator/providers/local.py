"""The local spot simulator: each instance is a Ray actor (its own process) running one worker.

Lifetimes come from a preemption model (exponential or Weibull, per node type) or from a
replayable CSV trace; a preemption is a notice (the worker leaves gracefully) followed, after the
notice period, by a real SIGKILL of the actor's process.  Times are simulated seconds: the
supervisor's clock runs ``time_scale`` times faster than the wall clock.
"""

from __future__ import annotations

import csv
import logging
import os
import random
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from ..config import ClusterConfig
from .base import Instance, NodeProvider, PreemptionNotice

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_restarts=0)
class SimulatedInstance:
    """One simulated machine: a worker peer training in a thread of this actor's process."""

    def __init__(self) -> None:
        self.peer: Any = None
        self.thread: threading.Thread | None = None
        self.left = threading.Event()

    def start(self, worker_args: dict) -> dict:
        import logging as _logging

        from workers.peer import TrainingPeer, WorkerConfig  # imported here: only instances need torch

        _logging.basicConfig(level=_logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.peer = TrainingPeer(WorkerConfig(**worker_args))
        self.thread = threading.Thread(target=self.peer.run, name="training", daemon=True)
        self.thread.start()
        return {"pid": os.getpid(), "peer_id": str(self.peer.dht.peer_id), "address": self.peer.address}

    def notice(self, deadline_s: float) -> None:
        """A preemption notice: keep training through most of it, then leave gracefully in the
        background, all within ``deadline_s``."""
        def leave() -> None:
            try:
                # the last quarter is for finishing a round and withdrawing our records
                self.peer.prepare_to_leave(deadline=deadline_s, train_for=0.75 * deadline_s)
            finally:
                self.left.set()
        threading.Thread(target=leave, name="leaving", daemon=True).start()

    def status(self) -> dict:
        peer = self.peer
        return {"epoch": peer.epoch if peer else 0, "left": self.left.is_set()}

    def stop(self) -> None:
        """Graceful stop without a notice period (used by ``down``)."""
        if self.peer is not None and not self.left.is_set():
            self.peer.prepare_to_leave(deadline=10.0)
            self.left.set()


@dataclass
class _Schedule:
    notice_at: float | None
    kill_at: float | None
    noticed: bool = False


class LocalSpotProvider(NodeProvider):
    def __init__(self, config: ClusterConfig, clock: Any) -> None:
        self.config = config
        self.clock = clock
        self.rng = random.Random(config.provider.seed)
        self.instances: dict[str, Instance] = {}
        self.pids: dict[str, int] = {}
        self.schedules: dict[str, _Schedule] = {}
        self.starting: dict[str, Any] = {}  # instance id -> ObjectRef of the worker's start
        self.failed: set[str] = set()
        self.leave_checks: dict[str, Any] = {}
        self.launches = 0
        self.trace = _read_trace(config.provider.trace_file) if config.provider.trace_file else None

    @property
    def provisioning_delay(self) -> float:
        return self.config.provider.provisioning_delay_s

    def price(self, node_type: str, zone: str, market: str) -> float:
        nt = self.config.available_node_types[node_type]
        if market == "on-demand":
            return nt.on_demand_price_per_hour
        return nt.spot_price_per_hour.get(zone, 0.3 * nt.on_demand_price_per_hour)

    def launch(self, node_type: str, zone: str, market: str, worker_args: dict) -> Instance:
        index = self.launches
        self.launches += 1
        instance_id = f"{self.config.cluster_name}-{node_type}-{index:04d}"
        actor = SimulatedInstance.remote()
        # returns at once (billing starts now, as on a cloud); the worker boots in the background
        self.starting[instance_id] = actor.start.remote(worker_args)
        now = self.clock()
        inst = Instance(instance_id, node_type, zone, market, self.price(node_type, zone, market), now,
                        tags={"cluster": self.config.cluster_name}, handle=actor)
        self.instances[instance_id] = inst
        self.schedules[instance_id] = self._schedule(index, node_type, market, now)
        return inst

    def _collect_started(self) -> None:
        if not self.starting:
            return
        refs = {ref: instance_id for instance_id, ref in self.starting.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in ready:
            instance_id = refs[ref]
            del self.starting[instance_id]
            try:
                info = ray.get(ref)
            except Exception as e:  # the worker failed to boot: the instance is lost
                logger.warning("instance %s failed to start: %s", instance_id, e)
                self.failed.add(instance_id)
                continue
            self.pids[instance_id] = info["pid"]
            if instance_id in self.instances:
                self.instances[instance_id].tags["peer_id"] = info["peer_id"]

    def _schedule(self, index: int, node_type: str, market: str, now: float) -> _Schedule:
        notice_period = self.config.spot.notice_period_s
        if self.trace is not None:
            if index >= len(self.trace):
                return _Schedule(None, None)
            notice_after, kill_after = self.trace[index]
            return _Schedule(None if notice_after is None else now + notice_after,
                             None if kill_after is None else now + kill_after)
        model = self.config.available_node_types[node_type].preemption
        if market != "spot" or model.distribution == "none":
            return _Schedule(None, None)
        if model.distribution == "exponential":
            lifetime = self.rng.expovariate(1.0 / model.mean_lifetime_s)
        else:  # Weibull with the requested mean
            import math
            scale = model.mean_lifetime_s / math.gamma(1 + 1 / model.weibull_shape)
            lifetime = self.rng.weibullvariate(scale, model.weibull_shape)
        kill_at = now + lifetime
        return _Schedule(max(now, kill_at - notice_period), kill_at)

    def poll_notices(self, now: float) -> list[PreemptionNotice]:
        out = []
        for instance_id, sched in self.schedules.items():
            if instance_id in self.instances and not sched.noticed and sched.notice_at is not None \
                    and now >= sched.notice_at:
                sched.noticed = True
                out.append(PreemptionNotice(instance_id, sched.notice_at, sched.kill_at or sched.notice_at))
        return out

    def poll_terminated(self, now: float) -> list[str]:
        self._collect_started()
        gone = []
        for instance_id in list(self.instances):
            sched = self.schedules[instance_id]
            pid = self.pids.get(instance_id)
            if sched.kill_at is not None and now >= sched.kill_at:
                self._sigkill(instance_id)
                gone.append(instance_id)
            elif instance_id in self.failed or (pid is not None and not _alive(pid)):
                self._sigkill(instance_id)
                gone.append(instance_id)
        return gone

    def poll_left(self, instance_ids: list[str]) -> list[str]:
        """Which of these noticed instances' workers have finished leaving (non-blocking)."""
        for instance_id in instance_ids:
            inst = self.instances.get(instance_id)
            if inst is not None and instance_id not in self.leave_checks and instance_id in self.pids:
                self.leave_checks[instance_id] = inst.handle.status.remote()
        if not self.leave_checks:
            return []
        refs = {ref: i for i, ref in self.leave_checks.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        left = []
        for ref in ready:
            instance_id = refs[ref]
            del self.leave_checks[instance_id]
            try:
                if ray.get(ref)["left"]:
                    left.append(instance_id)
            except Exception:  # killed meanwhile: it never reported leaving
                continue
        return left

    def notify(self, instance: Instance, deadline_s: float) -> None:
        instance.handle.notice.remote(deadline_s)  # queued behind start if it is still booting

    def terminate(self, instance: Instance) -> None:
        """Release: the worker leaves gracefully, then the actor ends (no preemption involved)."""
        if instance.id not in self.instances:
            return
        if instance.id in self.pids:
            try:
                ray.get(instance.handle.stop.remote(), timeout=30)
            except Exception as e:  # already dead or stuck
                logger.debug("graceful stop of %s failed: %s", instance.id, e)
        self.instances.pop(instance.id, None)
        self.starting.pop(instance.id, None)
        ray.kill(instance.handle)

    def _sigkill(self, instance_id: str) -> None:
        inst = self.instances.pop(instance_id, None)
        self.starting.pop(instance_id, None)
        pid = self.pids.get(instance_id)
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)  # a real preemption: no atexit, no goodbye
        elif inst is not None:
            ray.kill(inst.handle)  # still booting: nothing to kill but the actor

    def list(self) -> list[Instance]:
        return list(self.instances.values())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _read_trace(path: str) -> list[tuple[float | None, float | None]]:
    """CSV with columns notice_after_s, kill_after_s: row i applies to the i-th instance launched
    (seconds after its launch; empty = never)."""
    rows = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"notice_after_s", "kill_after_s"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: trace needs columns notice_after_s, kill_after_s (missing {sorted(missing)})")
        for line, row in enumerate(reader, start=2):
            try:
                notice = float(row["notice_after_s"]) if row["notice_after_s"].strip() else None
                kill = float(row["kill_after_s"]) if row["kill_after_s"].strip() else None
            except ValueError:
                raise ValueError(f"{path}:{line}: times must be numbers of seconds") from None
            rows.append((notice, kill))
    return rows
