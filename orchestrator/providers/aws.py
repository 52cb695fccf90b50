"""EC2 spot instances through boto3: one ``run_instances`` per instance, tagged with the run.

The node type's ``node_config`` goes to ``run_instances`` as in Ray's AWS cluster YAML; this adds
the tags, the boot script as user data, IMDSv2 (required), the zone (``Placement`` or the zone's
subnet from ``SubnetIds``) and the market (``InstanceMarketOptions`` for spot, none on demand).
Spot prices come from ``describe_spot_price_history`` (cached, refreshed from the poll thread);
on-demand prices from the config.  A node type may sit in a region of its own (``region``): the
provider keeps one EC2 client per region the run uses, and launches, terminates, lists and prices
each node type in its region.

Errors are sorted once, here: no capacity (next zone, then on-demand: the policy decides),
throttling (retried with exponential backoff and jitter), refused credentials (the run stops),
anything else (a launch failure the policy backs off from).  Notices come from the instances'
own IMDS watchers, not from here; ``poll_terminated`` reconciles with ``describe_instances``.
"""

from __future__ import annotations

import base64
import binascii
import logging
import time
from typing import Any

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

CAPACITY_CODES = frozenset({"InsufficientInstanceCapacity", "SpotMaxPriceTooLow", "MaxSpotInstanceCountExceeded",
                            "Unsupported", "InsufficientCapacity", "InsufficientHostCapacity",
                            "InsufficientReservedInstanceCapacity"})
THROTTLE_CODES = frozenset({"RequestLimitExceeded", "Throttling", "ThrottlingException", "RequestThrottled",
                            "ServiceUnavailable", "Unavailable", "InternalError", "SlowDown"})
AUTH_CODES = frozenset({"AuthFailure", "UnauthorizedOperation", "InvalidClientTokenId", "SignatureDoesNotMatch",
                        "OptInRequired", "Blocked", "ExpiredToken", "UnrecognizedClientException", "AccessDenied",
                        "AccessDeniedException", "InvalidAccessKeyId", "MissingAuthenticationToken"})
GONE_STATES = frozenset({"shutting-down", "terminated", "stopping", "stopped"})
SPOT_TERMINATION = "Server.SpotInstanceTermination"
DEFAULT_SPOT_OPTIONS = {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}
USER_DATA_LIMIT = 16 * 1024  # EC2 refuses larger user data
REGION_KEY = "SpotswarmRegion"  # added to a described instance: the region whose client listed it


def _subnet_ids(node_config: dict) -> list[str]:
    """A node config's subnets: Ray's ``SubnetIds`` and EC2's ``SubnetId``."""
    return [s for s in node_config.get("SubnetIds", []) + [node_config.get("SubnetId")] if s]


def _error_code(error: Exception) -> str:
    return getattr(error, "response", {}).get("Error", {}).get("Code", "") if hasattr(error, "response") else ""


class AwsProvider(CloudProvider):
    """The ``aws`` provider; every method that talks to EC2 may block (the policy runs them on
    threads), ``price`` answers from the cache."""

    #: seconds between refreshes of the spot price history
    price_ttl_s: float = 300.0

    def __init__(self, config: ClusterConfig, clock: Any, client: Any = None, max_attempts: int = 8) -> None:
        super().__init__(config, clock, max_attempts)
        self.region = config.provider.region
        self.ec2 = client or self._client(config, self.region)  # the provider region's
        self.clients: dict[str, Any] = {region: self.ec2 if region == self.region else self._client(config, region)
                                        for region in config.regions()}
        for ec2 in self.clients.values():
            ec2.meta.events.register("before-call.ec2.*", self._count)
        self._spot_prices: dict[tuple[str, str], float] = {}
        self._prices_at = float("-inf")
        self._region_zone_names: dict[str, list[str]] = {}
        self._subnets = self._zone_subnets()
        provider_subnets = [z for z, ids in self._subnets.items() if set(ids) & self._region_subnets(self.region)]
        self.zones = list(config.provider.zones) or sorted(provider_subnets) or self._region_zones(self.region)
        self._node_type_zones = {name: self._find_zones(name) for name in config.fleet_types()}
        self.refresh_prices()

    @staticmethod
    def _client(config: ClusterConfig, region: str) -> Any:
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise ProviderError("the aws provider needs boto3: pip install 'spotswarm[aws]'") from None
        # botocore's own retries are off: throttling is retried here, with jitter, and counted
        settings = Config(retries={"total_max_attempts": 1}, connect_timeout=10, read_timeout=60)
        return boto3.client("ec2", region_name=region, endpoint_url=config.provider.endpoint_url, config=settings)

    def _count(self, model: Any = None, **_: Any) -> None:
        self.calls[model.name if model is not None else "?"] += 1

    # ---- calling EC2 -----------------------------------------------------------------------------
    def _call(self, operation: str, region: str | None = None, **params: Any) -> dict:
        """One EC2 call in ``region`` (None: the provider's): throttling is retried with exponential
        backoff and jitter; every other failure becomes a ProviderError (or CapacityError,
        ProviderAuthError) naming the call."""
        region = region or self.region
        what = f"EC2 {operation}" if region == self.region else f"EC2 {operation} in {region}"
        return retry_transient(what, self.max_attempts, self._call_once, self.clients[region], operation, params)

    def _call_once(self, ec2: Any, operation: str, params: dict) -> dict:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        try:
            return getattr(ec2, operation)(**params)
        except ClientError as e:
            code = _error_code(e)
            message = e.response.get("Error", {}).get("Message", str(e))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in AUTH_CODES:
                raise ProviderAuthError(f"AWS refused the run's credentials or permissions for {operation} ({code}: "
                                        f"{message}); see docs/aws.md for the IAM permissions needed") from None
            if code in CAPACITY_CODES:  # EC2 answers some of these with a 500: sorted before the retries
                raise CapacityError(f"EC2 {operation}: {code}: {message}", "", "") from None
            if code in THROTTLE_CODES or status in (500, 502, 503, 504):
                raise Transient() from e
            raise ProviderError(f"EC2 {operation}: {code or status}: {message}") from None
        except NoCredentialsError:
            raise ProviderAuthError("no AWS credentials found (environment, ~/.aws or an instance profile); "
                                    "see docs/aws.md") from None
        except BotoCoreError as e:  # unreachable endpoint, timeouts: transient, retried
            raise Transient() from e

    # ---- zones and prices ------------------------------------------------------------------------
    def _region_subnets(self, region: str) -> set[str]:
        """The subnets the node types of ``region`` name."""
        return {s for name, nt in self.config.available_node_types.items()
                if self.config.region_of(name) == region for s in _subnet_ids(nt.node_config)}

    def _zone_subnets(self) -> dict[str, list[str]]:
        """Zone -> the subnets of every node type's ``SubnetIds``/``SubnetId`` (a zone's instances go
        to its subnet), each region's asked of that region (a zone's name is its region's alone)."""
        zones: dict[str, list[str]] = {}
        for region in self.clients:
            ids = sorted(self._region_subnets(region))
            if not ids:
                continue
            for subnet in self._call("describe_subnets", region=region, SubnetIds=ids)["Subnets"]:
                zones.setdefault(subnet["AvailabilityZone"], []).append(subnet["SubnetId"])
        return zones

    def _region_zones(self, region: str) -> list[str]:
        """Every available zone of ``region`` (asked once per region)."""
        if region not in self._region_zone_names:
            answer = self._call("describe_availability_zones", region=region,
                                Filters=[{"Name": "state", "Values": ["available"]}])
            self._region_zone_names[region] = sorted(z["ZoneName"] for z in answer["AvailabilityZones"])
        return self._region_zone_names[region]

    def _find_zones(self, name: str) -> list[str]:
        """Where a node type launches: as the provider's region does where it lists no zones and is in
        it; else its own zones; else its subnets' zones, or every zone of its region."""
        if self.config.uses_provider_zones(name):
            return self.zones
        own = self.config.zones_of(name)
        if own:
            return own
        mine = set(_subnet_ids(self.config.available_node_types[name].node_config))
        return sorted(z for z, ids in self._subnets.items() if mine & set(ids)) or \
            self._region_zones(self.config.region_of(name))

    def zones_for(self, node_type: str) -> list[str] | None:
        return self._node_type_zones.get(node_type)

    def _instance_type(self, node_type: str) -> str | None:
        return self.config.available_node_types[node_type].node_config.get("InstanceType")

    def refresh_prices(self) -> None:
        """The current spot price of every node type's instance type in every zone of its region (one
        call per type)."""
        prices: dict[tuple[str, str], float] = {}
        for name in self.config.available_node_types:
            kind = self._instance_type(name)
            if name == self.config.head_node_type or kind is None:
                continue
            history = self._call("describe_spot_price_history", region=self.config.region_of(name),
                                 InstanceTypes=[kind],
                                 ProductDescriptions=["Linux/UNIX", "Linux/UNIX (Amazon VPC)"],
                                 StartTime=time.time(), MaxResults=1000)["SpotPriceHistory"]
            newest: dict[str, tuple[Any, float]] = {}
            for row in history:
                zone, when = row["AvailabilityZone"], row["Timestamp"]
                if zone not in newest or when > newest[zone][0]:
                    newest[zone] = (when, float(row["SpotPrice"]))
            prices.update({(name, zone): price for zone, (_, price) in newest.items()})
        self._spot_prices = prices
        self._prices_at = time.monotonic()

    def price(self, node_type: str, zone: str, market: str) -> float:
        cached = self._spot_prices.get((node_type, zone)) if market == "spot" else None
        return cached if cached is not None else self.config.available_node_types[node_type].price(zone, market)

    # ---- launching -------------------------------------------------------------------------------
    def run_params(self, spec: LaunchSpec) -> dict[str, Any]:
        """``run_instances``'s parameters for one instance: the node config plus what spotswarm sets."""
        params = {k: v for k, v in spec.node_config.items() if k != "SubnetIds"}
        params.setdefault("ImageId", self.config.provider.image)
        if params["ImageId"] is None:
            raise ProviderError(f"node type {spec.node_type!r}: no ImageId (node_config.ImageId or provider.image)")
        params.update(MinCount=1, MaxCount=1)
        params.setdefault("InstanceInitiatedShutdownBehavior", "terminate")  # a shut-down machine stops billing
        params["MetadataOptions"] = {**params.get("MetadataOptions", {}), "HttpTokens": "required",
                                     "HttpEndpoint": "enabled"}
        subnets = _subnet_ids(spec.node_config)
        if subnets:
            in_zone = [s for s in subnets if s in self._subnets.get(spec.zone, [])]
            if not in_zone:
                raise CapacityError(f"no subnet of node type {spec.node_type!r} in zone {spec.zone}",
                                    spec.zone, spec.market)
            params["SubnetId"] = in_zone[0]
        else:
            params["Placement"] = {**params.get("Placement", {}), "AvailabilityZone": spec.zone}
        if spec.market == "spot":
            options = dict(params.get("InstanceMarketOptions") or {"MarketType": "spot"})
            spot_options = {**DEFAULT_SPOT_OPTIONS, **options.get("SpotOptions", {})}
            cap = self.config.spot.max_price_per_hour
            if cap is not None:
                spot_options.setdefault("MaxPrice", f"{cap:.4f}")
            params["InstanceMarketOptions"] = {**options, "MarketType": "spot", "SpotOptions": spot_options}
        else:
            params.pop("InstanceMarketOptions", None)
        if spec.boot_script:
            if len(spec.boot_script.encode()) > USER_DATA_LIMIT:
                raise ProviderError(f"the boot script is {len(spec.boot_script.encode())} bytes; EC2 takes "
                                    f"{USER_DATA_LIMIT} of user data")
            params["UserData"] = spec.boot_script
        params["TagSpecifications"] = self._tag_specifications(spec, params.get("TagSpecifications", []))
        return params

    @staticmethod
    def _tag_specifications(spec: LaunchSpec, given: list[dict]) -> list[dict]:
        tags = {"Name": f"spotswarm-{spec.instance_id}", **spec.tags}
        out, found = [], False
        for entry in given:
            if entry.get("ResourceType") == "instance":
                found = True
                mine = {t["Key"]: t["Value"] for t in entry.get("Tags", [])}
                entry = {**entry, "Tags": [{"Key": k, "Value": v} for k, v in {**mine, **tags}.items()]}
            out.append(entry)
        if not found:
            out.append({"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]})
        return out

    def launch(self, spec: LaunchSpec) -> Instance:
        params = self.run_params(spec)
        try:
            answer = self._call("run_instances", region=self.config.region_of(spec.node_type), **params)
        except CapacityError as e:
            raise CapacityError(str(e), spec.zone, spec.market) from None
        return self._launched(spec, answer["Instances"][0]["InstanceId"])

    def _region_of(self, instance: Instance) -> str:
        """The region an instance runs in: as recorded, else its node type's (else the provider's)."""
        if instance.region in self.clients:
            return instance.region
        known = instance.node_type in self.config.available_node_types
        return self.config.region_of(instance.node_type) if known else self.region

    def terminate(self, instance: Instance) -> None:
        try:
            self._call("terminate_instances", region=self._region_of(instance), InstanceIds=[instance.handle])
        except ProviderError as e:
            if "InvalidInstanceID.NotFound" not in str(e):
                raise
        self._forget([instance.id])

    # ---- the fleet as EC2 sees it ----------------------------------------------------------------
    def _describe(self, tag_filters: dict[str, str], states: list[str] | None = None) -> list[dict]:
        """The instances with these tags in every region the run uses, each marked with its region."""
        return [{**d, REGION_KEY: region} for region in self.clients
                for d in self._describe_region(region, tag_filters, states)]

    def _describe_region(self, region: str, tag_filters: dict[str, str], states: list[str] | None) -> list[dict]:
        filters = [{"Name": f"tag:{k}", "Values": [v]} for k, v in tag_filters.items()]
        if states:
            filters.append({"Name": "instance-state-name", "Values": states})
        found, token = [], None
        while True:
            page = self._call("describe_instances", region=region, Filters=filters,
                              **({"NextToken": token} if token else {}))
            found += [i for r in page["Reservations"] for i in r["Instances"]]
            token = page.get("NextToken")
            if not token:
                return found

    def _machine(self, described: dict) -> Machine:
        return Machine(described["InstanceId"], {t["Key"]: t["Value"] for t in described.get("Tags", [])},
                       described["Placement"]["AvailabilityZone"], described.get("InstanceLifecycle") == "spot",
                       described["LaunchTime"].timestamp(), described.get(REGION_KEY, ""),
                       described.get("PrivateIpAddress", ""), described.get("State", {}).get("Name", ""))

    def heads(self) -> list[Machine]:
        if self.config.head_node_type is None:
            return []
        tags = {RUN_TAG: self.config.cluster_name, NODE_TYPE_TAG: self.config.head_node_type}
        return [self._machine(d) for d in self._describe(tags, ["pending", "running"])]

    def release_head(self, machine: Machine) -> None:
        try:
            self._call("terminate_instances", region=machine.region or None, InstanceIds=[machine.handle])
        except ProviderError as e:
            if "InvalidInstanceID.NotFound" not in str(e):
                raise

    def console_output(self, machine: Machine) -> str:
        answer = self._call("get_console_output", region=machine.region or None, InstanceId=machine.handle,
                            Latest=True)
        output = answer.get("Output") or ""
        try:  # EC2 sends it base64-encoded
            return base64.b64decode(output, validate=True).decode(errors="replace")
        except (binascii.Error, ValueError):
            return output

    def _release(self, described: dict) -> None:
        self._call("terminate_instances", region=described.get(REGION_KEY), InstanceIds=[described["InstanceId"]])

    def list(self, tag_filters: dict[str, str]) -> list[Instance]:
        return self._adopt(self._describe(tag_filters, ["pending", "running"]))

    def poll_terminated(self, now: float) -> list[str]:
        """Instances EC2 no longer runs (preempted when its state reason says so); releases the
        run's orphans (tagged instances nobody launched or adopted, e.g. after a lost answer)."""
        if time.monotonic() - self._prices_at > self.price_ttl_s:
            try:
                self.refresh_prices()
            except ProviderError as e:
                logger.warning("spot prices not refreshed: %s", e)
        mine = self._held()
        described = self._describe({RUN_TAG: self.config.cluster_name})
        seen, gone = set(), []
        for d in described:
            ec2_id, state = d["InstanceId"], d["State"]["Name"]
            seen.add(ec2_id)
            inst = mine.get(ec2_id)
            if inst is not None and state in GONE_STATES:
                if d.get("StateReason", {}).get("Code") == SPOT_TERMINATION:
                    self._preempted.add(inst.id)
                gone.append(inst.id)
            elif inst is None and state in ("pending", "running"):
                self._release_orphan(d)
        # gone from EC2's list altogether (its list lags a launch by seconds: only old instances count)
        gone += [inst.id for ec2_id, inst in mine.items()
                 if ec2_id not in seen and self.clock() - inst.launched_at > self.orphan_grace_s]
        self._forget(gone)
        return gone

    def shutdown(self) -> None:
        for ec2 in self.clients.values():
            ec2.close()


def terminate_run(config: ClusterConfig, clock: Any = time.time, tags: dict[str, str] | None = None) -> list[str]:
    """Terminate every instance tagged with the run (and with ``tags``, if given), in every region the
    config names (``spotswarm down`` when no head is left)."""
    provider = AwsProvider(config, clock)
    try:
        found = provider._describe({RUN_TAG: config.cluster_name, **(tags or {})},
                                   ["pending", "running", "stopping", "stopped"])
        ids = []
        for region in provider.clients:
            here = [d["InstanceId"] for d in found if d[REGION_KEY] == region]
            if here:
                provider._call("terminate_instances", region=region, InstanceIds=here)
            ids += here
        return ids
    finally:
        provider.shutdown()
