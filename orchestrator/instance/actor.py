"""An instance's worker as a Ray actor: one ``WorkerActor`` per instance, placed on the instance's Ray
node by the resource its boot script advertises (``fleet/workers.py`` reaches it from the supervisor).

Actors are named after their instance, so a restarted supervisor finds the workers of the one
before it.  On a cluster they are detached: a worker belongs to its machine, not to whichever
supervisor process started it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray

logger = logging.getLogger(__name__)


def announce_host(listen: str, configured: str | None) -> str | None:
    """Where other machines reach a peer listening on ``listen``: as configured, else this Ray
    node's address when it listens on every interface (None: the address it listens on)."""
    if configured:
        return configured
    return ray.util.get_node_ip_address() if listen in ("0.0.0.0", "::") else None


def worker_actor_name(instance_id: str) -> str:
    return f"spotswarm-worker-{instance_id}"


@ray.remote(num_cpus=0, max_restarts=0)
class WorkerActor:
    """One instance's worker: its ``WorkerCore`` in this actor's process, or, given a warm image's
    socket (the local simulator's), in a process forked from that image for this actor."""

    def __init__(self, image: str | None = None) -> None:
        self.core: Any = None
        if image is not None:
            from orchestrator.instance.warm_image import ForkedCore

            try:
                self.core = ForkedCore(image)
            except (OSError, RuntimeError) as e:  # the image is gone or cannot fork: boot here instead
                logging.getLogger(__name__).warning("booting without the warm image: %s", e)
        if self.core is None:
            from orchestrator.instance.core import WorkerCore

            self.core = WorkerCore()

    def start(self, worker_args: dict, watch: dict | None = None) -> dict:
        """``WorkerCore.start``, with where other machines reach this worker (this Ray node's address
        when it listens on every interface)."""
        args = dict(worker_args)
        args["announce_host"] = announce_host(args.get("host", "127.0.0.1"), args.get("announce_host"))
        info = self.core.start(args, watch)
        return {**info, "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def status(self, rounds_after: int | None = None) -> dict:
        return {**self.core.status(rounds_after), "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id()}

    # the rest is the core's, as it is: see WorkerCore
    def activate(self) -> bool:
        return self.core.activate()

    def peer_id(self) -> str:
        return self.core.peer_id()

    def renew(self, token: str) -> None:
        self.core.renew(token)

    def notice(self, deadline_s: float, sent_at: float | None = None) -> None:
        self.core.notice(deadline_s, sent_at)

    def swarm_now(self) -> float:
        return self.core.swarm_now()

    def throttle(self, bytes_per_s: float | None) -> None:
        self.core.throttle(bytes_per_s)

    def jump_clock(self, seconds: float) -> None:
        self.core.jump_clock(seconds)

    def history(self) -> list[dict]:
        return self.core.history()

    def assign(self, uids: list[str], donors: dict[str, list[str]], checkpoints: dict[str, bytes]) -> list[dict]:
        return self.core.assign(uids, donors, checkpoints)

    def unassign(self, uids: list[str], withdraw: bool = True, linger: float = 0.0) -> None:
        self.core.unassign(uids, withdraw, linger)

    def redeclare(self) -> None:
        self.core.redeclare()

    def expert_states(self, uids: list[str]) -> dict[str, bytes]:
        return self.core.expert_states(uids)

    def params_checksums(self) -> dict[str, str]:
        return self.core.params_checksums()

    def expert_stats(self) -> dict:
        return self.core.expert_stats()

    def stop_stepping(self, timeout: float) -> dict | None:
        return self.core.stop_stepping(timeout)

    def stop(self) -> None:
        self.core.stop()


def spawn_worker(instance_id: str, resources: dict[str, float], detached: bool, num_gpus: int = 0,
                 image: str | None = None) -> Any:
    """The worker's actor; with ``num_gpus`` Ray gives it the node's GPU (an actor that asks for
    none sees no GPU: Ray hides them from it); with ``image`` (a warm image's socket), its worker
    is forked from that image."""
    options: dict[str, Any] = {"name": worker_actor_name(instance_id), "resources": resources, "num_gpus": num_gpus}
    if detached:
        options["lifetime"] = "detached"
    return WorkerActor.options(**options).remote(image)
