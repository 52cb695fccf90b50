"""The fleet policy's worker control without Ray or workers: every call recorded, and the test says
which workers left, run, died or refuse to start.  For tests about the policy and the cloud, not the
training peers."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.providers.base import Instance


class FakeWorkers:
    """WorkerControl without Ray: records every call; the test marks which workers left or run."""

    def __init__(self) -> None:
        self.placed: list[str] = []
        self.notified: list[tuple[str, float]] = []
        self.stopped: list[str] = []
        self.left: set[str] = set()
        self.alive: set[str] = set()  # instances whose worker is already running (adoption)
        self.refuse = False  # every worker fails to start (a broken image or boot script)
        self.dead: set[str] = set()  # instances whose worker died while the machine runs on
        self.args: dict[str, dict[str, Any]] = {}  # what each placed worker started with
        self.activated: list[str] = []
        self.standby: set[str] = set()  # running workers that are warm spares (adoption)
        self.rebalanced: set[str] = set()  # instances whose machine saw a rebalance recommendation
        self._lock = threading.Lock()

    def place(self, instance: Instance, worker_args: dict[str, Any]) -> str:
        with self._lock:
            self.placed.append(instance.id)
            self.args[instance.id] = dict(worker_args)
        if self.refuse:
            raise RuntimeError("the instance's node never joined")
        return f"peer-{instance.id}"

    def notify(self, instance: Instance, deadline_s: float) -> None:
        with self._lock:
            self.notified.append((instance.id, deadline_s))

    def activate(self, instance: Instance) -> None:
        with self._lock:
            self.activated.append(instance.id)

    def poll_left(self, instance_ids: list[str]) -> list[str]:
        return [i for i in instance_ids if i in self.left]

    def poll_rebalances(self, instance_ids: list[str]) -> list[str]:
        return [i for i in instance_ids if i in self.rebalanced]

    def poll_dead(self, instance_ids: list[str]) -> list[str]:
        return [i for i in instance_ids if i in self.dead]

    def stop(self, instance: Instance) -> None:
        with self._lock:
            self.stopped.append(instance.id)

    def running(self, instance: Instance) -> dict | None:
        if instance.id not in self.alive:
            return None
        return {"peer_id": f"peer-{instance.id}", "address": f"/ip4/127.0.0.1/tcp/1/p2p/peer-{instance.id}",
                "phase": "standby" if instance.id in self.standby else "idle"}
