"""What a cloud is to a run's config: which providers this build runs and how each one's
``node_config`` is checked when a file is loaded.  Apart from ``providers/`` (how machines are
created), so that a config is judged without importing a cloud's client."""

from __future__ import annotations

import importlib.util

from orchestrator.config.loader import did_you_mean

RUNNABLE_PROVIDERS = ("local", "aws", "gcp")
_LOCAL_NODE_CONFIG_KEYS = ("InstanceType",)


def _boto3_installed() -> bool:
    """Whether boto3 can be imported, without importing it (``validate`` stays fast)."""
    return importlib.util.find_spec("boto3") is not None


def _compute_installed() -> bool:
    """Whether google-cloud-compute can be imported, without importing it."""
    try:
        return importlib.util.find_spec("google.cloud.compute_v1") is not None
    except ModuleNotFoundError:  # no google.cloud namespace at all
        return False


def provider_problem(provider_type: str) -> str | None:
    """Why this build cannot run ``provider_type``, or None when it can.  Asked when a config is
    loaded, so that an unrunnable provider fails before Ray starts or a run directory exists."""
    if provider_type == "aws":
        return None if _boto3_installed() else (
            "provider.type 'aws' needs boto3, which is not installed: pip install 'spotswarm[aws]'")
    if provider_type == "gcp":
        return None if _compute_installed() else (
            "provider.type 'gcp' needs google-cloud-compute, which is not installed: pip install 'spotswarm[gcp]'")
    if provider_type in RUNNABLE_PROVIDERS:
        return None
    *others, last = [repr(p) for p in RUNNABLE_PROVIDERS]
    runnable = f"{', '.join(others)} and {last}"
    return f"provider.type {provider_type!r} is not a provider (this build runs {runnable})"


def node_config_problems(provider_type: str, node_type: str, node_config: dict
                         ) -> list[tuple[str | tuple[str | int, ...], str]]:
    """The provider's own checks of ``available_node_types.<node_type>.node_config``, as (key,
    message); the key is a top-level ``node_config`` key, or a path of keys into it for a nested
    problem.  aws checks it against EC2's RunInstances model (botocore's), gcp against Compute
    Engine's Instance message (google-cloud-compute's), so a bad key fails at load, not at the
    first launch; the local provider reads only a label."""
    if provider_type == "aws":
        if importlib.util.find_spec("botocore") is None:
            return []  # provider_problem says what to install
        from orchestrator.config.aws import aws_node_config_problems

        return list(aws_node_config_problems(node_config))
    if provider_type == "gcp":
        if not _compute_installed():
            return []  # provider_problem says what to install
        from orchestrator.config.gcp import gcp_node_config_problems

        return list(gcp_node_config_problems(node_config))
    if provider_type != "local":
        return []
    problems: list[tuple[str | tuple[str | int, ...], str]] = []
    for key, value in node_config.items():
        if key not in _LOCAL_NODE_CONFIG_KEYS:
            hint = did_you_mean(key, _LOCAL_NODE_CONFIG_KEYS, fold=True)  # instance_type -> InstanceType too
            problems.append((key, "unknown key for the local provider" + (
                hint or f" (it reads only {', '.join(_LOCAL_NODE_CONFIG_KEYS)})")))
        elif not isinstance(value, str):
            problems.append((key, f"must be a string, a label for node type {node_type!r} (got {value!r})"))
    return problems
