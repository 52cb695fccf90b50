"""Decentralized progress tracking (DeDLOC): how far the collaboration is toward its global batch.

Each peer publishes ``{epoch, samples, samples_per_second, time, client_mode}`` as a signed subkey
of its progress key: ``<run>.progress`` in a run of up to ``fanout`` peers, where everyone reads
everyone's records, else a leaf of the tree of keys ``progress_tree.py`` lays out, where a peer reads
its leaf's records and one summary of the rest of the swarm.  The global epoch is the largest any
live peer reports; the samples accumulated toward it are summed over the peers at that epoch,
extrapolated by their throughput since they reported, each peer's share capped at the global batch.

A training step must not wait on the network: ``start_view`` keeps a view of the swarm fresh in the
background (our own reports published, everyone's read back every ``refresh_interval``, at once
after ``publish``, and when the view expects the global batch complete), and ``view`` answers from
it without a DHT call.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field

import pydantic

from dht import DHTNode, ReplicaSets, SignatureValidator, owners_in
from dht.replicas import REUSED_FOR
from p2p import PeerID
from p2p.waiting import wait_event

from .progress_tree import DOWN, UP, ProgressLayout, ProgressSummary, freshest, freshest_by_child, merge, summarize

logger = logging.getLogger(__name__)
READ_REPLICAS = 3  # of a key's replicas, how many a view reads: each holds every record written


class PeerProgress(pydantic.BaseModel):
    """One peer's report (also the DHT schema of ``<run>.progress`` values); no other fields, so a
    record cannot be padded to fill the shared key."""

    model_config = pydantic.ConfigDict(extra="forbid")

    epoch: int = pydantic.Field(ge=0)
    samples: int = pydantic.Field(ge=0)
    samples_per_second: float = pydantic.Field(ge=0)
    time: float
    client_mode: bool = False
    loss: float | None = None


@dataclass
class _KeyRead:
    """One progress key as read: peers' records, withdrawn records, and summaries (by subkey)."""

    records: dict[str, PeerProgress] = field(default_factory=dict)
    withdrawn: set[str] = field(default_factory=set)
    ups: dict[str, ProgressSummary] = field(default_factory=dict)
    downs: dict[str, ProgressSummary] = field(default_factory=dict)


@dataclass(frozen=True)
class GlobalProgress:
    epoch: int
    samples: float  # estimated samples accumulated toward the current epoch, all peers
    target: int
    samples_per_second: float
    num_peers: int  # peers that reported for the global epoch
    eta: float  # estimated seconds until the target is reached
    live_peers: int = 0  # peers that reported recently, at any epoch: the group mates to wait for
    peers: int = 0  # every peer whose record has not expired, live or not

    @property
    def ready(self) -> bool:
        return self.samples >= self.target


class ProgressTracker:
    """One peer's reports and its view of the swarm's progress.  ``layout`` must be the run's (every
    peer's the same; the default, one key, suits runs of up to 16 peers).  An ``observer`` (the
    supervisor) publishes nothing and reads every leaf, to see each peer's own record."""

    def __init__(self, node: DHTNode, run: str, target_batch_size: int, signer: SignatureValidator,
                 expiration: float = 30.0, fresh_for: float = 5.0, refresh_interval: float = 0.1,
                 layout: ProgressLayout | None = None, observer: bool = False, roster: bool = False) -> None:
        self.node = node
        self.layout = layout or ProgressLayout(run)
        if self.layout.run != run:
            raise ValueError(f"progress layout of run {self.layout.run!r} given for run {run!r}")
        self.path = self.layout.leaf_of(node.peer_id)
        self.key = self.layout.key(self.path)  # where our record lives
        self.target = target_batch_size
        self.subkey = f"{signer.marker}{node.peer_id}"
        self.expiration = expiration
        self.fresh_for = fresh_for  # a record older than this may be a dead peer's: not worth waiting for
        self.observer = observer
        self.last_report: PeerProgress | None = None
        self.refresh_interval = refresh_interval
        self.refreshes = 0  # reads of the swarm done so far: the unit a view's cost is counted in
        self._seen: dict[str, PeerProgress] = {}  # the background view's last read of our leaf's records
        # every other leaf's records, read a few leaves per refresh (``members``), where ``roster`` is on
        self.roster = roster and self.layout.depth > 1 and not observer
        self._roster: dict[tuple[int, ...], dict[str, PeerProgress]] = {}
        self._roster_clock: float | None = None  # loop time of the last roster read
        self._roster_owed = 0.0  # leaves due to be read, carried from one refresh to the next
        self._roster_next = 0  # the next leaf to read
        self._roster_rounds = 0  # rounds of leaf reads begun: which replica of a leaf the round reads
        self._rest: ProgressSummary | None = None  # everyone outside our leaf, as its aggregators last summed it
        self._replicas = ReplicaSets(node)
        # a roster reads each leaf once per fresh_for: a replica set kept no longer would mean a lookup a read
        self._roster_replicas = ReplicaSets(node, max(REUSED_FOR, 2 * fresh_for))
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
        await self._write(self.key, self.subkey, progress.model_dump(), self.expiration)

    async def withdraw(self) -> None:
        await self._write(self.key, self.subkey, None, self.expiration + 1)

    async def _write(self, key: str, subkey: str, value: object, lasts: float) -> None:
        await self.node.store(key, value, self.now() + lasts, subkey=subkey, at=await self._replicas.of(key))

    async def peers(self) -> dict[str, PeerProgress]:
        """The records read now: our leaf's (an observer's: every peer's)."""
        return (await self._read_records())[0]

    async def _read_records(self) -> tuple[dict[str, PeerProgress], set[str], ProgressSummary | None]:
        """The records we see, the subkeys of the peers that withdrew theirs, and the rest of the swarm."""
        if self.observer and self.layout.depth > 1:
            keys = [self.layout.key(path) for path in self.layout.all_leaves()]
            found = await self.node.get_many(keys, latest=True)
            reads = [_parse(found[k], self.now() + self.fresh_for) for k in keys]
            return ({k: p for r in reads for k, p in r.records.items()},
                    {k for r in reads for k in r.withdrawn}, None)
        read = await self._read_key(self.key)
        return read.records, read.withdrawn, freshest(read.downs.values())

    async def _read_key(self, key: str, one: int | None = None) -> _KeyRead:
        """One key from its nearest ``READ_REPLICAS`` replicas (every write goes to them all); ``one``:
        from only one of them, the ``one``-th in turn (the roster's reads of the other leaves)."""
        sets = self._replicas if one is None else self._roster_replicas
        replicas = (await sets.of(key))[:READ_REPLICAS]
        if one is not None:
            replicas = [replicas[one % len(replicas)]]
        # a summary dated ahead would stay the freshest for good: a clock a little ahead is all it may be
        return _parse(await self.node.get(key, at=replicas), self.now() + self.fresh_for)

    async def global_progress(self) -> GlobalProgress:
        """The swarm's progress read now (a DHT call); a training step uses ``view`` instead."""
        records, _, rest = await self._read_records()
        return self._summarize(records, rest)

    def members(self, epoch: int) -> list[PeerID]:
        """The peers a grouped average at ``epoch`` plans for, us included (no network): those whose
        record, fresh within two freshness periods, shows ``epoch`` or the one before (a peer that
        just stepped may not have reported it yet).  A one-key run's view holds every record; a larger
        run's roster (``roster=True``) reads every leaf once per ``fresh_for`` seconds, a few leaves per
        refresh: O(N) bytes per peer per ``fresh_for``, against O(1) for its view (``docs/protocol.md``)."""
        records = {k: p for leaf in self._roster.values() for k, p in leaf.items()}
        records.update(self._seen)
        if self.last_report is not None and not self.observer:
            records[self.subkey] = self.last_report
        now = self.now()
        peers = {self.peer_of(k) for k, p in records.items()
                 if p.epoch >= epoch - 1 and now - p.time <= 2 * self.fresh_for}
        return [p for p in peers if p is not None]

    async def _refresh_roster(self) -> None:
        """Read the leaves owed since the last refresh, round-robin, so that each is read once per
        ``fresh_for`` seconds; all of them on the first call."""
        leaves = [path for path in self.layout.all_leaves() if path != self.path]
        if not leaves:
            return
        clock = asyncio.get_running_loop().time()
        first = self._roster_clock is None
        if first:
            owed = float(len(leaves))
        else:
            owed = self._roster_owed + len(leaves) * (clock - self._roster_clock) / self.fresh_for
        self._roster_clock = clock
        count = min(int(owed), len(leaves))
        self._roster_owed = min(owed - count, float(len(leaves)))  # a slow loop owes at most one round
        paths = [leaves[(self._roster_next + i) % len(leaves)] for i in range(count)]
        self._roster_next = (self._roster_next + count) % len(leaves)
        self._roster_rounds += self._roster_next < count  # wrapped around: the next round reads other replicas
        # after a first read of every replica, one replica a leaf, another each round: a record missing from
        # one stays until it would have expired, and its writer's next report reaches every replica
        one = None if first else self._roster_rounds
        reads = await asyncio.gather(*(self._read_key(self.layout.key(path), one) for path in paths))
        cutoff = self.now() - self.expiration
        for path, read in zip(paths, reads, strict=True):
            # a leaf missing from one read keeps its records until they would have expired (see _refresh)
            kept = {k: p for k, p in self._roster.get(path, {}).items()
                    if k not in read.withdrawn and k not in read.records and p.time >= cutoff}
            self._roster[path] = {**kept, **read.records}

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
        """Our leaf's records (an observer's: every peer's) as the background view holds them (no network)."""
        return dict(self._seen)

    def view(self) -> GlobalProgress:
        """The swarm's progress from the background view, extrapolated to now: no network."""
        return self._summarize(dict(self._seen), self._rest)

    @property
    def rest(self) -> ProgressSummary | None:
        """The summary of everyone outside our leaf that the view holds (None in a one-key run)."""
        return self._rest

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
        # an observer of a large run reads every leaf: a second apart is enough for what it records
        slow = self.observer and self.layout.depth > 1
        interval = max(self.refresh_interval, 1.0) if slow else self.refresh_interval
        while True:
            eta = self.view().eta  # read again when the view expects the batch complete, not an interval later
            await wait_event(self._wake, min(interval, eta) if eta > 0 else interval)
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
        found, withdrawn, rest = await self._read_records()
        cutoff = self.now() - self.expiration
        kept = {k: p for k, p in self._seen.items() if k not in withdrawn and k not in found and p.time >= cutoff}
        self._seen = {**kept, **found}
        if rest is not None or self._rest is None or self._rest.time < cutoff:
            self._rest = rest
        if self.layout.depth > 1 and not self.observer:
            await self._aggregate()
        if self.roster:
            await self._refresh_roster()
        self.refreshes += 1

    async def _aggregate(self) -> None:
        """Our share of carrying sums up and down the tree (see progress_tree.py): at each level where
        we are among a key's first writers, sum the key into its parent and the rest of the swarm into it."""
        now, layout = self.now(), self.layout
        lasts = 2 * self.fresh_for  # a former aggregator's summaries leave soon: readers need only the freshest
        mine = self._mine()
        summary = summarize(mine.values(), now, self.fresh_for, self.target)
        members = [k for k, p in mine.items() if now - p.time <= self.fresh_for]
        path = self.path
        while path and summary is not None and self.subkey in sorted(members)[: layout.redundancy]:
            parent_path, child = path[:-1], path[-1]
            parent_key = layout.key(parent_path)
            up = summary.model_copy(update={"child": child})
            _, parent = await asyncio.gather(self._write(parent_key, self.subkey + UP, up.model_dump(), lasts),
                                             self._read_key(parent_key))
            ups = freshest_by_child(s for s in parent.ups.values() if s.time >= now - self.expiration)
            ups[child] = up
            above = freshest(parent.downs.values()) if parent_path else None
            rest = merge([above, *(s for c, s in ups.items() if c != child)], now, self.target)
            if path == self.path:
                self._rest = rest
            if rest is not None:
                await self._write(layout.key(path), self.subkey + DOWN, rest.model_dump(), lasts)
            summary = merge(ups.values(), now, self.target)
            members = [k[: -len(UP)] for k, s in parent.ups.items() if now - s.time <= self.fresh_for]
            members.append(self.subkey)
            path = parent_path

    def _mine(self) -> dict[str, PeerProgress]:
        """Our leaf's records with our own latest report, even if the DHT is behind."""
        records = dict(self._seen)
        if self.last_report is not None and not self.observer:
            records[self.subkey] = self.last_report
        return records

    def _summarize(self, peers: dict[str, PeerProgress], rest: ProgressSummary | None) -> GlobalProgress:
        if self.last_report is not None and not self.observer:
            peers[self.subkey] = self.last_report  # our own latest, even if the DHT is behind
        now = self.now()
        total = merge([summarize(peers.values(), now, self.fresh_for, self.target), rest], now, self.target)
        if total is None:
            return GlobalProgress(0, 0.0, self.target, 0.0, 0, float("inf"))
        samples, rate = total.samples, total.samples_per_second
        eta = 0.0 if samples >= self.target else ((self.target - samples) / rate if rate > 0 else float("inf"))
        # a peer behind is about to load state and join (or its record is a few milliseconds stale):
        # groups wait for it, else a fast peer alone would race ahead and a newcomer never catch up
        return GlobalProgress(total.epoch, samples, self.target, rate, total.at_epoch, eta, max(total.live, 1),
                              total.peers)


def _parse(found: object, not_after: float) -> _KeyRead:
    """A progress key's value as read: malformed entries, and summaries dated after ``not_after``, are
    left out (a replica validates what it stores, but a reader does not trust the replica either)."""
    out = _KeyRead()
    value = getattr(found, "value", None)
    if not isinstance(value, dict):
        return out
    for raw, item in value.items():
        subkey = str(raw)
        kind = UP if subkey.endswith(UP) else DOWN if subkey.endswith(DOWN) else ""
        if item.value is None:
            if not kind:
                out.withdrawn.add(subkey)
            continue
        try:
            if kind:
                summary = ProgressSummary.model_validate(item.value)
                if summary.time <= not_after:
                    (out.ups if kind == UP else out.downs)[subkey] = summary
            else:
                out.records[subkey] = PeerProgress.model_validate(item.value)
        except pydantic.ValidationError:
            continue
    return out
