"""The provider contract: everything the supervisor asks of a cloud, and nothing else.

Tags are the source of truth: every instance carries the run's tags, so a new supervisor finds
the fleet of the one before it with ``list`` and adopts it instead of launching duplicates.
Calls that talk to a cloud (``launch``, ``terminate``, ``list``, the two polls) may block; the
supervisor's policy makes them off its tick, so a hanging API never delays a notice.  ``price``
must answer at once (providers cache prices).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import tenacity

T = TypeVar("T")


def instance_resource(instance_id: str) -> str:
    """The Ray resource a machine advertises, so that its worker actor is placed on it."""
    return f"spotswarm-instance-{instance_id}"


@dataclass
class LaunchSpec:
    """One machine to start.  ``instance_id`` is the run's name for it (also in ``tags``), chosen
    before the launch so that the boot script can name the machine's Ray resource after it."""

    instance_id: str
    node_type: str
    zone: str
    market: str  # "spot" or "on-demand"
    tags: dict[str, str]
    node_config: dict[str, Any] = field(default_factory=dict)
    resources: dict[str, float] = field(default_factory=dict)
    sequence: int = 0  # the run's launch number (0, 1, ...): a replayed trace's row for this instance
    boot_script: str | None = None  # what the machine runs at boot: joins the run's Ray cluster


@dataclass
class Instance:
    id: str
    node_type: str
    zone: str
    market: str  # "spot" or "on-demand"
    price_per_hour: float
    launched_at: float
    tags: dict[str, str] = field(default_factory=dict)
    handle: Any = None  # provider-specific: a cloud's own id, a process group, a Ray actor
    region: str = ""  # the region it runs in (its node type's); "" where the provider did not say


@dataclass
class PreemptionNotice:
    instance_id: str
    notice_at: float
    terminate_at: float
    # "provider": the supervisor learnt it from the cloud and forwards it to the worker; "instance": the
    # machine's own watcher saw it (EC2's IMDS, GCE's metadata server) and its worker is leaving already
    source: str = "provider"


class Transient(Exception):
    """A call the cloud asked us to slow down for (throttling, 5xx) or that never reached it: retried."""


#: the one backoff for cloud APIs: exponential with full jitter, so a throttled fleet spreads out
CLOUD_BACKOFF = tenacity.wait_random_exponential(multiplier=0.5, max=20)


def retry_transient(what: str, attempts: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, retried with ``CLOUD_BACKOFF`` while it raises Transient; after ``attempts``
    a ProviderError naming ``what`` and the last cause."""
    retrying = tenacity.Retrying(retry=tenacity.retry_if_exception_type(Transient), wait=CLOUD_BACKOFF,
                                 stop=tenacity.stop_after_attempt(attempts), reraise=True)
    try:
        return retrying(fn, *args)
    except Transient as e:
        raise ProviderError(f"{what}: still refused after {attempts} attempts: {e.__cause__}") from None


class ProviderError(RuntimeError):
    """A cloud call failed; the message names the call and the cloud's error code."""


class CapacityError(ProviderError):
    """The cloud has no capacity for this node type in this zone and market right now (try another
    zone, then on-demand)."""

    def __init__(self, message: str, zone: str, market: str) -> None:
        super().__init__(message)
        self.zone = zone
        self.market = market


class ProviderAuthError(ProviderError):
    """The cloud refused the credentials or their permissions: nothing will work until a person
    fixes them, so the run stops with this message instead of retrying."""


class NodeProvider(abc.ABC):
    """What the supervisor needs from a cloud.  Times are the supervisor's clock (seconds)."""

    #: seconds between asking for an instance and the cloud starting to bill it
    provisioning_delay: float = 0.0

    #: zones of the provider's region to launch in when the provider knows them better than the config
    #: (a cloud's subnets): for the node types that list no zones of their own
    zones: list[str] | None = None

    #: real seconds between polls (``poll_notices``/``poll_terminated``): a cloud's API is rate limited
    poll_interval_s: float = 0.0

    @abc.abstractmethod
    def launch(self, spec: LaunchSpec) -> Instance:
        """Ask for one machine; returns once the cloud accepted (it may still be booting)."""

    @abc.abstractmethod
    def terminate(self, instance: Instance) -> None:
        """Release an instance now (no notice)."""

    @abc.abstractmethod
    def list(self, tag_filters: dict[str, str]) -> list[Instance]:
        """Live instances whose tags include every one of ``tag_filters``."""

    @abc.abstractmethod
    def price(self, node_type: str, zone: str, market: str) -> float:
        """Dollars per hour; answers at once."""

    @abc.abstractmethod
    def poll_notices(self, now: float) -> list[PreemptionNotice]:
        """Preemption notices that arrived since the last poll."""

    @abc.abstractmethod
    def poll_terminated(self, now: float) -> list[str]:
        """Ids of instances the cloud took away (or that died) since the last poll."""

    def zones_for(self, node_type: str) -> list[str] | None:
        """The zones ``node_type`` launches in when the provider knows them better than the config
        (another region's zones, found by asking the cloud); None: ``zones``, else the config's."""
        return None

    def was_preempted(self, instance_id: str) -> bool:
        """Whether the cloud says it took this terminated instance back (answers at once, from the
        last poll); an instance noticed before its end counts as preempted either way."""
        return False

    def shutdown(self) -> None:  # noqa: B027 - an optional hook; most providers hold nothing to release
        """Release provider resources (not the instances: ``terminate`` them first)."""
