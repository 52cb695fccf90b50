"""Checks of an AWS node type's ``node_config`` against EC2's own RunInstances model (botocore's),
so a typo or a wrong type fails when the file is loaded rather than at the first launch, hours in.

No key list is written here: the members and their types come from the service model that boto3
itself sends requests with.  Each problem is (key path inside ``node_config``, message).
"""

from __future__ import annotations

import functools
import re
from typing import Any

from orchestrator.config.loader import did_you_mean
from orchestrator.config.schema import ClusterConfig, NodeType, spot_said_alike, spot_said_twice

# Keys of RunInstances that spotswarm sets itself, or that would break every launch, and why.
RESERVED_KEYS = {
    "MinCount": "set by spotswarm: one instance per launch, the boot script as user data",
    "MaxCount": "set by spotswarm: one instance per launch, the boot script as user data",
    "UserData": "set by spotswarm: one instance per launch, the boot script as user data",
    "ClientToken": "set by spotswarm: one fixed token would make every launch return the same instance",
    "DryRun": "would make every launch a dry run that starts nothing",
}
# Zones come from provider.zones / provider.availability_zone, so that the supervisor can move
# between them; a zone fixed here would pin the node type to one.
ZONE_KEYS = ("AvailabilityZone", "AvailabilityZoneId")
SUBNET_IDS = "SubnetIds"  # Ray's own key: a list of subnets, one chosen per launch

Path = tuple[str | int, ...]
_NAME_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


@functools.lru_cache(maxsize=1)
def run_instances_shape() -> Any:
    """The input shape of EC2 RunInstances (loading the model takes a few tenths of a second: once)."""
    import botocore.session

    return botocore.session.get_session().get_service_model("ec2").operation_model("RunInstances").input_shape


def _path_of(name: str, fallback: str) -> Path:
    """``BlockDeviceMappings[0].Ebs.VolumeSize`` as a key path, or the top-level key if it does not parse."""
    parts = _NAME_PART.findall(name)
    if not parts or "".join(f"[{i}]" if i else f".{k}" for k, i in parts).lstrip(".") != name:
        return (fallback,)
    return tuple(int(i) if i else k for k, i in parts)


def _split_report(report: str) -> list[str]:
    """botocore's report, one entry per problem (a value with a line break continues a line)."""
    starts = ("Missing required", "Unknown parameter", "Invalid ", "Must set one of")
    out: list[str] = []
    for line in report.splitlines():
        if out and not line.startswith(starts):
            out[-1] += "\\n" + line
        else:
            out.append(line)
    return out


def _botocore_problems(key: str, value: Any) -> list[tuple[Path, str]]:
    """botocore's validation of one top-level key, each problem at its own (nested) key."""
    from botocore.validate import ParamValidator

    try:
        report = ParamValidator().validate({key: value}, run_instances_shape()).generate_report()
    except Exception as e:  # noqa: BLE001 - an odd value (a huge timestamp, a self-referencing alias)
        return [((key,), f"botocore cannot check this value: {type(e).__name__}: {e}")]
    out = []
    for line in _split_report(report):
        if line.startswith("Missing required parameter in input:"):
            continue  # MinCount, MaxCount: spotswarm's
        unknown = re.match(r'Unknown parameter in (\S+): "(.*?)", must be one of', line)
        if unknown:
            out.append((_path_of(unknown.group(1), key) + (unknown.group(2),), line))
            continue
        named = re.match(r"(?:Missing required parameter in|Invalid [a-z ]*?parameter|Invalid parameter) "
                         r"([^\s,:]+)", line)
        out.append((_path_of(named.group(1), key) if named else (key,), line))
    return out


def _unknown_key(key: str, members: list[str]) -> str:
    """An unknown key, with the RunInstances member it most likely means."""
    return "unknown key for the aws provider (not a parameter of EC2 RunInstances)" + did_you_mean(
        key, [*members, SUBNET_IDS], fold=True)


def _subnet_ids_problems(node_config: dict) -> list[tuple[Path, str]]:
    value = node_config[SUBNET_IDS]
    if "SubnetId" in node_config:
        return [((SUBNET_IDS,), "SubnetId and SubnetIds both given: set one (SubnetIds, Ray's key, lists "
                                "subnets to choose among; SubnetId is one)")]
    if not isinstance(value, list) or not value or not all(isinstance(s, str) and s for s in value):
        return [((SUBNET_IDS,), f"must be a non-empty list of subnet ids, e.g. [subnet-0abc] (got {value!r})")]
    return []


def _placement_problems(value: Any) -> list[tuple[Path, str]]:
    if not isinstance(value, dict):
        return []  # botocore reports the type
    return [(("Placement", key), "zones come from provider.zones or provider.availability_zone, not node_config")
            for key in ZONE_KEYS if key in value]


def aws_node_config_problems(node_config: dict) -> list[tuple[Path, str]]:
    """Every problem of one node type's ``node_config``, as (key path, message)."""
    shape = run_instances_shape()
    members = list(shape.members)
    out: list[tuple[Path, str]] = []
    for key, value in node_config.items():
        if not isinstance(key, str):
            out.append(((str(key),), "not a parameter name of EC2 RunInstances"))
        elif key in RESERVED_KEYS:
            out.append(((key,), RESERVED_KEYS[key]))
        elif key == SUBNET_IDS:
            out.extend(_subnet_ids_problems(node_config))
        elif key not in shape.members:
            out.append(((key,), _unknown_key(key, members)))
        else:
            out.extend(_botocore_problems(key, value))
            if key == "Placement":
                out.extend(_placement_problems(value))
    return out


# ---- checks that span sections of an aws cluster config ----------------------------------------
def market_type(node_type: NodeType) -> str | None:
    """``node_config.InstanceMarketOptions.MarketType`` (aws), when given."""
    options = node_type.node_config.get("InstanceMarketOptions")
    market = options.get("MarketType") if isinstance(options, dict) else None
    return market if isinstance(market, str) else None


def _image_problems(config: ClusterConfig) -> list[tuple[Path, str]]:
    """Every node type spotswarm launches needs an AMI: its own ImageId or provider.image."""
    if config.provider.image is not None:
        return []
    return [(("available_node_types", name, "node_config"),
             f"node type {name!r} has no ImageId: set node_config.ImageId or provider.image (the AMI its "
             "instances boot)")
            for name, nt in config.fleet_types().items()
            if "ImageId" not in nt.node_config]


def aws_config_problems(config: ClusterConfig) -> list[tuple[Path, str]]:
    """The aws checks that span sections: every launched type's AMI, spot said one way."""
    return _image_problems(config) + spot_said_twice(config, market_type, "InstanceMarketOptions",
                                                     "MarketType spot", "MarketType {market}")


def aws_config_warnings(config: ClusterConfig) -> list[tuple[Path, str]]:
    """Allowed but worth a word: a spot head, spot said twice."""
    return spot_said_alike(config, market_type, "InstanceMarketOptions",
                           "InstanceMarketOptions wins: it is sent to EC2 as given")
