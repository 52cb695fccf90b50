"""Decentralized progress tracking (DeDLOC): how far the collaboration is toward its global batch.

Each peer publishes ``{epoch, samples, samples_per_second, time, client_mode}`` as a signed subkey
of ``<run>.progress``; everyone reads all of them.  The global epoch is the largest any live peer
reports; the samples accumulated toward it are summed over the peers at that epoch, extrapolated
by their throughput since they reported, each peer's share capped at the global batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pydantic

from dht import DHTNode, SignatureValidator


class PeerProgress(pydantic.BaseModel):
    """One peer's report (also the DHT schema of ``<run>.progress`` values)."""

    epoch: int = pydantic.Field(ge=0)
    samples: int = pydantic.Field(ge=0)
    samples_per_second: float = pydantic.Field(ge=0)
    time: float
    client_mode: bool = False
    loss: float | None = None


@dataclass(frozen=True)
class GlobalProgress:
    epoch: int
    samples: float  # estimated samples accumulated toward the current epoch, all peers
    target: int
    samples_per_second: float
    num_peers: int  # peers that reported for the global epoch
    eta: float  # estimated seconds until the target is reached
    live_peers: int = 0  # peers that reported recently, at any epoch: the group mates to wait for

    @property
    def ready(self) -> bool:
        return self.samples >= self.target


class ProgressTracker:
    def __init__(self, node: DHTNode, run: str, target_batch_size: int, signer: SignatureValidator,
                 expiration: float = 30.0, fresh_for: float = 5.0) -> None:
        self.node = node
        self.key = f"{run}.progress"
        self.target = target_batch_size
        self.subkey = f"{signer.marker}{node.peer_id}"
        self.expiration = expiration
        self.fresh_for = fresh_for  # a record older than this may be a dead peer's: not worth waiting for
        self.last_report: PeerProgress | None = None

    async def report(self, progress: PeerProgress) -> None:
        self.last_report = progress
        await self.node.store(self.key, progress.model_dump(), time.time() + self.expiration, subkey=self.subkey)

    async def withdraw(self) -> None:
        await self.node.store(self.key, None, time.time() + self.expiration + 1, subkey=self.subkey)

    async def peers(self) -> dict[str, PeerProgress]:
        found = await self.node.get(self.key, latest=True)
        out: dict[str, PeerProgress] = {}
        if found is None or not isinstance(found.value, dict):
            return out
        for subkey, item in found.value.items():
            if item.value is None:
                continue
            try:
                out[str(subkey)] = PeerProgress.model_validate(item.value)
            except pydantic.ValidationError:
                continue
        return out

    async def global_progress(self) -> GlobalProgress:
        peers = await self.peers()
        if self.last_report is not None:
            peers[self.subkey] = self.last_report  # our own latest, even if the DHT is behind
        if not peers:
            return GlobalProgress(0, 0.0, self.target, 0.0, 0, float("inf"))
        epoch = max(p.epoch for p in peers.values())
        current = [p for p in peers.values() if p.epoch == epoch]
        now = time.time()
        samples = sum(min(p.samples + p.samples_per_second * max(now - p.time, 0.0), self.target) for p in current)
        rate = sum(p.samples_per_second for p in current)
        eta = 0.0 if samples >= self.target else ((self.target - samples) / rate if rate > 0 else float("inf"))
        # a peer behind is about to load state and join (or its record is a few milliseconds stale):
        # groups wait for it, else a fast peer alone would race ahead and a newcomer never catch up
        live = sum(now - p.time <= self.fresh_for for p in peers.values())
        return GlobalProgress(epoch, samples, self.target, rate, len(current), eta, max(live, 1))
