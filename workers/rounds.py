"""Each epoch a peer completes, split into the seconds it spent computing and communicating.

A peer's cost totals (``TrainingPeer.costs``) only say how its whole time divides; the split of one
epoch (in DiLoCo, one outer round) is the difference of those totals between two epoch records.
The rounds since those the supervisor has travel to it with the peer's status; it stores them for
the dashboard's and the report's per-round table.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass

#: rounds a status answer carries when the caller names none it has: the newest few
RECENT_ROUNDS = 16
#: the most rounds one status answer carries after those the caller has (it asks again for the rest)
ROUNDS_PER_STATUS = 128


@dataclass(frozen=True)
class RoundTime:
    """One completed epoch of one peer."""

    epoch: int
    time: float  # wall clock when the peer completed it
    compute_s: float  # seconds training, outside averaging and state downloads
    comm_s: float  # seconds averaging or downloading state

    def as_dict(self) -> dict:
        return asdict(self)


class RoundSplitter:
    """The deltas of a peer's (busy − comm, comm) totals from one epoch record to the next.

    ``start`` sets the baseline when training begins; each ``close`` returns the epoch's split and
    moves the baseline, so the splits of all epochs add up to the totals' growth since the start.
    Only an epoch that follows the previous one by exactly one is kept as a round: a jump (state
    loaded from a peer ahead of us) spans several of the swarm's rounds, and its time is no one
    round's.  Safe to read from another thread (a status call) while the training thread closes."""

    def __init__(self, keep: int = 8 * ROUNDS_PER_STATUS) -> None:
        self._lock = threading.Lock()
        self._rounds: deque[RoundTime] = deque(maxlen=keep)
        self._epoch: int | None = None
        self._compute = 0.0
        self._comm = 0.0

    def start(self, epoch: int, busy_s: float, comm_s: float) -> None:
        """The baseline: the epoch training starts from and the totals at that moment."""
        self._epoch, self._compute, self._comm = epoch, busy_s - comm_s, comm_s

    def close(self, epoch: int, busy_s: float, comm_s: float, at: float) -> RoundTime:
        """The split of the epoch just completed (``epoch``), from the totals now."""
        if self._epoch is None:
            self.start(epoch - 1, 0.0, 0.0)
        split = RoundTime(epoch, at, round(busy_s - comm_s - self._compute, 4), round(comm_s - self._comm, 4))
        one_round = epoch == self._epoch + 1
        self._epoch, self._compute, self._comm = epoch, busy_s - comm_s, comm_s
        if one_round:
            with self._lock:
                self._rounds.append(split)
        return split

    def recent(self, n: int = RECENT_ROUNDS) -> list[dict]:
        """The newest ``n`` rounds kept, oldest first, as plain dicts (a status answer's)."""
        with self._lock:
            newest = list(self._rounds)[-n:] if n > 0 else []
        return [r.as_dict() for r in newest]

    def after(self, epoch: int, limit: int = ROUNDS_PER_STATUS) -> list[dict]:
        """The rounds kept of epochs after ``epoch``, oldest first, at most ``limit`` of them: a caller
        that names the newest round it has gets the ones it lacks, and the rest on its next call."""
        with self._lock:
            rounds = [r for r in self._rounds if r.epoch > epoch][:limit]
        return [r.as_dict() for r in rounds]
