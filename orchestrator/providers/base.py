"""The provider interface: launch, terminate, list, price, and preemption notices."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Instance:
    id: str
    node_type: str
    zone: str
    market: str  # "spot" or "on-demand"
    price_per_hour: float
    launched_at: float
    tags: dict[str, str] = field(default_factory=dict)
    handle: Any = None  # provider-specific (a Ray actor for the local simulator)


@dataclass
class PreemptionNotice:
    instance_id: str
    notice_at: float
    terminate_at: float


class NodeProvider(abc.ABC):
    """What the supervisor needs from a cloud.  Times are the supervisor's clock (seconds)."""

    @abc.abstractmethod
    def launch(self, node_type: str, zone: str, market: str, worker_args: dict) -> Instance:
        """Start one instance running a worker peer configured by ``worker_args``."""

    @abc.abstractmethod
    def terminate(self, instance: Instance) -> None:
        """Release an instance now (no notice)."""

    @abc.abstractmethod
    def list(self) -> list[Instance]:
        """Instances of this cluster that are alive."""

    @abc.abstractmethod
    def price(self, node_type: str, zone: str, market: str) -> float:
        """Dollars per hour."""

    @abc.abstractmethod
    def poll_notices(self, now: float) -> list[PreemptionNotice]:
        """Preemption notices that arrived since the last poll."""

    @abc.abstractmethod
    def poll_terminated(self, now: float) -> list[str]:
        """Ids of instances the cloud took away (or that died) since the last poll."""

    def shutdown(self) -> None:  # noqa: B027 - an optional hook; most providers hold nothing to release
        """Release provider resources (not the instances: ``terminate`` them first)."""
