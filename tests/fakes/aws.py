"""AWS without an account: moto in server mode (real HTTP; boto3 reaches it through ``endpoint_url``)
for EC2 and S3, fake credentials, a proxy in front of moto that plays EC2's throttling, capacity and
credential errors and answers the console output of the machines the harness boots, and a fake IMDSv2 for
one instance (with its instance profile's credentials, where it has one)."""

from __future__ import annotations

import base64
import json
import logging
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from urllib.parse import parse_qs

from orchestrator.host.ports import free_port
from orchestrator.host.wait import wait_for
from tests.fakes.servers import LoopServers

FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@contextmanager
def moto_server() -> Iterator[str]:
    """moto's server in this process, on a loopback port: its URL; fake credentials in the environment
    (never a real account's) while it runs."""
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


@contextmanager
def moto_server_with_auth() -> Iterator[str]:
    """A moto server (a process of its own) that checks credentials (its IAM knows no users, so every
    key is refused): its URL once it listens."""
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


def reset_moto(endpoint: str) -> None:
    """A fresh moto account: every resource of the server at ``endpoint`` forgotten."""
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"), timeout=10)


class FakeImds:
    """One instance's IMDSv2: a session token (PUT), then metadata reads that present it."""

    def __init__(self, servers: LoopServers, ec2_id: str, zone: str, role: str | None = None) -> None:
        from aiohttp import web

        self.ec2_id, self.zone, self.role = ec2_id, zone, role  # role: its instance profile's
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
        if self.role:  # an instance profile's role: its temporary credentials, as botocore fetches them
            answers["iam/security-credentials/"] = self.role
            answers[f"iam/security-credentials/{self.role}"] = json.dumps(self._credentials())
        text = answers.get(path)
        return web.Response(status=404) if text is None else web.Response(text=text)

    @staticmethod
    def _credentials() -> dict:
        now = datetime.now(tz=timezone.utc)
        stamp = "%Y-%m-%dT%H:%M:%SZ"
        return {"Code": "Success", "LastUpdated": now.strftime(stamp), "Type": "AWS-HMAC",
                "AccessKeyId": FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                "SecretAccessKey": FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                "Token": FAKE_CREDENTIALS["AWS_SESSION_TOKEN"],
                "Expiration": (now + timedelta(hours=6)).strftime(stamp)}

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
        self.console: Callable[[str], str] = lambda ec2_id: ""  # an instance's console output (the harness's)
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

    def _console_output(self, ec2_id: str):
        from aiohttp import web

        output = base64.b64encode(self.console(ec2_id)[-(64 << 10):].encode()).decode()  # EC2: the last 64 KB
        stamp = datetime.now(tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")
        body = (f'<?xml version="1.0" encoding="UTF-8"?><GetConsoleOutputResponse '
                f'xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"><requestId>proxy</requestId>'
                f"<instanceId>{ec2_id}</instanceId><timestamp>{stamp}</timestamp><output>{output}</output>"
                f"</GetConsoleOutputResponse>")
        return web.Response(text=body, content_type="text/xml")

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
        if action == "GetConsoleOutput":  # moto's is a fixed sample; a machine's own comes from the harness
            return self._console_output(form.get("InstanceId", ""))
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
