"""The policy's ``WorkerControl`` over Ray: it reaches each instance's ``WorkerActor`` (``instance/actor.py``)
by its name, places it on the instance's Ray node, and forwards notices, activations and certificates.
Every call that may wait on a worker is an ObjectRef checked later, so the supervisor's tick never blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from orchestrator.instance.actor import spawn_worker, worker_actor_name
from orchestrator.providers.base import Instance, PreemptionNotice, instance_resource

logger = logging.getLogger(__name__)


class RayWorkers:
    """The policy's ``WorkerControl`` over Ray actors."""

    def __init__(self, boot_timeout: float = 600.0, watch: dict | None = None, check_every_s: float = 1.0,
                 certifier: Any = None, gpus: dict[str, int] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.clock = clock  # the supervisor's swarm clock: a notice is dated by it, as workers read theirs
        self.gpus = gpus or {}  # node type -> GPUs its worker takes (the training device may be one)
        self.boot_timeout = boot_timeout  # a cloud machine may take minutes to boot and join
        self.certifier = certifier  # the run's authority.Certifier; None: membership off
        self.watch = watch  # instances watch their own metadata for notices (clouds)
        self.check_every_s = check_every_s
        self._left_checks: dict[str, Any] = {}
        self._activate_when_placed: set[str] = set()  # spares activated before their actor existed
        self._activating = threading.Lock()
        self._notice_checks: dict[str, Any] = {}
        self._next_check: dict[str, float] = {}
        self._rebalanced: dict[str, float] = {}  # instance -> when its machine saw a rebalance recommendation
        self._alive_checks: dict[str, Any] = {}
        self._next_alive_check: dict[str, float] = {}
        self._worker_node: dict[str, str] = {}  # instance id -> the Ray node its worker last answered from
        self._handles: dict[str, Any] = {}  # instance id -> its worker actor (a name lookup is a GCS call)
        self._costs: dict[str, dict] = {}  # instance id -> its trainer's newest cost totals, not yet recorded
        self._rounds_after: dict[str, int] = {}  # instance id -> the newest round its answers brought

    def _actor(self, instance: Instance) -> Any:
        return self.handle(instance.id)

    def handle(self, instance_id: str) -> Any:
        """The instance's worker actor; raises ValueError when it has none."""
        handle = self._handles.get(instance_id)
        if handle is None:
            handle = self._handles[instance_id] = ray.get_actor(worker_actor_name(instance_id))
        return handle

    def place(self, instance: Instance, worker_args: dict[str, Any]) -> str:
        """Start the worker on the instance's own node; blocks until the node joined and it runs."""
        try:
            actor = spawn_worker(instance.id, {instance_resource(instance.id): 1.0}, detached=True,
                                 num_gpus=self.gpus.get(instance.node_type, 0))
        except ValueError:  # the name is taken: a supervisor before us placed it, then died
            adopted = self._adopt_placed(instance)
            if adopted is not None:
                return adopted
            actor = spawn_worker(instance.id, {instance_resource(instance.id): 1.0}, detached=True,
                                 num_gpus=self.gpus.get(instance.node_type, 0))
        try:
            if self.certifier is not None:
                started = time.monotonic()
                peer_id = ray.get(actor.peer_id.remote(), timeout=self.boot_timeout)
                worker_args = {**worker_args, "membership_token": self.certify(instance.id, peer_id)}
                timeout = max(self.boot_timeout - (time.monotonic() - started), 1.0)
            else:
                timeout = self.boot_timeout
            info = ray.get(actor.start.remote(worker_args, self.watch), timeout=timeout)
        except BaseException:
            ray.kill(actor)  # a detached actor outlives us: never leave one waiting for a node that is gone
            raise
        self._handles[instance.id] = actor
        self._worker_node[instance.id] = info["node_id"]
        with self._activating:
            activate = instance.id in self._activate_when_placed
            self._activate_when_placed.discard(instance.id)
        if activate:
            actor.activate.remote()
        logger.info("worker of %s runs on node %s as %s", instance.id, info["node_id"][:12], info["address"])
        return info["peer_id"]

    def _adopt_placed(self, instance: Instance) -> str | None:
        """The worker a dead supervisor was placing on ``instance``: its peer id once its start is
        done (a status call waits behind it), or None after removing one that never started."""
        actor = ray.get_actor(worker_actor_name(instance.id))
        try:
            status = ray.get(actor.status.remote(), timeout=self.boot_timeout)
        except Exception:  # noqa: BLE001 - died or hung while starting: start afresh
            status = {}
        if not status.get("peer_id"):
            ray.kill(actor)
            return None
        self._handles[instance.id] = actor
        self._worker_node[instance.id] = status["node_id"]
        if self.certifier is not None:
            self.certifier.know(instance.id, status["peer_id"])
        logger.info("worker of %s was placed by the previous supervisor; adopted", instance.id)
        return status["peer_id"]

    def certify(self, instance_id: str, peer_id: str) -> str | None:
        """The membership token for the worker of ``instance_id`` (None: membership is off)."""
        if self.certifier is None:
            return None
        return self.certifier.issue(instance_id, peer_id).to_token()

    def renew(self, instance_id: str, token: str) -> None:
        """Hand a worker its renewed certificate (never waits)."""
        try:
            self.handle(instance_id).renew.remote(token)
        except ValueError:
            logger.debug("no worker on %s to renew", instance_id)

    def notify(self, instance: Instance, deadline_s: float) -> None:
        try:
            self._actor(instance).notice.remote(deadline_s, self.clock())  # queued behind start if still booting
        except ValueError:  # no such actor: the worker never started or is gone already
            logger.info("no worker on %s to notify", instance.id)

    def activate(self, instance: Instance) -> None:
        """A warm spare starts training (queued behind its start if it is still booting; once placed,
        if its actor does not exist yet)."""
        with self._activating:
            try:
                self._actor(instance).activate.remote()
            except ValueError:
                self._activate_when_placed.add(instance.id)

    def _statuses(self, checks: dict[str, Any], instance_ids: list[str]) -> dict[str, dict]:
        """Start a status call for each instance without one in flight; return the answers that
        arrived (never waits: the policy's tick calls this)."""
        for instance_id in instance_ids:
            if instance_id not in checks:
                try:
                    checks[instance_id] = self.handle(instance_id).status.remote(self._rounds_cursor(instance_id))
                except ValueError:
                    continue
        if not checks:
            return {}
        refs = {ref: i for i, ref in checks.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        answers = {}
        for ref in ready:
            instance_id = refs[ref]
            del checks[instance_id]
            try:
                answers[instance_id] = ray.get(ref)
            except Exception:  # killed meanwhile: look the name up again next time
                self._handles.pop(instance_id, None)
            else:
                self._note_costs(instance_id, answers[instance_id])
        return answers

    def _rounds_cursor(self, instance_id: str) -> int:
        """What a status call asks a trainer for: its rounds after the newest one we heard of (all it
        kept, at first, so a new supervisor also hears of those its predecessor missed)."""
        return self._rounds_after.get(instance_id, -1)

    def _note_costs(self, instance_id: str, status: dict) -> None:
        """Keep a trainer's newest totals, and every round any answer since the last take carried
        (answers to calls in flight at once may repeat some; each is kept once)."""
        costs = status.get("costs")
        if not isinstance(costs, dict):
            return
        rounds = {r.get("epoch"): r for r in self._costs.get(instance_id, {}).get("rounds", [])
                  if isinstance(r, dict)}
        if isinstance(costs.get("rounds"), list):
            rounds.update((r.get("epoch"), r) for r in costs["rounds"] if isinstance(r, dict))
        self._costs[instance_id] = {**costs, "rounds": list(rounds.values())}
        epochs = [e for e in rounds if isinstance(e, int)]
        if epochs:
            self._rounds_after[instance_id] = max(self._rounds_cursor(instance_id), *epochs)

    def take_costs(self) -> dict[str, dict]:
        """The trainers' cost totals their status answers carried since the last call (see
        ``TrainingPeer.costs``), with the rounds they completed (``TrainingPeer.recent_rounds``):
        what the dashboard's bytes per sample, time split and per-round table come from."""
        costs, self._costs = self._costs, {}
        return costs

    def poll_left(self, instance_ids: list[str]) -> list[str]:
        return [i for i, status in self._statuses(self._left_checks, instance_ids).items() if status["left"]]

    def poll_notices(self, instance_ids: list[str]) -> list[PreemptionNotice]:
        """Notices the instances' own watchers saw (times on the wall clock), each instance asked
        at most every ``check_every_s``."""
        if self.watch is None:
            return []
        now = time.monotonic()
        waiting = set(instance_ids)  # a thousand instances: looked up, not scanned
        self._next_check = {i: t for i, t in self._next_check.items() if i in waiting}  # only the waiting
        due = [i for i in instance_ids if self._next_check.get(i, 0.0) <= now]
        for instance_id in due:
            self._next_check[instance_id] = now + self.check_every_s
        notices = []
        for instance_id, status in self._statuses(self._notice_checks, due).items():
            if status.get("rebalance_at"):
                self._rebalanced.setdefault(instance_id, status["rebalance_at"])
            seen = status.get("notice")
            if seen:
                notices.append(PreemptionNotice(instance_id, seen["seen_at"], seen["seen_at"] + seen["deadline_s"],
                                                source="instance"))
        return notices

    def poll_rebalances(self, instance_ids: list[str]) -> list[str]:
        """Which of the instances saw a rebalance recommendation (their watchers' word, collected with the
        notices by ``poll_notices``)."""
        asked = set(instance_ids)
        self._rebalanced = {i: t for i, t in self._rebalanced.items() if i in asked}
        return list(self._rebalanced)

    def poll_dead(self, instance_ids: list[str]) -> list[str]:
        """Instances whose worker process died while their machine runs on (killed, crashed): such a
        machine trains nothing and would cost money for ever.  Each is asked at most every
        ``check_every_s``; a worker that does not answer (paused, busy) is not dead.  Never waits."""
        now = time.monotonic()
        asked = set(instance_ids)  # a thousand instances: looked up, not scanned
        self._next_alive_check = {i: t for i, t in self._next_alive_check.items() if i in asked}
        for instance_id in instance_ids:
            if instance_id in self._alive_checks or self._next_alive_check.get(instance_id, 0.0) > now:
                continue
            self._next_alive_check[instance_id] = now + self.check_every_s
            try:
                self._alive_checks[instance_id] = self.handle(instance_id).status.remote(
                    self._rounds_cursor(instance_id))
            except ValueError:  # no actor by that name (yet): placement reports its own failures
                continue
        refs = {ref: i for i, ref in self._alive_checks.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0) if refs else ([], [])
        dead = []
        for ref in ready:
            instance_id = refs[ref]
            del self._alive_checks[instance_id]
            try:
                status = ray.get(ref)
                self._worker_node[instance_id] = status["node_id"]
                self._note_costs(instance_id, status)
            except ray.exceptions.ActorDiedError:
                self._handles.pop(instance_id, None)
                dead.append(instance_id)
            except Exception:  # noqa: BLE001 - unreachable for now, not known dead: asked again later
                self._handles.pop(instance_id, None)
        if not dead:
            return []
        # a worker that died with its whole machine is the provider's to report (preempted or died)
        alive_nodes = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        return [i for i in dead if self._worker_node.pop(i, None) in alive_nodes]

    def stop_stepping(self, instances: list[Instance], timeout: float) -> dict[str, dict]:
        """Every trainer among ``instances`` finishes its round and stops stepping, all at once (see
        ``WorkerCore.stop_stepping``); the answers that came within ``timeout``, by instance id.  Expert
        servers, spares, and workers gone, leaving or still booting answer nothing."""
        calls = {}
        for instance in instances:
            try:  # a tenth of the time is the call's own: a round still going after the rest is left to finish
                calls[self._actor(instance).stop_stepping.remote(0.9 * timeout)] = instance.id
            except ValueError:  # no worker (yet): nothing to stop
                continue
        if not calls:
            return {}
        ready, _ = ray.wait(list(calls), num_returns=len(calls), timeout=timeout)
        answers = {}
        for ref in ready:
            try:
                record = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - died meanwhile: it holds nothing to checkpoint
                logger.info("worker of %s did not stop stepping: %s", calls[ref], e)
                continue
            if record:
                answers[calls[ref]] = record
        return answers

    def stop(self, instance: Instance) -> None:
        self._worker_node.pop(instance.id, None)
        try:
            actor = self._handles.pop(instance.id, None) or ray.get_actor(worker_actor_name(instance.id))
        except ValueError:
            return
        try:
            # a worker still booting answers nothing until its start returns: nothing to leave yet
            ray.get(actor.status.remote(), timeout=2)
            ray.get(actor.stop.remote(), timeout=30)
        finally:
            ray.kill(actor)

    def running(self, instance: Instance, timeout: float = 30.0) -> dict | None:
        try:
            status = ray.get(self._actor(instance).status.remote(), timeout=timeout)
        except Exception:
            self._handles.pop(instance.id, None)
            return None
        self._worker_node[instance.id] = status["node_id"]  # an adopted worker found dead later is told apart
        if status["peer_id"] and self.certifier is not None:
            self.certifier.know(instance.id, status["peer_id"])  # an adopted worker: renewed on the next tick
        return status if status["peer_id"] else None
