"""Node providers: where instances come from. ``local`` simulates a spot market on this machine;
``aws`` and ``gcp`` (later) talk to the clouds. One file per provider."""

import difflib
from pathlib import Path

from .base import Instance, LaunchSpec, NodeProvider, PreemptionNotice

__all__ = ["Instance", "LaunchSpec", "NodeProvider", "PreemptionNotice", "make_provider"]


RUNNABLE_PROVIDERS = ("local",)
_LOCAL_NODE_CONFIG_KEYS = ("InstanceType",)


def provider_problem(provider_type: str) -> str | None:
    """Why this build cannot run ``provider_type``, or None when it can.  Asked when a config is
    loaded, so that an unrunnable provider fails before Ray starts or a run directory exists."""
    if provider_type in RUNNABLE_PROVIDERS:
        return None
    runnable = ", ".join(repr(p) for p in RUNNABLE_PROVIDERS)
    if provider_type in ("aws", "gcp"):
        return (f"provider.type {provider_type!r} is not available in this build yet (only {runnable} is); "
                "the file validates, but nothing in this build can launch its instances")
    return f"provider.type {provider_type!r} is not a provider (this build runs {runnable})"


def node_config_problems(provider_type: str, node_type: str, node_config: dict) -> list[tuple[str, str]]:
    """The provider's own checks of ``available_node_types.<node_type>.node_config``, as (key,
    message).  The cloud providers pass ``node_config`` to their APIs, which judge it; the local one
    reads only a label."""
    if provider_type != "local":
        return []
    problems = []
    for key, value in node_config.items():
        if key not in _LOCAL_NODE_CONFIG_KEYS:
            folded = {k.casefold(): k for k in _LOCAL_NODE_CONFIG_KEYS}  # instance_type -> InstanceType too
            hint = difflib.get_close_matches(str(key).replace("_", "").casefold(), list(folded), n=1)
            problems.append((key, "unknown key for the local provider" + (
                f"; did you mean {folded[hint[0]]!r}?" if hint
                else f" (it reads only {', '.join(_LOCAL_NODE_CONFIG_KEYS)})")))
        elif not isinstance(value, str):
            problems.append((key, f"must be a string, a label for node type {node_type!r} (got {value!r})"))
    return problems


def make_provider(config, clock, run_dir: Path) -> NodeProvider:
    """The provider for ``config.provider`` (its state, if any, kept under ``run_dir``)."""
    kind = config.provider.type
    problem = provider_problem(kind)
    if problem is not None:
        raise ValueError(problem)
    if config.provider.mode == "nodes":
        from .local_nodes import LocalNodeProvider

        return LocalNodeProvider(config, clock, Path(run_dir) / "nodes")
    from .local import LocalSpotProvider

    return LocalSpotProvider(config, clock)
