"""A node-wide bandwidth limit: token buckets for the bytes a node sends and receives.

Fault injection uses it to make one peer's link slow (about 1 Mbit/s) where traffic shaping with
``tc`` is unavailable.  The buckets only do arithmetic; the connections wait on them (``P2P.set_rate_limit``).
"""

from __future__ import annotations

import asyncio
import math
import numbers
from dataclasses import dataclass

from .limits import KiB

_MIN_BURST = 64 * KiB  # the bucket holds at least this much credit ...
_BURST_SECONDS = 0.05  # ... or this many seconds of the rate, whichever is larger
_MIN_READ = 4 * KiB  # a throttled socket is read at most max(_MIN_READ, _READ_SECONDS of the rate) at a time,
_READ_SECONDS = 0.02  # so a message's last bytes wait their turn like the others


def check_rate(bytes_per_s: float | None) -> float | None:
    """The rate as a float (None: unlimited); ValueError for anything but a positive finite number."""
    if bytes_per_s is None:
        return None
    if isinstance(bytes_per_s, bool) or not isinstance(bytes_per_s, numbers.Real) \
            or not math.isfinite(bytes_per_s) or bytes_per_s <= 0:
        raise ValueError(f"a rate limit must be a positive finite number of bytes per second or None, "
                         f"got {bytes_per_s!r}")
    return float(bytes_per_s)


@dataclass(slots=True)
class TokenBucket:
    """Credit in bytes that refills at ``rate`` up to ``burst``; a transfer larger than the credit
    runs it into debt, and ``delay`` says how long the debt takes to pay off."""

    rate: float  # bytes per second
    burst: float  # bytes
    tokens: float = 0.0  # negative: debt
    stamp: float = 0.0  # when ``tokens`` was last brought up to date

    @classmethod
    def for_rate(cls, rate: float, now: float, tokens: float = 0.0) -> TokenBucket:
        """A bucket with the default burst; it starts empty: a link that just slowed down has nothing banked."""
        burst = max(_MIN_BURST, rate * _BURST_SECONDS)
        return cls(rate, burst, min(tokens, burst), now)

    def level(self, now: float) -> float:
        """The credit at ``now`` (negative: debt), after refilling."""
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        return self.tokens

    def delay(self, nbytes: int, now: float) -> float:
        """Take ``nbytes`` of credit; seconds until the bucket is out of debt again (0: it is not in debt)."""
        tokens = self.level(now) - nbytes
        self.tokens = tokens
        return 0.0 if tokens >= 0 else -tokens / self.rate


class Throttle:
    """One node's limit: a bucket per direction, each at ``rate`` over all the node's connections."""

    __slots__ = ("rate", "send", "recv", "read_size")

    def __init__(self, rate: float, now: float, previous: Throttle | None = None) -> None:
        self.rate = rate
        # A new rate keeps the old buckets' debt: bytes already let through are still paid for.
        self.send = TokenBucket.for_rate(rate, now, previous.send.level(now) if previous else 0.0)
        self.recv = TokenBucket.for_rate(rate, now, previous.recv.level(now) if previous else 0.0)
        self.read_size = int(max(_MIN_READ, rate * _READ_SECONDS))

    def __repr__(self) -> str:
        return f"Throttle({self.rate:g} B/s)"


def wake(waiter: asyncio.Future) -> None:
    """Let a paused sender continue (its pause ended, its limit changed, or its connection closed)."""
    if not waiter.done():
        waiter.set_result(None)
