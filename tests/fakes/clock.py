"""A clock a test sets by hand: windows, expiries and spending come out exact, and nothing sleeps.
Whatever takes a ``clock`` callable (the fleet policy, the run store, DHT storage, membership
certificates) takes one."""

from __future__ import annotations


class FakeClock:
    """Reads ``now``, which the test sets or advances by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now
