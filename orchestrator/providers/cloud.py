"""What the EC2 and GCE providers share: the instances this supervisor holds, and how a cloud's
own description of the run's machines is read back into them (adoption, reconciliation, orphans).

A subclass says how to read one described machine (``_machine``) and how to release one;
everything that decides what the description means lives here once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from orchestrator.config.schema import ClusterConfig
from orchestrator.config.tags import INSTANCE_TAG, NODE_TYPE_TAG
from orchestrator.providers.base import Instance, LaunchSpec, NodeProvider, PreemptionNotice

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Machine:
    handle: str  # the cloud's name for it
    tags: dict[str, str]
    zone: str
    spot: bool
    created: float  # wall-clock seconds
    region: str = ""  # where the cloud answered for it ("": the machine's node type's region)
    address: str = ""  # its private IP address, where the cloud gave one
    state: str = ""  # the cloud's word for it: running, pending, TERMINATED, ...


class CloudProvider(NodeProvider):
    #: seconds between reconciliations with the cloud's list (the notices come from the instances)
    poll_interval_s: float = 5.0
    #: instances with the run's tag that nobody launched or adopted are released after this long
    orphan_grace_s: float = 120.0

    def __init__(self, config: ClusterConfig, clock: Any, max_attempts: int) -> None:
        self.config = config
        self.clock = clock
        self.max_attempts = max_attempts
        self.calls: Counter[str] = Counter()  # API calls (every attempt), for the figures
        self.instances: dict[str, Instance] = {}
        self._preempted: set[str] = set()
        self._lock = threading.Lock()

    def _machine(self, described: Any) -> Machine:
        """How the cloud's record of one machine reads."""
        raise NotImplementedError

    def _release(self, described: Any) -> None:
        raise NotImplementedError

    # ---- the head that ``spotswarm up`` launches ---------------------------------------------------
    def heads(self) -> list[Machine]:
        """The run's head machines the cloud lists as pending or running (``up`` launches one)."""
        raise NotImplementedError

    def release_head(self, machine: Machine) -> None:
        raise NotImplementedError

    def console_output(self, machine: Machine) -> str:
        """What the machine wrote to its console (its boot script's output): EC2's console output, GCE's
        serial port 1; "" when the cloud has none yet."""
        raise NotImplementedError

    def _is_head(self, machine: Machine) -> bool:
        head = self.config.head_node_type
        return head is not None and machine.tags.get(NODE_TYPE_TAG) == head

    # ---- the instances held -----------------------------------------------------------------------
    def _launched(self, spec: LaunchSpec, handle: str) -> Instance:
        inst = Instance(spec.instance_id, spec.node_type, spec.zone, spec.market,
                        self.price(spec.node_type, spec.zone, spec.market), self.clock(), tags=dict(spec.tags),
                        handle=handle, region=self.config.region_of(spec.node_type))
        with self._lock:
            self.instances[inst.id] = inst
        logger.info("launched %s as %s in %s, %s (%s)", inst.id, handle, inst.region, spec.zone, spec.market)
        return inst

    def _forget(self, instance_ids: Iterable[str]) -> None:
        with self._lock:
            for instance_id in instance_ids:
                self.instances.pop(instance_id, None)

    def _held(self) -> dict[str, Instance]:
        """The held instances by handle, taken before a list call: a launch answered meanwhile is
        not in the list's answer yet, and must not be taken for gone."""
        with self._lock:
            return {inst.handle: inst for inst in self.instances.values()}

    def _instance(self, described: Any) -> Instance | None:
        """The instance a described machine is, or None when it is not one of the run's types."""
        machine = self._machine(described)
        instance_id, node_type = machine.tags.get(INSTANCE_TAG), machine.tags.get(NODE_TYPE_TAG)
        if instance_id is None or node_type not in self.config.fleet_types():
            return None  # not the run's, or its head: never adopted into the fleet
        market, age = "spot" if machine.spot else "on-demand", time.time() - machine.created
        return Instance(instance_id, node_type, machine.zone, market, self.price(node_type, machine.zone, market),
                        self.clock() - max(age, 0.0), tags=machine.tags, handle=machine.handle,
                        region=machine.region or self.config.region_of(node_type))

    def _adopt(self, described: Iterable[Any]) -> list[Instance]:
        """Live described machines as instances, held from now on (the one already held if any)."""
        out = []
        for one in described:
            inst = self._instance(one)
            if inst is not None:
                with self._lock:
                    out.append(self.instances.setdefault(inst.id, inst))
        return out

    def _release_orphan(self, described: Any) -> None:
        machine = self._machine(described)
        if time.time() - machine.created < self.orphan_grace_s or self._is_head(machine):
            return  # probably a launch whose answer is on its way; or the head that runs this supervisor
        logger.warning("instance %s carries this run's tag but no one launched or adopted it; releasing it",
                       machine.handle)
        self._release(described)

    def poll_notices(self, now: float) -> list[PreemptionNotice]:
        return []  # the cloud tells the instance (IMDS, metadata server); its worker reports the notice

    def was_preempted(self, instance_id: str) -> bool:
        return instance_id in self._preempted
