"""Which declared leaders answer: a follower skips a dead one in about a second.

A declaration names an address, and nothing stops a member (or a crashed peer's stale record)
from naming a socket that accepts and never answers.  Calling it costs the follower its whole
request timeout, and a handful of such declarations, all earlier than the honest ones, kept every
group from forming for a whole matchmaking window.

So a follower opens connections to the leading candidates at once, in parallel.  The one it
picked is skipped when it fails, or when it has not finished its handshake ``slack`` times as long
as another candidate took (at least ``floor`` seconds) — an honest leader a few times slower than
its peers still leads, a silent one is dropped as soon as anyone else has answered.  With no other
candidate answering, ``timeout`` bounds the wait.  Connections made here are those the join
request then uses.

The floor stays at a second: at 0.1 s, an honest leader whose handshake ran late on a loaded machine
(two test processes on two cores) was skipped, its followers formed groups of their own, and a
round that needed everyone averaged without one of them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from p2p import PeerID

logger = logging.getLogger(__name__)

Connect = Callable[[str, float], Awaitable[object]]


class LeaderProbes:
    """Connection attempts to candidate leaders, owned by one ``form_group`` call (``close`` ends them)."""

    def __init__(self, connect: Connect, timeout: float, *, slack: float = 4.0, floor: float = 1.0,
                 fanout: int = 16) -> None:
        self._connect = connect
        self.timeout = timeout
        self.slack = slack
        self.floor = floor
        self.fanout = fanout
        self._tasks: dict[PeerID, asyncio.Task] = {}
        self._started: dict[PeerID, float] = {}  # loop time each attempt began
        self._took: dict[PeerID, float] = {}  # seconds each successful handshake took
        self._changed = asyncio.Event()

    def start(self, candidates: list[tuple[PeerID, str]]) -> None:
        """Begin connecting to up to ``fanout`` of ``candidates`` (in the order a follower would try them)."""
        loop = asyncio.get_running_loop()
        for peer_id, address in candidates[: self.fanout]:
            if peer_id not in self._tasks:
                self._started[peer_id] = loop.time()
                self._tasks[peer_id] = asyncio.ensure_future(self._attempt(peer_id, address))

    async def _attempt(self, peer_id: PeerID, address: str) -> bool:
        try:
            await self._connect(address, self.timeout)
        except Exception as e:  # noqa: BLE001 - any failure to connect means: not a leader to follow
            logger.debug("candidate leader %s did not answer: %s", peer_id, e)
            return False
        finally:
            self._changed.set()
        self._took[peer_id] = asyncio.get_running_loop().time() - self._started[peer_id]
        return True

    async def answers(self, peer_id: PeerID, address: str) -> bool:
        """Whether ``peer_id`` finished its handshake in time (see the module's rule)."""
        self.start([(peer_id, address)])
        task = self._tasks[peer_id]
        loop = asyncio.get_running_loop()
        while not task.done():
            give_up = self._started[peer_id] + self.timeout
            if self._took:
                give_up = min(give_up, self._started[peer_id] + max(self.floor, self.slack * min(self._took.values())))
            remaining = give_up - loop.time()
            if remaining <= 0:
                logger.info("candidate leader %s did not answer while others did: skipped", peer_id)
                return False
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                pass
        return task.result()

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
