"""Ray's cluster-launcher keys that spotswarm does not use: a Ray YAML loads, each such key removed
with a warning that says why, while a key neither knows stays an error."""

from __future__ import annotations

from typing import Any

import pydantic

from orchestrator.config.loader import Loc, did_you_mean
from orchestrator.config.schema import ClusterConfig, NodeType, ProviderConfig

# Keys of Ray's cluster launcher (ray/autoscaler/ray-schema.json, and a few that Ray's AWS provider
# and autoscaler read beyond it) that spotswarm does not use, by section, each with why.  A Ray YAML
# loads: these are removed before validation, each with a warning; a key neither knows stays an error.
_BOOT = "every instance runs spotswarm's boot script instead (see spotswarm bootstrap-script)"
_START = ("spotswarm's boot script starts Ray itself, after initialization_commands, setup_commands and "
          "head_setup_commands or worker_setup_commands")
_SSH = "spotswarm does not SSH into instances or sync files to them"
_SIZE = "the fleet follows each node type's min_workers and max_workers and the spot policy"
_IGNORED = "ignored"
RAY_LAUNCHER_KEYS: dict[str, dict[str, str]] = {
    "": {  # top level
        "auth": _SSH, "cluster_synced_files": _SSH, "docker": _BOOT, "file_mounts": _SSH,
        "file_mounts_sync_continuously": _SSH, "head_start_ray_commands": _START,
        "idle_timeout_minutes": _SIZE, "max_workers": _SIZE,
        "metadata": _IGNORED, "no_restart": _BOOT, "rsync_exclude": _SSH, "rsync_filter": _SSH,
        "upscaling_speed": _SIZE, "worker_start_ray_commands": _START,
    },
    "provider": {
        **dict.fromkeys((
            "autoscaler_role", "autoscaler_role_binding", "autoscaler_service_account", "cloudwatch",
            "disable_launch_config_check", "disable_node_updaters", "foreground_node_launch",
            "head_ip", "location", "module", "msi_identity_id", "msi_identity_principal_id", "namespace",
            "resource_group", "subnet_id", "subscription_id", "tags", "use_external_head_ip",
            "use_internal_ips", "worker_ips", "worker_liveness_check"), _IGNORED),
        "aws_credentials": "boto3 finds credentials as usual (environment, profile, instance role)",
        "gcp_credentials": "google-auth finds credentials as usual (GOOGLE_APPLICATION_CREDENTIALS, gcloud's "
                           "application-default login, the head's service account)",
        "cache_stopped_nodes": "spotswarm terminates the instances it releases",
        "key_pair": "set node_config.KeyName", "security_group": "set node_config.SecurityGroupIds",
    },
    "available_node_types.*": {
        "docker": _BOOT, "idle_timeout_s": _SIZE, "labels": _IGNORED, "priority": _SIZE,
    },
}


def _without_ray_keys(section: Any, kind: str, where: Loc, model: type[pydantic.BaseModel],
                      found: list[tuple[Loc, str]]) -> Any:
    """A copy of ``section`` (a mapping) without Ray's launcher keys, each noted in ``found`` with its
    reason.  Copied, not changed: a YAML alias may share one mapping between sections."""
    if not isinstance(section, dict):
        return section
    known = RAY_LAUNCHER_KEYS[kind]
    kept = {}
    for key, value in section.items():
        if not (isinstance(key, str) and key in known):
            kept[key] = value
            continue
        found.append((where + (key,), f"Ray's cluster launcher key, not used by spotswarm: {known[key]}"
                      + did_you_mean(key, model.model_fields, cutoff=0.8)))  # namespace -> namespaces
    return kept


def strip_ray_launcher_keys(data: dict) -> tuple[dict, list[tuple[Loc, str]]]:
    """``data`` without the keys of Ray's cluster launcher that spotswarm does not use, and where
    each was, with a warning message."""
    found: list[tuple[Loc, str]] = []
    data = _without_ray_keys(data, "", (), ClusterConfig, found)
    if "provider" in data:
        data["provider"] = _without_ray_keys(data["provider"], "provider", ("provider",), ProviderConfig, found)
    types = data.get("available_node_types")
    if isinstance(types, dict):
        data["available_node_types"] = {
            name: _without_ray_keys(nt, "available_node_types.*", ("available_node_types", name), NodeType, found)
            for name, nt in types.items()}
    return data, found
