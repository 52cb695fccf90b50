"""Cluster YAML: shaped like Ray's cluster launcher YAML, plus spotswarm's own sections.

Parsed with PyYAML, validated with pydantic.  Every error names the field, the line and what was
expected; unknown keys are errors with a did-you-mean, so a typo never silently means a default.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml

from workers.peer import WorkerConfig


class ConfigError(ValueError):
    """The cluster YAML is invalid; the message lists every problem with its line."""


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")


_HOST_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}\Z){_HOST_LABEL}(?:\.{_HOST_LABEL})*\.?")
_NAMESPACE = re.compile(r"[A-Za-z0-9_.-]+")


def check_host(value: str) -> str:
    """An IP address or a hostname; raises ValueError naming what is wrong (a typo here would
    otherwise surface as a peer that nobody can reach)."""
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    if re.fullmatch(r"[0-9.]+", value):  # looks like IPv4 but is not one: never a hostname
        raise ValueError(f"{value!r} is not a valid IP address")
    if not _HOSTNAME.fullmatch(value):
        raise ValueError(f"{value!r} is neither an IP address nor a hostname")
    return value


def check_ray_address(value: str) -> str:
    """``auto`` or ``HOST:PORT`` (IPv6 in brackets); raises ValueError naming what is wrong."""
    if value == "auto":
        return value
    expected = "expected 'auto' or HOST:PORT, e.g. 10.0.0.5:6379"
    if "://" in value:
        raise ValueError(f"{value!r}: a URL (a Ray Client address?); {expected}, the head's GCS address")
    if value.startswith("["):
        host, sep, port = value[1:].partition("]:")
        if not sep:
            raise ValueError(f"{value!r}: {expected}")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{value!r}: {host!r} in brackets is not an IPv6 address") from None
    else:
        host, sep, port = value.rpartition(":")
        if not sep or not host:
            raise ValueError(f"{value!r}: {expected}")
        if ":" in host:
            raise ValueError(f"{value!r}: an IPv6 host goes in brackets, e.g. [::1]:6379")
        try:
            check_host(host)
        except ValueError as e:
            raise ValueError(f"{value!r}: {e}") from None
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise ValueError(f"{value!r}: port {port!r} is not a number from 1 to 65535")
    return value


class ProviderConfig(_Strict):
    type: Literal["local", "aws", "gcp"] = "local"
    # local simulator only: "actors" runs each instance as a Ray actor on the driver's node (light);
    # "nodes" starts each instance as its own raylet with the boot script, joining the run's Ray
    mode: Literal["actors", "nodes"] = "actors"
    namespaces: list[str] = []  # local "nodes" only: network namespaces, one per instance, own IPs
    region: str = "local"
    zones: list[str] = ["local-a", "local-b"]
    # local simulator only
    time_scale: float = pydantic.Field(1.0, gt=0, description="simulated seconds per real second")
    provisioning_delay_s: float = pydantic.Field(5.0, ge=0)
    trace_file: str | None = None  # replayable CSV of launch/notice/kill offsets
    seed: int = 0
    # cloud providers
    project: str | None = None  # gcp
    endpoint_url: str | None = None  # an EC2 / Compute endpoint other than the default (tests, private clouds)
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
            if not _NAMESPACE.fullmatch(name) or name in (".", ".."):
                raise ValueError(f"{name!r} is not a network namespace name (letters, digits, '_', '.', '-')")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"listed more than once: {', '.join(map(repr, duplicates))}")
        return names


class PreemptionModel(_Strict):
    distribution: Literal["exponential", "weibull", "none"] = "exponential"
    mean_lifetime_s: float = pydantic.Field(600.0, gt=0)
    weibull_shape: float = pydantic.Field(1.5, gt=0)


class NodeType(_Strict):
    node_config: dict[str, Any] = {}
    resources: dict[str, float] = {}
    min_workers: int = pydantic.Field(0, ge=0)
    max_workers: int = pydantic.Field(1, ge=0)
    spot: bool = True
    on_demand_price_per_hour: float = pydantic.Field(1.0, ge=0)
    spot_price_per_hour: dict[str, float] = {}  # by zone; missing zones use 0.3 x on-demand
    preemption: PreemptionModel = PreemptionModel()

    @pydantic.model_validator(mode="after")
    def _min_le_max(self) -> NodeType:
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers ({self.min_workers}) exceeds max_workers ({self.max_workers})")
        return self


class SpotConfig(_Strict):
    market: Literal["spot", "on-demand"] = "spot"
    max_price_per_hour: float | None = pydantic.Field(None, gt=0)
    notice_period_s: float = pydantic.Field(120.0, ge=0)  # AWS-like; GCP gives 30
    fallback_to_on_demand_after: int | None = pydantic.Field(None, ge=1)  # preemptions ...
    fallback_window_s: float = pydantic.Field(600.0, gt=0)  # ... within this window


class BudgetConfig(_Strict):
    max_dollars_per_hour: float | None = pydantic.Field(None, gt=0)
    max_total_dollars: float | None = pydantic.Field(None, gt=0)


class TrainingConfig(_Strict):
    task: str = "synthetic"
    target_batch_size: int = pydantic.Field(256, gt=0)
    averaging: Literal["collaborative", "moshpit"] = "collaborative"
    group_size: int = pydantic.Field(16, ge=2)
    grid: list[int] = [2, 2]
    compression: Literal["none", "fp16", "uniform8", "blockwise8"] = "none"
    averaging_timeout_s: float = pydantic.Field(30.0, gt=0)
    min_matchmaking_time_s: float = pydantic.Field(2.0, gt=0)
    param_digests: bool = False  # every worker records a digest of its parameters per epoch (an audit)


class CheckpointConfig(_Strict):
    directory: str | None = None  # default: <run dir>/checkpoints
    every_s: float = pydantic.Field(60.0, gt=0)
    keep: int = pydantic.Field(3, ge=1)


class DashboardConfig(_Strict):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = pydantic.Field(8270, ge=0, le=65535)  # not 8265: that is Ray's own dashboard


class RayConfig(_Strict):
    address: str | None = None  # None: a local Ray session; "auto" or HOST:PORT: join that cluster

    @pydantic.field_validator("address")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        return None if value is None else check_ray_address(value)


class NetworkConfig(_Strict):
    listen_host: str | None = None  # None: see ClusterConfig.listen_host()
    announce_host: str | None = None  # None: the Ray node's IP address

    @pydantic.field_validator("listen_host")
    @classmethod
    def _listen(cls, value: str | None) -> str | None:
        return None if value is None else check_host(value)

    @pydantic.field_validator("announce_host")
    @classmethod
    def _announce(cls, value: str | None) -> str | None:
        if value is None:
            return None
        check_host(value)
        try:
            wildcard = ipaddress.ip_address(value).is_unspecified
        except ValueError:  # a hostname
            wildcard = False
        if wildcard:
            raise ValueError(f"{value!r} is a wildcard to listen on; announce an address other peers can reach")
        return value


class ClusterConfig(_Strict):
    cluster_name: str = pydantic.Field(pattern=r"^[A-Za-z0-9_-]+$")
    runs_dir: str = "runs"
    provider: ProviderConfig = ProviderConfig()
    head_node_type: str | None = None
    available_node_types: dict[str, NodeType]
    spot: SpotConfig = SpotConfig()
    budget: BudgetConfig = BudgetConfig()
    training: TrainingConfig = TrainingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    dashboard: DashboardConfig = DashboardConfig()
    ray: RayConfig = RayConfig()
    network: NetworkConfig = NetworkConfig()

    @pydantic.model_validator(mode="after")
    def _node_types(self) -> ClusterConfig:
        if not self.available_node_types:
            raise ValueError("available_node_types must name at least one node type")
        if self.head_node_type is not None and self.head_node_type not in self.available_node_types:
            raise ValueError(f"head_node_type {self.head_node_type!r} is not in available_node_types")
        return self

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
        try:
            ray_config = RayConfig.model_validate({**self.ray.model_dump(), "address": address})
        except pydantic.ValidationError as e:
            raise ConfigError(f"--address: {e.errors()[0]['msg'].removeprefix('Value error, ')}") from None
        return self.model_copy(update={"ray": ray_config})

    def max_instances(self) -> int:
        """The fleet's size when every node type runs ``max_workers``."""
        return sum(nt.max_workers for nt in self.available_node_types.values())

    def worker_config(self, initial_peers: list[str], **extra: Any) -> WorkerConfig:
        t = self.training
        return WorkerConfig(run=self.cluster_name, task=t.task, mode=t.averaging, initial_peers=initial_peers,
                            target_batch_size=t.target_batch_size, compression=t.compression,
                            min_matchmaking_time=t.min_matchmaking_time_s, averaging_timeout=t.averaging_timeout_s,
                            moshpit_grid=t.grid, group_size=t.group_size,
                            param_digests=t.param_digests, **extra)


# ---- loading with line numbers ---------------------------------------------------------------
Loc = tuple[str | int, ...]


def _line_map(node: yaml.Node, path: tuple = (), out: dict | None = None, seen: set[int] | None = None
              ) -> dict[tuple, int]:
    """Where each key path starts in the file (1-based lines), for error messages.  An aliased node
    is walked once, so recursive or exponential aliases cannot hang the loader."""
    out = {} if out is None else out
    seen = set() if seen is None else seen
    out.setdefault(path, node.start_mark.line + 1)
    if id(node) in seen:
        return out
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if not isinstance(key, yaml.ScalarNode):
                continue
            k = key.value
            out[path + (k,)] = key.start_mark.line + 1
            _line_map(value, path + (k,), out, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _line_map(item, path + (i,), out, seen)
    return out


def _known_fields(model: type[pydantic.BaseModel], loc: tuple) -> list[str]:
    """The field names valid at ``loc`` (for did-you-mean on an unknown key)."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(current, type) and issubclass(current, pydantic.BaseModel):
            field = current.model_fields.get(str(part))
            if field is None:
                return []
            current = field.annotation
        elif getattr(current, "__origin__", None) is dict:
            current = current.__args__[1]
        else:
            return []
    if isinstance(current, type) and issubclass(current, pydantic.BaseModel):
        return list(current.model_fields)
    return []


def _at(loc: Loc, message: str, lines: dict[tuple, int], source: str) -> str:
    """``file:line: dotted.key: message``, the line of the nearest key of ``loc`` in the file."""
    line = lines.get(loc)
    probe = loc
    while line is None and probe:
        probe = probe[:-1]
        line = lines.get(probe)
    # a key with a line break or another control character would split the one-line message
    where = ".".join(str(p) if str(p).isprintable() else repr(p) for p in loc) or "(top level)"
    if message.startswith(f"{where} "):  # the message names its key already
        return f"{source}:{line or '?'}: {message}"
    return f"{source}:{line or '?'}: {where}: {message}"


def _describe(err: dict, lines: dict[tuple, int], source: str) -> str:
    loc = tuple(err["loc"])
    if err["type"] == "extra_forbidden":
        hint = difflib.get_close_matches(str(loc[-1]), _known_fields(ClusterConfig, loc), n=1)
        message = "unknown key" + (f"; did you mean {hint[0]!r}?" if hint else "")
    elif err["type"] == "missing":
        message = "required field is missing"
    else:
        message = err["msg"].removeprefix("Value error, ")
        if "input" in err and err["type"] not in ("value_error", "assertion_error"):
            message += f" (got {err['input']!r})"
    return _at(loc, message, lines, source)


def _node_config_problems(config: ClusterConfig) -> list[tuple[Loc, str]]:
    from .providers import node_config_problems

    return [(("available_node_types", name, "node_config", key), message)
            for name, node_type in config.available_node_types.items()
            for key, message in node_config_problems(config.provider.type, name, node_type.node_config)]


def config_problems(config: ClusterConfig) -> list[tuple[Loc, str]]:
    """What the schema alone cannot judge, as (key path, message): whether this build can run the
    provider, the provider's own ``node_config`` keys, and limits that span sections.  Kept out of
    the model so that configs for providers still to come can be built and inspected."""
    from .providers import provider_problem

    out: list[tuple[Loc, str]] = []
    problem = provider_problem(config.provider.type)
    if problem is not None:
        out.append((("provider", "type"), problem))
    out.extend(_node_config_problems(config))
    fleet = config.max_instances()
    if config.training.averaging == "collaborative" and fleet > config.training.group_size:
        # a run larger than group_size is refused: two groups in one epoch would step to different parameters
        out.append((("training", "group_size"),
                    f"{config.training.group_size} is less than the fleet's largest size, {fleet} instances (the "
                    "sum of max_workers): collaborative averaging needs every live peer in one group; raise "
                    "group_size or use averaging: moshpit"))
    return out


def _raw_provider_type(data: dict) -> Any:
    provider = data.get("provider", {})
    return provider.get("type", "local") if isinstance(provider, dict) else None


def load_cluster_config(path: str | Path) -> ClusterConfig:
    """Read, validate and check a cluster YAML; every problem, with its line, in one ConfigError."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{line}: not valid YAML: {getattr(e, 'problem', None) or e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid YAML: nested too deeply") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:1: a cluster config must be a mapping of sections")
    lines = _line_map(node) if node is not None else {}
    source = str(path)
    try:
        config = ClusterConfig.model_validate(data)
    except pydantic.ValidationError as e:
        errors = e.errors()
        problems = [_describe(err, lines, source) for err in errors]
        # a provider this build cannot run is worth knowing even while other keys are wrong
        kind = _raw_provider_type(data)
        if isinstance(kind, str) and not any(tuple(err["loc"]) == ("provider", "type") for err in errors):
            from .providers import provider_problem

            problem = provider_problem(kind)
            if problem is not None:
                problems.insert(0, _at(("provider", "type"), problem, lines, source))
        raise ConfigError("\n".join(problems)) from None
    except RecursionError:  # a YAML alias that contains itself
        raise ConfigError(f"{path}: a value refers to itself (a recursive YAML alias)") from None
    problems = [_at(loc, message, lines, source) for loc, message in config_problems(config)]
    if problems:
        raise ConfigError("\n".join(problems))
    return config
