"""Backpressure of one connection: when its socket stops being read, and when a sender must wait.

There are no window or credit messages on the wire; a peer slows the other side by not reading
its socket, and TCP does the rest.  Reading pauses for any of three reasons: received items not yet
consumed exceed ``max_buffered_bytes`` (flow control, resumed at half of it), a message waits for
the node's frame budget, or the node's receive rate limit is in debt.  A sender waits until the
kernel took its bytes (the transport's write buffer is empty again) and, under the node's send
rate limit, until the bucket has paid for them.

:class:`FlowControl` is the base of :class:`~p2p.connection.Connection`, which decides when each
of these applies; this module only keeps the state and pauses, resumes and wakes.
"""

from __future__ import annotations

import asyncio

from .limits import Limits
from .throttle import Throttle, wake


class FlowControl(asyncio.BufferedProtocol):
    """The pauses of one connection's reading and the waits of its senders.

    A subclass sets ``transport`` once connected and ``closed`` when it closes (then calls
    ``stop_flow``), and says in ``closed_error`` what a sender left waiting raises."""

    __slots__ = (
        "loop", "limits", "transport", "closed", "_buffered", "_reading_paused", "_budget_paused",
        "_transport_paused", "_write_paused", "_drain_waiters", "_rate_timer", "_paced",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, limits: Limits) -> None:
        self.loop = loop
        self.limits = limits
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._buffered = 0
        self._reading_paused = False  # flow control: our side has not consumed enough
        self._budget_paused = False  # a message waits for the peer's frame budget
        self._transport_paused = False
        self._write_paused = False
        self._drain_waiters: list[asyncio.Future] = []
        self._rate_timer: asyncio.TimerHandle | None = None  # reading paused by the node's rate limit
        self._paced: set[asyncio.Future] | None = None  # senders waiting out the rate limit (made on first use)

    def closed_error(self) -> Exception:
        """What a sender raises when the connection closed while it waited."""
        raise NotImplementedError

    # ---- reading ---------------------------------------------------------------------------
    def update_reading(self) -> None:
        """Pause the socket while flow control, the frame budget or the rate limit says so; resume otherwise."""
        pause = self._reading_paused or self._budget_paused or self._rate_timer is not None
        if pause != self._transport_paused and self.transport is not None and not self.closed:
            self._transport_paused = pause
            if pause:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

    def hold(self, nbytes: int) -> None:
        """A received item of ``nbytes`` waits to be consumed: past ``max_buffered_bytes``, stop reading."""
        self._buffered += nbytes
        if not self._reading_paused and self._buffered > self.limits.max_buffered_bytes:
            self._reading_paused = True
            self.update_reading()

    def consumed(self, nbytes: int) -> None:
        """An item held before was read (or dropped): read again once half the buffer is free."""
        self._buffered -= nbytes
        if self._reading_paused and self._buffered <= self.limits.max_buffered_bytes // 2:
            self._reading_paused = False
            self.update_reading()

    @property
    def flow_paused(self) -> bool:
        """Whether reading is paused because what arrived is not consumed yet (our side's doing)."""
        return self._reading_paused

    def pause_for_budget(self) -> bool:
        """A message waits for the frame budget: stop reading.  False if already paused for that."""
        if self._budget_paused:
            return False
        self._budget_paused = True
        self.update_reading()
        return True

    def budget_granted(self) -> None:
        """The frame budget granted the waiting message; reading resumes at the next ``update_reading``."""
        self._budget_paused = False

    def pause_for_rate(self, delay: float) -> None:
        """The receive rate limit is ``delay`` seconds in debt: stop reading until it is paid."""
        if delay > 0 and self._rate_timer is None:
            self._rate_timer = self.loop.call_later(delay, self._end_rate_pause)
            self.update_reading()

    def _end_rate_pause(self) -> None:
        """Resume reading once the rate limit's debt is paid (or the limit changed)."""
        if self._rate_timer is not None:
            self._rate_timer.cancel()
            self._rate_timer = None
            self.update_reading()

    def rate_limit_changed(self) -> None:
        """The node's rate limit changed or ended: whatever waits on the old one goes on at once
        (the debt is carried over, so the new limit judges what comes next)."""
        self._end_rate_pause()
        self._wake_paced()

    # ---- writing ---------------------------------------------------------------------------
    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        waiters, self._drain_waiters = self._drain_waiters, []
        for w in waiters:
            wake(w)

    @property
    def write_paused(self) -> bool:
        return self._write_paused

    async def drain(self) -> None:
        """Wait until the transport's write buffer has emptied."""
        while self._write_paused and not self.closed:
            w = self.loop.create_future()
            self._drain_waiters.append(w)
            await w
        if self.closed:
            raise self.closed_error()

    async def pace(self, throttle: Throttle, bufs: list) -> None:
        """After writing ``bufs``, wait until the node's send bucket has paid for them, so that the
        node's senders together keep to its rate; woken early when the limit changes or the
        connection closes (``closed_error`` then).  Cancelling the wait leaves the debt in the bucket."""
        delay = throttle.send.delay(sum(map(len, bufs)), self.loop.time())
        if delay <= 0:
            return
        waiter = self.loop.create_future()
        timer = self.loop.call_later(delay, wake, waiter)
        if self._paced is None:
            self._paced = set()
        self._paced.add(waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._paced.discard(waiter)
        if self.closed:
            raise self.closed_error()

    def _wake_paced(self) -> None:
        if self._paced:
            for w in self._paced:
                wake(w)

    # ---- closing ---------------------------------------------------------------------------
    def stop_flow(self) -> None:
        """The connection closed: wake every sender waiting on it and stop the rate limit's pause."""
        for w in self._drain_waiters:
            wake(w)
        self._drain_waiters.clear()
        self._wake_paced()
        if self._rate_timer is not None:
            self._rate_timer.cancel()
            self._rate_timer = None
