"""A cluster YAML read and judged whole: the schema (``schema.py``), then what only the providers
can judge (their ``node_config`` keys, cross-section checks), with every problem at its line.

Apart from ``schema.py`` so that the models never import the providers, which import the models.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pydantic

from orchestrator.config.aws import aws_config_problems, aws_config_warnings
from orchestrator.config.clouds import node_config_problems, provider_problem
from orchestrator.config.gcp import gcp_config_problems, gcp_config_warnings
from orchestrator.config.loader import ConfigError, Loc, at, describe, read_yaml
from orchestrator.config.ray_keys import strip_ray_launcher_keys
from orchestrator.config.schema import ClusterConfig

logger = logging.getLogger(__name__)


def _node_config_problems(config: ClusterConfig) -> list[tuple[Loc, str]]:
    return [(("available_node_types", name, "node_config", *(key if isinstance(key, tuple) else (key,))), message)
            for name, node_type in config.available_node_types.items()
            for key, message in node_config_problems(config.provider.type, name, node_type.node_config)]


def link_regions(config: ClusterConfig) -> dict[str, str]:
    """Each node type the fleet launches, and its region: what ``provider.links`` joins (the
    simulator's relay, ``orchestrator/sim/relay.py``, reads it too)."""
    return {name: config.region_of(name) for name in config.fleet_types()}


def _links_problems(config: ClusterConfig) -> list[tuple[Loc, str]]:
    """``provider.links`` gives each region's workers their address: the network section may not name another."""
    if config.provider.links is None:
        return []
    out = [(("network", key), f"{getattr(config.network, key)!r}, but provider.links gives each region's workers "
                              "a loopback address of its own (127.77.<i>.1): remove one of the two")
           for key in ("listen_host", "announce_host") if getattr(config.network, key) is not None]
    regions = set(link_regions(config).values())
    if len(regions) > 254:
        out.append((("provider", "links"), f"{len(regions)} regions; at most 254 are emulated"))
    return out


def _links_warnings(config: ClusterConfig) -> list[tuple[Loc, str]]:
    """Links with one region only: nothing between regions to emulate."""
    regions = sorted(set(link_regions(config).values()))
    if config.provider.links is None or len(regions) > 1:
        return []
    return [(("provider", "links"), f"every node type is in region {regions[0]!r}: there is no link between "
                                    "regions to emulate (give node types a region of their own)")]


def config_warnings(config: ClusterConfig) -> list[tuple[Loc, str]]:
    """What is allowed but worth a word, as (key path, message): spot said twice, a spot head, a
    gcp project for another provider, emulated links with one region."""
    if config.provider.type == "gcp":
        return gcp_config_warnings(config)
    given = [k for k in ("project_id", "project") if k in config.provider.model_fields_set]
    out: list[tuple[Loc, str]] = [(("provider", key), f"read by the gcp provider only (the GCP project); ignored "
                                                      f"for provider {config.provider.type!r}")
                                  for key in given[:1]]  # project_id sets project too: one warning
    return out + (aws_config_warnings(config) if config.provider.type == "aws" else []) + _links_warnings(config)


def config_problems(config: ClusterConfig) -> list[tuple[Loc, str]]:
    """What the schema alone cannot judge, as (key path, message): whether this build can run the
    provider, the provider's own ``node_config`` keys, and limits that span sections.  Kept out of
    the model so that configs for providers still to come can be built and inspected."""
    out: list[tuple[Loc, str]] = []
    problem = provider_problem(config.provider.type)
    if problem is not None:
        out.append((("provider", "type"), problem))
    out.extend(_node_config_problems(config))
    out.extend(_links_problems(config))
    if config.provider.type == "aws":
        out.extend(aws_config_problems(config))
    if config.provider.type == "gcp":
        out.extend(gcp_config_problems(config))
    if config.training.device == "cuda":
        gpu_less = [name for name, nt in config.fleet_types().items() if nt.resources.get("GPU", 0) < 1]
        if gpu_less:
            out.append((("training", "device"), f"cuda, but node type(s) {', '.join(gpu_less)} have no GPU (give "
                        "them resources: {GPU: 1}, or use device: auto to train where there is one)"))
    return out


def _warn(messages: list[str], warnings: list[str] | None) -> None:
    """Hand warnings to the caller's list, or to the log when the caller gave none."""
    if warnings is not None:
        warnings.extend(messages)
    else:
        for message in messages:
            logger.warning(message)


def load_cluster_config(path: str | Path, warnings: list[str] | None = None) -> ClusterConfig:
    """Read, validate and check a cluster YAML; every problem, with its line, in one ConfigError.

    Warnings (a Ray launcher key spotswarm does not use, spot said twice) are ``file:line: key:
    message`` strings too: appended to ``warnings`` when given, else logged; given even when the
    file also has errors."""
    data, lines = read_yaml(path, "a cluster config must be a mapping of sections")
    source = str(path)
    data, ray_keys = strip_ray_launcher_keys(data)
    _warn([at(loc, message, lines, source) for loc, message in
           sorted(ray_keys, key=lambda item: lines.get(item[0], 0))], warnings)
    try:
        config = ClusterConfig.model_validate(data)
    except pydantic.ValidationError as e:
        errors = e.errors()
        problems = [describe(err, ClusterConfig, lines, source) for err in errors]
        # a provider this build cannot run is worth knowing even while other keys are wrong
        provider = data.get("provider", {})
        kind = provider.get("type", "local") if isinstance(provider, dict) else None
        if isinstance(kind, str) and not any(tuple(err["loc"]) == ("provider", "type") for err in errors):
            problem = provider_problem(kind)
            if problem is not None:
                problems.insert(0, at(("provider", "type"), problem, lines, source))
        raise ConfigError("\n".join(problems)) from None
    except RecursionError:  # a YAML alias that contains itself
        raise ConfigError(f"{path}: a value refers to itself (a recursive YAML alias)") from None
    _warn([at(loc, message, lines, source) for loc, message in config_warnings(config)], warnings)
    problems = [at(loc, message, lines, source) for loc, message in config_problems(config)]
    if problems:
        raise ConfigError("\n".join(problems))
    return config
