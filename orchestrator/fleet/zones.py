"""Where the fleet buys its next instance of a node type: the cheapest zone, penalized by its recent
preemptions, in the spot market unless spot keeps failing or costs too much.  Apart from the policy
because it is a rule over prices and history alone, with no instance to keep."""

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


class ZoneChoice:
    """The market's memory the choice rests on: recent preemptions by zone, and zones that refused a
    launch for lack of capacity (until when)."""

    def __init__(self, config: ClusterConfig, provider: NodeProvider) -> None:
        self.config = config
        self.provider = provider
        self.preemptions: deque[tuple[float, str]] = deque()  # (when, zone)
        self.no_capacity: dict[tuple[str, str, str], float] = {}  # (node type, zone, market) -> until

    def has_capacity(self, node_type: str, zone: str, market: str, now: float) -> bool:
        until = self.no_capacity.get((node_type, zone, market))
        return until is None or now >= until

    def choose(self, node_type: str, now: float) -> tuple[str, str]:
        """The cheapest zone, penalized by its recent preemptions; on-demand after too many of them
        (and back to spot once they leave the window), or when spot is above the price cap."""
        spot = self.config.spot
        while self.preemptions and now - self.preemptions[0][0] > spot.fallback_window_s:
            self.preemptions.popleft()
        window = [z for _, z in self.preemptions]
        market = "spot" if spot.market == "spot" and self.config.available_node_types[node_type].spot else "on-demand"
        every_zone = self.provider.zones or self.config.provider.zones
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

        return min(zones, key=score), market
