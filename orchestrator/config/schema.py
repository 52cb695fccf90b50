"""Cluster YAML: shaped like Ray's cluster launcher YAML, plus spotswarm's own sections.

Parsed with PyYAML, validated with pydantic.  Every error names the field, the line and what was
expected; unknown keys are errors with a did-you-mean, so a typo never silently means a default.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pydantic
import pydantic_core
from pydantic_core import InitErrorDetails

from orchestrator.config.loader import ConfigError as ConfigError  # raised for this module's configs by checks.py
from orchestrator.config.loader import Loc, ModelFlags
from orchestrator.config.validators import (
    NAMESPACE,
    AnnounceHost,
    ArchiveUri,
    EndpointUrl,
    Host,
    RayAddress,
    split_zones,
)
from p2p.devices import DeviceName
from workers.worker_config import BUILTIN_TASK_NAMES, WorkerConfig, check_overlap

logger = logging.getLogger(__name__)


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")


class LinksConfig(_Strict):
    """The local simulator's links between its regions (any two different regions: a node type's
    ``region``, else ``provider.region``): each region's workers get a loopback address of their own and
    a relay carries the connections between regions at ``mbit`` each way, ``rtt_ms`` later a round trip
    (``orchestrator/sim/relay.py``).  Within a region, plain loopback."""

    mbit: float = pydantic.Field(gt=0, le=10_000, allow_inf_nan=False, description="each link's rate, each way")
    rtt_ms: float = pydantic.Field(ge=0, le=10_000, allow_inf_nan=False, description="each link's round trip")


class ProviderConfig(_Strict):
    type: Literal["local", "aws", "gcp"] = "local"
    # local simulator only: "actors" runs each instance as a Ray actor on the driver's node (light);
    # "nodes" starts each instance as its own raylet with the boot script, joining the run's Ray
    mode: Literal["actors", "nodes"] = "actors"
    namespaces: list[str] = []  # local "nodes" only: network namespaces, one per instance, own IPs
    links: LinksConfig | None = None  # local "actors" only: slow links between the node types' regions
    region: str = "local"
    # Ray's key, comma-separated; for the cloud providers it gives zones when zones is not given
    availability_zone: str | None = None
    # aws: not given (and no availability_zone) means [], "the subnets' zones, or every zone of the region"
    zones: list[str] = ["local-a", "local-b"]
    # local simulator only
    time_scale: float = pydantic.Field(1.0, gt=0, description="simulated seconds per real second")
    provisioning_delay_s: float = pydantic.Field(5.0, ge=0)
    trace_file: str | None = None  # replayable CSV of launch/notice/kill offsets
    seed: int = 0
    # local "actors" only (None: on there): fork the instances' workers from one preloaded interpreter,
    # so a boot does not spend seconds of CPU on imports on the cores the other simulated instances use
    warm_image: bool | None = None
    # cloud providers
    project: str | None = None  # gcp: the project instances are launched in
    project_id: str | None = None  # gcp: Ray's key for the same (either may be given)
    endpoint_url: EndpointUrl | None = None  # an EC2 / Compute endpoint other than the default (tests, private clouds)
    image: str | None = None

    @pydantic.field_validator("mode")
    @classmethod
    def _mode_needs_local(cls, mode: str, info: pydantic.ValidationInfo) -> str:
        kind = info.data.get("type")
        if mode == "nodes" and kind is not None and kind != "local":
            raise ValueError(f"'nodes' is for the local provider only (provider.type is {kind!r}); "
                             "cloud instances are separate machines already")
        return mode

    @pydantic.field_validator("namespaces")
    @classmethod
    def _namespaces(cls, names: list[str], info: pydantic.ValidationInfo) -> list[str]:
        kind, mode = info.data.get("type"), info.data.get("mode")
        if names and (kind, mode) != ("local", "nodes") and None not in (kind, mode):
            raise ValueError(f"only provider.type 'local' with provider.mode 'nodes' runs instances in network "
                             f"namespaces (here type {kind!r}, mode {mode!r})")
        for name in names:
            if not NAMESPACE.fullmatch(name) or name in (".", ".."):
                raise ValueError(f"{name!r} is not a network namespace name (letters, digits, '_', '.', '-')")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"listed more than once: {', '.join(map(repr, duplicates))}")
        return names

    @pydantic.field_validator("links")
    @classmethod
    def _links_are_local_actors(cls, links: LinksConfig | None, info: pydantic.ValidationInfo) -> LinksConfig | None:
        kind, mode = info.data.get("type"), info.data.get("mode")
        if links is not None and kind is not None and kind != "local":
            raise ValueError(f"the local simulator's emulated links between regions; provider.type {kind!r} has "
                             "real ones (remove links)")
        if links is not None and mode == "nodes":
            raise ValueError("emulated for provider.mode 'actors' only (its workers run on this machine's "
                             "loopback); in mode 'nodes' give each instance a network namespace (namespaces) "
                             "and shape its links there")
        return links

    @pydantic.field_validator("warm_image")
    @classmethod
    def _warm_image_is_local_actors(cls, warm: bool | None, info: pydantic.ValidationInfo) -> bool | None:
        kind, mode = info.data.get("type"), info.data.get("mode")
        if warm is not None and (kind, mode) != ("local", "actors") and None not in (kind, mode):
            raise ValueError(f"only provider.type 'local' with provider.mode 'actors' forks workers from a warm "
                             f"image (here type {kind!r}, mode {mode!r}); the others boot every worker on its own")
        return warm

    @pydantic.field_validator("availability_zone")
    @classmethod
    def _availability_zone(cls, value: str | None, info: pydantic.ValidationInfo) -> str | None:
        if value is None:
            return None
        if info.data.get("type") == "local":
            raise ValueError("Ray's key for a cloud provider's zones; the local simulator's zones are provider.zones")
        if "" in split_zones(value):
            raise ValueError(f"{value!r}: expected zone names separated by commas, e.g. 'us-east-1a,us-east-1b'")
        return value

    @pydantic.field_validator("zones")
    @classmethod
    def _zones_agree(cls, zones: list[str], info: pydantic.ValidationInfo) -> list[str]:
        """Runs only for zones given explicitly: they must name what availability_zone names."""
        given = info.data.get("availability_zone")
        if given is not None and set(split_zones(given)) != set(zones):
            raise ValueError(f"{zones} and provider.availability_zone {given!r} name different zones; "
                             "give one of them")
        return zones

    @pydantic.model_validator(mode="after")
    def _project(self) -> ProviderConfig:
        """Ray's ``project_id`` and our ``project`` name one project: either gives ``project``."""
        if self.project is not None and self.project_id is not None and self.project != self.project_id:
            raise ValueError(f"project {self.project!r} and project_id {self.project_id!r} differ; give one of them")
        if self.project is None and self.project_id is not None:
            self.project = self.project_id
        return self

    @pydantic.model_validator(mode="after")
    def _default_zones(self) -> ProviderConfig:
        """A cloud provider's zones: ``zones``, else ``availability_zone``; for aws else [] (the
        provider finds them: the subnets' zones, or every zone of the region)."""
        if self.type == "local" or "zones" in self.model_fields_set:
            return self
        if self.availability_zone is not None:
            self.zones = split_zones(self.availability_zone)
        elif self.type == "aws":
            self.zones = []
        return self


class PreemptionModel(_Strict):
    distribution: Literal["exponential", "weibull", "none"] = "exponential"
    mean_lifetime_s: float = pydantic.Field(600.0, gt=0)
    weibull_shape: float = pydantic.Field(1.5, gt=0)


class NodeType(_Strict):
    # trainer: a training peer; experts: an expert server hosting the part of the run's expert grid
    # that the supervisor assigns it (see the experts section)
    role: Literal["trainer", "experts"] = "trainer"
    node_config: dict[str, Any] = {}
    resources: dict[str, float] = {}
    min_workers: int = pydantic.Field(0, ge=0)
    max_workers: int = pydantic.Field(1, ge=0)
    # trainers only: instances kept booted and joined but idle, each ready to take a preempted
    # trainer's place at its notice instead of a cold boot later; billed like any instance
    warm_spares: int = pydantic.Field(0, ge=0, le=64)
    spot: bool = True
    on_demand_price_per_hour: float = pydantic.Field(1.0, ge=0)
    spot_price_per_hour: dict[str, float] = {}  # by zone; missing zones use 0.3 x on-demand
    preemption: PreemptionModel = PreemptionModel()
    # Mbit/s its instances declare for the all-reduce's load balancing; unset, each measures its own
    bandwidth: float | None = pydantic.Field(None, gt=0, allow_inf_nan=False)
    # the provider's region this node type's capacity is in; unset: provider.region
    region: str | None = pydantic.Field(None, min_length=1)
    # the zones of its region it launches in; unset: provider.zones when its region is the provider's
    # (aws in another region: that region's zones, found by the provider); see ClusterConfig.zones_of
    zones: list[str] | None = None
    # as in Ray's YAML, this node type's own boot commands in place of the top-level lists of the same name
    # (unset: those); worker_setup_commands apply to workers, initialization_commands to the head too
    initialization_commands: list[str] | None = None
    worker_setup_commands: list[str] | None = None

    @pydantic.field_validator("zones")
    @classmethod
    def _zones(cls, zones: list[str] | None) -> list[str] | None:
        """Given, the list names zones, each once: an empty one would leave nowhere to launch."""
        if zones is None:
            return None
        if not zones:
            raise ValueError("names no zone: list at least one, or leave zones out for the provider's")
        if any(not zone.strip() for zone in zones):
            raise ValueError(f"{zones}: a zone name may not be empty")
        duplicates = sorted({z for z in zones if zones.count(z) > 1})
        if duplicates:
            raise ValueError(f"listed more than once: {', '.join(map(repr, duplicates))}")
        return zones

    @pydantic.model_validator(mode="after")
    def _check_sizes(self) -> NodeType:
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers ({self.min_workers}) exceeds max_workers ({self.max_workers})")
        if self.warm_spares and self.role != "trainer":
            raise ValueError(f"warm_spares ({self.warm_spares}) is for trainers; role {self.role!r} has none (its "
                             "replicas already cover a lost server)")
        return self

    def price(self, zone: str, market: str) -> float:
        """Dollars per hour as the config says (a cloud's own spot price, where it has one, comes first)."""
        if market == "on-demand":
            return self.on_demand_price_per_hour
        return self.spot_price_per_hour.get(zone, 0.3 * self.on_demand_price_per_hour)


class SpotConfig(_Strict):
    market: Literal["spot", "on-demand"] = "spot"
    max_price_per_hour: float | None = pydantic.Field(None, gt=0)
    notice_period_s: float = pydantic.Field(120.0, ge=0)  # AWS-like; GCP gives 30
    fallback_to_on_demand_after: int | None = pydantic.Field(None, ge=1)  # preemptions ...
    fallback_window_s: float = pydantic.Field(600.0, gt=0)  # ... within this window


class PolicyConfig(_Strict):
    # an early warning that a spot machine is at elevated risk (EC2's rebalance recommendation): "replace"
    # launches its replacement at once, in another zone where one has capacity, and releases the machine
    # once the replacement trains (or at its notice, whichever comes first); "ignore" only records it
    on_rebalance: Literal["replace", "ignore"] = "replace"


class BudgetConfig(_Strict):
    max_dollars_per_hour: float | None = pydantic.Field(None, gt=0)
    max_total_dollars: float | None = pydantic.Field(None, gt=0)


class TrainingConfig(_Strict):
    task: str = "synthetic"
    task_options: dict[str, Any] = {}  # keyword arguments of the task's factory (e.g. moe-charlm's layers, context)
    target_batch_size: int = pydantic.Field(256, gt=0)
    # how peers combine their work; "mode" is accepted for it too
    averaging: Literal["collaborative", "moshpit", "diloco"] = pydantic.Field(
        "collaborative", validation_alias=pydantic.AliasChoices("averaging", "mode"))
    # diloco: each peer's inner steps per outer round (the round's samples: inner_steps x the task's
    # batch x the trainers' min_workers), and the outer SGD's learning rate and Nesterov momentum
    inner_steps: int = pydantic.Field(50, ge=1)
    outer_lr: float = pydantic.Field(0.7, gt=0, allow_inf_nan=False)
    outer_momentum: float = pydantic.Field(0.9, ge=0, lt=1)
    # diloco: a round's all-reduce runs while the next inner phase trains; its outer step lands when it
    # completes, and the inner progress made meanwhile is kept on top of it
    overlap: bool = False
    group_size: int = pydantic.Field(16, ge=2)
    grid: list[int] = [2, 2]
    # "fp16" is the name "float16" had before the codecs were unified: accepted until the next release
    compression: Literal["none", "float16", "bfloat16", "uniform8", "blockwise8", "fp16"] = "none"
    # how far reducers are trusted: off (our own fleet), clip (CenteredClip per chunk), verify (clip, and
    # every reducer audited by the others; a reducer caught is banned): averaging/robust.py, docs/security.md
    byzantine: Literal["off", "clip", "verify"] = "off"
    averaging_timeout_s: float = pydantic.Field(30.0, gt=0)
    min_matchmaking_time_s: float = pydantic.Field(2.0, gt=0)
    param_digests: bool = False  # every worker records a digest of its parameters per epoch (an audit)
    # where workers train: auto is the instance's GPU when its node type has one (resources: {GPU: n})
    device: DeviceName = "auto"

    _overlap = pydantic.field_validator("overlap")(check_overlap)


MOE_TASKS = ("moe-charlm",)  # built-in tasks whose feed-forward layers are the run's expert grid


class ExpertsConfig(_Strict):
    """The run's expert grid (mixture-of-experts runs): what the expert servers host and how the
    trainers' mixtures call it."""

    uid_prefix: str = pydantic.Field("ffn", pattern=r"^[A-Za-z_][A-Za-z0-9_-]*$")
    grid: list[int] = pydantic.Field([2, 4], min_length=1, max_length=4)
    kind: str = "ffn"  # a registered expert kind (experts/layers.py): ffn, transformer, nop
    hidden_dim: int = pydantic.Field(64, gt=0)  # the experts' width: the model's width (moe-charlm's dim)
    k_best: int = pydantic.Field(4, ge=1)
    k_min: int = pydantic.Field(2, ge=0)
    backward_k_min: int = pydantic.Field(1, ge=0)
    forward_timeout_s: float = pydantic.Field(5.0, gt=0)
    timeout_after_k_min_s: float = pydantic.Field(0.5, ge=0)
    backward_timeout_s: float = pydantic.Field(5.0, gt=0)
    replicas: int = pydantic.Field(2, ge=1)  # servers holding each expert: one preemption never removes one
    average_every_s: float = pydantic.Field(10.0, ge=0)  # replicas average their parameters (0: never)
    lr: float = pydantic.Field(1e-3, gt=0)
    declare_period_s: float = pydantic.Field(2.0, gt=0)  # DHT re-declarations (real seconds)

    @pydantic.field_validator("grid")
    @classmethod
    def _grid(cls, grid: list[int]) -> list[int]:
        if any(n < 1 or n > 256 for n in grid):
            raise ValueError(f"{grid}: every dimension of the grid is a number from 1 to 256")
        return grid

    @pydantic.model_validator(mode="after")
    def _k(self) -> ExpertsConfig:
        size = math.prod(self.grid)
        if self.k_best > size:
            raise ValueError(f"k_best ({self.k_best}) exceeds the grid's {size} experts")
        if self.k_min > self.k_best or self.backward_k_min > self.k_best:
            raise ValueError(f"k_min ({self.k_min}) and backward_k_min ({self.backward_k_min}) may not exceed "
                             f"k_best ({self.k_best})")
        return self

    def uids(self) -> list[str]:
        """Every expert of the grid, row-major: ``ffn.0.0``, ``ffn.0.1``, ..."""
        return [".".join((self.uid_prefix, *map(str, coords)))
                for coords in itertools.product(*(range(n) for n in self.grid))]

    def task_options(self) -> dict[str, Any]:
        """The mixture settings of a ``moe-charlm`` trainer."""
        return {"dim": self.hidden_dim, "grid": list(self.grid), "uid_prefix": self.uid_prefix,
                "k_best": self.k_best, "k_min": self.k_min, "backward_k_min": self.backward_k_min,
                "forward_timeout": self.forward_timeout_s, "timeout_after_k_min": self.timeout_after_k_min_s,
                "backward_timeout": self.backward_timeout_s}


class CheckpointConfig(_Strict):
    directory: str | None = None  # default: <run dir>/checkpoints
    every_s: float = pydantic.Field(60.0, gt=0)
    keep: int = pydantic.Field(3, ge=1)
    # a clean stop's final checkpoint waits this long (real seconds) for a live peer's newest state
    final_timeout_s: float = pydantic.Field(60.0, gt=0, le=3600)
    # s3://bucket[/prefix], gs://bucket[/prefix] or an absolute path: the run's history and checkpoints
    # also go there, and a new head resumes from them
    uri: ArchiveUri | None = None
    # an S3-compatible endpoint other than AWS's (tests: moto), or a Cloud Storage emulator for gs://
    endpoint_url: EndpointUrl | None = None


class DashboardConfig(_Strict):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = pydantic.Field(8270, ge=0, le=65535)  # not 8265: that is Ray's own dashboard


class RayConfig(_Strict):
    address: RayAddress | None = None  # None: a local Ray session; "auto" or HOST:PORT: join that cluster


class NetworkConfig(_Strict):
    listen_host: Host | None = None  # None: see ClusterConfig.listen_host()
    announce_host: AnnounceHost | None = None  # None: the Ray node's IP address


class MembershipConfig(_Strict):
    """Who takes part: with ``enabled``, every peer presents a certificate signed by the run's
    authority key at each connection, and peers without one are refused."""

    enabled: bool = True
    ttl_s: float = pydantic.Field(3600.0, ge=10)  # a certificate's lifetime; renewed when half of it is left


class ClusterConfig(_Strict):
    cluster_name: str = pydantic.Field(pattern=r"^[A-Za-z0-9_-]+$")
    runs_dir: str = "runs"
    provider: ProviderConfig = ProviderConfig()
    head_node_type: str | None = None
    available_node_types: dict[str, NodeType]
    spot: SpotConfig = SpotConfig()
    policy: PolicyConfig = PolicyConfig()
    budget: BudgetConfig = BudgetConfig()
    training: TrainingConfig = TrainingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    dashboard: DashboardConfig = DashboardConfig()
    ray: RayConfig = RayConfig()
    network: NetworkConfig = NetworkConfig()
    membership: MembershipConfig = MembershipConfig()
    experts: ExpertsConfig = ExpertsConfig()
    # Ray's boot commands, run by each machine's boot script in Ray's order before spotswarm starts there:
    # initialization_commands, setup_commands, then head_setup_commands (the head launched by ``up``) or
    # worker_setup_commands (the fleet); each is one ``bash -c``, and a failure ends the boot, named
    initialization_commands: list[str] = []
    setup_commands: list[str] = []
    head_setup_commands: list[str] = []
    worker_setup_commands: list[str] = []

    @pydantic.model_validator(mode="after")
    def _roles(self) -> ClusterConfig:
        """Expert servers and an expert task come together, with servers enough for the replicas."""
        servers = {name: nt for name, nt in self.fleet_types().items() if nt.role == "experts"}
        if self.training.task in MOE_TASKS and not servers:
            raise ValueError(f"training.task {self.training.task!r} calls the run's experts, but no node type has "
                             "role: experts (add one to host the grid)")
        if servers and self.training.task in BUILTIN_TASK_NAMES and self.training.task not in MOE_TASKS:
            raise ValueError(f"node type(s) {', '.join(servers)} have role: experts, but training.task "
                             f"{self.training.task!r} uses no experts (use task: moe-charlm)")
        if servers and not self.trainer_types():
            raise ValueError("every node type has role: experts; a run needs trainers too (role: trainer)")
        most = sum(nt.max_workers for nt in servers.values())
        if servers and self.experts.replicas > most:
            raise ValueError(f"experts.replicas is {self.experts.replicas}, but at most {most} expert servers run "
                             "(the sum of their max_workers): raise max_workers or lower replicas")
        return self

    @pydantic.model_validator(mode="after")
    def _node_types(self) -> ClusterConfig:
        if not self.available_node_types:
            raise ValueError("available_node_types must name at least one node type")
        if self.head_node_type is not None and self.head_node_type not in self.available_node_types:
            raise ValueError(f"head_node_type {self.head_node_type!r} is not in available_node_types")
        return self

    @pydantic.model_validator(mode="after")
    def _regions(self) -> ClusterConfig:
        """A node type's region and zones agree with its provider; each problem at its node type's key."""
        problems = [problem for name in self.available_node_types for problem in _region_problems(self, name)]
        if problems:
            raise pydantic_core.ValidationError.from_exception_data("ClusterConfig", [
                InitErrorDetails(type="value_error", loc=loc, input=value, ctx={"error": ValueError(message)})
                for loc, value, message in problems])
        return self

    def region_of(self, node_type: str) -> str:
        """The region a node type's capacity is in: its own ``region``, else ``provider.region``."""
        return self.available_node_types[node_type].region or self.provider.region

    def uses_provider_zones(self, node_type: str) -> bool:
        """Whether a node type launches where ``provider.zones`` says (and where a provider that finds
        the zones itself finds them): it lists none of its own and is in the provider's region."""
        return self.available_node_types[node_type].zones is None and self.region_of(node_type) == self.provider.region

    def zones_of(self, node_type: str) -> list[str]:
        """A node type's zones as the config gives them: its own, else ``provider.zones`` in the
        provider's region; [] for an aws node type in another region (the provider finds its zones)."""
        own = self.available_node_types[node_type].zones
        if own is not None:
            return list(own)
        return list(self.provider.zones) if self.region_of(node_type) == self.provider.region else []

    def regions(self) -> list[str]:
        """Every region the run's node types are in, the provider's first, then in the config's order."""
        out = [self.provider.region]
        for name in self.available_node_types:
            if self.region_of(name) not in out:
                out.append(self.region_of(name))
        return out

    def run_dir(self, base: Path | None = None) -> Path:
        return (base or Path(self.runs_dir)) / self.cluster_name

    def listen_host(self) -> str:
        """Where peers listen: ``network.listen_host``, else loopback when every instance is an actor
        on this machine (nothing outside needs to reach them), else every interface."""
        if self.network.listen_host is not None:
            return self.network.listen_host
        if self.provider.type == "local" and self.provider.mode == "actors":
            return "127.0.0.1"
        return "0.0.0.0"

    def with_ray_address(self, address: str | None) -> ClusterConfig:
        """This config joining the Ray cluster at ``address`` (``--address``; None keeps
        ``ray.address``), checked as the YAML key is: a bad one is a ConfigError."""
        if address is None:
            return self
        ray_config = ModelFlags(RayConfig).load(None, {**self.ray.model_dump(), "address": address})
        return self.model_copy(update={"ray": ray_config})

    def fleet_types(self) -> dict[str, NodeType]:
        """The node types spotswarm launches: all but ``head_node_type`` (the head runs the supervisor)."""
        return {name: nt for name, nt in self.available_node_types.items() if name != self.head_node_type}

    def max_instances(self) -> int:
        """The fleet's size when every node type it launches runs ``max_workers`` and its warm spares."""
        return sum(nt.max_workers + nt.warm_spares for nt in self.fleet_types().values())

    def trainer_types(self) -> dict[str, NodeType]:
        """The fleet's node types that train (not expert servers)."""
        return {name: nt for name, nt in self.fleet_types().items() if nt.role == "trainer"}

    def min_trainers(self) -> int:
        """The trainers a run keeps up: a DiLoCo round is sized for them."""
        return max(1, sum(nt.min_workers for nt in self.trainer_types().values()))

    def max_trainers(self) -> int:
        """Trainers at most: every warm spare may be training while the peers it replaces leave."""
        return sum(nt.max_workers + nt.warm_spares for nt in self.trainer_types().values())

    def role(self, node_type: str) -> str:
        return self.available_node_types[node_type].role

    def uses_experts(self) -> bool:
        return any(nt.role == "experts" for nt in self.fleet_types().values())

    def task_options(self) -> dict[str, Any]:
        """The task factory's keyword arguments, as every trainer gets them."""
        t = self.training
        return {**(self.experts.task_options() if t.task in MOE_TASKS else {}), **t.task_options}

    def worker_config(self, initial_peers: list[str], node_type: str | None = None, **extra: Any) -> WorkerConfig:
        """A trainer's settings; ``node_type`` adds what its instances' type says (their bandwidth)."""
        t = self.training
        if node_type is not None:
            extra = {"bandwidth": self.available_node_types[node_type].bandwidth, **extra}
        options = self.task_options()
        if options:
            extra = {"task_options": options, **extra}
        return WorkerConfig(run=self.cluster_name, task=t.task, mode=t.averaging, initial_peers=initial_peers,
                            target_batch_size=t.target_batch_size, compression=t.compression,
                            min_matchmaking_time=t.min_matchmaking_time_s, averaging_timeout=t.averaging_timeout_s,
                            moshpit_grid=t.grid, group_size=t.group_size, device=t.device,
                            swarm_size=self.max_trainers(), inner_steps=t.inner_steps, outer_lr=t.outer_lr,
                            outer_momentum=t.outer_momentum, overlap=t.overlap, round_peers=self.min_trainers(),
                            param_digests=t.param_digests, byzantine=t.byzantine, **extra)

    def expert_host_config(self, initial_peers: list[str], node_type: str | None = None,
                           **extra: Any) -> dict[str, Any]:
        """An expert server's settings (``workers.expert_host.ExpertHostConfig``'s fields); ``node_type``
        adds what its instances' type says (their bandwidth)."""
        e = self.experts
        if node_type is not None:
            extra = {"bandwidth": self.available_node_types[node_type].bandwidth, **extra}
        return {"run": self.cluster_name, "initial_peers": initial_peers, "device": self.training.device,
                "experts": {"uid_prefix": e.uid_prefix, "grid": list(e.grid), "kind": e.kind,
                            "hidden_dim": e.hidden_dim, "lr": e.lr},
                "declare_period": e.declare_period_s, "replica_average_every_s": e.average_every_s,
                "averaging_timeout": self.training.averaging_timeout_s, **extra}

    def worker_gpus(self) -> dict[str, int]:
        """GPUs each node type's worker takes: one where the type has any and training may use it."""
        if self.training.device == "cpu":
            return {}
        return {name: 1 for name, nt in self.fleet_types().items() if nt.resources.get("GPU", 0) >= 1}


def _region_problems(config: ClusterConfig, name: str) -> list[tuple[Loc, Any, str]]:
    """What is wrong with where node type ``name`` launches, as (key path, value, message): a region
    of its own needs zones the provider can use, and zones must lie in the node type's region."""
    nt, provider = config.available_node_types[name], config.provider
    at, region = ("available_node_types", name), config.region_of(name)
    if nt.zones is None:
        if region == provider.region or provider.type == "aws":  # aws finds another region's zones itself
            return []
        example = f"{region}-b" if provider.type == "gcp" else f"{region}-a"
        return [(at + ("zones",), None, f"node type {name!r} is in region {region!r}, not provider.region "
                                        f"{provider.region!r}: list its zones there (e.g. zones: [{example}])")]
    out = [(at + ("zones", i), zone, message) for i, zone in enumerate(nt.zones)
           if (message := _zone_outside(provider.type, name, region, zone)) is not None]
    out += [(at + ("spot_price_per_hour", zone), price, f"zone {zone!r} is not among the zones of node type "
                                                        f"{name!r} ({', '.join(nt.zones)})")
            for zone, price in nt.spot_price_per_hour.items() if zone not in nt.zones]
    return out


def _zone_outside(kind: str, name: str, region: str, zone: str) -> str | None:
    """Why ``zone`` is not in ``region`` for provider ``kind`` (None: it is, or the provider cannot
    tell): a GCE zone is ``<region>-<letter>``, an EC2 zone's name starts with its region's; the
    local simulator's zones and regions are labels, and an unset region ("local") says nothing."""
    if kind == "gcp" and region != "local" and not re.fullmatch(rf"{re.escape(region)}-[a-z]", zone):
        return (f"zone {zone!r} of node type {name!r} is not in its region {region!r} (GCE zones are "
                f"<region>-<letter>, e.g. {region}-b)")
    if kind == "aws" and region != "local" and not zone.startswith(region):
        return (f"zone {zone!r} of node type {name!r} is not in its region {region!r} (an EC2 zone's name "
                f"starts with its region's, e.g. {region}a)")
    return None


def spot_said_twice(config: ClusterConfig, market_of: Callable[[NodeType], str | None], key: str,
                    spot_is: str, other_is: str) -> list[tuple[Loc, str]]:
    """Spot is said one way: the provider's own node_config ``key`` (Ray's) or spot (ours); a
    contradiction is an error. ``spot_is``/``other_is`` say how the key reads for spot and not."""
    out: list[tuple[Loc, str]] = []
    for name, nt in config.available_node_types.items():
        market, at = market_of(nt), ("available_node_types", name)
        if market == "spot" and "spot" in nt.model_fields_set and not nt.spot:
            out.append((at + ("spot",), f"false, but node_config.{key} asks for spot ({spot_is}): remove one of "
                                        f"the two ({key} for on-demand, spot: false for spot)"))
        elif market is not None and market != "spot" and nt.spot:
            out.append((at + ("node_config", key), other_is.format(market=repr(market)) + " is not spot, but the "
                        "node type is spot (spot: true, the default): set spot: false"))
        elif market == "spot" and config.spot.market == "on-demand" and name != config.head_node_type:
            out.append((("spot", "market"), f"'on-demand' for the whole fleet, but available_node_types.{name}."
                                            f"node_config.{key} asks for spot: remove one"))
    return out


def spot_said_alike(config: ClusterConfig, market_of: Callable[[NodeType], str | None], key: str,
                    twice: str) -> list[tuple[Loc, str]]:
    """Warnings where the provider's node_config ``key`` asks for spot: on the head, or with spot: true too."""
    out: list[tuple[Loc, str]] = []
    for name, nt in config.available_node_types.items():
        if market_of(nt) != "spot":
            continue
        at = ("available_node_types", name)
        if name == config.head_node_type:
            out.append((at + ("node_config", key), "the head node type asks for spot; the head should be on-demand "
                        "(spotswarm does not launch it: it is where the supervisor runs)"))
        elif "spot" in nt.model_fields_set and nt.spot:
            out.append((at + ("spot",), f"true and node_config.{key} say the same (spot); {twice}"))
    return out
