"""The swarm clock: this machine's wall clock, corrected toward the other peers' clocks.

Peers compare wall-clock times across machines: record expirations in the DHT, the ``time`` of a
progress record (liveness), matchmaking declarations, state adverts.  One machine whose clock
steps (an NTP step, a VM resume) would otherwise misjudge all of them: ahead, it sees every other
peer's record as stale and trains alone; behind, the others see it as dead.

Every DHT ping reply carries the responder's local wall clock.  A sample of peer ``p`` is
``remote_time - midpoint``, the midpoint of the call on this machine's monotonic clock, so a step
of our own wall clock never invalidates samples already taken.  A peer's vote is the median of its
last few samples (calls slower than ``max_rtt`` are dropped: their midpoint says little); our own
vote is ``local() - monotonic()`` now.  ``now()`` is ``monotonic()`` plus the median of all votes:
with most clocks sane a stepped clock is outvoted, its own step included, at once.

With an even number of votes (two peers, say) there is no majority.  The middle vote nearest the
one chosen before wins, so a step of either clock moves neither peer (each stays where both
were); at the first estimate the lower one wins, the side on which a swarm clock that errs makes
records look fresher than they are (a dead peer waited for a little longer), never live peers dead.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass


class LocalClock:
    """A wall clock that a fault injector can step: ``base()`` plus every ``jump`` so far."""

    def __init__(self, base: Callable[[], float] = time.time) -> None:
        self.base = base
        self._jumped = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.base() + self._jumped

    def jump(self, seconds: float) -> None:
        """Step this clock by ``seconds`` (from any thread), as an NTP step or a VM resume would."""
        with self._lock:
            self._jumped += float(seconds)

    @property
    def jumped(self) -> float:
        return self._jumped


_process_clock = LocalClock()


def local_time() -> float:
    """This process's wall clock: ``time.time()`` plus whatever ``jump`` added (tests, fault injection)."""
    return _process_clock()


def jump(seconds: float) -> None:
    """Step this process's wall clock by ``seconds``: every node built on ``local_time`` sees it."""
    _process_clock.jump(seconds)


@dataclass
class _PeerVotes:
    samples: deque[float]
    last_sample: float  # monotonic time
    vote: float = 0.0


def _lower_median(values: list[float]) -> float:
    values.sort()
    return values[(len(values) - 1) // 2]


def _median_near(values: list[float], previous: float | None) -> float:
    """The median; of two middle values, the one nearer ``previous`` (the lower if None)."""
    values.sort()
    n = len(values)
    low, high = values[(n - 1) // 2], values[n // 2]
    if previous is None or abs(low - previous) <= abs(high - previous):
        return low
    return high


class SwarmClock:
    """``now()``: the local wall clock corrected by the median offset of the peers' clocks.

    ``record`` takes samples (the node's pings feed it); ``now``, ``offset`` and ``local`` may be
    called from any thread.  With no samples, ``now() == local()``.
    """

    def __init__(self, local: Callable[[], float] = local_time, *, window: int = 5, max_peers: int = 16,
                 max_rtt: float = 1.0, max_age: float = 120.0) -> None:
        self.local = local if isinstance(local, LocalClock) else LocalClock(local)
        self.window = window
        self.max_peers = max_peers
        self.max_rtt = max_rtt
        self.max_age = max_age  # a peer not sampled for this long (left, unreachable) no longer votes
        self._peers: dict[Hashable, _PeerVotes] = {}
        self._votes: tuple[float, ...] = ()  # the peers' votes, replaced whole so readers need no lock
        self._chosen: float | None = None  # the last estimate (a vote) made with peers' votes: breaks ties
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.now()

    def now(self) -> float:
        """The swarm's time: what cross-peer comparisons (liveness, expirations) must use."""
        mono, local = time.monotonic(), self.local()
        return mono + self._estimate(local - mono)

    @property
    def offset(self) -> float:
        """Seconds to add to the local wall clock to get the swarm's time (about 0 with sane clocks)."""
        mono, local = time.monotonic(), self.local()
        return mono + self._estimate(local - mono) - local

    def _estimate(self, own_vote: float) -> float:
        votes = self._votes
        if not votes:
            return own_vote
        # readers on several threads may race here: each computes from the same votes, any result will do
        chosen = self._chosen = _median_near([own_vote, *votes], self._chosen)
        return chosen

    @property
    def voters(self) -> int:
        """How many peers' clocks the estimate uses (ourselves not counted)."""
        return len(self._votes)

    def jump(self, seconds: float) -> None:
        """Step the local wall clock (``LocalClock.jump``); ``now()`` stays where the swarm is."""
        self.local.jump(seconds)

    def record(self, peer: Hashable, remote_time: object, sent: float, received: float) -> bool:
        """A sample from a reply carrying the peer's wall clock, for a call made between ``sent`` and
        ``received`` (``time.monotonic()``).  False if unusable (slow call, not a finite number)."""
        if not isinstance(remote_time, (int, float)) or isinstance(remote_time, bool) \
                or not math.isfinite(remote_time) or not 0 <= received - sent <= self.max_rtt:
            return False
        sample = float(remote_time) - (sent + received) / 2
        with self._lock:
            votes = self._peers.get(peer)
            if votes is None:
                votes = self._peers[peer] = _PeerVotes(deque(maxlen=self.window), received)
            votes.samples.append(sample)
            votes.last_sample = received
            votes.vote = _lower_median(list(votes.samples))
            self._forget_locked(received)
        return True

    def votes(self) -> dict[Hashable, float]:
        """Each voting peer's clock minus our monotonic clock (the median of its recent samples)."""
        with self._lock:
            return {p: v.vote for p, v in self._peers.items()}

    def last_sampled(self, peer: Hashable) -> float:
        """When ``peer`` was last sampled (monotonic), -inf if never: whom to sample next."""
        votes = self._peers.get(peer)
        return votes.last_sample if votes is not None else -math.inf

    def prune(self) -> None:
        """Drop the votes of peers not sampled for ``max_age``."""
        with self._lock:
            self._forget_locked(time.monotonic())

    def _forget_locked(self, now: float) -> None:
        stale = [p for p, v in self._peers.items() if now - v.last_sample > self.max_age]
        for p in stale:
            del self._peers[p]
        if len(self._peers) > self.max_peers:  # keep the most recently sampled
            ranked = sorted(self._peers, key=lambda p: self._peers[p].last_sample, reverse=True)
            for p in ranked[self.max_peers:]:
                del self._peers[p]
        self._votes = tuple(v.vote for v in self._peers.values())
