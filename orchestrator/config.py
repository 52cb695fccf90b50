"""Cluster YAML: shaped like Ray's cluster launcher YAML, plus spotswarm's own sections.

Parsed with PyYAML, validated with pydantic.  Every error names the field, the line and what was
expected; unknown keys are errors with a did-you-mean, so a typo never silently means a default.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml

from workers.peer import WorkerConfig


class ConfigError(ValueError):
    """The cluster YAML is invalid; the message lists every problem with its line."""


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")


class ProviderConfig(_Strict):
    type: Literal["local", "aws", "gcp"] = "local"
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


class CheckpointConfig(_Strict):
    directory: str | None = None  # default: <run dir>/checkpoints
    every_s: float = pydantic.Field(60.0, gt=0)
    keep: int = pydantic.Field(3, ge=1)


class DashboardConfig(_Strict):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = pydantic.Field(8265, ge=0, le=65535)


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

    @pydantic.model_validator(mode="after")
    def _node_types(self) -> ClusterConfig:
        if not self.available_node_types:
            raise ValueError("available_node_types must name at least one node type")
        if self.head_node_type is not None and self.head_node_type not in self.available_node_types:
            raise ValueError(f"head_node_type {self.head_node_type!r} is not in available_node_types")
        return self

    def run_dir(self, base: Path | None = None) -> Path:
        return (base or Path(self.runs_dir)) / self.cluster_name

    def worker_config(self, initial_peers: list[str], **extra: Any) -> WorkerConfig:
        t = self.training
        return WorkerConfig(run=self.cluster_name, task=t.task, mode=t.averaging, initial_peers=initial_peers,
                            target_batch_size=t.target_batch_size, compression=t.compression,
                            min_matchmaking_time=t.min_matchmaking_time_s, averaging_timeout=t.averaging_timeout_s,
                            moshpit_grid=t.grid, **extra)


# ---- loading with line numbers ---------------------------------------------------------------
def _line_map(node: yaml.Node, path: tuple = (), out: dict | None = None) -> dict[tuple, int]:
    """Where each key path starts in the file (1-based lines), for error messages."""
    out = {} if out is None else out
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            k = key.value
            out[path + (k,)] = key.start_mark.line + 1
            _line_map(value, path + (k,), out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _line_map(item, path + (i,), out)
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


def _describe(err: dict, lines: dict[tuple, int], source: str) -> str:
    loc = tuple(err["loc"])
    line = lines.get(loc)
    probe = loc
    while line is None and probe:
        probe = probe[:-1]
        line = lines.get(probe)
    where = ".".join(str(p) for p in loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        hint = difflib.get_close_matches(str(loc[-1]), _known_fields(ClusterConfig, loc), n=1)
        message = "unknown key" + (f"; did you mean {hint[0]!r}?" if hint else "")
    elif err["type"] == "missing":
        message = "required field is missing"
    else:
        message = err["msg"]
        if "input" in err and err["type"] not in ("value_error", "assertion_error"):
            message += f" (got {err['input']!r})"
    return f"{source}:{line or '?'}: {where}: {message}"


def load_cluster_config(path: str | Path) -> ClusterConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{line}: not valid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:1: a cluster config must be a mapping of sections")
    lines = _line_map(node) if node is not None else {}
    try:
        return ClusterConfig.model_validate(data)
    except pydantic.ValidationError as e:
        raise ConfigError("\n".join(_describe(err, lines, str(path)) for err in e.errors())) from None
