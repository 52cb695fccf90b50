"""GCE without a project: Compute Engine v1's REST API for instances, zone operations and the project's
own record (``projects.get``: its number), in memory,
with GCE's answers and error bodies (the real google-cloud-compute client talks to it over HTTP), and
one instance's metadata server, whose ``instance/preempted`` a test turns TRUE."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

from tests.fakes.servers import LoopServers

GCE_PROJECT = "my-project"
# the project's number: the one gcp-storage-emulator names as every bucket's owner, so that a bucket made
# there counts as the project's own (a test that wants another owner sets ``project_number``)
GCE_PROJECT_NUMBER = "1234"
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
        self.project_number = GCE_PROJECT_NUMBER
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
        self.console: Callable[[str, str], str] = lambda zone, name: ""  # a VM's serial port 1 (the harness's)
        base = "/compute/v1/projects/{project}/zones/{zone}"
        @web.middleware
        async def gate(request, handler):
            return await self._gate(request, handler)

        app = web.Application(middlewares=[gate], client_max_size=1 << 22)
        app.router.add_get("/compute/v1/projects/{project}", self._project, name="projects.get")
        app.router.add_post(base + "/instances", self._insert, name="instances.insert")
        app.router.add_get(base + "/instances", self._list, name="instances.list")
        app.router.add_get(base + "/instances/{name}", self._get, name="instances.get")
        app.router.add_delete(base + "/instances/{name}", self._delete, name="instances.delete")
        app.router.add_get(base + "/instances/{name}/serialPort", self._serial_port,
                           name="instances.getSerialPortOutput")
        app.router.add_get(base + "/operations", self._operations, name="zoneOperations.list")
        app.router.add_get(base + "/operations/{operation}", self._operation, name="zoneOperations.get")
        app.router.add_post(base + "/operations/{operation}/wait", self._operation, name="zoneOperations.wait")
        self.url = f"http://127.0.0.1:{servers.serve(app)}"

    async def _project(self, request):
        from aiohttp import web

        return web.json_response({"kind": "compute#project", "name": self.project, "id": self.project_number,
                                  "selfLink": f"https://www.googleapis.com/compute/v1/projects/{self.project}"})

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

    async def _serial_port(self, request):
        from aiohttp import web

        zone, name = request.match_info["zone"], request.match_info["name"]
        with self.lock:
            if (zone, name) not in self.instances:
                return gce_error(404, "notFound", f"The resource 'projects/{self.project}/zones/{zone}/instances/"
                                 f"{name}' was not found")
        contents = self.console(zone, name)[-(1 << 20):]  # GCE: the last 1 MB
        return web.json_response({"kind": "compute#serialPortOutput", "contents": contents, "start": "0",
                                  "next": str(len(contents.encode())), "selfLink": self._link(zone, "instances", name)})

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
