"""The experts of a mixture-of-experts run, kept alive by the supervisor.

Each tick (never waiting on a worker): learn the addresses of expert servers that came up; forget
servers that are gone, and have their experts' other replicas declare themselves at once; plan
(``placement.py``) and send assignments, each expert loaded from a live replica, else from its
checkpoint, else fresh; after a move, drop the expert from the server that had too many; every
``checkpoint.every_s`` pull each expert's state from one holder into
``<checkpoint dir>/experts/<uid>.pt`` (what a run resumed after losing everything starts from); and
sample the servers' load and the trainers' k_min statistics into the run store.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from orchestrator.config.schema import ClusterConfig
from orchestrator.fleet.placement import plan_placement
from orchestrator.providers.base import Instance
from orchestrator.runs.store import RunStore

logger = logging.getLogger(__name__)

STATS_EVERY_S = 1.0  # real seconds between load samples


@dataclass
class _Call:
    kind: str  # status | assign | unassign | states | stats
    instance_id: str
    ref: Any
    detail: Any = None


class ExpertFleet:
    """Placement, hand-off, checkpoints and statistics of the run's expert grid."""

    def __init__(self, config: ClusterConfig, store: RunStore, live: Callable[[], dict[str, Instance]],
                 noticed: Callable[[], set[str]], actor: Callable[[str], Any], checkpoint_dir: Path,
                 clock: Callable[[], float], archive: Callable[[Path], None] | None = None) -> None:
        self.config = config
        self.settings = config.experts
        self.uids = config.experts.uids()
        self.store = store
        self.live = live
        self.noticed = noticed
        self.actor = actor  # instance id -> its worker actor (ValueError when it has none)
        self.directory = checkpoint_dir / "experts"
        self.clock = clock
        self.archive = archive  # hands the expert checkpoints to the run's archive (checkpoint.uri)
        self.addresses: dict[str, str] = {}  # expert server -> its endpoint, once it is up
        self.holders: dict[str, set[str]] = {uid: set() for uid in self.uids}
        self.calls: list[_Call] = []
        self.moves: dict[tuple[str, str], str] = {}
        self._noticed_seen: set[str] = set()
        self._last_checkpoint = clock()
        self._next_stats = 0.0
        self._server_totals: dict[str, dict] = {}  # newest stats answer of each server (and trainer)
        self._previous: tuple[float, float] | None = None  # (time, requests) of the last sample

    def servers(self) -> list[str]:
        return [i for i, inst in self.live().items() if self.config.role(inst.node_type) == "experts"]

    def trainers(self) -> list[str]:
        return [i for i, inst in self.live().items() if self.config.role(inst.node_type) == "trainer"]

    # ---- one tick ------------------------------------------------------------------------------
    def tick(self) -> None:
        self._collect()
        self._forget_gone()
        self._redeclare_for_noticed()
        self._ask_addresses()
        if not any(c.kind in ("assign", "unassign") for c in self.calls):
            self._place()
        self._maybe_checkpoint()
        self._sample()

    def _send(self, kind: str, instance_id: str, method: str, *args: Any, detail: Any = None) -> bool:
        try:
            ref = getattr(self.actor(instance_id), method).remote(*args)
        except ValueError:  # no actor (yet, or any more)
            return False
        self.calls.append(_Call(kind, instance_id, ref, detail))
        return True

    def _collect(self) -> None:
        if not self.calls:
            return
        ready, _ = ray.wait([c.ref for c in self.calls], num_returns=len(self.calls), timeout=0)
        done = set(ready)
        for call in [c for c in self.calls if c.ref in done]:
            self.calls.remove(call)
            try:
                result = ray.get(call.ref)
            except Exception as e:  # the server died meanwhile: the next plan goes on without it
                logger.info("%s on %s failed: %s", call.kind, call.instance_id, str(e).splitlines()[0][:200])
                continue
            getattr(self, f"_on_{call.kind}")(call, result)

    def _on_status(self, call: _Call, status: dict) -> None:
        if status.get("role") == "experts" and status.get("address"):
            self.addresses[call.instance_id] = status["address"]
            for uid in status.get("hosted", []):  # a server adopted from an earlier supervisor
                if uid in self.holders:
                    self.holders[uid].add(call.instance_id)

    def _on_assign(self, call: _Call, handoffs: list[dict]) -> None:
        for h in handoffs:
            self.holders.setdefault(h["uid"], set()).add(call.instance_id)
            self.store.event("expert_handoff", call.instance_id, h)
            mover = self.moves.pop((call.instance_id, h["uid"]), None)
            if mover is not None and mover in self.addresses:
                # the mover leaves the expert's records at once and answers for two more declare periods,
                # for callers that found it a moment ago
                self.holders[h["uid"]].discard(mover)
                self._send("unassign", mover, "unassign", [h["uid"]], True, 2 * self.settings.declare_period_s,
                           detail=h["uid"])
                self._send("redeclare", call.instance_id, "redeclare")
        self._record_placement()

    def _on_unassign(self, call: _Call, result: Any) -> None:
        pass

    def _on_states(self, call: _Call, states: dict[str, bytes]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for uid, data in states.items():
            path = self.directory / f"{uid}.pt"
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)  # atomic: a crash never leaves half a checkpoint
        self.store.event("expert_checkpoint", call.instance_id, {"experts": sorted(states)})
        if self.archive is not None:
            self.archive(self.directory)  # uploaded in the background: the tick never waits on S3

    def _on_stats(self, call: _Call, stats: dict) -> None:
        self._server_totals[call.instance_id] = stats

    def _forget_gone(self) -> None:
        live = set(self.live())
        gone = [i for i in self.addresses if i not in live]
        for instance_id in gone:
            del self.addresses[instance_id]
            self._server_totals.pop(instance_id, None)
            orphaned = [uid for uid, h in self.holders.items() if instance_id in h]
            for uid in orphaned:
                self.holders[uid].discard(instance_id)
            self.moves = {k: v for k, v in self.moves.items() if instance_id not in (k[0], v)}
            survivors = {i for uid in orphaned for i in self.holders[uid]}
            for survivor in survivors:  # their declarations replace the dead server's records now
                self._send("redeclare", survivor, "redeclare")
            logger.info("expert server %s is gone; %d of its experts have other replicas", instance_id,
                        sum(1 for uid in orphaned if self.holders[uid]))
            self.store.event("expert_server_lost", instance_id, {"experts": orphaned})
        for instance_id in [i for i in self._server_totals if i not in live]:
            del self._server_totals[instance_id]
        if gone:
            self._record_placement()

    def _redeclare_for_noticed(self) -> None:
        """A noticed server stops declaring; the other holders of its experts declare now, so the
        records name them well before the kill."""
        noticed = {i for i in self.noticed() if i in self.addresses} - self._noticed_seen
        if not noticed:
            return
        self._noticed_seen |= noticed
        others = {h for uid, holders in self.holders.items() if holders & noticed for h in holders} - noticed
        for holder in others:
            self._send("redeclare", holder, "redeclare")

    def _on_redeclare(self, call: _Call, result: Any) -> None:
        pass

    def _ask_addresses(self) -> None:
        asking = {c.instance_id for c in self.calls if c.kind == "status"}
        for instance_id in self.servers():
            inst = self.live()[instance_id]
            if instance_id not in self.addresses and instance_id not in asking and inst.tags.get("peer_id"):
                self._send("status", instance_id, "status")

    # ---- placement -----------------------------------------------------------------------------
    def _place(self) -> None:
        leaving = self.noticed()
        usable = [i for i in self.servers() if i in self.addresses and i not in leaving]
        plan = plan_placement(self.uids, self.settings.replicas, self.holders, usable)
        for server, uids in plan.assign.items():
            donors = {uid: self._donors(uid, server, leaving) for uid in uids}
            # the checkpoint too, for when every donor dies before it hands the state over
            checkpoints = {uid: data for uid in uids if (data := self._checkpoint(uid)) is not None}
            if self._send("assign", server, "assign", uids, donors, checkpoints):
                for uid in uids:
                    if (server, uid) in plan.moves:
                        self.moves[(server, uid)] = plan.moves[(server, uid)]

    def _donors(self, uid: str, target: str, leaving: set[str]) -> list[str]:
        """Addresses of the servers holding ``uid``: staying ones first, then those about to leave."""
        holders = sorted(self.holders.get(uid, set()) - {target}, key=lambda i: (i in leaving, i))
        return [self.addresses[i] for i in holders if i in self.addresses]

    def _checkpoint(self, uid: str) -> bytes | None:
        path = self.directory / f"{uid}.pt"
        try:
            return path.read_bytes()
        except OSError:
            return None

    def _record_placement(self) -> None:
        self.store.event("expert_placement", detail={uid: sorted(h) for uid, h in self.holders.items()})

    # ---- checkpoints ---------------------------------------------------------------------------
    def _maybe_checkpoint(self) -> None:
        now = self.clock()
        if now - self._last_checkpoint < self.config.checkpoint.every_s:
            return
        if any(c.kind == "states" for c in self.calls):
            return
        self._last_checkpoint = now
        self.checkpoint_now()

    def checkpoint_now(self) -> None:
        """Ask one holder of each expert for its state (staying servers first); written when it answers."""
        leaving = self.noticed()
        by_server: dict[str, list[str]] = {}
        for uid, holders in self.holders.items():
            ranked = sorted((i for i in holders if i in self.addresses), key=lambda i: (i in leaving, i))
            if ranked:
                by_server.setdefault(ranked[0], []).append(uid)
        for server, uids in by_server.items():
            self._send("states", server, "expert_states", uids)

    def final_checkpoint(self, timeout: float = 15.0) -> None:
        """Every expert's state written before the servers are released (a graceful stop)."""
        self.checkpoint_now()
        refs = [c.ref for c in self.calls if c.kind == "states"]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout)
        self._collect()

    # ---- statistics ----------------------------------------------------------------------------
    def _sample(self) -> None:
        now = time.monotonic()
        if now < self._next_stats:
            return
        self._next_stats = now + STATS_EVERY_S
        self._write_sample()
        asking = {c.instance_id for c in self.calls if c.kind == "stats"}
        for instance_id in [*self.addresses, *self.trainers()]:
            if instance_id not in asking:
                self._send("stats", instance_id, "expert_stats")

    def summary(self) -> dict:
        """What the dashboard shows: experts live, replicas, server load, k_min fraction."""
        live = set(self.addresses)
        replicas = [len(self.holders[uid] & live) for uid in self.uids]
        servers = {i: s for i, s in self._server_totals.items() if s.get("role") == "experts"}
        trainers = [s for s in self._server_totals.values() if s.get("role") == "trainer"]
        calls = sum(s.get("calls", 0) for s in trainers)
        met = sum(s.get("calls_meeting_k_min", 0) for s in trainers)
        batches = sum(s.get("forward_batches", 0) for s in servers.values())
        rows = sum(s.get("samples_forward", 0) for s in servers.values())
        return {"grid": len(self.uids), "live": sum(r > 0 for r in replicas), "min_replicas": min(replicas, default=0),
                "mean_replicas": sum(replicas) / len(replicas) if replicas else 0.0, "servers": len(servers),
                "requests": sum(s.get("requests_forward", 0) for s in servers.values()),
                "rows_per_batch": rows / batches if batches else None,
                "calls": calls, "calls_meeting_k_min": met, "kmin_fraction": met / calls if calls else None,
                "failovers": sum(s.get("failovers", 0) for s in trainers),
                "hosted": {i: s.get("hosted", []) for i, s in servers.items()}}

    def _write_sample(self) -> None:
        s = self.summary()
        now = time.monotonic()
        rate = None
        if self._previous is not None and now > self._previous[0]:
            rate = max(s["requests"] - self._previous[1], 0) / (now - self._previous[0])
        self._previous = (now, s["requests"])
        self.store.expert_sample(s["live"], s["grid"], s["min_replicas"], s["mean_replicas"], rate,
                                 s["rows_per_batch"], s["calls"], s["kmin_fraction"])
