"""Where the fleet buys its next instance of a node type: the cheapest zone of the node type's region,
penalized by that zone's recent preemptions, in the spot market unless spot keeps failing there or
costs too much.  Apart from the policy because it is a rule over prices and history alone, with no
instance to keep."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from orchestrator.config.schema import ClusterConfig
from orchestrator.providers.base import NodeProvider


@dataclass
class PendingLaunch:
    """A launch chosen (type, zone, market) and waiting for the provider's provisioning delay."""

    node_type: str
    zone: str
    market: str
    ready_at: float


@dataclass(frozen=True)
class Choice:
    """Where the next instance of a node type goes, and its score there: the price, raised by the
    zone's recent preemptions (lower is better; comparable across node types and regions)."""

    node_type: str
    region: str
    zone: str
    market: str
    score: float


class ZoneChoice:
    """The market's memory the choice rests on: recent preemptions by region and zone, and zones that
    refused a launch of a node type for lack of capacity (until when).  A node type is in one region,
    so its refusals are that region's."""

    def __init__(self, config: ClusterConfig, provider: NodeProvider) -> None:
        self.config = config
        self.provider = provider
        self.preemptions: deque[tuple[float, str, str]] = deque()  # (when, region, zone)
        self.no_capacity: dict[tuple[str, str, str], float] = {}  # (node type, zone, market) -> until

    def has_capacity(self, node_type: str, zone: str, market: str, now: float) -> bool:
        until = self.no_capacity.get((node_type, zone, market))
        return until is None or now >= until

    def zones(self, node_type: str) -> list[str]:
        """The zones a node type may launch in: what the provider found for it (another region's
        zones), else what it found for its own region (a cloud's subnets) where the node type lists
        none, else the config's."""
        found = self.provider.zones_for(node_type)
        if found:
            return list(found)
        if self.config.uses_provider_zones(node_type):
            return list(self.provider.zones or self.config.provider.zones)
        return self.config.zones_of(node_type)

    def best(self, node_type: str, now: float, avoid: set[str] | frozenset[str] = frozenset()) -> Choice:
        """The cheapest zone of the node type's region, penalized by its recent preemptions; on-demand
        after too many of them in that region (and back to spot once they leave the window), or when
        spot is above the price cap."""
        spot = self.config.spot
        while self.preemptions and now - self.preemptions[0][0] > spot.fallback_window_s:
            self.preemptions.popleft()
        region = self.config.region_of(node_type)
        window = [z for _, r, z in self.preemptions if r == region]
        market = "spot" if spot.market == "spot" and self.config.available_node_types[node_type].spot else "on-demand"
        every_zone = self.zones(node_type)
        zones = [z for z in every_zone if self.has_capacity(node_type, z, market, now)]
        if market == "spot" and spot.fallback_to_on_demand_after and len(window) >= spot.fallback_to_on_demand_after:
            market = "on-demand"
        if market == "spot" and spot.max_price_per_hour is not None:
            zones = [z for z in zones if self.provider.price(node_type, z, "spot") <= spot.max_price_per_hour]
        if market == "spot" and not zones:  # no spot anywhere (price cap, capacity): on-demand
            market = "on-demand"
            zones = [z for z in every_zone if self.has_capacity(node_type, z, market, now)]
        if not zones:  # no capacity at all: the least recently refused zone is tried again first
            zones = sorted(every_zone, key=lambda z: self.no_capacity.get((node_type, z, market), 0.0))[:1]

        def score(zone: str) -> float:  # cheaper, and fewer recent preemptions, is better
            return self.provider.price(node_type, zone, market) * (1 + 0.5 * window.count(zone))

        zone = min([z for z in zones if z not in avoid] or zones, key=score)  # ``avoid`` unless it is all there is
        return Choice(node_type, region, zone, market, score(zone))
