"""The fleet policy: what the supervisor decides each tick, apart from how it is carried out.

A plain object over a provider, a clock, a run store and a worker control, with no Ray in it, so
every decision (zone, market, budget, min/max workers, adoption after a restart) is tested in
seconds with a fake provider and a fake clock.  Its tick never waits on a cloud: launches,
releases, worker placements and provider polls run on thread pools, and each tick only starts
calls and collects the ones that finished.  The run store is written from the tick alone.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.config.schema import ClusterConfig
from orchestrator.config.tags import INSTANCE_TAG, NODE_TYPE_TAG, RUN_TAG
from orchestrator.fleet.backoff import LaunchBackoff
from orchestrator.fleet.budget import Budget
from orchestrator.fleet.calls import Call, Calls
from orchestrator.fleet.worker_control import HostsWorkers, WorkerControl
from orchestrator.fleet.zones import Choice, PendingLaunch, ZoneChoice
from orchestrator.providers.base import (
    CapacityError,
    Instance,
    LaunchSpec,
    NodeProvider,
    PreemptionNotice,
    ProviderAuthError,
)
from orchestrator.runs.store import InstanceRecord, RunStore

logger = logging.getLogger(__name__)


class FleetPolicy:
    """Keeps a run's fleet at the size its config asks for, within its budget."""

    def __init__(self, config: ClusterConfig, provider: NodeProvider, clock: Callable[[], float], store: RunStore,
                 workers: WorkerControl, worker_args: Callable[[str], dict[str, Any]],
                 boot_script: Callable[[LaunchSpec], str | None] = lambda spec: None,
                 to_real: Callable[[float], float] = lambda s: s, max_calls: int = 16) -> None:
        self.config = config
        self.provider = provider
        self.clock = clock
        self.store = store
        self.workers = workers
        self.worker_args = worker_args  # node type -> what its worker starts with (a trainer or an expert server)
        self.boot_script = boot_script
        self.to_real = to_real  # simulated seconds -> the workers' real seconds
        self.pending: list[PendingLaunch] = []
        self.live: dict[str, Instance] = {}
        self.noticed: set[str] = set()
        self.left: set[str] = set()
        self.spares: set[str] = set()  # warm spares (launched or launching): booted and joined, not training
        # machines that saw a rebalance recommendation (policy.on_rebalance), and when: with "replace", each
        # is left out of its type's count (its replacement launches) until it is released or noticed
        self.at_risk: dict[str, float] = {}
        self.zone_choice = ZoneChoice(config, provider)
        self.preemptions = self.zone_choice.preemptions  # (when, region, zone), read by the policy's tests too
        self.budget = Budget(config, store)
        self.budget_exhausted = False
        self.fatal: str | None = None  # a problem only a person can fix (credentials): the run stops
        self.status_text = "starting"
        self.fleet_log: list[str] = []  # one line per instance lost, for the operator's console
        self.backoff = LaunchBackoff()
        self._held_notices: list[PreemptionNotice] = []  # for instances whose launch is not collected yet
        self.calls = Calls(max_calls)
        self._next_index = self._first_free_index()
        self.log_dir: Path | None = None  # where each instance's worker logs (``<instance id>.log``); None: nowhere
        # called before the budget's release (the final checkpoint) with the real seconds it may take: half
        # of what the budget has left at the fleet's rate
        self.before_release: Callable[[float], None] | None = None
        # a provider that starts each worker itself gets its arguments, fixed when the launch is asked
        self.hosts_workers = isinstance(provider, HostsWorkers)
        self._hosted_args: dict[str, dict[str, Any]] = {}
        if self.hosts_workers:
            provider.host_workers(self._hosted_args.pop, self._certify_hook())

    # ---- restart: adopt what the previous supervisor left running --------------------------------
    def adopt(self, lost_at: float | None = None, timeout: float = 120.0, head_changed: bool = False) -> list[str]:
        """Take over the run's live instances (found by tag) instead of launching duplicates;
        close in the store what no longer exists (its cost ends at ``lost_at``, the last moment the
        store heard from the run), and release instances the store never knew.  ``head_changed``:
        the run's Ray head is a new one, so machines that joined the old head can never run a
        worker for this supervisor; they are released too."""
        listed = self.calls.call(self.provider.list, {RUN_TAG: self.config.cluster_name}, timeout=timeout)
        with self.store.batch():  # a fleet of a thousand: one commit
            return self._adopt(listed, lost_at, head_changed)

    def _adopt(self, listed: list[Instance], lost_at: float | None, head_changed: bool) -> list[str]:
        known = {r.id: r for r in self.store.instances()}
        now = self.clock()
        adopted = []
        for inst in listed:
            record = known.get(inst.id)
            if head_changed and not self.hosts_workers:
                logger.warning("instance %s joined the run's previous Ray head; releasing it", inst.id)
                if record is not None and record.ended_at is None:
                    self.store.update_instance(inst.id, ended_at=now, end_reason="orphaned")
                    self.store.event("orphaned", inst.id)
                    known.pop(inst.id)
                self._submit("release", inst, self.provider.terminate, inst)
                continue
            if record is None or record.ended_at is not None:
                logger.warning("instance %s has this run's tag but no open record; releasing it", inst.id)
                self._submit("release", inst, self._release, inst)
                continue
            inst.price_per_hour, inst.launched_at = record.price_per_hour, record.launched_at
            self.live[inst.id] = inst
            if record.notice_at is not None:
                self.noticed.add(inst.id)
            if not self.hosts_workers:
                self._submit("adopt", inst, self._ensure_worker, inst)
            self.store.event("adopted", inst.id)
            adopted.append(inst.id)
        lost = [r.id for r in known.values() if r.ended_at is None and r.id not in self.live]
        for instance_id in lost:
            self.store.update_instance(instance_id, ended_at=now if lost_at is None else lost_at, end_reason="lost")
            self.store.event("lost", instance_id)
        if lost:
            logger.warning("%d instances of this run are gone; their cost ends when the run was last heard from",
                           len(lost))
        if adopted:
            self.status_text = "running"
        return adopted

    def _ensure_worker(self, inst: Instance) -> tuple[str, bool]:
        """An adopted instance's worker: the running one (and whether it is a warm spare), or a new trainer."""
        running = self.workers.running(inst)
        if running:
            return running["peer_id"], running.get("phase") == "standby"
        return self.workers.place(inst, self._logging(inst.id, self.worker_args(inst.node_type))), False

    @property
    def launching(self) -> int:
        """Launches asked of the provider and not answered yet."""
        return len(self.calls.of_kind("launch"))

    # ---- one tick --------------------------------------------------------------------------------
    def tick(self) -> None:
        """One pass over the fleet; what it records is committed once, at its end (``RunStore.batch``)."""
        with self.store.batch():
            self._tick()

    def _tick(self) -> None:
        now = self.clock()
        self._collect_background()
        self._collect_polls(now)
        self._collect_instance_notices(now)
        self._collect_rebalances(now)
        self._retire_rebalanced()
        self._record_leaves()
        self._release_dead_workers()
        self._enforce_budget(now)
        if not self.budget_exhausted and self.fatal is None:
            self._reconcile(now)
            self._launch_due(now)
        self._start_poll(now)

    def _start_poll(self, now: float) -> None:
        self.calls.start_poll(lambda: (self.provider.poll_notices(now), self.provider.poll_terminated(now)),
                              self.provider.poll_interval_s)

    def _collect_polls(self, now: float) -> None:
        poll = self.calls.finished_poll()
        if poll is None:
            return
        try:
            notices, terminated = poll.result()
        except Exception as e:
            logger.warning("polling the provider failed: %s", e)
            return
        self._take_notices(now, notices)
        for instance_id in terminated:
            preempted = instance_id in self.noticed or self.provider.was_preempted(instance_id)
            reason = "preempted" if preempted else "died"
            if instance_id in self.live:
                logger.info("instance %s %s; a replacement follows", instance_id, reason)
            self._ended(instance_id, reason)

    def _collect_instance_notices(self, now: float) -> None:
        """Notices the machines saw themselves (a cloud's metadata service), reported by their workers."""
        poll = getattr(self.workers, "poll_notices", None)
        if poll is None:
            return
        waiting = [i for i in self.live if i not in self.noticed]
        if not waiting:
            return
        offset = now - time.time()  # their times are the wall clock's
        notices = [PreemptionNotice(n.instance_id, n.notice_at + offset, n.terminate_at + offset, n.source)
                   for n in poll(waiting)]
        if notices:
            self._take_notices(now, notices)

    def _collect_rebalances(self, now: float) -> None:
        """Rebalance recommendations the machines saw: each such machine is at risk from now on."""
        poll = getattr(self.workers, "poll_rebalances", None)
        candidates = [i for i in self.live if i not in self.noticed and i not in self.at_risk and i not in self.spares]
        if poll is None or not candidates:
            return
        action = self.config.policy.on_rebalance
        for instance_id in poll(candidates):
            self.at_risk[instance_id] = now
            self.store.event("rebalance", instance_id, {"action": action})
            logger.info("rebalance recommendation for %s: %s", instance_id,
                        "its replacement launches now" if action == "replace" else "ignored (policy.on_rebalance)")

    def _replacing(self, instance_id: str) -> bool:
        """An at-risk machine whose replacement is wanted: it no longer counts for its type's size."""
        return instance_id in self.at_risk and self.config.policy.on_rebalance == "replace"

    def _retire_rebalanced(self) -> None:
        """Release an at-risk machine once its type is at full strength without it, every other trainer's
        worker placed: its replacement trains, so it goes gracefully before its notice can come."""
        for instance_id in [i for i in self.at_risk if self._replacing(i)]:
            inst = self.live.get(instance_id)
            if inst is None or instance_id in self.noticed:
                continue
            others = [i for i in self.live.values() if i.node_type == inst.node_type and i.id not in self.noticed
                      and i.id not in self.at_risk and i.id not in self.spares and i.tags.get("peer_id")]
            if len(others) < self.config.available_node_types[inst.node_type].max_workers:
                continue
            logger.info("%s's replacement trains: releasing it before its notice", instance_id)
            self._ended(instance_id, "rebalanced")  # (its end is the event)
            self._submit("release", inst, self._release, inst)

    def _take_notices(self, now: float, notices: list[PreemptionNotice]) -> None:
        launching = {c.instance_id for c in self.calls.of_kind("launch")}
        notices, self._held_notices = self._held_notices + notices, []
        for notice in notices:
            inst = self.live.get(notice.instance_id)
            if inst is None and notice.instance_id in launching:
                self._held_notices.append(notice)  # the launch returned but its result is not collected yet
                continue
            if inst is None or inst.id in self.noticed:
                continue
            self.noticed.add(inst.id)
            self.at_risk.pop(inst.id, None)  # a notice now: it goes as any noticed machine does
            self.store.update_instance(inst.id, notice_at=notice.notice_at)
            self.store.event("notice", inst.id, {"terminate_at": notice.terminate_at, "source": notice.source})
            logger.info("preemption notice for %s: terminated in %.0f s", inst.id, notice.terminate_at - now)
            if notice.source == "provider":  # a machine that saw it itself is leaving already
                # the worker gets most of the notice; the rest is margin for the message and the kill
                self.workers.notify(inst, max(self.to_real(notice.terminate_at - now) * 0.8, 0.5))
            if inst.id not in self.spares:
                self._activate_spare(inst.node_type)

    def _activate_spare(self, node_type: str) -> None:
        """A trainer is going: a warm spare of its type takes its place now, not a boot later (one that
        finished booting first); the replacement launched for the trainer becomes the next spare."""
        candidates = [i for i in self.spares if i in self.live and i not in self.noticed
                      and self.live[i].node_type == node_type]
        if not candidates:
            return
        spare = max(candidates, key=lambda i: (bool(self.live[i].tags.get("peer_id")), -self.live[i].launched_at))
        self.spares.discard(spare)
        self.store.event("activated", spare)
        logger.info("warm spare %s takes over a trainer's place", spare)
        self._submit("activate", self.live[spare], self.workers.activate, self.live[spare])

    def _record_leaves(self) -> None:
        waiting = [i for i in self.noticed if i in self.live and i not in self.left]
        if not waiting:
            return
        for instance_id in self.workers.poll_left(waiting):
            self.left.add(instance_id)
            self.store.event("left", instance_id)  # the worker left gracefully before the kill

    def _release_dead_workers(self) -> None:
        """A machine whose worker died (killed, crashed) trains nothing: it ends as "died", is released,
        and a replacement follows, as for a machine that died whole."""
        poll = getattr(self.workers, "poll_dead", None)
        placed = [i for i, inst in self.live.items() if inst.tags.get("peer_id") and i not in self.noticed]
        if poll is None or not placed:
            return
        for instance_id in poll(placed):
            inst = self.live.get(instance_id)
            if inst is None:
                continue
            logger.warning("the worker on %s died while its machine runs on; releasing the instance", instance_id)
            self._ended(instance_id, "died")
            self._submit("release", inst, self.provider.terminate, inst)

    def _ended(self, instance_id: str, reason: str) -> None:
        inst = self.live.pop(instance_id, None)
        self.at_risk.pop(instance_id, None)
        was_spare = instance_id in self.spares
        self.spares.discard(instance_id)
        if inst is None:
            return
        if reason in ("preempted", "died") and not was_spare and instance_id not in self.noticed:
            self._activate_spare(inst.node_type)  # gone without a notice: no spare took its place yet
        now = self.clock()
        self.store.update_instance(instance_id, ended_at=now, end_reason=reason)
        self.store.event(reason, instance_id)
        if reason == "preempted":
            self.preemptions.append((now, self._region(inst), inst.zone))
        if reason == "died" and not inst.tags.get("peer_id"):
            self._boot_failed(now)
        if reason in ("preempted", "died"):
            self.fleet_log.append(f"{reason}: {instance_id} ({inst.zone}, {inst.market}) after "
                                  f"{now - inst.launched_at:.0f} s; a replacement follows")

    # ---- background calls ------------------------------------------------------------------------
    def _submit(self, kind: str, inst: Instance | LaunchSpec, fn: Callable[..., Any], *args: Any,
                detail: Any = None) -> None:
        instance_id = inst.instance_id if isinstance(inst, LaunchSpec) else inst.id
        self.calls.submit(kind, instance_id, fn, *args, detail=detail)

    def _collect_background(self) -> None:
        for b in self.calls.finished():
            try:
                result = b.future.result()
            except Exception as e:
                self._failed(b, e)
                continue
            if b.kind == "launch":
                self._launched(result)
            elif b.kind == "adopt":
                peer_id, standby = result
                if standby and b.instance_id in self.live:
                    self.spares.add(b.instance_id)
                self._placed(b.instance_id, peer_id)
            elif b.kind == "place" and result:
                self._placed(b.instance_id, result)

    def _placed(self, instance_id: str, peer_id: str) -> None:
        if peer_id:
            self.store.update_instance(instance_id, peer_id=peer_id)
            self.backoff.worker_started()
            if instance_id in self.live:
                self.live[instance_id].tags["peer_id"] = peer_id

    def _failed(self, b: Call, error: Exception) -> None:
        if b.kind == "launch":
            spec: LaunchSpec = b.detail
            self.store.event("launch_failed", detail={"node_type": spec.node_type, "zone": spec.zone,
                                                      "region": self.config.region_of(spec.node_type),
                                                      "market": spec.market, "error": str(error)})
            logger.warning("launching %s in %s (%s) failed: %s", spec.node_type, spec.zone, spec.market, error)
            self.spares.discard(spec.instance_id)
            self._launch_failed(spec, error)
        elif b.kind == "activate":
            logger.warning("activating the warm spare %s failed: %s", b.instance_id, error)
        elif b.kind in ("place", "adopt"):
            logger.warning("the worker of %s did not start: %s; releasing the instance", b.instance_id, error)
            inst = self.live.get(b.instance_id)
            if inst is not None:
                self._ended(inst.id, "died")
                self._submit("release", inst, self.provider.terminate, inst)
        else:
            logger.warning("releasing %s failed: %s", b.instance_id, error)

    #: clock seconds a zone without capacity is left alone before it is tried again
    no_capacity_s: float = 300.0

    def _launch_failed(self, spec: LaunchSpec, error: Exception) -> None:
        """No capacity: that zone and market rest for a while (the next launch picks another zone,
        then on-demand).  Refused credentials: the run stops, nothing else will work.  Anything
        else: back off exponentially rather than hammer the API every tick."""
        self._hosted_args.pop(spec.instance_id, None)
        now = self.clock()
        if isinstance(error, ProviderAuthError):
            self.fatal = str(error)
            self.status_text = f"stopped: {error}"
            self.store.event("fatal", detail={"error": str(error)})
            logger.error("the cloud refused the run's credentials; stopping: %s", error)
            return
        if isinstance(error, CapacityError):
            self.zone_choice.no_capacity[(spec.node_type, error.zone, error.market)] = now + self.no_capacity_s
            self.store.event("no_capacity", detail={"node_type": spec.node_type, "zone": error.zone,
                                                    "region": self.config.region_of(spec.node_type),
                                                    "market": error.market, "error": str(error)})
            return
        wait = self.backoff.launch_failed(now)
        self.status_text = f"{self.backoff.launch_failures} launches in a row failed; next launch in {wait:.0f} s"

    # ---- fleet -----------------------------------------------------------------------------------
    def _reconcile(self, now: float) -> None:
        """Keep at least min_workers and scale up to max_workers (plus the warm spares) while the budget
        allows.  The node types of one region fill in the config's order; across regions the next
        launch is the cheapest capacity: of each region's next node type, the one whose best zone
        scores lowest (a tie: the region listed first)."""
        launching = [c.detail for c in self.calls.of_kind("launch")]
        have: dict[str, int] = {}
        short: dict[str, list[str]] = {}  # region -> its node types below their size, in the config's order
        for name, node_type in self.config.fleet_types().items():  # not the head: the supervisor runs there
            have[name] = sum(1 for i in self.live.values() if i.node_type == name and i.id not in self.noticed
                             and not self._replacing(i.id))
            have[name] += sum(1 for p in self.pending if p.node_type == name)
            have[name] += sum(1 for s in launching if s.node_type == name)
            if have[name] < node_type.max_workers + node_type.warm_spares:
                short.setdefault(self.config.region_of(name), []).append(name)
        rate: float | None = None  # the fleet's $/h, summed once (the first time a launch is weighed)
        while short:
            choice = self._next_launch(short, now)
            name, zone, market = choice.node_type, choice.zone, choice.market
            node_type = self.config.available_node_types[name]
            full = True  # this node type takes no more launches this tick
            if not self.zone_choice.has_capacity(name, zone, market, now):
                self.status_text = f"no capacity for {name} in any zone; trying again shortly"
            else:
                price = self.provider.price(name, zone, market)
                rate = self._rate() if rate is None else rate
                if not self.budget.allows(rate, price, now):
                    if have[name] < node_type.min_workers:
                        self.status_text = f"budget: cannot launch {name} (min_workers {node_type.min_workers})"
                else:
                    self.pending.append(PendingLaunch(name, zone, market, now + self.provider.provisioning_delay))
                    self.store.event("launch_requested", detail={"node_type": name, "zone": zone, "market": market,
                                                                 "region": choice.region})
                    rate += price  # what _rate() would say now, without summing a thousand instances again
                    have[name] += 1
                    full = have[name] >= node_type.max_workers + node_type.warm_spares
            if full:
                short[choice.region].pop(0)
                if not short[choice.region]:
                    del short[choice.region]

    def _next_launch(self, short: dict[str, list[str]], now: float) -> Choice:
        """The best choice of each region's first short node type, and of those the cheapest."""
        choices = [self.zone_choice.best(names[0], now, avoid=self._risky_zones(names[0])) for names in short.values()]
        return choices[0] if len(choices) == 1 else min(choices, key=lambda c: c.score)

    def _risky_zones(self, node_type: str) -> set[str]:
        """Zones where a machine of the type saw a rebalance recommendation: its replacement goes elsewhere."""
        risky = (self.live.get(i) for i in self.at_risk)
        return {inst.zone for inst in risky if inst is not None and inst.node_type == node_type}

    def _rate(self) -> float:
        """Dollars per hour of the instances live, pending and launching."""
        launching = [c.detail for c in self.calls.of_kind("launch")]
        return (sum(i.price_per_hour for i in self.live.values())
                + sum(self.provider.price(p.node_type, p.zone, p.market) for p in self.pending)
                + sum(self.provider.price(s.node_type, s.zone, s.market) for s in launching))

    def _enforce_budget(self, now: float) -> None:
        if self.budget_exhausted:
            return
        rate = sum(i.price_per_hour for i in self.live.values())
        spent = self.budget.exhausted(rate, self.spend_margin_s, now)
        if spent is not None:
            total = self.config.budget.max_total_dollars
            self.budget_exhausted = True
            self.status_text = f"budget exhausted: ${spent:.4f} of ${total:.2f}; instances released"
            self.store.event("budget_exhausted", detail={"spent": spent, "max_total_dollars": total})
            logger.warning("budget exhausted: $%.4f of $%.2f; releasing every instance", spent, total)
            self.pending.clear()
            if self.before_release is not None and self.live:
                self.store.commit()  # what the tick recorded so far is not held through the wait
                left_s = max(total - spent, 0.0) / rate * 3600 if rate > 0 else 0.0  # at the fleet's rate
                try:  # half of it: the release itself takes time too
                    self.before_release(self.to_real(left_s) / 2)
                except Exception:  # never in the way of the release the budget calls for
                    logger.exception("the step before the budget's release failed")
            for inst in list(self.live.values()):
                self._ended(inst.id, "budget")
                self._submit("release", inst, self._release, inst)

    def _boot_failed(self, now: float) -> None:
        """An instance died before its worker ran: ``LaunchBackoff`` says when to launch again."""
        wait = self.backoff.boot_failed(now)
        if wait is None:
            return
        failures = self.backoff.boot_failures
        self.status_text = f"{failures} instances in a row died while booting; next launch in {wait:.0f} s"
        self.store.event("boot_backoff", detail={"failures": failures, "wait_s": wait})

    #: clock seconds of spending the budget check keeps in reserve (a few ticks of the supervisor)
    spend_margin_s: float = 0.0

    def _certify_hook(self) -> Callable[[str, str], str | None] | None:
        """The membership token of a worker its provider starts itself; None when membership is off."""
        if getattr(self.workers, "certifier", None) is None:
            return None
        return lambda instance_id, peer_id: self.workers.certify(instance_id, peer_id)  # type: ignore[attr-defined]

    def _first_free_index(self) -> int:
        """Instance ids continue after every id the run ever used, across restarts."""
        used = [int(m.group(1)) for r in self.store.instances() if (m := re.search(r"-(\d+)$", r.id))]
        return max(used, default=-1) + 1

    def _launch_due(self, now: float) -> None:
        if not self.backoff.may_launch(now):
            return
        due = [p for p in self.pending if p.ready_at <= now]
        if not due:
            return
        self.pending = [p for p in self.pending if p.ready_at > now]
        trainers: dict[str, int] = {}  # by node type: counted once, then one more per trainer launched
        for k, p in enumerate(due):
            try:
                self._launch(p, trainers)
            except BaseException:
                self.pending += due[k + 1:]  # not asked for yet: the next tick asks
                raise

    def _launch(self, p: PendingLaunch, trainers: dict[str, int]) -> None:
        """Ask the provider for one instance (on the pool); a warm spare once its type has its trainers."""
        index, self._next_index = self._next_index, self._next_index + 1
        instance_id = f"{self.config.cluster_name}-{p.node_type}-{index:04d}"
        node_type = self.config.available_node_types[p.node_type]
        if p.node_type not in trainers:
            trainers[p.node_type] = self._trainers(p.node_type)
        if trainers[p.node_type] >= node_type.max_workers:
            self.spares.add(instance_id)
        else:
            trainers[p.node_type] += 1
        spec = LaunchSpec(instance_id, p.node_type, p.zone, p.market,
                          tags={RUN_TAG: self.config.cluster_name, INSTANCE_TAG: instance_id,
                                NODE_TYPE_TAG: p.node_type},
                          node_config=dict(node_type.node_config), resources=dict(node_type.resources),
                          sequence=index)
        if self.hosts_workers:
            self._hosted_args[instance_id] = self._worker_args_of(instance_id, p.node_type)
        spec.boot_script = self.boot_script(spec)
        # once: cloud providers retry transient errors themselves, and a failure backs off
        self._submit("launch", spec, self.provider.launch, spec, detail=spec)

    def _trainers(self, node_type: str) -> int:
        """Instances of the type that train or will: live or launching, neither noticed nor spares."""
        launching = [c.detail for c in self.calls.of_kind("launch")]
        live = sum(1 for i in self.live.values() if i.node_type == node_type and i.id not in self.noticed
                   and i.id not in self.spares and not self._replacing(i.id))
        return live + sum(1 for s in launching if s.node_type == node_type and s.instance_id not in self.spares)

    def idle_spares(self) -> int:
        """Warm spares up and waiting (launched, not noticed).  Safe from another thread: the set is
        copied first, in one C call."""
        return sum(1 for i in set(self.spares) if i in self.live and i not in self.noticed)

    def _worker_args_of(self, instance_id: str, node_type: str) -> dict[str, Any]:
        args = self._logging(instance_id, self.worker_args(node_type))
        return {**args, "standby": True} if instance_id in self.spares else args

    def _logging(self, instance_id: str, args: dict[str, Any]) -> dict[str, Any]:
        """A worker's arguments with where it logs in the run directory, if the run says."""
        return args if self.log_dir is None else {**args, "log_file": str(self.log_dir / f"{instance_id}.log")}

    def _launched(self, inst: Instance, place: bool = True) -> None:
        self.live[inst.id] = inst
        self.backoff.launched()
        inst.region = self._region(inst)
        od = self.config.available_node_types[inst.node_type].on_demand_price_per_hour
        self.store.launched(InstanceRecord(inst.id, inst.node_type, inst.zone, inst.market, inst.price_per_hour,
                                           od, inst.launched_at, peer_id=inst.tags.get("peer_id"),
                                           region=inst.region))
        if inst.id in self.spares:
            self.store.event("standby", inst.id)  # a warm spare: billed, booted, not training until activated
        if self.fatal is not None:  # the run stopped while this launch was in flight: nothing will work
            self._ended(inst.id, "released")
            self._submit("release", inst, self._release, inst)
            return
        self.status_text = "running"
        if self.budget_exhausted:  # the budget ran out while this launch was in flight
            self._ended(inst.id, "budget")
            self._submit("release", inst, self._release, inst)
        elif place and not self.hosts_workers:
            self._submit("place", inst, self.workers.place, inst, self._worker_args_of(inst.id, inst.node_type))

    def _region(self, inst: Instance) -> str:
        """Where an instance runs: as its provider says, else its node type's region."""
        if inst.region or inst.node_type not in self.config.available_node_types:
            return inst.region
        return self.config.region_of(inst.node_type)

    def _release(self, inst: Instance) -> None:
        try:
            self.workers.stop(inst)
        except Exception as e:  # already dead, or stuck: the machine goes either way
            logger.debug("graceful stop of %s failed: %s", inst.id, e)
        self.provider.terminate(inst)

    # ---- stopping --------------------------------------------------------------------------------
    def release_all(self, timeout: float = 120.0) -> None:
        """Release every instance (gracefully, concurrently) and wait for the calls to finish."""
        self.pending.clear()
        for b in self.calls.of_kind("launch"):
            try:  # a launch in flight becomes an instance we must release too
                self._launched(b.future.result(timeout=timeout), place=False)
            except Exception as e:
                logger.warning("a launch in flight failed while stopping: %s", e)
            self.calls.running.remove(b)
        with self.store.batch():
            for inst in list(self.live.values()):
                self._ended(inst.id, "released")
                self._submit("release", inst, self._release, inst)
        for b in list(self.calls.running):
            try:
                b.future.result(timeout=timeout)
            except Exception as e:
                logger.warning("%s of %s failed while stopping: %s", b.kind, b.instance_id, e)
        self.calls.running.clear()

    def shutdown(self) -> None:
        """Stop the pools (after ``release_all``, or to leave the instances for the next supervisor)."""
        self.calls.shutdown()
        self.provider.shutdown()
