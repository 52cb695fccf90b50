"""Node providers: where instances come from. ``local`` simulates a spot market on this machine;
``aws`` and ``gcp`` (later) talk to the clouds. One file per provider."""

from .base import Instance, NodeProvider, PreemptionNotice

__all__ = ["Instance", "NodeProvider", "PreemptionNotice", "make_provider"]


def make_provider(config, clock) -> NodeProvider:
    kind = config.provider.type
    if kind == "local":
        from .local import LocalSpotProvider

        return LocalSpotProvider(config, clock)
    raise NotImplementedError(f"provider type {kind!r} is not implemented yet; use 'local'")
