"""An in-memory cloud behind the NodeProvider contract, for the fleet policy's decisions: launches,
terminations and listings answered at once (or held, like an API that stops answering), preemptions
queued by the test, prices from a table."""

from __future__ import annotations

import threading
from dataclasses import replace

from orchestrator.providers.base import Instance, LaunchSpec, NodeProvider, PreemptionNotice
from tests.fakes.clock import FakeClock


class FakeProvider(NodeProvider):
    """An in-memory cloud.  With ``hang`` set, a launch blocks until ``gate`` is set, like an API
    that stops answering; preemptions are whatever the test queues with ``notice`` and ``kill``."""

    provisioning_delay = 0.0

    def __init__(self, clock: FakeClock, prices: dict[tuple[str, str, str], float]) -> None:
        self.clock = clock
        self.prices = prices
        self.hang = False
        self.gate = threading.Event()
        self.specs: list[LaunchSpec] = []  # every launch asked for, in order
        self.hanging: set[str] = set()  # launches blocked on the gate right now
        self.instances: dict[str, Instance] = {}  # live, as the cloud sees them
        self.terminated: list[str] = []
        self.shutdowns = 0
        self._notices: list[PreemptionNotice] = []
        self._killed: list[str] = []
        self._lock = threading.Lock()

    # ---- the contract ----
    def launch(self, spec: LaunchSpec) -> Instance:
        with self._lock:
            self.specs.append(spec)
            hang = self.hang
            if hang:
                self.hanging.add(spec.instance_id)
        if hang and not self.gate.wait(20):
            raise RuntimeError(f"the hanging launch of {spec.instance_id} was never released")
        inst = Instance(spec.instance_id, spec.node_type, spec.zone, spec.market,
                        self.price(spec.node_type, spec.zone, spec.market), self.clock(), tags=dict(spec.tags))
        with self._lock:
            self.hanging.discard(spec.instance_id)
            self.instances[inst.id] = replace(inst, tags=dict(inst.tags))
        return inst

    def terminate(self, instance: Instance) -> None:
        with self._lock:
            self.terminated.append(instance.id)
            self.instances.pop(instance.id, None)

    def list(self, tag_filters: dict[str, str]) -> list[Instance]:
        with self._lock:  # copies: a cloud answers with fresh objects, not the policy's own
            return [replace(i, tags=dict(i.tags)) for i in self.instances.values()
                    if all(i.tags.get(k) == v for k, v in tag_filters.items())]

    def price(self, node_type: str, zone: str, market: str) -> float:
        return self.prices[(node_type, zone, market)]

    def poll_notices(self, now: float) -> list[PreemptionNotice]:
        with self._lock:
            out, self._notices = self._notices, []
        return out

    def poll_terminated(self, now: float) -> list[str]:
        with self._lock:
            out, self._killed = self._killed, []
        return out

    def shutdown(self) -> None:
        self.shutdowns += 1

    # ---- what the test does to the cloud ----
    def notice(self, instance_id: str, at: float, terminate_at: float) -> None:
        with self._lock:
            self._notices.append(PreemptionNotice(instance_id, at, terminate_at))

    def kill(self, instance_id: str) -> None:
        """The cloud takes the instance and says so in its next poll."""
        with self._lock:
            self.instances.pop(instance_id, None)
            self._killed.append(instance_id)

    def lose(self, instance_id: str) -> None:
        """The instance is gone and no poll will say so (it went while no supervisor ran)."""
        with self._lock:
            self.instances.pop(instance_id, None)

    def add(self, instance: Instance) -> None:
        """An instance this policy never launched (another run's, or one the store never heard of)."""
        with self._lock:
            self.instances[instance.id] = instance
