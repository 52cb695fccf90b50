"""One instance's worker without Ray: a training peer (or an expert server) and its controls.

``actor.WorkerActor`` is the Ray face of it, and holds it either in its own process or, on
the local simulator with a warm image (``warm_image.py``), in a process forked from that image and
reached through a pipe.  So nothing here may use Ray, and what the actor calls takes and returns
plain, picklable data.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import asdict
from typing import Any

logger = logging.getLogger(__name__)


class WorkerCore:
    """One training peer, training in a thread of this process."""

    def __init__(self) -> None:
        from p2p import Identity

        self.identity = Identity()  # made here, so the run's certificate can name it before training starts
        self.peer: Any = None  # a TrainingPeer (role trainer) ...
        self.host: Any = None  # ... or an ExpertHost (role experts)
        self.thread: threading.Thread | None = None
        self.left = threading.Event()
        self.watcher: Any = None
        self.instance_notice: dict | None = None  # what the machine's own watcher saw: seen_at, deadline_s
        self.rebalance_at: float | None = None
        self.log: Any = None  # the handler that writes this worker's log into the run directory

    def start(self, worker_args: dict, watch: dict | None = None) -> dict:
        """Start training (or, with ``"role": "experts"`` in the arguments, serving experts); ``watch``
        ({"kind": "aws"|"gcp", "interval_s": ..., for gcp "deadline_s"}, see ``notices.instance_watch``)
        also watches this machine's metadata for its preemption notice (cloud instances), so the
        worker leaves in time even when nobody else could tell it.  ``"standby": true`` in the
        arguments makes a warm spare: booted, joined, idle until ``activate``; ``"log_file"`` is where
        this worker logs besides its stderr (the run directory's ``logs/<instance>.log``)."""
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        args = dict(worker_args)
        log_file = args.pop("log_file", None)
        if log_file is not None and self.log is None:
            from orchestrator.runs.logs import log_to_file

            self.log = log_to_file(log_file, catch_uncaught=True)
        role = args.pop("role", "trainer")
        if role == "experts":
            from workers.expert_host import ExpertHost, ExpertHostConfig  # imported here: only instances need torch

            self.host = ExpertHost(ExpertHostConfig(**args), identity=self.identity)
            address = self.host.address
        else:
            from workers.peer import TrainingPeer, WorkerConfig

            standby = bool(args.pop("standby", False))
            self.peer = TrainingPeer(WorkerConfig(**args), identity=self.identity, standby=standby)
            if not standby:
                self.activate()
            address = self.peer.address
        if watch is not None:
            from orchestrator.instance.notices import start_watcher

            self.watcher = start_watcher(watch, self._on_instance_notice)
        return {"worker_pid": os.getpid(), "peer_id": str(self.identity.peer_id), "address": address}

    def activate(self) -> bool:
        """A warm spare takes a trainer's place: it loads the swarm's state and trains (in its
        training thread; this returns at once).  False when there is nothing to activate: no
        trainer here, already training, or leaving."""
        if self.peer is None or self.thread is not None or self.left.is_set():
            return False
        self.thread = threading.Thread(target=self.peer.run, name="training", daemon=True)
        self.thread.start()
        return True

    def peer_id(self) -> str:
        return str(self.identity.peer_id)

    def renew(self, token: str) -> None:
        """A fresh membership certificate from the supervisor, before the current one expires."""
        if self.left.is_set():
            return
        if self.peer is not None:
            self.peer.renew_membership(token)
        elif self.host is not None:
            self.host.renew_membership(token)

    def notice(self, deadline_s: float, sent_at: float | None = None) -> None:
        """A preemption notice: keep training (or serving experts, whose state the supervisor is
        copying elsewhere meanwhile) through most of it, then leave gracefully in the background,
        all within ``deadline_s`` of ``sent_at`` (the swarm clock, which the supervisor's and this
        machine's DHT nodes agree on even when their wall clocks do not): a notice that waited
        behind a busy worker's start has less time left, not the whole period again."""
        if sent_at is not None:
            deadline_s = max(deadline_s - max(self.swarm_now() - sent_at, 0.0), 0.5)

        def leave() -> None:
            try:
                if self.host is not None:  # out of its experts' records at once, answering until it goes
                    self.host.leaving()
                    self.left.wait(0.75 * deadline_s)
                    self.host.shutdown(withdraw=False)
                elif self.peer is not None:
                    # the last quarter is for finishing a round and withdrawing our records
                    self.peer.prepare_to_leave(deadline=deadline_s, train_for=0.75 * deadline_s)
            finally:
                self.left.set()
        threading.Thread(target=leave, name="leaving", daemon=True).start()

    def swarm_now(self) -> float:
        """This worker's swarm clock (its DHT's; the wall clock before its DHT is up)."""
        dht = self.peer.dht if self.peer is not None else getattr(getattr(self.host, "server", None), "dht", None)
        return dht.clock.now() if dht is not None else time.time()

    def _on_instance_notice(self, notice: Any) -> None:
        if notice.kind == "rebalance":
            self.rebalance_at = notice.seen_at
            logger.info("rebalance recommendation: this machine is at elevated risk")
            return
        self.instance_notice = {"seen_at": notice.seen_at, "deadline_s": notice.deadline_s, "kind": notice.kind}
        logger.info("interruption notice (%s in %.0f s): leaving gracefully", notice.kind, notice.deadline_s)
        # as for a notice the supervisor forwards: most of it for training, the rest is margin for the kill
        self.notice(max(notice.deadline_s * 0.8, 0.5))

    def status(self, rounds_after: int | None = None) -> dict:
        """What the worker is doing; a trainer's also carries its cost totals and the rounds it
        completed after epoch ``rounds_after`` (the newest round the caller has; None: the newest few)."""
        peer, host = self.peer, self.host
        status = {"epoch": peer.epoch if peer else 0, "left": self.left.is_set(), "worker_pid": os.getpid(),
                  "phase": peer.phase if peer else "idle",
                  "notice": self.instance_notice, "rebalance_at": self.rebalance_at,
                  "peer_id": str(peer.dht.peer_id) if peer else None, "address": peer.address if peer else None}
        if host is not None:
            status.update(role="experts", peer_id=host.peer_id, address=host.address, hosted=host.hosted())
        elif peer is not None and peer.optimizer is not None:
            status["costs"] = {**peer.costs(), "rounds": peer.recent_rounds(rounds_after)}
        return status

    def stop_stepping(self, timeout: float) -> dict | None:
        """A clean stop's first half: the trainer finishes its round (within ``timeout``) and takes no
        more steps, but stays in the swarm serving its state, so that the run's final checkpoint holds
        exactly the parameters it stopped with.  Its epoch, parameter digest and address; None for an
        expert server or a peer that never trained."""
        if self.peer is None or self.thread is None or self.left.is_set():  # a warm spare never trained
            return None
        return self.peer.stop_stepping(timeout)

    def throttle(self, bytes_per_s: float | None) -> None:
        """Cap this peer's traffic (None: no cap): a fault injector's slow link where no tc shapes one."""
        if self.peer is not None:
            self.peer.throttle(bytes_per_s)

    def jump_clock(self, seconds: float) -> None:
        """Step this process's wall clock (a fault injector's NTP step or VM resume)."""
        if self.peer is not None:
            self.peer.jump_clock(seconds)

    def history(self) -> list[dict]:
        """The peer's per-epoch records (epoch, loss, samples/s, parameter digest)."""
        return list(self.peer.history) if self.peer is not None else []

    # ---- mixture-of-experts runs ---------------------------------------------------------------
    def assign(self, uids: list[str], donors: dict[str, list[str]], checkpoints: dict[str, bytes]) -> list[dict]:
        """Host these experts, each loaded from a live replica, else its checkpoint, else fresh."""
        return [asdict(h) for h in self.host.assign(uids, donors=donors, checkpoints=checkpoints)]

    def unassign(self, uids: list[str], withdraw: bool = True, linger: float = 0.0) -> None:
        self.host.unassign(uids, withdraw=withdraw, linger=linger)

    def redeclare(self) -> None:
        self.host.redeclare()

    def expert_states(self, uids: list[str]) -> dict[str, bytes]:
        return self.host.states(uids)

    def params_checksums(self) -> dict[str, str]:
        return self.host.params_checksums() if self.host is not None else {}

    def expert_stats(self) -> dict:
        """An expert server's load; a trainer's mixture calls (how many met k_min)."""
        if self.host is not None:
            return {"role": "experts", "hosted": self.host.hosted(), **self.host.stats()}
        moe = self.peer.moe_stats() if self.peer is not None else {}
        return {"role": "trainer", **moe}

    def stop(self) -> None:
        """Graceful stop without a notice period (a release, not a preemption)."""
        if self.watcher is not None:
            self.watcher.stop()
        if self.left.is_set():
            return
        if self.host is not None:
            self.host.shutdown(withdraw=True)
        elif self.peer is not None:
            self.peer.prepare_to_leave(deadline=10.0)
        self.left.set()
