"""Two training peers in this process, each on its own thread: a, then b joining through a."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from workers.peer import TrainingPeer, WorkerConfig


@contextmanager
def two_peers_training(**common) -> Iterator[list[TrainingPeer]]:
    """Yields [a, b] training (seeds 0 and 1); on the way out both leave and every thread is joined."""
    a = TrainingPeer(WorkerConfig(seed=0, **common))
    b = None
    threads: list[threading.Thread] = []
    try:
        b = TrainingPeer(WorkerConfig(seed=1, initial_peers=[a.address], **common))
        peers = [a, b]
        threads = [threading.Thread(target=p.run, name=f"train-{i}", daemon=True) for i, p in enumerate(peers)]
        for t in threads:
            t.start()
        yield peers
    finally:
        leave_all([a, b], threads)


def leave_all(peers: list[TrainingPeer | None], threads: list[threading.Thread]) -> None:
    """Every peer leaves (concurrently, each within 10 s); then every thread is joined."""
    leaving = [threading.Thread(target=p.prepare_to_leave, kwargs={"deadline": 10.0}) for p in peers if p is not None]
    for t in leaving:
        t.start()
    for t in [*leaving, *threads]:
        t.join(timeout=30)


def assert_in_step(peers: list[TrainingPeer], after: int, before: int, at_least: int) -> None:
    """Every epoch both completed after ``after`` holds the same parameters on both (at least
    ``at_least`` of them), and every step between ``after`` and ``before`` was taken together."""
    digests = [{r["epoch"]: r["params"] for r in p.history} for p in peers]
    shared = [e for e in sorted(set(digests[0]) & set(digests[1])) if e > after]
    assert len(shared) >= at_least, shared
    for epoch in shared:
        assert digests[0][epoch] == digests[1][epoch], f"different parameters at epoch {epoch}"
    for p in peers:  # the first to leave leaves the other alone: steps from ``before`` on are not counted
        sizes = [(r.epoch, r.group_size) for r in p.optimizer.history if after < r.epoch < before]
        assert sizes and min(s for _, s in sizes) == 2, (after, sizes)
