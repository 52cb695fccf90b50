"""Decentralized progress tracking (DeDLOC): how far the collaboration is toward its global batch.

Each peer publishes ``{epoch, samples, samples_per_second, time, client_mode}`` as a signed subkey
of ``<run>.progress``; everyone reads all of them.  The global epoch is the largest any live peer
reports; the samples accumulated toward it are summed over the peers at that epoch, extrapolated
by their throughput since they reported, each peer's share capped at the global batch.

A training step must not wait on the network: ``start_view`` keeps a view of the swarm fresh in the
background (our own reports published, everyone's read back every ``refresh_interval``, at once
after ``publish``, and when the view expects the global batch complete), and ``view`` answers from
it without a DHT call.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass

import pydantic

from dht import DHTNode, SignatureValidator, owners_in
from p2p import PeerID

logger = logging.getLogger(__name__)


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
                 expiration: float = 30.0, fresh_for: float = 5.0, refresh_interval: float = 0.1) -> None:
        self.node = node
        self.key = f"{run}.progress"
        self.target = target_batch_size
        self.subkey = f"{signer.marker}{node.peer_id}"
        self.expiration = expiration
        self.fresh_for = fresh_for  # a record older than this may be a dead peer's: not worth waiting for
        self.last_report: PeerProgress | None = None
        self.refresh_interval = refresh_interval
        self._seen: dict[str, PeerProgress] = {}  # the background view's last read of everyone's records
        self._unpublished: PeerProgress | None = None
        self._handing = threading.Lock()  # publish (any thread) and the view (the loop) trade _unpublished
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def now(self) -> float:
        """The swarm clock's time (any thread): a record's ``time`` is compared on other machines, so
        one peer's stepped wall clock must not make it, or the others, misjudge who is live."""
        return self.node.clock.now()

    async def report(self, progress: PeerProgress) -> None:
        self.last_report = progress
        await self.node.store(self.key, progress.model_dump(), self.now() + self.expiration, subkey=self.subkey)

    async def withdraw(self) -> None:
        await self.node.store(self.key, None, self.now() + self.expiration + 1, subkey=self.subkey)

    async def peers(self) -> dict[str, PeerProgress]:
        return (await self._read())[0]

    async def _read(self) -> tuple[dict[str, PeerProgress], set[str]]:
        """Every live peer's record, and the subkeys of the peers that withdrew theirs."""
        found = await self.node.get(self.key, latest=True)
        out: dict[str, PeerProgress] = {}
        withdrawn: set[str] = set()
        if found is None or not isinstance(found.value, dict):
            return out, withdrawn
        for subkey, item in found.value.items():
            if item.value is None:
                withdrawn.add(str(subkey))
                continue
            try:
                out[str(subkey)] = PeerProgress.model_validate(item.value)
            except pydantic.ValidationError:
                continue
        return out, withdrawn

    async def global_progress(self) -> GlobalProgress:
        """The swarm's progress read now (a DHT call); a training step uses ``view`` instead."""
        return self._summarize(await self.peers())

    @staticmethod
    def peer_of(subkey: str) -> PeerID | None:
        """The peer a record's subkey (``<owner marker><peer id>``) names, if the key that signs it is
        that peer's own: a member cannot name another peer (whom we would then ping, see
        ``CollaborativeOptimizer``)."""
        marker, _, tail = subkey.rpartition("]")
        try:
            peer = PeerID.from_string(tail)
        except ValueError:
            return None
        owners = owners_in((marker + "]").encode())
        return peer if len(owners) == 1 and PeerID.from_public_key(owners[0]) == peer else None

    def records(self) -> dict[str, PeerProgress]:
        """Every peer's last record as the background view holds it (no network)."""
        return dict(self._seen)

    def view(self) -> GlobalProgress:
        """The swarm's progress from the background view, extrapolated to now: no network."""
        return self._summarize(dict(self._seen))

    # ---- the background view -------------------------------------------------------------------
    async def start_view(self) -> None:
        """Read the swarm once, then keep the view fresh on the node's loop; ends with the node.  A
        view that started empty would show a newcomer alone, and it would step alone."""
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        await self._refresh()
        self.node.spawn(self._keep_view())

    def publish(self, progress: PeerProgress) -> None:
        """Our report, from any thread, without waiting: the view counts it at once, the DHT soon."""
        with self._handing:
            self.last_report = self._unpublished = progress
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _keep_view(self) -> None:
        assert self._wake is not None
        while True:
            eta = self.view().eta  # read again when the view expects the batch complete, not an interval later
            try:
                await asyncio.wait_for(self._wake.wait(), min(self.refresh_interval, eta) if eta > 0 else
                                       self.refresh_interval)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            with self._handing:
                progress, self._unpublished = self._unpublished, None
            try:
                if progress is not None:
                    await self.report(progress)
                await self._refresh()
            except Exception as e:  # the DHT's own errors: the view stays as it was until the next read
                logger.debug("progress view not refreshed: %s: %s", type(e).__name__, e)

    async def _refresh(self) -> None:
        """Merge a read into the view.  A peer missing from one read (a replica that did not answer in
        time) keeps its last record until that would have expired in the DHT too, unless it withdrew:
        one short read must not make the others look gone, or a peer would step alone."""
        found, withdrawn = await self._read()
        cutoff = self.now() - self.expiration
        kept = {k: p for k, p in self._seen.items() if k not in withdrawn and k not in found and p.time >= cutoff}
        self._seen = {**kept, **found}

    def _summarize(self, peers: dict[str, PeerProgress]) -> GlobalProgress:
        if self.last_report is not None:
            peers[self.subkey] = self.last_report  # our own latest, even if the DHT is behind
        if not peers:
            return GlobalProgress(0, 0.0, self.target, 0.0, 0, float("inf"))
        epoch = max(p.epoch for p in peers.values())
        current = [p for p in peers.values() if p.epoch == epoch]
        now = self.now()
        samples = sum(min(p.samples + p.samples_per_second * max(now - p.time, 0.0), self.target) for p in current)
        rate = sum(p.samples_per_second for p in current)
        eta = 0.0 if samples >= self.target else ((self.target - samples) / rate if rate > 0 else float("inf"))
        # a peer behind is about to load state and join (or its record is a few milliseconds stale):
        # groups wait for it, else a fast peer alone would race ahead and a newcomer never catch up
        live = sum(now - p.time <= self.fresh_for for p in peers.values())
        return GlobalProgress(epoch, samples, self.target, rate, len(current), eta, max(live, 1))
