"""Checks of a GCP node type's ``node_config`` against Compute Engine's own ``Instance`` message
(google-cloud-compute's protobuf), so a typo or a wrong type fails when the file is loaded rather
than at the first launch, hours in.

No key list is written here: the field names (camelCase, as in Ray's GCP YAML and GCE's REST
API), their types and the values of GCE's enum-like strings come from the message classes the
client sends requests with.  Each problem is (key path inside ``node_config``, message); the
checks that need the whole config (project, zones, image, spot) are ``gcp_config_problems``.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Any

from orchestrator.config.loader import did_you_mean
from orchestrator.config.schema import spot_said_alike, spot_said_twice
from orchestrator.config.tags import INSTANCE_TAG, NODE_TYPE_TAG, RUN_TAG

if TYPE_CHECKING:
    from orchestrator.config.schema import ClusterConfig

Path = tuple[str | int, ...]

# Keys of Instance that spotswarm sets itself, and why.
RESERVED_KEYS = {
    "name": "set by spotswarm: each instance is named after the run's id for it",
    "zone": "zones come from provider.zones or provider.availability_zone, not node_config",
}
# metadata items spotswarm writes on every instance
STARTUP_SCRIPT = "startup-script"
TAGS_ITEM = "spotswarm-tags"
RESERVED_METADATA = {STARTUP_SCRIPT: "set by spotswarm: the boot script that joins the run's Ray cluster",
                     TAGS_ITEM: "set by spotswarm: the run's tags, exactly (labels are lowercased)"}
RESERVED_LABELS = (RUN_TAG, INSTANCE_TAG, NODE_TYPE_TAG)
# zonal resources named by their bare name: spotswarm puts the launch's zone in front
ZONAL_NAMES = {("machineType",): "machineTypes", ("guestAccelerators", "acceleratorType"): "acceleratorTypes",
               ("disks", "initializeParams", "diskType"): "diskTypes"}
LABEL_KEY = re.compile(r"[a-z][a-z0-9_-]{0,62}")
LABEL_VALUE = re.compile(r"[a-z0-9_-]{0,63}")
_NAME_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


@functools.lru_cache(maxsize=1)
def _compute() -> Any:
    from google.cloud import compute_v1

    return compute_v1


@functools.lru_cache(maxsize=1)
def instance_fields() -> dict[str, str]:
    """Instance's fields: JSON (camelCase) name -> protobuf (snake_case) name."""
    return {f.json_name: f.name for f in _compute().Instance.pb().DESCRIPTOR.fields}


def normalized(node_config: dict) -> dict:
    """``node_config`` with Ray's list form of ``scheduling`` (``scheduling: [{preemptible: true}]``,
    as in Ray's GCP examples) merged into the one mapping GCE takes."""
    scheduling = node_config.get("scheduling")
    if isinstance(scheduling, list) and all(isinstance(item, dict) for item in scheduling):
        merged: dict = {}
        for item in scheduling:
            merged.update(item)
        return {**node_config, "scheduling": merged}
    return node_config


def canonical(node_config: dict) -> dict:
    """``node_config`` as GCE's JSON (camelCase keys, snake_case ones renamed): parsed into the
    Instance message and back, so the provider reads one spelling."""
    from google.protobuf import json_format

    message = json_format.ParseDict(normalized(node_config), _compute().Instance.pb()())
    return json_format.MessageToDict(message)


def scheduling_market(node_config: dict) -> str | None:
    """"spot" when ``scheduling`` asks for it (``provisioningModel: SPOT``, or Ray's
    ``preemptible: true``), "on-demand" for ``provisioningModel: STANDARD``, else None."""
    scheduling = normalized(node_config).get("scheduling")
    if not isinstance(scheduling, dict):
        return None
    model = scheduling.get("provisioningModel", scheduling.get("provisioning_model"))
    if model == "SPOT" or scheduling.get("preemptible") is True:
        return "spot"
    return "on-demand" if model == "STANDARD" else None


def _path_of(dotted: str) -> Path:
    """``disks[0].initializeParams`` as a key path."""
    return tuple(int(i) if i else k for k, i in _NAME_PART.findall(dotted))


def _parse_problem(key: str, error: Exception) -> tuple[Path, str]:
    """protobuf's ParseError for one top-level key, at its (nested) key with a plain message."""
    text = str(error)
    first = text.splitlines()[0] if text else type(error).__name__
    at = re.search(r' at "?Instance\.([^"\s]+?)"?\.?$', first)
    fields = re.findall(r"Failed to parse (\w+) field: ", first)
    path: Path = _path_of(at.group(1)) if at else tuple(fields) or (key,)
    unknown = re.search(r'Message type "[\w.]*?(\w+)" has no field named "(.*?)"', first)
    if unknown:
        available = re.findall(r"'(\w+)'", text.split("Available Fields", 1)[-1])
        return path + (unknown.group(2),), (f"unknown key (not a field of Compute Engine's {unknown.group(1)})"
                                            + did_you_mean(unknown.group(2), available))
    message = re.sub(r"^(Failed to parse \w+ field: )+", "", first)
    message = re.sub(r' at "?Instance\.[^"\s]*"?\.?$', "", message).rstrip(".")
    return path, message


def _enum_problems(message: Any, path: Path) -> list[tuple[Path, str]]:
    """String fields GCE takes from a fixed set (``provisioningModel``, ``onHostMaintenance``,
    a disk's ``type`` ...): the set is the message class's enum of the same name."""
    compute = _compute()
    cls = getattr(compute, message.DESCRIPTOR.name, None)
    out: list[tuple[Path, str]] = []
    for field, value in message.ListFields():
        at = path + (field.json_name,)
        if field.message_type is not None:
            if field.message_type.GetOptions().map_entry:
                continue
            items = list(value) if field.is_repeated else [value]
            for i, item in enumerate(items):
                out.extend(_enum_problems(item, at + ((i,) if field.is_repeated else ())))
            continue
        enum = getattr(cls, "".join(p.title() for p in field.name.rstrip("_").split("_")), None)
        if field.type != field.TYPE_STRING or enum is None or field.is_repeated:
            continue
        allowed = [m for m in enum.__members__ if not m.startswith("UNDEFINED_")]
        if value not in allowed:
            out.append((at, f"{value!r} is not one of {', '.join(allowed)}" + did_you_mean(str(value).upper(),
                                                                                            allowed)))
    return out


def _unknown_key(key: str) -> str:
    fields = instance_fields()
    if key in fields.values():  # machine_type: the API takes it, but Ray's YAML and spotswarm read camelCase
        camel = next(j for j, p in fields.items() if p == key)
        return f"write it {camel!r} (camelCase, as in Ray's GCP YAML and GCE's REST API)"
    return "unknown key for the gcp provider (not a field of Compute Engine's Instance)" + did_you_mean(
        key, fields, fold=True)


def _zonal_name_problems(config: dict) -> list[tuple[Path, str]]:
    """Machine, accelerator and disk types are bare names: the zone is the launch's."""
    out = []
    for keys, kind in ZONAL_NAMES.items():
        for path, value in _values_at(config, keys):
            if isinstance(value, str) and "/" in value:
                out.append((path, f"{value!r}: give the bare name (e.g. {value.rsplit('/', 1)[-1]!r}); spotswarm "
                                  f"adds zones/<zone>/{kind}/ for the zone it launches in"))
    return out


def _values_at(node: Any, keys: tuple[str, ...], path: Path = ()) -> list[tuple[Path, Any]]:
    """Every value at ``keys`` inside ``node``, stepping through lists."""
    if not keys:
        return [(path, node)]
    if isinstance(node, list):
        return [found for i, item in enumerate(node) for found in _values_at(item, keys, path + (i,))]
    if isinstance(node, dict) and keys[0] in node:
        return _values_at(node[keys[0]], keys[1:], path + (keys[0],))
    return []


def _metadata_and_label_problems(config: dict) -> list[tuple[Path, str]]:
    out = []
    for path, key in _values_at(config, ("metadata", "items", "key")):
        if isinstance(key, str) and key in RESERVED_METADATA:
            out.append((path, f"{key!r}: {RESERVED_METADATA[key]}"))
    labels = config.get("labels")
    for key, value in (labels.items() if isinstance(labels, dict) else []):
        if key in RESERVED_LABELS:
            out.append((("labels", key), "set by spotswarm: the run's labels"))
        elif not LABEL_KEY.fullmatch(str(key)):
            out.append((("labels", key), "a GCE label key is a lowercase letter, then up to 62 lowercase letters, "
                                         "digits, '_' or '-'"))
        elif not isinstance(value, str) or not LABEL_VALUE.fullmatch(value):
            out.append((("labels", key), f"{value!r}: a GCE label value is up to 63 lowercase letters, digits, "
                                         "'_' or '-'"))
    return out


def _gpu_problems(node_config: dict, parsed: dict) -> list[tuple[Path, str]]:
    """GCE refuses a VM with GPUs that may live-migrate: onHostMaintenance must be TERMINATE."""
    if not parsed.get("guestAccelerators"):
        return []
    maintenance = parsed.get("scheduling", {}).get("onHostMaintenance")
    if maintenance == "TERMINATE":
        return []
    given = node_config.get("scheduling")
    if isinstance(given, dict) and "onHostMaintenance" in given:
        path: Path = ("scheduling", "onHostMaintenance")
    else:
        path = ("scheduling",) if given is not None else ("guestAccelerators",)
    return [(path, f"{maintenance or 'not set (MIGRATE)'}: a node type with GPUs (guestAccelerators) needs "
                   "scheduling.onHostMaintenance: TERMINATE; GCE cannot live-migrate GPU VMs and refuses to "
                   "create them otherwise")]


def gcp_node_config_problems(node_config: dict) -> list[tuple[Path, str]]:
    """Every problem of one node type's ``node_config``, as (key path, message)."""
    from google.protobuf import json_format

    fields = instance_fields()
    config = normalized(node_config)
    out: list[tuple[Path, str]] = []
    parsed_ok = True
    for key, value in config.items():
        if not isinstance(key, str):
            out.append(((str(key),), "not a field name of Compute Engine's Instance"))
        elif key in RESERVED_KEYS:
            out.append(((key,), RESERVED_KEYS[key]))
        elif key not in fields:
            out.append(((key,), _unknown_key(key)))
        else:
            try:
                message = json_format.ParseDict({key: value}, _compute().Instance.pb()())
            except (json_format.ParseError, TypeError, ValueError, AttributeError) as e:
                out.append(_parse_problem(key, e))
            else:
                out.extend(_enum_problems(message, ()))
                continue
        parsed_ok = False
    out.extend(_zonal_name_problems(config))
    out.extend(_metadata_and_label_problems(config))
    if parsed_ok:
        out.extend(_gpu_problems(node_config, canonical(config)))
    return out


# ---- checks that need the whole config --------------------------------------------------------
def _has_boot_image(node_config: dict) -> bool:
    disks = normalized(node_config).get("disks")
    for disk in disks if isinstance(disks, list) else []:
        if isinstance(disk, dict) and disk.get("boot"):
            params = disk.get("initializeParams") or disk.get("initialize_params") or {}
            return bool(disk.get("source") or (isinstance(params, dict) and
                                              (params.get("sourceImage") or params.get("source_image"))))
    return False


def _provider_problems(config: ClusterConfig) -> list[tuple[Path, str]]:
    provider = config.provider
    out: list[tuple[Path, str]] = []
    if provider.project is None:
        out.append((("provider",), "the gcp provider needs the project it launches in: provider.project_id "
                                   "(Ray's key) or provider.project"))
    if "zones" not in provider.model_fields_set and provider.availability_zone is None:
        out.append((("provider",), "the gcp provider needs its zones: provider.availability_zone (Ray's key, "
                                   "e.g. 'us-central1-a,us-central1-b') or provider.zones"))
    elif provider.region != "local":
        key = "availability_zone" if provider.availability_zone is not None else "zones"
        out += [(("provider", key), f"zone {zone!r} is not in provider.region {provider.region!r}")
                for zone in provider.zones if not zone.startswith(f"{provider.region}-")]
    return out


def _fleet_problems(config: ClusterConfig) -> list[tuple[Path, str]]:
    """What GCE needs of every node type spotswarm launches: a machine type and a boot image."""
    out: list[tuple[Path, str]] = []
    for name, nt in config.fleet_types().items():
        at = ("available_node_types", name, "node_config")
        if "machineType" not in nt.node_config:
            out.append((at, f"node type {name!r} has no machineType (e.g. n1-standard-4)"))
        if config.provider.image is None and not _has_boot_image(nt.node_config):
            out.append((at, f"node type {name!r} has no boot image: a disk with boot: true and "
                            "initializeParams.sourceImage, or provider.image"))
    return out


def _spot_problems(config: ClusterConfig) -> list[tuple[Path, str]]:
    return spot_said_twice(config, lambda nt: scheduling_market(nt.node_config), "scheduling",
                           "provisioningModel SPOT or preemptible", "provisioningModel STANDARD")


def gcp_config_problems(config: ClusterConfig) -> list[tuple[Path, str]]:
    """The gcp checks that span sections: project, zones, every launched type's machine and image, spot."""
    return _provider_problems(config) + _fleet_problems(config) + _spot_problems(config)


def gcp_config_warnings(config: ClusterConfig) -> list[tuple[Path, str]]:
    """Allowed but worth a word: a spot head, spot said twice."""
    return spot_said_alike(config, lambda nt: scheduling_market(nt.node_config), "scheduling", "one is enough")
