"""The local spot simulator: each instance is a Ray actor (its own process) running one worker,
by default in a process forked from the simulator's warm image (``instance/warm_image.py``).
(``mode: nodes``, each instance its own raylet, lives in ``nodes.py``.)

Lifetimes come from a preemption model (exponential or Weibull, per node type) or from a
replayable CSV trace; a preemption is a notice (the worker leaves gracefully) followed, after the
notice period, by a real SIGKILL of the actor's process.  Times are simulated seconds: the
supervisor's clock runs ``time_scale`` times faster than the wall clock.
"""

from __future__ import annotations

import csv
import logging
import math
import random
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import ray

from orchestrator.config.schema import ClusterConfig
from orchestrator.providers.base import Instance, LaunchSpec, NodeProvider, PreemptionNotice
from orchestrator.sim.relay import LinkSpec, RelayProcess, region_hosts, worker_networks

if TYPE_CHECKING:
    from orchestrator.instance.warm_image import WarmImage

logger = logging.getLogger(__name__)


@dataclass
class _Schedule:
    notice_at: float | None
    kill_at: float | None
    noticed: bool = False


def launch_rng(seed: int, sequence: int) -> random.Random:
    """The draws of one launch, a function of the run's seed and the launch's number alone: launch k
    gets the same lifetime whatever order concurrent launches complete in, and a resumed run, whose
    launch numbers continue, draws fresh lifetimes instead of replaying the first ones."""
    return random.Random(f"{seed}/{sequence}")


class SimulatedMarket:
    """What both local modes share: per-zone prices, a provisioning delay, and each launch's
    preemption schedule (drawn from the node type's lifetime model, or replayed from a trace).
    A node type's region is a label its instances carry; it changes nothing else."""

    def __init__(self, config: ClusterConfig, clock: Any) -> None:
        self.config = config
        self.clock = clock
        self.schedules: dict[str, _Schedule] = {}
        self.trace = _read_trace(config.provider.trace_file) if config.provider.trace_file else None

    @property
    def provisioning_delay(self) -> float:  # type: ignore[override]
        return self.config.provider.provisioning_delay_s

    def price(self, node_type: str, zone: str, market: str) -> float:
        return self.config.available_node_types[node_type].price(zone, market)

    def schedule(self, spec: LaunchSpec, now: float) -> None:
        self.schedules[spec.instance_id] = self._draw(spec.sequence, spec.node_type, spec.market, now)

    def _draw(self, sequence: int, node_type: str, market: str, now: float) -> _Schedule:
        notice_period = self.config.spot.notice_period_s
        if self.trace is not None:
            if sequence >= len(self.trace):
                return _Schedule(None, None)
            notice_after, kill_after = self.trace[sequence]
            return _Schedule(None if notice_after is None else now + notice_after,
                             None if kill_after is None else now + kill_after)
        model = self.config.available_node_types[node_type].preemption
        if market != "spot" or model.distribution == "none":
            return _Schedule(None, None)
        rng = launch_rng(self.config.provider.seed, sequence)
        if model.distribution == "exponential":
            lifetime = rng.expovariate(1.0 / model.mean_lifetime_s)
        else:  # Weibull with the requested mean
            scale = model.mean_lifetime_s / math.gamma(1 + 1 / model.weibull_shape)
            lifetime = rng.weibullvariate(scale, model.weibull_shape)
        kill_at = now + lifetime
        return _Schedule(max(now, kill_at - notice_period), kill_at)

    def preempt(self, instance_id: str, now: float) -> None:
        """A preemption on cue instead of at a drawn or traced time: noticed at the next poll, killed
        a notice period later.  For drills, and for tests that need the fleet in a given state first
        (a traced time can come before a slow boot is done)."""
        self.schedules[instance_id] = _Schedule(now, now + self.config.spot.notice_period_s)

    def due_notices(self, live: Iterable[str], now: float) -> list[PreemptionNotice]:
        out = []
        for instance_id in live:
            sched = self.schedules.get(instance_id)
            if sched is not None and not sched.noticed and sched.notice_at is not None and now >= sched.notice_at:
                sched.noticed = True
                out.append(PreemptionNotice(instance_id, sched.notice_at, sched.kill_at or sched.notice_at))
        return out

    def due_kill(self, instance_id: str, now: float) -> bool:
        sched = self.schedules.get(instance_id)
        return sched is not None and sched.kill_at is not None and now >= sched.kill_at


class LocalSpotProvider(SimulatedMarket, NodeProvider):
    """``mode: actors``: each instance is one Ray actor on this node, which is also its worker.  With
    ``provider.links``, each region's workers get an address of their own and the run's relay
    carries what crosses regions (``relay.py``); ``run_dir`` holds its log."""

    def __init__(self, config: ClusterConfig, clock: Any, run_dir: Path | None = None) -> None:
        super().__init__(config, clock)
        self.instances: dict[str, Instance] = {}
        self.processes: dict[str, psutil.Process] = {}  # bound to the pid and its start time: never a reused pid
        self.starting: dict[str, Any] = {}  # instance id -> ObjectRef of the worker's start
        self.identifying: dict[str, tuple[Any, dict]] = {}  # -> (ObjectRef of its peer id, worker args)
        self.failed: set[str] = set()
        self.workers: dict[str, psutil.Process] = {}  # the worker's own process, when forked from the image
        self.image: WarmImage | None = None
        if config.provider.warm_image is not False:  # on unless turned off
            from orchestrator.instance.warm_image import WarmImage

            self.image = WarmImage()
        self.worker_args: Callable[[str], dict[str, Any]] = lambda instance_id: {}
        self.certify: Callable[[str, str], str | None] | None = None
        self.relay: RelayProcess | None = None
        self.networks: dict[str, dict[str, str]] = {}  # node type -> its workers' host, announce_host, route
        if config.provider.links is not None:
            self._start_links(run_dir)

    def _start_links(self, run_dir: Path | None) -> None:
        """The relay between the node types' regions, and where each node type's workers listen."""
        from orchestrator.config.checks import link_regions
        from orchestrator.runs.logs import log_path

        links = self.config.provider.links
        assert links is not None
        node_regions = link_regions(self.config)
        hosts = region_hosts(list(node_regions.values()))
        if len(hosts) < 2:
            logger.info("provider.links: every node type is in region %s, nothing to emulate", *hosts)
            return
        self.relay = RelayProcess(hosts, LinkSpec(links.mbit, links.rtt_ms),
                                  log_file=log_path(run_dir, "relay") if run_dir is not None else None)
        try:
            address = self.relay.start()
        except BaseException:
            self.shutdown()
            raise
        self.networks = worker_networks(hosts, node_regions, address)
        logger.info("regions %s linked at %g Mbit/s, %g ms through the relay at %s:%d",
                    ", ".join(f"{r} ({h})" for r, h in hosts.items()), links.mbit, links.rtt_ms, *address)

    def host_workers(self, worker_args: Callable[[str], dict[str, Any]],
                     certify: Callable[[str, str], str | None] | None) -> None:
        """Each instance is its worker's own actor, so the launch starts the worker: with these arguments,
        and, when membership is on, a token for the peer id the actor made."""
        self.worker_args, self.certify = worker_args, certify

    def launch(self, spec: LaunchSpec) -> Instance:
        from orchestrator.instance.actor import spawn_worker

        # owned by the supervisor, not detached: the simulated machine goes down with its simulator
        actor = spawn_worker(spec.instance_id, {}, detached=False,
                             image=self.image.path if self.image is not None else None)
        # returns at once (billing starts now, as on a cloud); the worker boots in the background, once
        # its certificate (issued for the peer id the actor made) is there when membership is on
        args = {**self.worker_args(spec.instance_id), **self.networks.get(spec.node_type, {})}
        if self.certify is None:
            self.starting[spec.instance_id] = actor.start.remote(args)
        else:
            self.identifying[spec.instance_id] = (actor.peer_id.remote(), args)
        now = self.clock()
        inst = Instance(spec.instance_id, spec.node_type, spec.zone, spec.market,
                        self.price(spec.node_type, spec.zone, spec.market), now, tags=dict(spec.tags),
                        handle=actor, region=self.config.region_of(spec.node_type))
        self.instances[spec.instance_id] = inst
        self.schedule(spec, now)
        return inst

    def _collect_identified(self) -> None:
        """Workers whose actor made its identity: certify it and start training."""
        if not self.identifying:
            return
        refs = {ref: instance_id for instance_id, (ref, _) in self.identifying.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in ready:
            instance_id = refs[ref]
            _, worker_args = self.identifying.pop(instance_id)
            inst = self.instances.get(instance_id)
            try:
                peer_id = ray.get(ref)
                assert self.certify is not None
                args = {**worker_args, "membership_token": self.certify(instance_id, peer_id)}
            except Exception as e:
                logger.warning("instance %s failed to start: %s", instance_id, e)
                self.failed.add(instance_id)
                continue
            if inst is not None:
                self.starting[instance_id] = inst.handle.start.remote(args)

    def _collect_started(self) -> None:
        self._collect_identified()
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
            try:
                self.processes[instance_id] = psutil.Process(info["pid"])
                if info["worker_pid"] != info["pid"]:
                    self.workers[instance_id] = psutil.Process(info["worker_pid"])
            except psutil.NoSuchProcess:  # died right after it answered
                self.failed.add(instance_id)
                continue
            if instance_id in self.instances:
                self.instances[instance_id].tags["peer_id"] = info["peer_id"]

    def poll_notices(self, now: float) -> list[PreemptionNotice]:
        return self.due_notices(list(self.instances), now)

    def poll_terminated(self, now: float) -> list[str]:
        self._collect_started()
        gone = []
        for instance_id in list(self.instances):
            processes = [p for p in (self.processes.get(instance_id), self.workers.get(instance_id)) if p is not None]
            if self.due_kill(instance_id, now) or instance_id in self.failed \
                    or any(not _alive(p) for p in processes):
                self._sigkill(instance_id)
                gone.append(instance_id)
        return gone

    def terminate(self, instance: Instance) -> None:
        """Release: the actor ends (its worker was asked to leave gracefully before)."""
        if self.instances.pop(instance.id, None) is None:
            return
        self.starting.pop(instance.id, None)
        self.identifying.pop(instance.id, None)
        self.processes.pop(instance.id, None)
        self.workers.pop(instance.id, None)  # ends with its actor
        ray.kill(instance.handle)

    def _sigkill(self, instance_id: str) -> None:
        inst = self.instances.pop(instance_id, None)
        self.starting.pop(instance_id, None)
        self.identifying.pop(instance_id, None)
        process = self.processes.pop(instance_id, None)
        worker = self.workers.pop(instance_id, None)
        if process is not None and _alive(process):
            with suppress(psutil.NoSuchProcess):
                process.kill()  # a real preemption: no atexit, no goodbye (psutil checks the start time again)
        elif inst is not None:
            ray.kill(inst.handle)  # still booting: nothing to kill but the actor
        if worker is not None and _alive(worker):  # after its actor, which never sees it go as a crash
            with suppress(psutil.NoSuchProcess):
                worker.kill()  # it would follow its actor by itself, a moment later

    def shutdown(self) -> None:
        if self.image is not None:
            self.image.close()
            self.image = None
        if self.relay is not None:
            self.relay.stop()  # it logs the bytes each pair of regions carried
            self.relay = None

    def list(self, tag_filters: dict[str, str]) -> list[Instance]:
        """This simulator's machines die with it, so only its own are ever alive."""
        return [i for i in self.instances.values() if all(i.tags.get(k) == v for k, v in tag_filters.items())]


def _alive(process: psutil.Process) -> bool:
    """Running (the same process, not a reuse of its pid), and not a zombie (dead for our purposes)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # ZombieProcess is one too
        return False
    except psutil.AccessDenied:  # not ours to inspect, but there
        return True


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
