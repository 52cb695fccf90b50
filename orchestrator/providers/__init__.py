"""Node providers: where instances come from. ``local`` simulates a spot market on this machine;
``aws`` launches EC2 spot instances, ``gcp`` GCE Spot VMs. One file per provider."""

import importlib.util
from pathlib import Path

from ..config_loader import did_you_mean
from .base import Instance, LaunchSpec, NodeProvider, PreemptionNotice

__all__ = ["Instance", "LaunchSpec", "NodeProvider", "PreemptionNotice", "make_provider"]


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
        from .aws_config import aws_node_config_problems

        return list(aws_node_config_problems(node_config))
    if provider_type == "gcp":
        if not _compute_installed():
            return []  # provider_problem says what to install
        from .gcp_config import gcp_node_config_problems

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


def make_provider(config, clock, run_dir: Path) -> NodeProvider:
    """The provider for ``config.provider`` (its state, if any, kept under ``run_dir``)."""
    kind = config.provider.type
    problem = provider_problem(kind)
    if problem is not None:
        raise ValueError(problem)
    if kind == "aws":
        from .aws import AwsProvider

        return AwsProvider(config, clock)
    if kind == "gcp":
        from .gcp import GcpProvider

        return GcpProvider(config, clock)
    if config.provider.mode == "nodes":
        from .local_nodes import LocalNodeProvider

        return LocalNodeProvider(config, clock, Path(run_dir) / "nodes")
    from .local import LocalSpotProvider

    return LocalSpotProvider(config, clock)
