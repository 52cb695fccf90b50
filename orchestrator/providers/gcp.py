"""GCE Spot VMs through google-cloud-compute: one ``instances.insert`` per instance, labelled with the run.

The node type's ``node_config`` is the Instance resource as in Ray's GCP cluster YAML
(``machineType``, ``disks``, ``networkInterfaces``, ``guestAccelerators``, ``serviceAccounts``,
``metadata``, ``scheduling``, checked against the Instance message at load); this adds the name,
the zone (in the machine, accelerator and disk type URLs), the run's labels, the boot script as
``startup-script`` metadata, a boot disk from ``provider.image`` and the default network when the
node config has none, and the market: ``scheduling.provisioningModel: SPOT`` (with
``instanceTerminationAction``, DELETE unless given) for spot, ``STANDARD`` on demand.  GCE has
no price API this uses: spot and on-demand prices come from the config.

Errors are sorted once, here: no capacity (ZONE_RESOURCE_POOL_EXHAUSTED, QUOTA_EXCEEDED, a
resource not ready: the next zone, then on-demand; the policy decides), rate limits (429, or 403
with reason rateLimitExceeded: retried with exponential backoff and jitter), refused credentials
(401, other 403s: the run stops), anything else (a launch failure the policy backs off from).
Notices come from the instances' own metadata watchers; ``poll_terminated`` reconciles with
``instances.list``.  Every call is zone-scoped, so a node type in a region of its own needs only its
zones: the run's instances are listed in every zone of every node type.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import urllib.parse
from collections.abc import Callable
from datetime import datetime
from typing import Any

from orchestrator.config.gcp import STARTUP_SCRIPT, TAGS_ITEM, canonical
from orchestrator.config.schema import ClusterConfig
from orchestrator.config.tags import NODE_TYPE_TAG, RUN_TAG
from orchestrator.providers.base import (
    CapacityError,
    Instance,
    LaunchSpec,
    ProviderAuthError,
    ProviderError,
    Transient,
    retry_transient,
)
from orchestrator.providers.cloud import CloudProvider, Machine

logger = logging.getLogger(__name__)

# GCE's error codes (an operation's error.errors[].code) and reasons (an HTTP error's
# errors[].reason, camelCase), both compared as UPPER_SNAKE
CAPACITY_CODES = frozenset({"ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
                            "QUOTA_EXCEEDED", "RESOURCE_NOT_READY", "RESOURCE_POOL_EXHAUSTED"})
THROTTLE_CODES = frozenset({"RATE_LIMIT_EXCEEDED", "USER_RATE_LIMIT_EXCEEDED", "BACKEND_ERROR"})
LIVE_STATES = frozenset({"PROVISIONING", "STAGING", "RUNNING", "PENDING", "REPAIRING"})
GONE_STATES = frozenset({"STOPPING", "STOPPED", "SUSPENDING", "SUSPENDED", "TERMINATED", "PENDING_STOP",
                         "DEPROVISIONING"})
PREEMPTED_OPERATION = "compute.instances.preempted"
DEFAULT_NETWORK = [{"network": "global/networks/default",
                    "accessConfigs": [{"name": "External NAT", "type": "ONE_TO_ONE_NAT"}]}]
METADATA_VALUE_LIMIT = 256 * 1024  # GCE refuses a larger metadata value
_LABEL_VALUE = re.compile(r"[a-z0-9_-]{0,63}")
_INSTANCE_NAME = re.compile(r"[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?")


class GceApiError(ProviderError):
    """A GCE call failed with this HTTP status (404: no such resource, 409: it exists already)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _constant(name: str) -> str:
    """``rateLimitExceeded`` and ``RATE_LIMIT_EXCEEDED`` alike as the latter."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).upper()


def _digest(value: str) -> str:
    return hashlib.sha1(value.encode()).hexdigest()[:8]


def label_value(value: str) -> str:
    """A tag value as a GCE label value (lowercase letters, digits, '-' and '_', at most 63
    characters).  A value that is not one already becomes its cleaned prefix and a hash of it, so
    distinct values stay distinct; the exact tags are in the ``spotswarm-tags`` metadata item."""
    if _LABEL_VALUE.fullmatch(value):
        return value
    clean = re.sub(r"[^a-z0-9_-]", "-", value.lower())
    return f"{clean[:54]}-{_digest(value)}"


def instance_name(instance_id: str) -> str:
    """The GCE name of an instance (a lowercase letter first, then letters, digits and '-', at most
    63): the run's id when it is one, else its cleaned form and a hash."""
    if _INSTANCE_NAME.fullmatch(instance_id):
        return instance_id
    clean = re.sub(r"[^a-z0-9-]", "-", instance_id.lower()).strip("-")
    return f"ss-{clean[:50].rstrip('-')}-{_digest(instance_id)}"


def label_filter(tag_filters: dict[str, str]) -> str:
    """instances.list's filter for instances carrying every one of these tags (as labels)."""
    return " ".join(f'(labels.{key} = "{label_value(value)}")' for key, value in sorted(tag_filters.items()))


def _last_part(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


def _api_error_codes(error: Any) -> set[str]:
    """The reasons of an HTTP error (errors[].reason and ErrorInfo's), as UPPER_SNAKE."""
    reasons = {e.get("reason", "") for e in getattr(error, "errors", None) or [] if isinstance(e, dict)}
    reasons.add(getattr(error, "reason", None) or "")
    return {_constant(r) for r in reasons if r}


def _make_clients(config: ClusterConfig) -> tuple[Any, Any]:
    """The instances and zone operations clients (``_client``)."""
    try:
        from google.cloud import compute_v1
        from google.cloud.compute_v1.services.instances.transports.rest import InstancesRestTransport
        from google.cloud.compute_v1.services.zone_operations.transports.rest import ZoneOperationsRestTransport
    except ImportError:
        raise ProviderError("the gcp provider needs google-cloud-compute: pip install 'spotswarm[gcp]'") from None
    return (_client(config, compute_v1.InstancesClient, InstancesRestTransport),
            _client(config, compute_v1.ZoneOperationsClient, ZoneOperationsRestTransport))


def _client(config: ClusterConfig, client: Any, transport: Any) -> Any:
    """A google-cloud-compute client: to ``provider.endpoint_url`` when given (an ``http://`` one is a
    stand-in such as the tests' fake API and gets anonymous credentials, never real ones in clear text),
    else to GCE with the default credentials."""
    from google.auth.exceptions import DefaultCredentialsError

    url = config.provider.endpoint_url
    try:
        if url is None:
            return client()
        from google.auth.credentials import AnonymousCredentials

        parts = urllib.parse.urlsplit(url)
        credentials = AnonymousCredentials() if parts.scheme == "http" else None
        return client(transport=transport(host=parts.netloc, url_scheme=parts.scheme, credentials=credentials))
    except DefaultCredentialsError as e:
        raise ProviderAuthError(f"no Google credentials found ({e}); set GOOGLE_APPLICATION_CREDENTIALS, run "
                                "`gcloud auth application-default login`, or run on a VM with a service "
                                "account; see docs/gcp.md") from None


class GcpProvider(CloudProvider):
    """The ``gcp`` provider; every method that talks to GCE may block (the policy runs them on
    threads), ``price`` answers from the config."""

    #: seconds a launch waits for its insert operation
    operation_timeout_s: float = 300.0
    #: seconds one HTTP request may take
    request_timeout_s: float = 60.0

    def __init__(self, config: ClusterConfig, clock: Any, clients: tuple[Any, Any] | None = None,
                 max_attempts: int = 8) -> None:
        if config.provider.project is None:
            raise ProviderError("the gcp provider needs provider.project_id (or provider.project)")
        super().__init__(config, clock, max_attempts)
        self.project = config.provider.project
        self.instances_api, self.operations_api = clients or _make_clients(config)
        self.zones = list(config.provider.zones)
        if not self.zones:
            raise ProviderError("the gcp provider needs provider.zones (or provider.availability_zone)")
        self.list_zones = every_zone(config)
        self._list_zone(self.zones[0], {RUN_TAG: config.cluster_name}, max_results=1)  # refused credentials: now

    def project_number(self) -> str:
        """The run's project's number (what a Cloud Storage bucket names as its owner)."""
        from google.cloud import compute_v1
        from google.cloud.compute_v1.services.projects.transports.rest import ProjectsRestTransport

        projects = _client(self.config, compute_v1.ProjectsClient, ProjectsRestTransport)
        project = self._call("projects.get", projects.get, project=self.project)
        return str(project.id)

    # ---- calling GCE -----------------------------------------------------------------------------
    def _call(self, method: str, fn: Callable[..., Any], call_timeout: float | None = None, **request: Any) -> Any:
        """One GCE call: rate limits and transient failures are retried with exponential backoff
        and jitter; every other failure becomes a ProviderError (or CapacityError,
        ProviderAuthError) naming the call."""
        return retry_transient(f"GCE {method}", self.max_attempts, self._call_once, method, fn, request,
                               call_timeout or self.request_timeout_s)

    def _call_once(self, method: str, fn: Callable[..., Any], request: dict, timeout: float) -> Any:
        import requests
        from google.api_core import exceptions as api
        from google.auth import exceptions as auth

        self.calls[method] += 1
        try:
            return fn(request=request, retry=None, timeout=timeout)
        except api.GoogleAPICallError as e:
            error = self._classify(method, e)
            if isinstance(error, Transient):
                raise error from e
            raise error from None
        except (auth.TransportError, requests.RequestException) as e:  # unreachable, timeouts: transient
            raise Transient() from e
        except auth.GoogleAuthError as e:  # a 401 whose refresh failed (revoked, anonymous credentials)
            if getattr(e, "retryable", False) or isinstance(e.__cause__, (auth.TransportError,
                                                                           requests.RequestException)):
                raise Transient() from e  # the token endpoint was unreachable for a moment
            raise ProviderAuthError(f"GCE {method}: refused the run's credentials or permissions, and new ones "
                                    f"could not be had ({type(e).__name__}: {e}); see docs/gcp.md") from None

    def _classify(self, method: str, error: Any) -> Exception:
        codes, status = _api_error_codes(error), getattr(error, "code", 0) or 0
        details = [e.get("message") for e in getattr(error, "errors", None) or [] if isinstance(e, dict)]
        message = next((m for m in details if m), error.message)  # GCE's words, without the request's URL
        text = f"GCE {method}: {status} {', '.join(sorted(codes)) or type(error).__name__}: {message}"
        if codes & CAPACITY_CODES:  # QUOTA_EXCEEDED comes as a 403: sorted before the refusals
            return CapacityError(text, "", "")
        if codes & THROTTLE_CODES or status in (429, 500, 502, 503, 504):
            return Transient()
        if status in (401, 403):
            return ProviderAuthError(f"GCE refused the run's credentials or permissions ({text}); see "
                                     "docs/gcp.md for the IAM roles needed")
        return GceApiError(text, status)

    def _wait(self, zone: str, operation: Any) -> Any:
        """Wait for a zone operation to be DONE (zoneOperations.wait holds each request up to
        two minutes server-side)."""
        from google.cloud import compute_v1

        deadline = time.monotonic() + self.operation_timeout_s
        while operation.status != compute_v1.Operation.Status.DONE:
            if time.monotonic() > deadline:
                raise ProviderError(f"GCE operation {operation.name} in {zone} still running after "
                                    f"{self.operation_timeout_s:.0f} s")
            operation = self._call("zoneOperations.wait", self.operations_api.wait, call_timeout=150.0,
                                   project=self.project, zone=zone, operation=operation.name)
        return operation

    # ---- prices ----------------------------------------------------------------------------------
    def price(self, node_type: str, zone: str, market: str) -> float:
        """From the config: GCE publishes prices in the Cloud Billing catalog, not its compute API."""
        return self.config.available_node_types[node_type].price(zone, market)

    # ---- launching -------------------------------------------------------------------------------
    def insert_body(self, spec: LaunchSpec) -> dict[str, Any]:
        """The Instance resource for one launch (GCE's JSON): the node config plus what spotswarm sets."""
        body = canonical(spec.node_config)
        zone = spec.zone
        if "machineType" not in body:
            raise ProviderError(f"node type {spec.node_type!r}: no node_config.machineType")
        body["name"] = instance_name(spec.instance_id)
        body["machineType"] = f"zones/{zone}/machineTypes/{body['machineType']}"
        for accelerator in body.get("guestAccelerators", []):
            accelerator["acceleratorType"] = (f"projects/{self.project}/zones/{zone}/acceleratorTypes/"
                                              f"{accelerator['acceleratorType']}")
        body["disks"] = self._disks(spec, body.get("disks", []))
        body.setdefault("networkInterfaces", DEFAULT_NETWORK)
        body["labels"] = {**body.get("labels", {}), **{k: label_value(v) for k, v in spec.tags.items()}}
        body["metadata"] = self._metadata(spec, body.get("metadata", {}))
        body["scheduling"] = self._scheduling(spec.market, body.get("scheduling", {}))
        return body

    def _disks(self, spec: LaunchSpec, disks: list[dict]) -> list[dict]:
        image = self.config.provider.image
        if not disks:
            if image is None:
                raise ProviderError(f"node type {spec.node_type!r}: no boot disk (node_config.disks or "
                                    "provider.image)")
            return [{"boot": True, "autoDelete": True, "initializeParams": {"sourceImage": image}}]
        for disk in disks:
            params = disk.get("initializeParams")
            if params is None:
                continue
            if disk.get("boot") and "sourceImage" not in params and "sourceSnapshot" not in params and image:
                params["sourceImage"] = image
            if "diskType" in params:
                params["diskType"] = f"zones/{spec.zone}/diskTypes/{params['diskType']}"
        return disks

    @staticmethod
    def _metadata(spec: LaunchSpec, metadata: dict) -> dict:
        items = [i for i in metadata.get("items", []) if i.get("key") not in (STARTUP_SCRIPT, TAGS_ITEM)]
        items.append({"key": TAGS_ITEM, "value": json.dumps(spec.tags, sort_keys=True)})
        if spec.boot_script:
            if len(spec.boot_script.encode()) > METADATA_VALUE_LIMIT:
                raise ProviderError(f"the boot script is {len(spec.boot_script.encode())} bytes; GCE takes "
                                    f"{METADATA_VALUE_LIMIT} in a metadata value")
            items.append({"key": STARTUP_SCRIPT, "value": spec.boot_script})
        return {**metadata, "items": items}

    @staticmethod
    def _scheduling(market: str, scheduling: dict) -> dict:
        """Spot: provisioningModel SPOT, no live migration or restart (GCE requires it), DELETE on
        preemption unless the node config says STOP.  On demand: STANDARD, nothing spot-only."""
        if market == "spot":
            return {**scheduling, "provisioningModel": "SPOT", "onHostMaintenance": "TERMINATE",
                    "automaticRestart": False,
                    "instanceTerminationAction": scheduling.get("instanceTerminationAction", "DELETE")}
        out = {k: v for k, v in scheduling.items() if k not in ("preemptible", "instanceTerminationAction")}
        return {**out, "provisioningModel": "STANDARD"}

    def launch(self, spec: LaunchSpec) -> Instance:
        from google.cloud import compute_v1

        body = self.insert_body(spec)
        resource = compute_v1.Instance.from_json(json.dumps(body))
        try:
            operation = self._call("instances.insert", self.instances_api.insert_unary, project=self.project,
                                   zone=spec.zone, instance_resource=resource)
            errors = list(self._wait(spec.zone, operation).error.errors)
        except CapacityError as e:
            raise CapacityError(str(e), spec.zone, spec.market) from None
        except GceApiError as e:
            if e.status != 409:  # alreadyExists: a launch retried after its first answer was lost
                raise
            errors = []
        if errors:
            codes = {_constant(e.code) for e in errors}
            text = f"GCE instances.insert in {spec.zone}: " + "; ".join(f"{e.code}: {e.message}" for e in errors)
            if codes & CAPACITY_CODES:
                raise CapacityError(text, spec.zone, spec.market)
            raise ProviderError(text)
        return self._launched(spec, body["name"])

    def _delete(self, zone: str, name: str) -> None:
        """Delete an instance (not waiting for it: GCE takes tens of seconds); gone already is fine."""
        try:
            self._call("instances.delete", self.instances_api.delete_unary, project=self.project, zone=zone,
                       instance=name)
        except GceApiError as e:
            if e.status != 404:
                raise

    def terminate(self, instance: Instance) -> None:
        self._delete(instance.zone, instance.handle)
        self._forget([instance.id])

    # ---- the fleet as GCE sees it ----------------------------------------------------------------
    def _list_zone(self, zone: str, tag_filters: dict[str, str], max_results: int = 500) -> list[Any]:
        found, token = [], ""
        while True:
            page_token = {"page_token": token} if token else {}
            pager = self._call("instances.list", self.instances_api.list, project=self.project, zone=zone,
                               filter=label_filter(tag_filters), max_results=max_results, **page_token)
            page = next(iter(pager.pages))  # one page per call: each is counted and retried alone
            found += list(page.items)
            token = page.next_page_token
            if not token or max_results == 1:
                return found

    def _list(self, tag_filters: dict[str, str]) -> list[Any]:
        return [i for zone in self.list_zones for i in self._list_zone(zone, tag_filters)]

    def _tags(self, described: Any) -> dict[str, str]:
        """The exact tags (the metadata item), else the labels (lowercased, maybe hashed)."""
        for item in described.metadata.items if described.metadata else []:
            if item.key == TAGS_ITEM:
                try:
                    return dict(json.loads(item.value))
                except ValueError:
                    break
        return dict(described.labels)

    def _machine(self, described: Any) -> Machine:
        interfaces = list(described.network_interfaces)
        return Machine(described.name, self._tags(described), _last_part(described.zone), _is_spot(described),
                       _timestamp(described.creation_timestamp),
                       address=interfaces[0].network_i_p if interfaces else "", state=described.status)

    def heads(self) -> list[Machine]:
        if self.config.head_node_type is None:
            return []
        tags = {RUN_TAG: self.config.cluster_name, NODE_TYPE_TAG: self.config.head_node_type}
        return [self._machine(d) for d in self._list(tags) if d.status in LIVE_STATES]

    def release_head(self, machine: Machine) -> None:
        self._delete(machine.zone, machine.handle)

    def console_output(self, machine: Machine) -> str:
        try:
            answer = self._call("instances.getSerialPortOutput", self.instances_api.get_serial_port_output,
                                project=self.project, zone=machine.zone, instance=machine.handle, port=1)
        except GceApiError as e:
            if e.status == 404:
                return ""
            raise
        return answer.contents

    def _release(self, described: Any) -> None:
        self._delete(_last_part(described.zone), described.name)

    def list(self, tag_filters: dict[str, str]) -> list[Instance]:
        return self._adopt(d for d in self._list(tag_filters) if d.status in LIVE_STATES)

    def poll_terminated(self, now: float) -> list[str]:
        """Instances GCE no longer runs (preempted when it says so, see ``_preempted_by_status``);
        stopped ones are deleted (their disks bill on); orphans (labelled instances nobody launched
        or adopted, e.g. after a lost answer) are released."""
        mine = self._held()
        described = self._list({RUN_TAG: self.config.cluster_name})
        seen, gone = set(), []
        for d in described:
            seen.add(d.name)
            inst = mine.get(d.name)
            if inst is not None and d.status in GONE_STATES:
                if _preempted_by_status(d):
                    self._preempted.add(inst.id)
                gone.append(inst.id)
                if d.status in ("TERMINATED", "STOPPED", "SUSPENDED"):
                    self._delete_stopped(d)
            elif inst is None and d.status in LIVE_STATES:
                self._release_orphan(d)
            elif inst is None and d.status in ("TERMINATED", "STOPPED", "SUSPENDED"):
                self._delete_stopped(d)  # a stopped VM of the run nobody holds (a previous supervisor's)
        vanished = [inst for name, inst in mine.items() if name not in seen]  # deleted (DELETE on preemption)
        self._preempted.update(self._preempted_by_operations(vanished))
        gone += [inst.id for inst in vanished]
        self._forget(gone)
        return gone

    def _delete_stopped(self, described: Any) -> None:
        """A stopped VM of the run is never started again; deleted, it stops billing for its disk
        (a failure is only logged: the next poll sees it again)."""
        try:
            self._delete(_last_part(described.zone), described.name)
        except ProviderError as e:
            logger.warning("could not delete the stopped instance %s: %s", described.name, e)

    def _preempted_by_operations(self, vanished: list[Instance]) -> set[str]:
        """Which of these deleted instances GCE preempted first: the zone's compute.instances.preempted
        operations name them (one zoneOperations.list per zone, only when something vanished)."""
        out: set[str] = set()
        for zone in sorted({inst.zone for inst in vanished}):
            try:
                pager = self._call("zoneOperations.list", self.operations_api.list, project=self.project, zone=zone,
                                   filter=f'operationType = "{PREEMPTED_OPERATION}"')
                targets = {_last_part(op.target_link) for op in next(iter(pager.pages)).items}
            except ProviderError as e:
                logger.warning("could not ask GCE which instances it preempted in %s: %s", zone, e)
                continue
            out |= {inst.id for inst in vanished if inst.zone == zone and inst.handle in targets}
        return out

    def shutdown(self) -> None:
        for client in (self.instances_api, self.operations_api):
            transport = getattr(client, "transport", None)
            if transport is not None:
                transport.close()


def every_zone(config: ClusterConfig) -> list[str]:
    """Every zone the run may have instances in: the provider's, then each node type's own, once each."""
    zones = list(config.provider.zones)
    for name in config.available_node_types:
        zones += [z for z in config.zones_of(name) if z not in zones]
    return zones


def _is_spot(described: Any) -> bool:
    scheduling = described.scheduling
    return bool(scheduling) and (scheduling.provisioning_model == "SPOT" or bool(scheduling.preemptible))


def _preempted_by_status(described: Any) -> bool:
    """GCE took it back: its status message says so, or it is a Spot VM that stopped (spotswarm
    itself never stops instances, it deletes them)."""
    return "preempt" in (described.status_message or "").lower() or (
        _is_spot(described) and described.status in ("STOPPING", "STOPPED", "TERMINATED"))


def _timestamp(text: str) -> float:
    """GCE's RFC 3339 times (``2026-01-02T03:04:05.678-08:00``) as epoch seconds (now if unreadable)."""
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except (ValueError, AttributeError):
        return time.time()


def terminate_run(config: ClusterConfig, clock: Any = time.time, tags: dict[str, str] | None = None) -> list[str]:
    """Delete every instance labelled with the run (and with ``tags``, if given), in every zone of the
    config (``spotswarm down`` when no head is left)."""
    provider = GcpProvider(config, clock)
    try:
        names = []
        for zone in provider.list_zones:
            for described in provider._list_zone(zone, {RUN_TAG: config.cluster_name, **(tags or {})}):
                provider._delete(zone, described.name)
                names.append(described.name)
        return names
    finally:
        provider.shutdown()
