"""The supervisor: one named Ray actor that keeps a run's fleet at the size its config asks for.

Every tick it forwards preemption notices to instances (their workers leave gracefully), records
instances the cloud took away, launches replacements (with retries and backoff, preferring
cheaper zones with fewer recent preemptions, falling back to on-demand after repeated
preemptions), enforces the budget, records per-epoch progress read from the DHT, and writes
durable checkpoints pulled from the peers.  Its DHT peer is the run's bootstrap node; on resume
it also serves the newest checkpoint as a state donor, so new workers continue from it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray

from dht import DHT, SignatureValidator
from orchestrator.config.schema import ClusterConfig
from orchestrator.fleet.authority import Certifier, run_authority
from orchestrator.fleet.checkpointer import Checkpointer
from orchestrator.fleet.experts import ExpertFleet
from orchestrator.fleet.policy import FleetPolicy
from orchestrator.fleet.registry import make_provider
from orchestrator.fleet.workers import RayWorkers
from orchestrator.instance.actor import announce_host
from orchestrator.instance.notices import instance_watch
from orchestrator.providers.base import Instance, LaunchSpec
from orchestrator.providers.bootstrap import HEAD_INSTANCE_ENV, NODE_IP_SHELL, ray_auth_token, render_boot_script
from orchestrator.runs.durable import BackgroundArchiver, RunArchive
from orchestrator.runs.logs import SUPERVISOR_LOG, log_dir, log_path, log_to_file, stop_logging
from orchestrator.runs.store import RoundRecord, RunStore
from p2p import Identity
from workers.progress import ProgressTracker
from workers.progress_tree import ProgressLayout
from workers.run_keys import run_validators
from workers.state import StateSharer, StateUnavailable

logger = logging.getLogger(__name__)

# the least time the budget must leave for a final checkpoint before its release: the calls that stop
# the trainers and fetch a state take longer than that on a busy head, and would spend past the cap
MIN_FINAL_CHECKPOINT_S = 2.0
ARCHIVE_FLUSH_S = 30.0  # how long stop()/detach() wait for the last upload of the history
PUBLISH_S = 5.0  # the status document goes to the archive this often (real seconds) ...
PUBLISH_HISTORY_S = 30.0  # ... the run store's snapshot this often (and at every checkpoint) ...
PUBLISH_LOGS_S = 300.0  # ... and the logs that changed this often, and at the stop: a log goes up whole


class SimClock:
    """Simulated seconds: wall time scaled, continuing from ``origin`` (so a resumed run's clock
    carries on from where the stored history ends)."""

    def __init__(self, scale: float, origin: float | None = None) -> None:
        self.scale = scale
        self.wall0 = time.time()
        self.origin = origin if origin is not None else self.wall0

    def __call__(self) -> float:
        return self.origin + (time.time() - self.wall0) * self.scale

    def to_real(self, simulated_seconds: float) -> float:
        return simulated_seconds / self.scale


def parse_rounds(instance_id: str, reported: Any) -> list[RoundRecord]:
    """The rounds a trainer's status carried (``TrainingPeer.recent_rounds``), oldest first; one that
    does not parse is logged and skipped, never a reason to lose the others."""
    rounds = []
    for r in reported if isinstance(reported, list) else []:
        try:
            record = RoundRecord(int(r["epoch"]), float(r["compute_s"]), float(r["comm_s"]))
            if not (math.isfinite(record.compute_s) and math.isfinite(record.comm_s)):
                raise ValueError("not a finite number of seconds")
            rounds.append(record)
        except (KeyError, TypeError, ValueError) as e:
            logger.warning("instance %s reported a round that does not parse (%s): %r", instance_id, e, r)
    return sorted(rounds, key=lambda r: r.epoch)


class SupervisorCore:
    """The supervisor's work, runnable in any process; ``Supervisor`` wraps it in a Ray actor.
    Fleet decisions are the ``FleetPolicy``'s; this adds the run's DHT peer, progress records,
    checkpoints and the dashboard."""

    def __init__(self, config: ClusterConfig, run_dir: Path, tick_s: float = 0.2) -> None:
        self.config = config
        self.tick_s = tick_s
        self._log = log_to_file(log_path(run_dir, SUPERVISOR_LOG))  # the run's own log, not Ray's session's
        self.store = RunStore(run_dir)
        self._rounds_stored: dict[str, int] = {}  # instance id -> its newest epoch in ``rounds``
        self._bans_stored: set[tuple[str, str, str]] = set()  # (reporter, banned peer, group): events stored
        last = self.store.last_time()
        scale = config.provider.time_scale if config.provider.type == "local" else 1.0
        self.clock = SimClock(scale, origin=max(last, time.time()) if last else None)
        self.store.clock = self.clock
        archive = RunArchive.for_config(config)  # checkpoint.uri: the run outlives its head machine
        # since: a stop asked for through the archive before this supervisor started is an old one
        self.archiver = BackgroundArchiver(archive, self.store.dir, since=time.time()) if archive else None
        self._published = self._history_published = self._logs_published = float("-inf")  # monotonic
        identity = Identity.from_file(self.store.dir / "head.key")
        self.certifier = self._certifier()
        self.dht = self._start_dht(identity)
        signer = SignatureValidator(identity)
        layout = ProgressLayout(config.cluster_name, capacity=config.max_trainers())
        self.epoch_samples = epoch_samples(config)
        self.tracker = self.dht.run_coroutine(lambda n: _viewing(ProgressTracker(
            n, config.cluster_name, self.epoch_samples, signer, layout=layout, observer=True)))
        self.state = self.dht.run_coroutine(lambda n: _make(StateSharer, n, config.cluster_name, signer,
                                                             lambda: self.checkpoints.serve(), layout=layout))
        self.checkpoints = Checkpointer(config, self.store, self.dht, self.state, self.archiver, self.clock)
        self.policy = FleetPolicy(config, make_provider(config, self.clock, run_dir), self.clock, self.store,
                                  self._worker_control(), self._worker_args, boot_script=self._boot_script,
                                  to_real=self.clock.to_real)
        self._periods: collections.deque[float] = collections.deque(maxlen=50)  # the last ticks' start to start, s
        self.policy.spend_margin_s = self._spend_margin()
        self.policy.log_dir = log_dir(run_dir).resolve()  # each instance's worker logs there
        self.policy.before_release = self._final_checkpoint  # the budget's release waits for it
        self._final_taken = False
        self.experts = ExpertFleet(config, self.store, lambda: self.policy.live, lambda: self.policy.noticed,
                                   self.policy.workers.handle, self.checkpoints.directory, self.clock,
                                   archive=(lambda d: self.archiver.submit(experts=d)) if self.archiver else None) \
            if config.uses_experts() else None
        self.epoch = self.store.latest_epoch()
        self._first_seen: dict[str, int] = {}  # instance id -> the epoch its peer first reported
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        loaded = self.checkpoints.load()
        if loaded is not None:
            self.epoch = max(self.epoch, loaded)
        self.dashboard: Any = None
        adopted = self.policy.adopt(lost_at=last, head_changed=self._head_changed())
        if adopted:
            logger.info("adopted %d live instances of this run: %s", len(adopted), ", ".join(adopted))
            self._rejoin([self.policy.live[i] for i in adopted])
        # the clock goes into the store so that readers in other processes can tell the run's "now"
        self.store.event("supervisor_start", detail={"resumed_epoch": self.epoch, "adopted": adopted,
                                                     "ray_node": _ray_node(), "gcs_address": _gcs_address(),
                                                     "clock": {
            "scale": self.clock.scale, "wall0": self.clock.wall0, "origin": self.clock.origin}})

    def _certifier(self) -> Certifier | None:
        """The run's authority (kept in the run directory, so a resumed run keeps it), or None when
        membership is off and anyone who can reach a peer takes part."""
        settings = self.config.membership
        if not settings.enabled:
            return None
        return Certifier(run_authority(self.store.dir, self.config.cluster_name), settings.ttl_s)

    def _worker_control(self) -> RayWorkers:
        """Cloud machines watch their own metadata for notices; the local simulator tells its workers."""
        return RayWorkers(watch=instance_watch(self.config.provider.type, self.config.spot.notice_period_s),
                          certifier=self.certifier, gpus=self.config.worker_gpus(), clock=self.dht.clock.now)

    def _head_changed(self) -> bool:
        """Whether the run's previous supervisor ran on another Ray cluster (the old head is gone, and
        machines that joined it will never run a worker for this one)."""
        starts = self.store.events("supervisor_start")
        previous = json.loads(starts[-1][3] or "{}").get("gcs_address") if starts else None
        return previous is not None and previous != _gcs_address()

    def _start_dht(self, identity: Identity) -> DHT:
        """The run's bootstrap peer, on the port it had before when it can: a restarted supervisor
        stays where the workers it adopts look for it."""
        listen = self.config.listen_host()
        port_file = self.store.dir / "head.port"
        port = int(port_file.read_text()) if port_file.exists() else 0
        membership = self.certifier.membership("supervisor", identity.peer_id, ("supervisor",)) \
            if self.certifier else None
        options = dict(identity=identity, host=listen,
                       validators=run_validators(self.config.cluster_name, identity, self.config.training.byzantine),
                       announce_host=announce_host(listen, self.config.network.announce_host),
                       p2p_options={"membership": membership})
        try:
            dht = DHT([], port=port, **options)
        except OSError as e:
            logger.warning("the run's DHT port %d is taken (%s); the workers find the new one through the DHT", port, e)
            dht = DHT([], **options)
        port_file.write_text(str(dht.node.p2p.address.port))
        return dht

    def _rejoin(self, instances: list[Instance]) -> None:
        """Meet the adopted workers in the DHT (a new bootstrap peer starts knowing nobody)."""
        # a worker that does not answer at once (paused, busy) is met through the others' routing tables
        addresses = [r["address"] for i in instances
                     if (r := self.policy.workers.running(i, timeout=5.0)) and r.get("address")]
        if not addresses:
            return
        try:
            self.dht.run_coroutine(lambda n: n.bootstrap(addresses))
        except Exception as e:  # they will find us through their routing tables anyway
            logger.warning("could not reach the adopted workers' DHT peers: %s", e)

    @property
    def address(self) -> str:
        return self.dht.addresses[0]

    @property
    def live(self) -> dict[str, Instance]:
        return self.policy.live

    @property
    def budget_exhausted(self) -> bool:
        return self.policy.budget_exhausted

    def _worker_args(self, node_type: str) -> dict[str, Any]:
        """What the worker of a ``node_type`` instance starts with: a trainer's or an expert server's settings."""
        net = self.config.network
        if self.config.role(node_type) == "experts":
            return {"role": "experts", **self.config.expert_host_config([self.address], node_type=node_type,
                                                                         host=self.config.listen_host(),
                                                                         announce_host=net.announce_host)}
        return self.config.worker_config([self.address], node_type=node_type, host=self.config.listen_host(),
                                         announce_host=net.announce_host).model_dump()

    def _boot_script(self, spec: LaunchSpec) -> str | None:
        """Machines that join the run's Ray cluster get a boot script; simulated actors do not."""
        if self.config.provider.type == "local" and self.config.provider.mode == "actors":
            return None
        token = ray_auth_token()
        local = self.config.provider.type == "local"
        if token and local:
            token = "$RAY_AUTH_TOKEN"  # the simulator hands the secret over in the environment, not in a file
        return render_boot_script(self.config, spec.node_type, _gcs_address(), spec.instance_id, auth_token=token,
                                  # a cloud image has spotswarm's ray on its PATH; here it is ours
                                  ray_command=str(Path(sys.executable).with_name("ray")) if local else "ray",
                                  node_ip=NODE_IP_SHELL if self.config.provider.namespaces else None)

    # ---- lifetime ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="supervisor", daemon=True)
        self._thread.start()

    def _spend_margin(self) -> float:
        """Spending held in reserve before the budget's total (simulated seconds at the fleet's rate): until
        the next tick can release the fleet, three ticks apart, or twice the longest of the last ticks'
        periods, whichever is longer: a busy head's ticks come late, and the instances spend meanwhile."""
        longest = max(self._periods, default=0.0)
        return max(3 * self.tick_s, 2 * longest) * self.clock.scale

    def _loop(self) -> None:
        last: float | None = None
        while not self._stop.is_set():
            began = time.monotonic()
            if last is not None:
                self._periods.append(began - last)
                self.policy.spend_margin_s = self._spend_margin()
            last = began
            try:
                self.tick()
            except Exception:
                logger.exception("supervisor tick failed; carrying on")
            self._stop.wait(self.tick_s)

    def serve_dashboard(self) -> str | None:
        """Serve the run's dashboard (``config.dashboard``) while the run is up; returns its URL.
        A dashboard that cannot start (port taken, extra not installed) never stops the run."""
        settings = self.config.dashboard
        try:
            from orchestrator.ui.dashboard import DashboardServer

            self.dashboard = DashboardServer(self.store.dir, settings.host, settings.port, clock=self.clock, live=True)
            url = self.dashboard.start()
        except Exception as e:  # ImportError without the dashboard extra, OSError for a taken port
            logger.warning("dashboard not served: %s", e)
            self.dashboard = None
            return None
        logger.info("dashboard: %s", url)
        self.store.event("dashboard", detail={"url": url})
        return url

    def _halt(self) -> None:
        self._stop.set()
        if self.dashboard is not None:
            try:
                self.dashboard.stop()
            except Exception:  # never in the way of releasing the instances
                logger.exception("stopping the dashboard failed")
        if self._thread is not None:
            self._thread.join(timeout=60)

    def stop(self) -> None:
        """Release every instance (gracefully), keep the run's data."""
        self._close(release=True)

    def detach(self) -> None:
        """Stop supervising but leave the fleet running, for the next supervisor to adopt."""
        self._close(release=False)

    def _close(self, release: bool) -> None:
        if release:
            self.store.event("stopping")  # where a stop's time starts (the final checkpoint is part of it)
            if self.archiver is not None:  # who asked through the archive sees the stop begin
                self.archiver.submit(history=False, status=self._status_doc("stopping"))
        self._halt()
        self.checkpoints.close()
        if release:
            self._final_checkpoint()  # before any instance is released: the peers hold the newest state
            if self.experts is not None:
                self.experts.final_checkpoint()
            self.policy.release_all()
        self.policy.shutdown()
        self.store.event("supervisor_stop" if release else "supervisor_detach")
        self._flush_archive("stopped" if release else "detached")
        self.dht.shutdown()
        self.store.close()
        stop_logging(self._log)

    def _flush_archive(self, state: str) -> None:
        """The history's last upload, waited for (bounded): what the next head restores from."""
        if self.archiver is None:
            return
        self.archiver.submit(logs=self.policy.log_dir, history=False)
        if self.archiver.flush(ARCHIVE_FLUSH_S, status=self._status_doc(state)):
            logger.info("run archived to %s", self.archiver.archive.uri)
        self.archiver.close()

    # ---- one tick ------------------------------------------------------------------------------
    def tick(self) -> None:
        """The policy's tick, then experts, certificates, progress and checkpoints; what they all
        record is committed once, at the end (``RunStore.batch``)."""
        with self.store.batch():
            now = self.clock()
            self.policy.tick()
            if self.experts is not None:
                self.experts.tick()
            self._renew_certificates()
            self._record_progress()
            self._record_costs()
            self.checkpoints.maybe(now, start=not self._stop.is_set())
            self.checkpoints.refresh_advert()
            self._publish()

    def _publish(self) -> None:
        """The status document to the archive every ``PUBLISH_S``, the store's snapshot every
        ``PUBLISH_HISTORY_S``, the logs every ``PUBLISH_LOGS_S``: what ``status``, ``dashboard``, ``logs``
        and ``down`` read on another machine (on the archiver's thread: the tick never waits on the store)."""
        at = time.monotonic()
        if self.archiver is None or at - self._published < PUBLISH_S:
            return
        self._published = at
        history = at - self._history_published >= PUBLISH_HISTORY_S
        if history:
            self._history_published = at
        logs = at - self._logs_published >= PUBLISH_LOGS_S
        if logs:
            self._logs_published = at
        self.archiver.submit(history=history, status=self._status_doc("running"),
                             logs=self.policy.log_dir if logs else None)

    def _status_doc(self, state: str) -> bytes:
        policy = self.policy
        return json.dumps({"cluster": self.config.cluster_name, "state": state, "published_at": time.time(),
                           "epoch": self.epoch, "live": len(policy.live), "status": policy.status_text,
                           # of those, the ones that made their first averaged step (the others still join)
                           "training": sum(1 for i in list(policy.live) if self._first_seen.get(i) == -1),
                           "head": socket.gethostname(), "address": self.address,
                           # the head machine `spotswarm up` launched, if it did: a laptop tells a lost head by it
                           "head_instance": os.environ.get(HEAD_INSTANCE_ENV)}).encode()

    def _renew_certificates(self) -> None:
        """Members' certificates with half their lifetime left get fresh ones (never waits on a worker)."""
        if self.certifier is None:
            return
        for holder in self.certifier.holders():
            if holder != "supervisor" and holder not in self.policy.live:
                self.certifier.forget(holder)
        for holder, cert in self.certifier.renew_due():
            if holder == "supervisor":
                self.dht.renew_certificate(cert)
            else:
                self.policy.workers.renew(holder, cert.to_token())

    # ---- progress and checkpoints --------------------------------------------------------------
    def _record_progress(self) -> None:
        peers = self.tracker.records()  # the background view: the tick makes no DHT call
        if not peers:
            return
        self._record_first_steps(peers)
        epoch = max(p.epoch for p in peers.values())
        if epoch <= self.epoch:
            return
        current = [p for p in peers.values() if p.epoch == epoch]
        losses = [p.loss for p in peers.values() if p.loss is not None]
        fresh = sum(self.tracker.now() - p.time <= self.tracker.fresh_for for p in peers.values())  # not the dead's
        self.epoch = epoch
        self.store.progress(epoch, sum(losses) / len(losses) if losses else None,
                            sum(p.samples_per_second for p in current), max(fresh, 1),
                            epoch * self.epoch_samples)

    def _record_costs(self) -> None:
        """The trainers' totals their status answers brought (bytes per sample, time averaging), and
        the rounds they completed (each round's compute and communication seconds)."""
        take = getattr(self.policy.workers, "take_costs", None)
        for instance_id, c in (take() if take is not None else {}).items():
            try:
                self.store.peer_costs(instance_id, int(c["samples_total"]), int(c["bytes_sent"]), float(c["comm_s"]),
                                      float(c["busy_s"]))
            except (KeyError, TypeError, ValueError) as e:
                logger.warning("instance %s reported costs that do not parse (%s): %r", instance_id, e, c)
            self._record_rounds(instance_id, c.get("rounds") if isinstance(c, dict) else None)
            self._record_bans(instance_id, c.get("bans") if isinstance(c, dict) else None)

    def _record_bans(self, instance_id: str, reported: Any) -> None:
        """A trainer's audit caught a member (``byzantine: verify``): one ``member_banned`` event per ban,
        naming the member's instance where the fleet knows its peer id, and the evidence."""
        if not isinstance(reported, list):
            return
        by_peer = {i.tags["peer_id"]: i.id for i in list(self.policy.live.values()) if i.tags.get("peer_id")}
        for ban in reported[:64]:
            if not isinstance(ban, dict) or not isinstance(ban.get("peer"), str):
                continue
            key = (instance_id, ban["peer"], str(ban.get("group")))
            if key in self._bans_stored:
                continue
            self._bans_stored.add(key)
            self.store.event("member_banned", by_peer.get(ban["peer"]), {
                "peer": ban["peer"][:80], "by": instance_id, "evidence": str(ban.get("evidence", ""))[:500]})

    def _record_rounds(self, instance_id: str, reported: Any) -> None:
        """Store the rounds newer than those stored already: answers to status calls in flight at once
        may repeat some, and a resumed supervisor hears again of those its predecessor stored."""
        newest = self._rounds_stored.get(instance_id, -1)
        fresh = [r for r in parse_rounds(instance_id, reported) if r.epoch > newest]
        if fresh:
            self.store.rounds(instance_id, fresh)
            self._rounds_stored[instance_id] = max(r.epoch for r in fresh)

    def _record_first_steps(self, peers: dict) -> None:
        """An instance's first averaged step: its peer's epoch moves past the one it started at
        (how long a replacement takes to contribute, from the kill it replaced)."""
        by_peer = {i.tags["peer_id"]: i.id for i in list(self.policy.live.values()) if i.tags.get("peer_id")}
        lengths = sorted({len(p) for p in by_peer})  # peer ids have one length: a lookup per record, not a scan
        for subkey, record in peers.items():  # a subkey is the owner's signature marker + its peer id
            instance_id = next((by_peer[subkey[-n:]] for n in lengths if subkey[-n:] in by_peer), None)
            if instance_id is None or self._first_seen.get(instance_id) == -1:
                continue
            first = self._first_seen.setdefault(instance_id, record.epoch)
            if record.epoch > first:
                self._first_seen[instance_id] = -1
                self.store.event("first_step", instance_id, {"epoch": record.epoch})

    # ---- the final checkpoint of a clean stop --------------------------------------------------
    def _final_checkpoint(self, within_s: float | None = None) -> None:
        """The newest state at the stop, checkpointed before any instance is released: the trainers
        finish their rounds and stop stepping (staying up as state donors), and the state of one at
        the newest epoch is written like any checkpoint, so ``resume`` continues from exactly where
        the run stopped.  Bounded by ``checkpoint.final_timeout_s`` (and ``within_s``, what the budget
        leaves); when no peer answers in time the stop goes on, and the store records how many epochs
        older the last checkpoint is (``final_checkpoint_missed``).  Once per supervisor."""
        if self._final_taken:
            return
        self._final_taken = True
        started = time.monotonic()
        if within_s is not None and within_s < MIN_FINAL_CHECKPOINT_S:
            # the calls to the workers alone take longer on a busy head: trying would overrun the budget
            self._final_missed(f"the budget leaves {within_s:.2f} s", self.epoch, self.checkpoints.epoch, started)
            return
        timeout = self.config.checkpoint.final_timeout_s if within_s is None else \
            max(min(within_s, self.config.checkpoint.final_timeout_s), 0.0)
        deadline = started + timeout
        trainers = [i for i in list(self.policy.live.values()) if self.config.role(i.node_type) != "experts"]
        # three quarters for the rounds in flight to finish, the rest for the download
        records = self.policy.workers.stop_stepping(trainers, 0.75 * timeout) if trainers else {}
        self._record_progress()  # what the view holds now; the peers' own answers follow
        have = self.checkpoints.epoch
        stopped_at = max([r["epoch"] for r in records.values()] + [self.epoch])
        try:
            if not records:
                if stopped_at <= (have or 0):  # nothing newer than the last checkpoint (or nothing trained)
                    self.store.event("final_checkpoint", detail={"epoch": have, "written": False, "peers": {},
                                                                 "seconds": round(time.monotonic() - started, 3)})
                    return
                raise StateUnavailable("no live trainer answered")
            newest = max(r["epoch"] for r in records.values())
            donors = [r["address"] for r in records.values() if r["epoch"] == newest and r.get("address")]
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no time left of {timeout:g} s")
            epoch, state = self.dht.run_coroutine(
                lambda n: asyncio.wait_for(self.state.download_from(donors, min_epoch=newest), left))
            path = self.checkpoints.save(epoch, state)
        except Exception as e:  # noqa: BLE001 - no peer in time, a full disk: the stop goes on regardless
            self._final_missed(str(e) or type(e).__name__, stopped_at, have, started)
            self._record_stop_epoch(stopped_at, records)
            return
        self.checkpoints.keep(epoch, state, path, final=True)
        self._record_stop_epoch(epoch, records)
        seconds = time.monotonic() - started
        logger.info("final checkpoint of epoch %d written in %.2f s: %s", epoch, seconds, path)
        self.store.event("final_checkpoint", detail={
            "epoch": epoch, "path": str(path), "written": True, "seconds": round(seconds, 3),
            "peers": {i: {"epoch": r["epoch"], "params": r["params"], "settled": r["settled"]}
                      for i, r in records.items()}})

    def _final_missed(self, why: str, stopped_at: int, have: int | None, started: float) -> None:
        logger.warning("final checkpoint missed (%s); the last checkpoint is of epoch %s, the run stopped at "
                       "epoch %d", why, have, stopped_at)
        self.store.event("final_checkpoint_missed", detail={
            "epoch": stopped_at, "checkpoint_epoch": have, "epochs_behind": stopped_at - (have or 0),
            "reason": why[:500], "seconds": round(time.monotonic() - started, 3)})

    def _record_stop_epoch(self, epoch: int, records: dict[str, dict]) -> None:
        """The peers' last step, which the view may not hold yet: the run's epoch at the stop is this one,
        whether or not the final checkpoint was written."""
        if epoch <= self.epoch or not records:
            return
        losses = [r["loss"] for r in records.values() if r.get("loss") is not None]
        last = self.store.last_row("progress")
        self.epoch = epoch
        self.store.progress(epoch, sum(losses) / len(losses) if losses else None, last[3] if last else 0.0,
                            len(records), epoch * self.epoch_samples)

    # ---- reporting -----------------------------------------------------------------------------
    def status(self) -> dict:
        """What the fleet is doing; the run's figures are ``runs/figures.py``'s, read from the store."""
        policy = self.policy
        return {
            "cluster": self.config.cluster_name, "status": policy.status_text, "time": self.clock(),
            "live": len(policy.live), "pending": len(policy.pending) + policy.launching, "epoch": self.epoch,
            "warm_spares": policy.idle_spares(),
            "address": self.address, "budget_exhausted": policy.budget_exhausted, "fatal": policy.fatal,
            "fleet_events": policy.fleet_log[-50:], "fleet_events_total": len(policy.fleet_log),
            "experts": self.experts.summary() if self.experts is not None else None,
            "phase": "checkpoint write" if self.checkpoints.writing() else "idle",
            "pending_writes": self.store.pending_writes,
            "stop_requested": self.archiver.stop_request if self.archiver is not None else None,
        }


def _gcs_address() -> str:
    return ray.get_runtime_context().gcs_address


def _ray_node() -> dict:
    """Which Ray node the supervisor runs on (it belongs on the head)."""
    node_id = ray.get_runtime_context().get_node_id()
    info = next((n for n in ray.nodes() if n["NodeID"] == node_id), {})
    return {"id": node_id, "ip": info.get("NodeManagerAddress"),
            "head": "node:__internal_head__" in info.get("Resources", {})}


async def _make(cls: Any, *args: Any, **kwargs: Any) -> Any:
    return cls(*args, **kwargs)


def epoch_samples(config: ClusterConfig) -> int:
    """The samples a global epoch stands for: the global batch, or a DiLoCo round's (what each
    trainer sizes it to: inner steps x the task's batch x the trainers the run keeps up)."""
    t = config.training
    if t.averaging != "diloco":
        return t.target_batch_size
    from workers.diloco import round_samples
    from workers.task import load_task  # the task's batch; its factory builds no model

    return round_samples(t.inner_steps, load_task(t.task, **config.task_options()).batch_size, config.min_trainers())


async def _viewing(tracker: ProgressTracker) -> ProgressTracker:
    await tracker.start_view()
    return tracker



@ray.remote(num_cpus=0, max_restarts=0)
class Supervisor:
    def __init__(self, config: dict, run_dir: str) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.core = SupervisorCore(ClusterConfig.model_validate(config), Path(run_dir))
        self.dashboard_url = self.core.serve_dashboard() if self.core.config.dashboard.enabled else None
        self.core.start()

    def status(self) -> dict:
        return self.core.status()

    def address(self) -> str:
        return self.core.address

    def dashboard(self) -> str | None:
        return self.dashboard_url

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self.core.stop()
