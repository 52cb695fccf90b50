"""Cloud stand-ins shared by the orchestrator tests: moto in server mode (real HTTP; boto3 reaches
it through ``endpoint_url``) for EC2 and S3."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import closing
from typing import Any

import pytest

from orchestrator.host.ports import free_port
from orchestrator.host.processes import kill_session, signal_session
from orchestrator.host.ray_head import RayHead
from orchestrator.host.wait import wait_for
from tests.ray_heads import ray_head

FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    """moto's server for a test module, on a loopback port; fake credentials in the environment
    (never a real account's).  Its state is reset by ``aws`` for every test."""
    pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    previous = {k: os.environ.get(k) for k in FAKE_CREDENTIALS}
    os.environ.update(FAKE_CREDENTIALS)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def moto_with_auth() -> Iterator[str]:
    """A moto server that checks credentials (its IAM knows no users, so every key is refused)."""
    port = free_port()
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="0")
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"

    def listening() -> bool:
        assert server.poll() is None, "moto did not start"
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=1)
        except OSError:
            return False
        return True

    try:
        wait_for(listening, 30, "moto to listen", every=0.1)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture
def aws(moto_endpoint: str) -> str:
    """A fresh moto account for one test: its endpoint URL."""
    urllib.request.urlopen(urllib.request.Request(f"{moto_endpoint}/moto-api/reset", method="POST"), timeout=10)
    return moto_endpoint


# ---- playing EC2: fake instance metadata, a proxy in front of moto, a harness that boots instances ----
import asyncio  # noqa: E402
import base64  # noqa: E402
import dataclasses  # noqa: E402
import secrets  # noqa: E402
import signal  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from pathlib import Path  # noqa: E402
from urllib.parse import parse_qs  # noqa: E402


class LoopServers:
    """aiohttp servers on one event loop in a thread (fake metadata servers, the API proxy)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fake-servers", daemon=True)
        self.thread.start()
        self.runners: list = []

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, app) -> int:
        from aiohttp import web

        async def start() -> int:
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.runners.append(runner)
            return runner.addresses[0][1]

        return self.call(start())

    def close(self) -> None:
        async def stop() -> None:
            for runner in self.runners:
                await runner.cleanup()

        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def loop_servers() -> Iterator[LoopServers]:
    with closing(LoopServers()) as servers:
        yield servers


class FakeImds:
    """One instance's IMDSv2: a session token (PUT), then metadata reads that present it."""

    def __init__(self, servers: LoopServers, ec2_id: str, zone: str) -> None:
        from aiohttp import web

        self.ec2_id, self.zone = ec2_id, zone
        self.tokens: set[str] = set()
        self.action: dict | None = None
        self.rebalance: dict | None = None
        self.reads: list[tuple[float, str]] = []
        app = web.Application()
        app.router.add_put("/latest/api/token", self._token)
        app.router.add_get("/latest/meta-data/{path:.*}", self._read)
        self.url = f"http://127.0.0.1:{servers.serve(app)}/"

    async def _token(self, request):
        from aiohttp import web

        if "X-aws-ec2-metadata-token-ttl-seconds" not in request.headers:
            return web.Response(status=400)
        token = secrets.token_hex(16)
        self.tokens.add(token)
        return web.Response(text=token)

    async def _read(self, request):
        from aiohttp import web

        if request.headers.get("X-aws-ec2-metadata-token") not in self.tokens:
            return web.Response(status=401)  # IMDSv2 is required: no token, no metadata
        path = request.match_info["path"]
        self.reads.append((time.time(), path))
        answers = {"instance-id": self.ec2_id, "placement/availability-zone": self.zone,
                   "spot/instance-action": self.action and json.dumps(self.action),
                   "events/recommendations/rebalance": self.rebalance and json.dumps(self.rebalance)}
        text = answers.get(path)
        return web.Response(status=404) if text is None else web.Response(text=text)

    def announce(self, action: str, in_s: float) -> None:
        when = datetime.fromtimestamp(time.time() + in_s, tz=timezone.utc)
        self.action = {"action": action, "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}


class AwsProxy:
    """A small HTTP proxy in front of moto: counts the API calls by action and, when asked,
    answers like EC2 does when it throttles or has no capacity."""

    def __init__(self, servers: LoopServers, upstream: str) -> None:
        from aiohttp import web

        self.upstream = upstream
        self.calls: list[tuple[float, str]] = []
        self.throttle_next = 0  # answer this many coming calls with RequestLimitExceeded
        self.refuse_auth = False  # answer every call with AuthFailure (revoked keys)
        self.throttled = 0
        self.no_capacity: set[tuple[str, str]] = set()  # (zone, market) answered InsufficientInstanceCapacity
        self.refused: list[tuple[str, str]] = []
        app = web.Application(client_max_size=1 << 24)
        app.router.add_route("*", "/{path:.*}", self._forward)
        self.url = f"http://127.0.0.1:{servers.serve(app)}"

    def count(self, action: str, since: float = 0.0, until: float = float("inf")) -> int:
        return sum(1 for t, a in self.calls if a == action and since <= t <= until)

    @staticmethod
    def _error(code: str, message: str, status: int):
        from aiohttp import web

        body = (f"<?xml version='1.0' encoding='UTF-8'?><Response><Errors><Error><Code>{code}</Code>"
                f"<Message>{message}</Message></Error></Errors><RequestID>proxy</RequestID></Response>")
        return web.Response(status=status, text=body, content_type="text/xml")

    async def _forward(self, request):
        import aiohttp
        from aiohttp import web

        body = await request.read()
        form = {k: v[0] for k, v in parse_qs(body.decode(errors="replace")).items()}
        action = form.get("Action", "?")
        self.calls.append((time.time(), action))
        if self.refuse_auth:
            return self._error("AuthFailure", "AWS was not able to validate the provided access credentials", 401)
        if self.throttle_next > 0:
            self.throttle_next -= 1
            self.throttled += 1
            return self._error("RequestLimitExceeded", "Request limit exceeded.", 503)
        if action == "RunInstances":
            market = "spot" if form.get("InstanceMarketOptions.MarketType") == "spot" else "on-demand"
            zone = form.get("Placement.AvailabilityZone", "")
            if (zone, market) in self.no_capacity:
                self.refused.append((zone, market))
                return self._error("InsufficientInstanceCapacity",
                                   f"We currently do not have sufficient capacity in the Availability Zone "
                                   f"you requested ({zone}).", 500)  # EC2 answers it as a server error
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with aiohttp.ClientSession() as session:
            async with session.request(request.method, f"{self.upstream}{request.rel_url}", data=body,
                                       headers=headers) as answer:
                payload = await answer.read()
                kept = {k: v for k, v in answer.headers.items()
                        if k.lower() not in ("content-length", "transfer-encoding", "content-encoding", "connection")}
                return web.Response(status=answer.status, body=payload, headers=kept)


@pytest.fixture
def aws_proxy(aws: str, loop_servers: LoopServers) -> AwsProxy:
    return AwsProxy(loop_servers, aws)


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
        env = dict(os.environ, **env, SPOTSWARM_NODE_TMP=str(temp_dir),
                   PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
        for name in FAKE_CREDENTIALS:  # a machine has its own identity, not the operator's keys
            env.pop(name, None)
        leader = boot_detached(script, self.state_dir, str(key[-1] if isinstance(key, tuple) else key), env)
        with self._lock:
            self.machines[key] = Machine(key, zone, instance_id, metadata, leader, temp_dir, time.time())

    def _power_off(self, machine: Machine, sig: int) -> None:
        machine.killed_at = machine.killed_at or time.time()
        if sig == signal.SIGTERM:  # a shutdown: its grace, bounded, then the power
            kill_session(machine.leader, grace_s=20)
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
        imds = FakeImds(self.servers, ec2_id, zone)
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


@pytest.fixture
def ec2_harness(aws: str, loop_servers: LoopServers, tmp_path: Path) -> Iterator[Ec2Harness]:
    with closing(Ec2Harness(aws, loop_servers, tmp_path / "machines")) as harness:
        yield harness


@pytest.fixture
def fake_imds(loop_servers: LoopServers) -> FakeImds:
    return FakeImds(loop_servers, "i-0123456789abcdef0", "us-east-1a")


# ---- Ray heads of their own, as on separate head machines ------------------------------------------
@pytest.fixture
def ray_heads(tmp_path: Path) -> Iterator:
    """Start Ray heads by name (``ray_heads("a")``); every one is killed and cleaned up after the test."""
    pytest.importorskip("ray")
    started: list[RayHead] = []

    def start(name: str) -> RayHead:
        head = ray_head(name, tmp_path / f"ray-head-{name}.log")
        started.append(head)
        return head

    try:
        yield start
    finally:
        for head in started:
            head.close()


# ---- playing GCE: the Compute Engine v1 REST API, a metadata server per instance, a harness ----------
import re  # noqa: E402
from datetime import timedelta  # noqa: E402

GCE_PROJECT = "my-project"
PREEMPTED_OPERATION = "compute.instances.preempted"
_GCE_NAME = re.compile(r"[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?")
_GCE_LABEL_FILTER = re.compile(r'labels\.([a-z0-9_-]+)\s*=\s*"?([^")\s]*)"?')


def gce_time(when: float | None = None) -> str:
    """GCE's RFC 3339 timestamps, with the offset GCE writes (its own Pacific time)."""
    moment = datetime.fromtimestamp(time.time() if when is None else when, tz=timezone(timedelta(hours=-8)))
    return moment.isoformat(timespec="milliseconds")


def gce_error(status: int, reason: str, message: str, domain: str = "global", code: str | None = None):
    """An error the way GCE's REST API writes one (google.api_core reads ``errors[].reason``)."""
    from aiohttp import web

    error = {"code": status, "message": message, "errors": [{"message": message, "domain": domain, "reason": reason}]}
    if code:
        error["status"] = code
    return web.json_response({"error": error}, status=status)


class FakeComputeApi:
    """Compute Engine v1's REST API for instances (insert, get, list with a label filter, delete)
    and zone operations (get, wait, list), in memory, with GCE's answers and error bodies: the
    real google-cloud-compute client reaches it through ``InstancesRestTransport(host=...,
    url_scheme="http")``.  Knobs: ``exhausted`` (zone, market) pairs whose insert operation ends in
    ZONE_RESOURCE_POOL_EXHAUSTED, ``over_quota`` pairs answered 403 quotaExceeded, ``throttle`` a
    queue of "429" / "403" rate-limit answers for the next calls, ``refuse_auth`` 401 or 403 for
    every call."""

    def __init__(self, servers: LoopServers, project: str = GCE_PROJECT) -> None:
        from aiohttp import web

        self.project = project
        self.lock = threading.Lock()
        self.instances: dict[tuple[str, str], dict] = {}  # (zone, name) -> the Instance resource
        self.operations: dict[str, dict] = {}
        self.calls: list[tuple[float, str]] = []
        self.inserted: list[dict] = []  # every insert's body, as sent
        self.exhausted: set[tuple[str, str]] = set()
        self.over_quota: set[tuple[str, str]] = set()
        self.refused: list[tuple[str, str, str]] = []  # (zone, market, code)
        self.throttle: list[str] = []
        self.throttled = 0
        self.refuse_auth: int | None = None
        self._ids = iter(range(1000, 10**9))
        base = "/compute/v1/projects/{project}/zones/{zone}"
        @web.middleware
        async def gate(request, handler):
            return await self._gate(request, handler)

        app = web.Application(middlewares=[gate], client_max_size=1 << 22)
        app.router.add_post(base + "/instances", self._insert, name="instances.insert")
        app.router.add_get(base + "/instances", self._list, name="instances.list")
        app.router.add_get(base + "/instances/{name}", self._get, name="instances.get")
        app.router.add_delete(base + "/instances/{name}", self._delete, name="instances.delete")
        app.router.add_get(base + "/operations", self._operations, name="zoneOperations.list")
        app.router.add_get(base + "/operations/{operation}", self._operation, name="zoneOperations.get")
        app.router.add_post(base + "/operations/{operation}/wait", self._operation, name="zoneOperations.wait")
        self.url = f"http://127.0.0.1:{servers.serve(app)}"

    def count(self, method: str, since: float = 0.0) -> int:
        return sum(1 for t, m in self.calls if m == method and t >= since)

    def _link(self, zone: str, *parts: str) -> str:
        return "/".join([f"https://www.googleapis.com/compute/v1/projects/{self.project}/zones/{zone}", *parts])

    async def _gate(self, request, handler):
        route = request.match_info.route.name or "?"
        self.calls.append((time.time(), route))
        if request.match_info.get("project") not in (None, self.project):
            return gce_error(404, "notFound", f"The resource 'projects/{request.match_info['project']}' was not found")
        if self.refuse_auth == 401:
            return gce_error(401, "required", "Request is missing required authentication credential. Expected "
                             "OAuth 2 access token, login cookie or other valid authentication credential.",
                             code="UNAUTHENTICATED")
        if self.refuse_auth == 403:
            return gce_error(403, "forbidden", f"Required 'compute.{route}' permission for 'projects/{self.project}'")
        if self.throttle:
            kind = self.throttle.pop(0)
            self.throttled += 1
            if kind == "429":
                return gce_error(429, "rateLimitExceeded", "Quota exceeded for quota metric 'Queries' and limit "
                                 "'Queries per minute' of service 'compute.googleapis.com'", "usageLimits",
                                 code="RESOURCE_EXHAUSTED")
            return gce_error(403, "userRateLimitExceeded", "Rate Limit Exceeded", "usageLimits")
        return await handler(request)

    def _operation_for(self, zone: str, kind: str, target: str, error: dict | None = None,
                       done: bool = False) -> dict:
        name = f"operation-{next(self._ids)}"
        operation = {"kind": "compute#operation", "id": str(next(self._ids)), "name": name,
                     "zone": self._link(zone), "operationType": kind, "targetLink": target,
                     "status": "DONE" if done else "RUNNING", "progress": 100 if done else 0,
                     "insertTime": gce_time(), "selfLink": self._link(zone, "operations", name)}
        if error:
            operation["_error"] = error  # shown when the operation is done
        self.operations[name] = operation
        return operation

    def _shown(self, operation: dict) -> dict:
        shown = {k: v for k, v in operation.items() if not k.startswith("_")}
        if operation["status"] == "DONE" and "_error" in operation:
            shown.update(error=operation["_error"], httpErrorStatusCode=503, httpErrorMessage="SERVICE UNAVAILABLE")
        return shown

    @staticmethod
    def _invalid(body: dict, zone: str) -> str | None:
        """What GCE would refuse in an insert's body (a 400 invalid)."""
        if not _GCE_NAME.fullmatch(str(body.get("name", ""))):
            return f"Invalid value for field 'resource.name': '{body.get('name')}'"
        if not str(body.get("machineType", "")).startswith(f"zones/{zone}/machineTypes/"):
            return f"Invalid value for field 'resource.machineType': '{body.get('machineType')}'"
        boot = [d for d in body.get("disks", []) if d.get("boot")]
        if len(boot) != 1 or not boot[0].get("initializeParams", {}).get("sourceImage"):
            return "Invalid value for field 'resource.disks': exactly one boot disk with a source image is required"
        if not body.get("networkInterfaces"):
            return "Invalid value for field 'resource.networkInterfaces': at least one is required"
        for key, value in body.get("labels", {}).items():
            if not re.fullmatch(r"[a-z0-9_-]{0,63}", value):
                return f"Invalid value for field 'resource.labels': '{key}={value}'"
        return None

    async def _insert(self, request):
        from aiohttp import web

        zone, body = request.match_info["zone"], await request.json()
        self.inserted.append(body)
        market = "spot" if body.get("scheduling", {}).get("provisioningModel") == "SPOT" else "on-demand"
        problem = self._invalid(body, zone)
        if problem:
            return gce_error(400, "invalid", problem)
        if (zone, market) in self.over_quota:
            self.refused.append((zone, market, "QUOTA_EXCEEDED"))
            cpus = "PREEMPTIBLE_CPUS" if market == "spot" else "CPUS"
            return gce_error(403, "quotaExceeded", f"Quota '{cpus}' exceeded.  Limit: 8.0 in region "
                             f"{zone.rsplit('-', 1)[0]}.", "usageLimits")
        with self.lock:
            if (zone, body["name"]) in self.instances:
                return gce_error(409, "alreadyExists", f"The resource 'projects/{self.project}/zones/{zone}/"
                                 f"instances/{body['name']}' already exists")
            target = self._link(zone, "instances", body["name"])
            if (zone, market) in self.exhausted:
                self.refused.append((zone, market, "ZONE_RESOURCE_POOL_EXHAUSTED"))
                error = {"errors": [{"code": "ZONE_RESOURCE_POOL_EXHAUSTED", "message": f"The zone "
                         f"'projects/{self.project}/zones/{zone}' does not have enough resources available to "
                         "fulfill the request.  Try a different zone, or try again later."}]}
                return web.json_response(self._shown(self._operation_for(zone, "insert", target, error)))
            resource = {**body, "kind": "compute#instance", "id": str(next(self._ids)), "zone": self._link(zone),
                        "selfLink": target, "status": "PROVISIONING", "creationTimestamp": gce_time()}
            resource["machineType"] = self._link(zone, "machineTypes", body["machineType"].rsplit("/", 1)[-1])
            self.instances[(zone, body["name"])] = resource
            operation = self._operation_for(zone, "insert", target)
            operation["_instance"] = (zone, body["name"])
            return web.json_response(self._shown(operation))

    def _finish(self, operation: dict) -> None:
        """An operation completes when it is asked about (the instance starts running)."""
        if operation["status"] == "DONE":
            return
        operation.update(status="DONE", progress=100, endTime=gce_time())
        instance = self.instances.get(operation.get("_instance"))
        if instance is not None and instance["status"] == "PROVISIONING":
            instance["status"] = "RUNNING"

    async def _operation(self, request):
        from aiohttp import web

        with self.lock:
            operation = self.operations.get(request.match_info["operation"])
            if operation is None:
                return gce_error(404, "notFound", f"The resource '{request.match_info['operation']}' was not found")
            self._finish(operation)
            return web.json_response(self._shown(operation))

    async def _operations(self, request):
        from aiohttp import web

        zone = request.match_info["zone"]
        wanted = re.search(r'operationType\s*=\s*"?([\w.]+)"?', request.query.get("filter", ""))
        with self.lock:
            items = [self._shown(o) for o in self.operations.values() if o["zone"] == self._link(zone)
                     and (wanted is None or o["operationType"] == wanted.group(1))]
        return web.json_response({"kind": "compute#operationList", "id": "list", **({"items": items} if items else {})})

    async def _get(self, request):
        from aiohttp import web

        zone, name = request.match_info["zone"], request.match_info["name"]
        with self.lock:
            instance = self.instances.get((zone, name))
            if instance is None:
                return gce_error(404, "notFound", f"The resource 'projects/{self.project}/zones/{zone}/instances/"
                                 f"{name}' was not found")
            return web.json_response(instance)

    async def _list(self, request):
        from aiohttp import web

        zone = request.match_info["zone"]
        wanted = dict(_GCE_LABEL_FILTER.findall(request.query.get("filter", "")))
        size = min(int(request.query.get("maxResults", 500)), 500)
        start = int(request.query.get("pageToken") or 0)
        with self.lock:
            found = [i for (z, _), i in sorted(self.instances.items())
                     if z == zone and all(i.get("labels", {}).get(k) == v for k, v in wanted.items())]
        page = found[start:start + size]
        answer: dict = {"kind": "compute#instanceList", "id": f"projects/{self.project}/zones/{zone}/instances"}
        if page:
            answer["items"] = page
        if start + size < len(found):
            answer["nextPageToken"] = str(start + size)
        return web.json_response(answer)

    async def _delete(self, request):
        from aiohttp import web

        zone, name = request.match_info["zone"], request.match_info["name"]
        with self.lock:
            if self.instances.pop((zone, name), None) is None:
                return gce_error(404, "notFound", f"The resource 'projects/{self.project}/zones/{zone}/instances/"
                                 f"{name}' was not found")
            operation = self._operation_for(zone, "delete", self._link(zone, "instances", name), done=True)
            return web.json_response(self._shown(operation))

    # ---- what GCE does on its own ------------------------------------------------------------------
    def preempt_instance(self, zone: str, name: str, delete: bool = False) -> None:
        """GCE takes a Spot VM back: TERMINATED (STOP), or gone (DELETE), with its preempted operation."""
        with self.lock:
            instance = self.instances[(zone, name)]
            instance.update(status="TERMINATED", statusMessage="Instance was preempted.", lastStopTimestamp=gce_time())
            self._operation_for(zone, PREEMPTED_OPERATION, instance["selfLink"], done=True)
            if delete:
                del self.instances[(zone, name)]

    def snapshot(self) -> dict[tuple[str, str], dict]:
        with self.lock:
            return {key: json.loads(json.dumps(value)) for key, value in self.instances.items()}



class FakeGceMetadata:
    """One instance's GCE metadata server: ``Metadata-Flavor: Google`` required, ``instance/preempted``
    FALSE until ``preempt``, long polls (``wait_for_change``, ``last_etag``, ``timeout_sec``) held
    until the value changes.  ``host`` is what GCE_METADATA_HOST takes."""

    def __init__(self, servers: LoopServers, name: str = "vm", zone: str = "us-central1-a") -> None:
        from aiohttp import web

        self.servers, self.name, self.zone = servers, name, zone
        self.preempted = False
        self.version = 0
        self.reads: list[tuple[float, str, bool]] = []  # (time, path, long poll)
        self.waiting = 0  # long polls held now
        self._changed = asyncio.Event()
        app = web.Application()
        app.router.add_get("/computeMetadata/v1/{path:.*}", self._read)
        app.on_shutdown.append(self._wake_all)
        self.host = f"127.0.0.1:{servers.serve(app)}"

    @property
    def etag(self) -> str:
        return f"etag{self.version:08x}"

    async def _read(self, request):
        from aiohttp import web

        if request.headers.get("Metadata-Flavor") != "Google":
            return web.Response(status=403, text="Missing required header \"Metadata-Flavor\": \"Google\"")
        path = request.match_info["path"]
        wait = request.query.get("wait_for_change") == "true"
        self.reads.append((time.time(), path, wait))
        last = request.query.get("last_etag")
        if wait and path == "instance/preempted" and last in (None, self.etag):
            changed = self._changed
            self.waiting += 1
            try:
                await asyncio.wait_for(changed.wait(), float(request.query.get("timeout_sec", 3600)))
            except asyncio.TimeoutError:
                pass
            finally:
                self.waiting -= 1
        answers = {"instance/preempted": "TRUE" if self.preempted else "FALSE", "instance/name": self.name,
                   "instance/zone": f"projects/123456789/zones/{self.zone}"}
        if path not in answers:
            return web.Response(status=404, headers={"Metadata-Flavor": "Google"})
        return web.Response(text=answers[path], headers={"Metadata-Flavor": "Google", "ETag": self.etag})

    async def _wake_all(self, app) -> None:
        self._changed.set()  # the server is closing: answer every long poll now

    def preempt(self) -> None:
        """GCE's notice: ``instance/preempted`` turns TRUE, and every long poll is answered."""
        async def flip() -> None:
            self.preempted = True
            self.version += 1
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

        self.servers.call(flip())


class GceHarness(MachineHarness):
    """GCE's machines: booted from their ``startup-script`` metadata, each with a fake metadata
    server (GCE_METADATA_HOST); a preemption turns ``preempted`` TRUE, then after the window the
    instance is TERMINATED in the API as a preemption."""

    name = "gce"

    def __init__(self, api: FakeComputeApi, servers: LoopServers, state_dir: Path) -> None:
        self.api = api
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


@pytest.fixture
def gce_api(loop_servers: LoopServers) -> FakeComputeApi:
    pytest.importorskip("google.cloud.compute_v1")
    return FakeComputeApi(loop_servers)


@pytest.fixture
def gce_harness(gce_api: FakeComputeApi, loop_servers: LoopServers, tmp_path: Path) -> Iterator[GceHarness]:
    with closing(GceHarness(gce_api, loop_servers, tmp_path / "machines")) as harness:
        yield harness


@pytest.fixture
def gce_metadata(loop_servers: LoopServers) -> FakeGceMetadata:
    return FakeGceMetadata(loop_servers)
