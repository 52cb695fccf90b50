"""Which provider a run gets: a cloud's (``providers/``) or the local simulator's (``sim/``).  Here,
above both, so that the providers never import the simulator and the simulator never the fleet."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.config.clouds import provider_problem
from orchestrator.providers.base import NodeProvider

if TYPE_CHECKING:
    from orchestrator.config.schema import ClusterConfig


def make_provider(config, clock, run_dir: Path) -> NodeProvider:
    """The provider for ``config.provider`` (its state, if any, kept under ``run_dir``)."""
    kind = config.provider.type
    problem = provider_problem(kind)
    if problem is not None:
        raise ValueError(problem)
    if kind == "aws":
        from orchestrator.providers.aws import AwsProvider

        return AwsProvider(config, clock)
    if kind == "gcp":
        from orchestrator.providers.gcp import GcpProvider

        return GcpProvider(config, clock)
    if config.provider.mode == "nodes":
        from orchestrator.sim.nodes import LocalNodeProvider

        return LocalNodeProvider(config, clock, Path(run_dir) / "nodes")
    from orchestrator.sim.actors import LocalSpotProvider

    return LocalSpotProvider(config, clock, run_dir=Path(run_dir))


def terminate_cloud_run(config: ClusterConfig, tags: dict[str, str] | None = None) -> list[str]:
    """Terminate every instance of the run in its cloud (EC2 tags, GCE labels), or those with ``tags``
    too; their ids."""
    if config.provider.type == "gcp":
        from orchestrator.providers.gcp import terminate_run
    else:
        from orchestrator.providers.aws import terminate_run
    return terminate_run(config, tags=tags)
