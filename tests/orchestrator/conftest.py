"""Cloud stand-ins shared by the orchestrator tests: moto in server mode (real HTTP; boto3 reaches
it through ``endpoint_url``) for EC2 and S3."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest

FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "moto did not start"
                time.sleep(0.1)  # waiting for the server process to listen, bounded
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
    servers = LoopServers()
    try:
        yield servers
    finally:
        servers.close()


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
    ec2_id: str
    instance_id: str  # the run's name for it (its spotswarm-instance tag)
    imds: FakeImds
    leader: int
    temp_dir: Path
    booted_at: float
    noticed_at: float | None = None
    killed_at: float | None = None


class Ec2Harness:
    """Plays EC2's machines: every instance moto reports running is booted here from its own user
    data (its ``ray start`` joins the head as a new Ray node), with a fake IMDS of its own; an
    instance terminated through the API has its node stopped; ``preempt`` shows the interruption
    notice in the instance's IMDS, then terminates it in moto as a spot reclaim and kills its node."""

    def __init__(self, endpoint: str, servers: LoopServers, state_dir: Path, region: str = "us-east-1") -> None:
        import boto3
        from moto.backends import get_backend
        from moto.core import DEFAULT_ACCOUNT_ID

        self.ec2 = boto3.client("ec2", region_name=region, endpoint_url=endpoint)
        self.backend = get_backend("ec2")[DEFAULT_ACCOUNT_ID][region]
        self.servers = servers
        self.state_dir = state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        self.machines: dict[str, Machine] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="ec2-harness", daemon=True)
        self._thread.start()

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

    def _step(self) -> None:
        pages = self.ec2.describe_instances()["Reservations"]
        for described in [i for r in pages for i in r["Instances"]]:
            ec2_id, state = described["InstanceId"], described["State"]["Name"]
            machine = self.machines.get(ec2_id)
            if machine is None and state in ("pending", "running"):
                self._boot(described)
            elif machine is not None and state in ("shutting-down", "terminated", "stopped") and not machine.killed_at:
                self._power_off(machine, signal.SIGTERM)

    def _boot(self, described: dict) -> None:
        from orchestrator.providers.local_nodes import boot_detached

        ec2_id = described["InstanceId"]
        tags = {t["Key"]: t["Value"] for t in described.get("Tags", [])}
        user_data = self.ec2.describe_instance_attribute(InstanceId=ec2_id, Attribute="userData")
        script = base64.b64decode(user_data["UserData"].get("Value", "")).decode()
        imds = FakeImds(self.servers, ec2_id, described["Placement"]["AvailabilityZone"])
        temp_dir = Path(tempfile.mkdtemp(prefix="ec2-", dir="/tmp"))  # short: Ray's socket paths
        env = dict(os.environ, AWS_EC2_METADATA_SERVICE_ENDPOINT=imds.url, SPOTSWARM_NODE_TMP=str(temp_dir),
                   PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
        for key in FAKE_CREDENTIALS:  # a machine has its own instance profile, not the operator's keys
            env.pop(key, None)
        leader = boot_detached(script, self.state_dir, ec2_id, env)
        with self._lock:
            self.machines[ec2_id] = Machine(ec2_id, tags.get("spotswarm-instance", ec2_id), imds, leader, temp_dir,
                                            time.time())

    def _power_off(self, machine: Machine, sig: int) -> None:
        from orchestrator.providers.local_nodes import kill_node, node_alive

        machine.killed_at = machine.killed_at or time.time()
        kill_node(machine.leader, sig)
        if sig == signal.SIGTERM:
            deadline = time.monotonic() + 20
            while node_alive(machine.leader) and time.monotonic() < deadline:
                time.sleep(0.1)  # a shutdown's grace, bounded
            kill_node(machine.leader, signal.SIGKILL)

    def preempt(self, instance_id: str, notice_s: float) -> Machine:
        """The interruption notice now; the reclaim ``notice_s`` later (on a timer: EC2's own clock)."""
        machine = self.by_instance(instance_id)
        machine.imds.announce("terminate", notice_s)
        machine.noticed_at = time.time()
        timer = threading.Timer(notice_s, self.reclaim, args=(machine,))
        timer.daemon = True
        timer.start()
        return machine

    def reclaim(self, machine: Machine) -> None:
        """EC2 takes the spot instance back: terminated with the spot reason, and its power is cut."""
        from moto.ec2.models.instances import StateReason

        self._power_off(machine, signal.SIGKILL)
        self.backend.terminate_instances([machine.ec2_id])
        instance = self.backend.get_instance(machine.ec2_id)
        instance.state_reason = StateReason("Server.SpotInstanceTermination: Spot instance termination",
                                            "Server.SpotInstanceTermination")

    def crash_all(self) -> None:
        """Every machine's Ray node dies at once (SIGKILL); EC2 still lists them as running."""
        with self._lock:
            machines = list(self.machines.values())
        for machine in machines:
            self._power_off(machine, signal.SIGKILL)

    def alive(self) -> list[str]:
        from orchestrator.providers.local_nodes import node_alive

        with self._lock:
            return sorted(m.instance_id for m in self.machines.values() if node_alive(m.leader))

    def close(self) -> None:
        import shutil

        self._stop.set()
        self._thread.join(timeout=10)
        for machine in list(self.machines.values()):
            self._power_off(machine, signal.SIGKILL)
            shutil.rmtree(machine.temp_dir, ignore_errors=True)


@pytest.fixture
def ec2_harness(aws: str, loop_servers: LoopServers, tmp_path: Path) -> Iterator[Ec2Harness]:
    harness = Ec2Harness(aws, loop_servers, tmp_path / "machines")
    try:
        yield harness
    finally:
        harness.close()


@pytest.fixture
def fake_imds(loop_servers: LoopServers) -> FakeImds:
    return FakeImds(loop_servers, "i-0123456789abcdef0", "us-east-1a")


# ---- Ray heads of their own, as on separate head machines ------------------------------------------
ROOT = Path(__file__).resolve().parents[2]


def kill_session(leader: int) -> None:
    """SIGKILL every process of a session (a machine's power cut: Ray gives workers their own groups)."""
    import psutil

    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == leader:
                proc.send_signal(signal.SIGKILL)
        except (OSError, psutil.Error):
            continue


class RayHead:
    """``ray start --head`` with its own token and temp dir, in a session of its own."""

    def __init__(self, name: str, log: Path) -> None:
        self.temp = Path(f"/tmp/ssw-{name}-{os.getpid()}")  # short: Ray's socket paths must fit in 107 bytes
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
                    "PYTHONPATH": str(ROOT)}
        self.env.pop("RAY_ADDRESS", None)
        ray = Path(sys.executable).with_name("ray")
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [str(ray), "start", "--head", "--port", str(free_port()), "--num-cpus", "1", "--include-dashboard",
                 "false", "--disable-usage-stats", "--temp-dir", str(self.temp), "--ray-client-server-port",
                 str(free_port()), "--block"], env=self.env, stdout=out, stderr=out, start_new_session=True)
        address_file = self.temp / "ray_current_cluster"
        deadline = time.monotonic() + 60
        while not address_file.exists():
            assert time.monotonic() < deadline and self.process.poll() is None, f"the Ray head did not start: {log}"
            time.sleep(0.1)  # polling for the head to write its address, bounded
        self.address = address_file.read_text().strip()

    def kill(self) -> None:
        kill_session(self.process.pid)
        self.process.wait(timeout=30)

    def cleanup(self) -> None:
        if self.process.poll() is None:
            self.kill()
        subprocess.run(["rm", "-rf", str(self.temp)], check=False)


@pytest.fixture
def ray_heads(tmp_path: Path) -> Iterator:
    """Start Ray heads by name (``ray_heads("a")``); every one is killed and cleaned up after the test."""
    pytest.importorskip("ray")
    started: list[RayHead] = []

    def start(name: str) -> RayHead:
        head = RayHead(name, tmp_path / f"ray-head-{name}.log")
        started.append(head)
        return head

    try:
        yield start
    finally:
        for head in started:
            head.cleanup()
