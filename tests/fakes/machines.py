"""A cloud's machines played on this one: each instance the fake cloud runs is booted from its own
boot script as a detached session whose ``ray start`` joins the test's Ray head, with a fake metadata
server of its own, and a preemption is played as the cloud plays it (the notice, then the kill).  The
base harness, and EC2's (moto, a fake IMDSv2) and GCE's (the fake Compute API and metadata server)."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from orchestrator.host.processes import kill_session, signal_session
from tests.fakes.aws import FAKE_CREDENTIALS, FakeImds
from tests.fakes.gce import FakeComputeApi, FakeGceMetadata
from tests.fakes.servers import LoopServers


@dataclasses.dataclass
class Machine:
    key: Any  # the cloud's name for it: an EC2 instance id, a GCE (zone, name)
    zone: str
    instance_id: str  # the run's name for it (its spotswarm-instance tag)
    metadata: Any  # its own fake metadata server (FakeImds, FakeGceMetadata)
    leader: int
    temp_dir: Path
    booted_at: float
    noticed_at: float | None = None
    killed_at: float | None = None


class MachineHarness:
    """Plays a cloud's machines on this one: a thread follows the cloud stand-in's instances, boots
    each new one from its boot script as a detached session (its ``ray start`` joins the test's head
    as a Ray node) with a fake metadata server of its own, and stops the node of an instance the API
    ended.  ``preempt`` shows the notice in the machine's metadata, then the cloud takes it back.
    A cloud says how: ``_step`` (follow the API), ``_notice`` and ``_take_back``."""

    name = "harness"

    def __init__(self, servers: LoopServers, state_dir: Path) -> None:
        self.servers = servers
        self.state_dir = state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        self.machines: dict[Any, Machine] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def _step(self) -> None:
        raise NotImplementedError

    def _notice(self, machine: Machine, notice_s: float) -> None:
        raise NotImplementedError

    def _take_back(self, machine: Machine) -> None:
        raise NotImplementedError

    def console(self, name: str) -> str:
        """What the machine ``name`` (an EC2 id, a GCE name) wrote to its console: its boot script's output."""
        try:
            return (self.state_dir / f"{name}.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def by_instance(self, instance_id: str) -> Machine:
        with self._lock:
            return next(m for m in self.machines.values() if m.instance_id == instance_id)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception as e:  # reported by the test, never a dead harness thread
                self.errors.append(repr(e))
            self._stop.wait(0.2)

    def _boot(self, key: Any, zone: str, instance_id: str, script: str, metadata: Any, env: dict[str, str]) -> None:
        from orchestrator.sim.nodes import boot_detached

        temp_dir = Path(tempfile.mkdtemp(prefix=f"{self.name}-", dir="/tmp"))  # short: Ray's socket paths
        env = dict(os.environ, **env, SPOTSWARM_NODE_TMP=str(temp_dir), SPOTSWARM_HOME=str(temp_dir / "home"),
                   PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
        for name in FAKE_CREDENTIALS:  # a machine has its own identity, not the operator's keys
            env.pop(name, None)
        leader = boot_detached(script, self.state_dir, str(key[-1] if isinstance(key, tuple) else key), env)
        with self._lock:
            self.machines[key] = Machine(key, zone, instance_id, metadata, leader, temp_dir, time.time())

    def _power_off(self, machine: Machine, sig: int) -> None:
        machine.killed_at = machine.killed_at or time.time()
        if sig == signal.SIGTERM:  # a shutdown: its grace, bounded, then the power; the cloud goes on meanwhile
            threading.Thread(target=kill_session, args=(machine.leader, 20), name=f"shutdown-{machine.key}",
                             daemon=True).start()
        else:
            signal_session(machine.leader, sig)

    def preempt(self, instance_id: str, notice_s: float) -> Machine:
        """The notice now; the machine taken back ``notice_s`` later (on a timer: the cloud's own clock)."""
        machine = self.by_instance(instance_id)
        machine.noticed_at = time.time()
        self._notice(machine, notice_s)
        timer = threading.Timer(notice_s, self.reclaim, args=(machine,))
        timer.daemon = True
        timer.start()
        return machine

    def reclaim(self, machine: Machine) -> None:
        """The cloud takes the machine back: its power is cut, and the API says it was preempted."""
        self._power_off(machine, signal.SIGKILL)
        self._take_back(machine)

    def crash_all(self) -> None:
        """Every machine's Ray node dies at once (SIGKILL); the cloud still lists them as running."""
        with self._lock:
            machines = list(self.machines.values())
        for machine in machines:
            self._power_off(machine, signal.SIGKILL)

    def alive(self) -> list[str]:
        from orchestrator.sim.nodes import node_alive

        with self._lock:
            return sorted(m.instance_id for m in self.machines.values() if node_alive(m.leader))

    def close(self) -> None:
        import shutil

        self._stop.set()
        self._thread.join(timeout=10)
        for machine in list(self.machines.values()):
            self._power_off(machine, signal.SIGKILL)
            shutil.rmtree(machine.temp_dir, ignore_errors=True)


class Ec2Harness(MachineHarness):
    """EC2's machines: booted from their user data, each with a fake IMDSv2; a preemption is an
    instance-action in its IMDS, then a termination in moto with the spot reclaim's state reason."""

    name = "ec2"

    def __init__(self, endpoint: str, servers: LoopServers, state_dir: Path, region: str = "us-east-1") -> None:
        import boto3
        from moto.backends import get_backend
        from moto.core import DEFAULT_ACCOUNT_ID

        self.ec2 = boto3.client("ec2", region_name=region, endpoint_url=endpoint)
        self.backend = get_backend("ec2")[DEFAULT_ACCOUNT_ID][region]
        super().__init__(servers, state_dir)

    def _step(self) -> None:
        pages = self.ec2.describe_instances()["Reservations"]
        for described in [i for r in pages for i in r["Instances"]]:
            ec2_id, state = described["InstanceId"], described["State"]["Name"]
            machine = self.machines.get(ec2_id)
            if machine is None and state in ("pending", "running"):
                self._boot_instance(described)
            elif machine is not None and state in ("shutting-down", "terminated", "stopped") and not machine.killed_at:
                self._power_off(machine, signal.SIGTERM)

    def _boot_instance(self, described: dict) -> None:
        ec2_id = described["InstanceId"]
        tags = {t["Key"]: t["Value"] for t in described.get("Tags", [])}
        user_data = self.ec2.describe_instance_attribute(InstanceId=ec2_id, Attribute="userData")
        script = base64.b64decode(user_data["UserData"].get("Value", "")).decode()
        zone = described["Placement"]["AvailabilityZone"]
        profile = described.get("IamInstanceProfile", {}).get("Arn", "")
        imds = FakeImds(self.servers, ec2_id, zone, role=profile.rsplit("/", 1)[-1] or None)
        self._boot(ec2_id, zone, tags.get("spotswarm-instance", ec2_id), script, imds,
                   {"AWS_EC2_METADATA_SERVICE_ENDPOINT": imds.url})

    def _notice(self, machine: Machine, notice_s: float) -> None:
        machine.metadata.announce("terminate", notice_s)

    def _take_back(self, machine: Machine) -> None:
        from moto.ec2.models.instances import StateReason

        self.backend.terminate_instances([machine.key])
        instance = self.backend.get_instance(machine.key)
        instance.state_reason = StateReason("Server.SpotInstanceTermination: Spot instance termination",
                                            "Server.SpotInstanceTermination")


class GceHarness(MachineHarness):
    """GCE's machines: booted from their ``startup-script`` metadata, each with a fake metadata
    server (GCE_METADATA_HOST); a preemption turns ``preempted`` TRUE, then after the window the
    instance is TERMINATED in the API as a preemption."""

    name = "gce"

    def __init__(self, api: FakeComputeApi, servers: LoopServers, state_dir: Path) -> None:
        self.api = api
        api.console = lambda zone, name: self.console(name)
        super().__init__(servers, state_dir)

    def _step(self) -> None:
        instances = self.api.snapshot()
        for key, resource in instances.items():
            if key not in self.machines and resource["status"] == "RUNNING":
                self._boot_instance(key, resource)
        for key, machine in list(self.machines.items()):
            status = instances.get(key, {}).get("status")
            if not machine.killed_at and status in (None, "STOPPING", "TERMINATED"):
                self._power_off(machine, signal.SIGTERM)

    def _boot_instance(self, key: tuple[str, str], resource: dict) -> None:
        items = {i["key"]: i.get("value", "") for i in resource.get("metadata", {}).get("items", [])}
        tags = json.loads(items.get("spotswarm-tags", "{}"))
        zone, name = key
        metadata = FakeGceMetadata(self.servers, name, zone)
        script = items.get("startup-script", "#!/bin/bash\nexit 1\n")
        self._boot(key, zone, tags.get("spotswarm-instance", name), script, metadata,
                   {"GCE_METADATA_HOST": metadata.host})

    def _notice(self, machine: Machine, notice_s: float) -> None:
        machine.metadata.preempt()

    def _take_back(self, machine: Machine) -> None:
        zone, name = machine.key
        self.api.preempt_instance(zone, name)
