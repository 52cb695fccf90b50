"""The supervisor: one named Ray actor that keeps a run's fleet at the size its config asks for.

Every tick it forwards preemption notices to instances (their workers leave gracefully), records
instances the cloud took away, launches replacements (with retries and backoff, preferring
cheaper zones with fewer recent preemptions, falling back to on-demand after repeated
preemptions), enforces the budget, records per-epoch progress read from the DHT, and writes
durable checkpoints pulled from the peers.  Its DHT peer is the run's bootstrap node; on resume
it also serves the newest checkpoint as a state donor, so new workers continue from it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import tenacity
import torch

from dht import DHT, SignatureValidator
from p2p import Identity
from workers.progress import ProgressTracker
from workers.state import StateSharer, StateUnavailable

from .config import ClusterConfig
from .providers import Instance, make_provider
from .run_store import InstanceRecord, RunStore, summarize_costs

logger = logging.getLogger(__name__)


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


@dataclass
class _Pending:
    node_type: str
    zone: str
    market: str
    ready_at: float


class SupervisorCore:
    """The logic, runnable in any process; ``Supervisor`` wraps it in a Ray actor."""

    def __init__(self, config: ClusterConfig, run_dir: Path, tick_s: float = 0.2) -> None:
        self.config = config
        self.tick_s = tick_s
        self.store = RunStore(run_dir)
        last = self.store.last_time()
        if last is not None and self.store.close_lost_instances(last):
            logger.warning("instances of the previous supervisor were lost with it; their cost ends at %.0f", last)
        scale = config.provider.time_scale if config.provider.type == "local" else 1.0
        self.clock = SimClock(scale, origin=max(last, time.time()) if last else None)
        self.store.clock = self.clock
        self.provider = make_provider(config, self.clock)
        identity = Identity.from_file(self.store.dir / "head.key")
        self.dht = DHT([], identity=identity, validators=[SignatureValidator(identity)])
        signer = SignatureValidator(identity)
        self.tracker = self.dht.run_coroutine(lambda n: _make(ProgressTracker, n, config.cluster_name,
                                                               config.training.target_batch_size, signer))
        self.checkpoint_state: tuple[int, Any] | None = None
        self.state = self.dht.run_coroutine(lambda n: _make(StateSharer, n, config.cluster_name, signer,
                                                             self._serve_checkpoint))
        self.pending: list[_Pending] = []
        self.live: dict[str, Instance] = {}
        self.noticed: set[str] = set()
        self.left: set[str] = set()
        self.preemptions: deque[tuple[float, str]] = deque()
        self.epoch = self.store.latest_epoch()
        self.status_text = "starting"
        self.budget_exhausted = False
        self._last_checkpoint = self.clock()
        self._last_advert = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._load_checkpoint()
        self.dashboard: Any = None
        # the clock goes into the store so that readers in other processes can tell the run's "now"
        self.store.event("supervisor_start", detail={"resumed_epoch": self.epoch, "clock": {
            "scale": self.clock.scale, "wall0": self.clock.wall0, "origin": self.clock.origin}})

    @property
    def address(self) -> str:
        return self.dht.addresses[0]

    # ---- lifetime ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="supervisor", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
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
            from .dashboard import DashboardServer

            self.dashboard = DashboardServer(self.store.dir, settings.host, settings.port, clock=self.clock, live=True)
            url = self.dashboard.start()
        except Exception as e:  # ImportError without the dashboard extra, OSError for a taken port
            logger.warning("dashboard not served: %s", e)
            self.dashboard = None
            return None
        logger.info("dashboard: %s", url)
        self.store.event("dashboard", detail={"url": url})
        return url

    def stop(self) -> None:
        """Release every instance (gracefully), keep the run's data."""
        self._stop.set()
        if self.dashboard is not None:
            try:
                self.dashboard.stop()
            except Exception:  # never in the way of releasing the instances
                logger.exception("stopping the dashboard failed")
        if self._thread is not None:
            self._thread.join(timeout=60)
        for inst in list(self.live.values()):
            self.provider.terminate(inst)
            self._ended(inst.id, "released")
        self.store.event("supervisor_stop")
        self.dht.shutdown()
        self.store.close()

    # ---- one tick ------------------------------------------------------------------------------
    def tick(self) -> None:
        now = self.clock()
        self._forward_notices(now)
        self._record_leaves()
        for instance_id in self.provider.poll_terminated(now):
            self._ended(instance_id, "preempted" if instance_id in self.noticed else "died")
        self._record_progress()
        self._maybe_checkpoint(now)
        self._enforce_budget(now)
        if not self.budget_exhausted:
            self._reconcile(now)
            self._launch_due(now)
        self._refresh_advert(now)

    def _forward_notices(self, now: float) -> None:
        for notice in self.provider.poll_notices(now):
            inst = self.live.get(notice.instance_id)
            if inst is None:
                continue
            self.noticed.add(inst.id)
            self.store.update_instance(inst.id, notice_at=notice.notice_at)
            self.store.event("notice", inst.id, {"terminate_at": notice.terminate_at})
            deadline = max(self.clock.to_real(notice.terminate_at - now) * 0.8, 0.5)
            self.provider.notify(inst, deadline)

    def _record_leaves(self) -> None:
        waiting = [i for i in self.noticed if i in self.live and i not in self.left]
        poll = getattr(self.provider, "poll_left", None)
        if not waiting or poll is None:
            return
        for instance_id in poll(waiting):
            self.left.add(instance_id)
            self.store.event("left", instance_id)  # the worker left gracefully before the kill

    def _ended(self, instance_id: str, reason: str) -> None:
        inst = self.live.pop(instance_id, None)
        if inst is None:
            return
        now = self.clock()
        self.store.update_instance(instance_id, ended_at=now, end_reason=reason)
        self.store.event(reason, instance_id)
        if reason == "preempted":
            self.preemptions.append((now, inst.zone))

    # ---- fleet ---------------------------------------------------------------------------------
    def _reconcile(self, now: float) -> None:
        for name, node_type in self.config.available_node_types.items():
            have = sum(1 for i in self.live.values() if i.node_type == name and i.id not in self.noticed)
            have += sum(1 for p in self.pending if p.node_type == name)
            while have < node_type.max_workers:
                zone, market = self._choose_zone(name, now)
                price = self.provider.price(name, zone, market)
                if not self._affordable(price, now):
                    if have < node_type.min_workers:
                        self.status_text = f"budget: cannot launch {name} (min_workers {node_type.min_workers})"
                    break
                delay = getattr(self.provider, "provisioning_delay", 0.0)
                self.pending.append(_Pending(name, zone, market, now + delay))
                self.store.event("launch_requested", detail={"node_type": name, "zone": zone, "market": market})
                have += 1

    def _choose_zone(self, node_type: str, now: float) -> tuple[str, str]:
        spot = self.config.spot
        window = [z for t, z in self.preemptions if now - t <= spot.fallback_window_s]
        market = "spot" if spot.market == "spot" and self.config.available_node_types[node_type].spot else "on-demand"
        if market == "spot" and spot.fallback_to_on_demand_after and len(window) >= spot.fallback_to_on_demand_after:
            market = "on-demand"
        if market == "spot" and spot.max_price_per_hour is not None:
            affordable = [z for z in self.config.provider.zones
                          if self.provider.price(node_type, z, "spot") <= spot.max_price_per_hour]
            if not affordable:
                market = "on-demand"

        def score(zone: str) -> float:  # cheaper, and fewer recent preemptions, is better
            return self.provider.price(node_type, zone, market) * (1 + 0.5 * window.count(zone))

        return min(self.config.provider.zones, key=score), market

    def _affordable(self, price: float, now: float) -> bool:
        budget = self.config.budget
        rate = sum(i.price_per_hour for i in self.live.values()) + sum(
            self.provider.price(p.node_type, p.zone, p.market) for p in self.pending)
        if budget.max_dollars_per_hour is not None and rate + price > budget.max_dollars_per_hour + 1e-9:
            return False
        if budget.max_total_dollars is not None:
            spent = summarize_costs(self.store, now).dollars
            horizon_h = max(self.config.checkpoint.every_s, 60.0) / 3600  # room to notice and stop in time
            if spent + (rate + price) * horizon_h > budget.max_total_dollars:
                return False
        return True

    def _enforce_budget(self, now: float) -> None:
        total = self.config.budget.max_total_dollars
        if total is None or self.budget_exhausted:
            return
        rate = sum(i.price_per_hour for i in self.live.values())
        spent = summarize_costs(self.store, now).dollars
        # stop while there is still room for the instances' next tick of spending
        margin = rate * self.clock.scale * self.tick_s * 3 / 3600
        if spent + margin >= total:
            self.budget_exhausted = True
            self.status_text = f"budget exhausted: ${spent:.4f} of ${total:.2f}; instances released"
            self.store.event("budget_exhausted", detail={"spent": spent, "max_total_dollars": total})
            self.pending.clear()
            for inst in list(self.live.values()):
                self.provider.terminate(inst)
                self._ended(inst.id, "budget")

    @tenacity.retry(stop=tenacity.stop_after_attempt(3), wait=tenacity.wait_exponential(multiplier=0.5, max=5),
                    reraise=True)
    def _launch_with_retries(self, p: _Pending) -> Instance:
        args = self.config.worker_config([self.address]).model_dump()
        return self.provider.launch(p.node_type, p.zone, p.market, args)

    def _launch_due(self, now: float) -> None:
        due = [p for p in self.pending if p.ready_at <= now]
        for p in due:
            self.pending.remove(p)
            try:
                inst = self._launch_with_retries(p)
            except Exception as e:
                self.store.event("launch_failed", detail={"node_type": p.node_type, "zone": p.zone, "error": str(e)})
                logger.warning("launching %s in %s failed: %s", p.node_type, p.zone, e)
                continue
            self.live[inst.id] = inst
            od = self.config.available_node_types[p.node_type].on_demand_price_per_hour
            self.store.launched(InstanceRecord(inst.id, inst.node_type, inst.zone, inst.market, inst.price_per_hour,
                                               od, inst.launched_at, peer_id=inst.tags.get("peer_id")))
            self.status_text = "running"

    # ---- progress and checkpoints --------------------------------------------------------------
    def _record_progress(self) -> None:
        peers = self.dht.run_coroutine(lambda n: self.tracker.peers())
        if not peers:
            return
        epoch = max(p.epoch for p in peers.values())
        if epoch <= self.epoch:
            return
        current = [p for p in peers.values() if p.epoch == epoch]
        losses = [p.loss for p in peers.values() if p.loss is not None]
        self.epoch = epoch
        self.store.progress(epoch, sum(losses) / len(losses) if losses else None,
                            sum(p.samples_per_second for p in current), len(peers),
                            epoch * self.config.training.target_batch_size)

    def _maybe_checkpoint(self, now: float) -> None:
        if now - self._last_checkpoint < self.config.checkpoint.every_s:
            return
        self._last_checkpoint = now
        have = self.checkpoint_state[0] if self.checkpoint_state else -1
        try:
            epoch, state = self.dht.run_coroutine(lambda n: self.state.download(min_epoch=have + 1))
        except StateUnavailable as e:
            logger.info("no newer state to checkpoint: %s", e)
            return
        directory = Path(self.config.checkpoint.directory or self.store.dir / "checkpoints")
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"epoch-{epoch:06d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save({"epoch": epoch, "state": state}, tmp)
        tmp.replace(path)  # atomic: a crash never leaves a half-written checkpoint behind
        self.checkpoint_state = (epoch, state)
        self.store.checkpoint(epoch, path)
        self.store.event("checkpoint", detail={"epoch": epoch, "path": str(path)})
        for old in sorted(directory.glob("epoch-*.pt"))[: -self.config.checkpoint.keep]:
            old.unlink(missing_ok=True)

    def _load_checkpoint(self) -> None:
        latest = self.store.latest_checkpoint()
        if latest is None:
            return
        epoch, path = latest
        data = torch.load(path, weights_only=False)
        self.checkpoint_state = (int(data["epoch"]), data["state"])
        self.epoch = max(self.epoch, epoch)
        logger.info("serving checkpoint of epoch %d from %s", epoch, path)

    def _serve_checkpoint(self) -> tuple[int, Any]:
        if self.checkpoint_state is None:
            raise StateUnavailable("no checkpoint yet")
        return self.checkpoint_state

    def _refresh_advert(self, now: float) -> None:
        if self.checkpoint_state is None or time.monotonic() - self._last_advert < 20:
            return
        self._last_advert = time.monotonic()
        epoch = self.checkpoint_state[0]
        self.dht.run_coroutine(lambda n: self.state.advertise(epoch))

    # ---- reporting -----------------------------------------------------------------------------
    def status(self) -> dict:
        now = self.clock()
        costs = summarize_costs(self.store, now)
        rows = self.store.progress_rows()
        return {
            "cluster": self.config.cluster_name, "status": self.status_text, "time": now,
            "live": len(self.live), "pending": len(self.pending), "epoch": self.epoch,
            "loss": rows[-1][2] if rows else None, "samples_per_second": rows[-1][3] if rows else None,
            "peers": rows[-1][4] if rows else 0, "dollars": costs.dollars, "on_demand_dollars": costs.on_demand_dollars,
            "preemptions": costs.preemptions, "samples": costs.samples, "address": self.address,
            "budget_exhausted": self.budget_exhausted,
        }


async def _make(cls: Any, *args: Any) -> Any:
    return cls(*args)


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

    def stop(self) -> None:
        self.core.stop()
