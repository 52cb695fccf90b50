"""How the fleet policy reaches the workers, as protocols with no Ray in them: the supervisor's Ray
actors answer them, and the policy's tests answer them with plain objects."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from orchestrator.providers.base import Instance


class WorkerControl(Protocol):
    """How the policy reaches the training peer on an instance (Ray actors in the supervisor)."""

    def place(self, instance: Instance, worker_args: dict[str, Any]) -> str:
        """Start the instance's worker on it; returns its peer id.  May block while it boots."""

    def notify(self, instance: Instance, deadline_s: float) -> None:
        """Forward a preemption notice (never blocks)."""

    def activate(self, instance: Instance) -> None:
        """Make a warm spare's worker train (never blocks; queued behind its boot if it is booting)."""

    def poll_left(self, instance_ids: list[str]) -> list[str]:
        """Which of these noticed instances' workers have left gracefully (never blocks)."""

    def stop(self, instance: Instance) -> None:
        """Make the worker leave gracefully (may block for its deadline)."""

    def running(self, instance: Instance) -> dict | None:
        """The running worker's ``peer_id`` and ``address``, or None (adoption after a restart)."""

    # optional: ``poll_notices(instance_ids) -> list[PreemptionNotice]``, the notices the instances' own
    # watchers saw (wall-clock times, source "instance"); never blocks; ``certifier`` (None: membership
    # off) and ``certify(instance_id, peer_id) -> token | None``, the membership token of a worker a
    # provider starts itself; ``poll_dead(instance_ids) -> list[str]``, the instances whose worker died
    # while the machine runs on (never blocks)


@runtime_checkable
class HostsWorkers(Protocol):
    """A provider whose launch also starts the instance's worker (the local simulator's actors mode,
    where the simulated machine is the worker's own actor).  The policy then never places one; it
    hands the provider, once, the arguments of each instance's worker and the token hook."""

    def host_workers(self, worker_args: Callable[[str], dict[str, Any]],
                     certify: Callable[[str, str], str | None] | None) -> None:
        """``worker_args(instance_id)``: what that instance's worker starts with; ``certify(instance_id,
        peer_id)``: its membership token (None: membership is off)."""
