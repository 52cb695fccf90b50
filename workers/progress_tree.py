"""Where a run's progress records live, so that a peer's view of the swarm costs it the same at any size.

One key holding every peer's record costs each reader O(N) bytes per read, and its replicas O(N²)
a second.  Instead, records live in the leaves of a tree of keys (``ProgressLayout``): a run sized
for at most ``fanout`` peers has one key, ``<run>.progress``, as before; a larger one hashes each
peer into one of ``ceil(capacity / fanout)`` leaves ``<run>.progress.<d1>.<d2>…`` (the leaf's
number in base ``fanout``), so a leaf holds about ``fanout`` records and the tree is
``1 + ceil(log_fanout(leaves))`` levels deep.

Every key's first ``redundancy`` fresh writers (by subkey) are its aggregators.  Each refresh, an
aggregator of key K writes K's ``ProgressSummary`` into K's parent (subkey ``<owner><peer>:up``), reads
the parent, and writes into K the summary of everyone *outside* K's subtree (``:down``): the
parent's own ``:down`` merged with the ``:up`` of K's siblings.  A peer reads only its leaf: its
neighbours' records plus one ``:down`` make the whole swarm, each peer counted once.  Per refresh a
peer reads one key of about ``fanout + redundancy`` entries; an aggregator also reads its parent
and writes two entries per level it aggregates, and a fraction ``redundancy / fanout`` of each
level's writers aggregate the next one.  A change reaches everyone within two refreshes per level.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass

import pydantic

from p2p import PeerID

UP, DOWN = ":up", ":down"  # subkey suffixes: a subtree's summary in its parent; the rest of the swarm in a key


class ProgressSummary(pydantic.BaseModel):
    """Many peers' records in one: what a subtree reports upward, or the rest of the swarm downward.
    Only the peers at the newest epoch count toward its samples, as in a single peer's view."""

    model_config = pydantic.ConfigDict(allow_inf_nan=False)

    epoch: int = pydantic.Field(ge=0)  # the newest epoch any counted peer reports
    samples: float = pydantic.Field(ge=0)  # toward that epoch, by its peers, as of ``time``
    samples_per_second: float = pydantic.Field(ge=0)  # of the peers at that epoch
    at_epoch: int = pydantic.Field(ge=0)  # peers at that epoch
    live: int = pydantic.Field(ge=0)  # peers whose records were fresh at ``time``, at any epoch
    peers: int = pydantic.Field(ge=0)  # every unexpired record counted
    loss_sum: float = 0.0
    loss_count: int = pydantic.Field(0, ge=0)
    time: float
    child: int = pydantic.Field(-1, ge=-1)  # in an ``:up`` entry: which child key of this one it sums

    def extrapolated(self, now: float, target: int) -> float:
        """Samples toward the epoch by ``now``, at the summarized rate, at most ``target``."""
        return min(self.samples + self.samples_per_second * max(now - self.time, 0.0), float(target))


@dataclass(frozen=True)
class ProgressLayout:
    """The tree of progress keys of run ``run``, sized for ``capacity`` peers (every peer of a run
    must use the same layout: the orchestrator sizes it from the fleets' largest sizes)."""

    run: str
    capacity: int = 16
    fanout: int = 16
    redundancy: int = 2

    def __post_init__(self) -> None:
        if self.fanout < 2 or self.capacity < 1 or self.redundancy < 1:
            raise ValueError(f"progress layout needs fanout >= 2, capacity >= 1, redundancy >= 1; got {self}")

    @property
    def leaves(self) -> int:
        return max(1, math.ceil(self.capacity / self.fanout))

    @property
    def depth(self) -> int:
        """Levels of keys: 1 (one key) up to ``fanout`` leaves' worth of peers, one more per factor fanout."""
        digits = 0
        while self.fanout ** digits < self.leaves:
            digits += 1
        return 1 + digits

    def leaf_of(self, peer: PeerID) -> tuple[int, ...]:
        """A peer's leaf, as digits from the root: fixed by its id, so its records stay in one place."""
        index = int.from_bytes(hashlib.sha256(b"progress" + peer.digest).digest()[:8], "big") % self.leaves
        digits = []
        for _ in range(self.depth - 1):
            index, digit = divmod(index, self.fanout)
            digits.append(digit)
        return tuple(reversed(digits))

    def key(self, path: tuple[int, ...], kind: str = "progress") -> str:
        """The key at ``path`` of the tree of ``kind`` keys: ``progress``, or ``state`` (the state
        adverts, kept in leaves alike so that no key holds one subkey per peer of a large run)."""
        return f"{self.run}.{kind}" + "".join(f".{d}" for d in path)

    def all_leaves(self) -> list[tuple[int, ...]]:
        """Every leaf's path: what an observer (the supervisor) reads to see each peer's record."""
        out = []
        for index in range(self.leaves):
            digits = []
            for _ in range(self.depth - 1):
                index, digit = divmod(index, self.fanout)
                digits.append(digit)
            out.append(tuple(reversed(digits)))
        return out


def summarize(records: Iterable[object], now: float, fresh_for: float, target: int) -> ProgressSummary | None:
    """The summary of peers' records (``PeerProgress``), extrapolated to ``now``; None for no records."""
    records = list(records)
    if not records:
        return None
    epoch = max(r.epoch for r in records)  # type: ignore[attr-defined]
    current = [r for r in records if r.epoch == epoch]  # type: ignore[attr-defined]
    samples = sum(min(r.samples + r.samples_per_second * max(now - r.time, 0.0), target)  # type: ignore
                  for r in current)
    losses = [r.loss for r in records if r.loss is not None]  # type: ignore[attr-defined]
    return ProgressSummary(epoch=epoch, samples=min(samples, float(target)),
                           samples_per_second=sum(r.samples_per_second for r in current),  # type: ignore
                           at_epoch=len(current), live=sum(now - r.time <= fresh_for for r in records),  # type: ignore
                           peers=len(records), loss_sum=float(sum(losses)), loss_count=len(losses), time=now)


def merge(parts: Iterable[ProgressSummary | None], now: float, target: int) -> ProgressSummary | None:
    """One summary of disjoint parts of the swarm, as of ``now``; None if there are none."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    epoch = max(p.epoch for p in parts)
    current = [p for p in parts if p.epoch == epoch]
    return ProgressSummary(epoch=epoch, samples=min(sum(p.extrapolated(now, target) for p in current), float(target)),
                           samples_per_second=sum(p.samples_per_second for p in current),
                           at_epoch=sum(p.at_epoch for p in current), live=sum(p.live for p in parts),
                           peers=sum(p.peers for p in parts), loss_sum=sum(p.loss_sum for p in parts),
                           loss_count=sum(p.loss_count for p in parts), time=now)


def freshest(entries: Iterable[ProgressSummary]) -> ProgressSummary | None:
    return max(entries, key=lambda s: s.time, default=None)


def freshest_by_child(entries: Iterable[ProgressSummary]) -> dict[int, ProgressSummary]:
    """Per child key, the newest of its aggregators' ``:up`` entries (they are redundant copies)."""
    out: dict[int, ProgressSummary] = {}
    for s in entries:
        if s.child >= 0 and (s.child not in out or s.time > out[s.child].time):
            out[s.child] = s
    return out
