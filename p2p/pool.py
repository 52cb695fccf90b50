"""The connections of one peer: at most one in use per remote peer, found by PeerID or address.

A call finds the pooled connection to its peer without awaiting anything (``cached``), or dials
one, once, however many calls wait for it (``connection``).  The pool also keeps the limits that
concern all of a peer's connections together: strangers still in the handshake (``max_half_open``),
the number of connections (``max_connections``, idle ones closed first), idle connections (closed
after ``idle_timeout``), and connections that hold the node's frame budget without feeding it
(``frame_stall_timeout``).

A connection reports its life to its pool through the methods under "what connections report":
``admit`` when it is made, ``handshake_over`` when its handshake ended either way, ``ready`` once
it proved who is on the other end, ``withdraw`` when it takes no new calls, ``remove`` once closed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from .address import PeerAddress
from .connection import Connection
from .errors import PeerGone, PeerUnreachable, RPCTimeout
from .identity import PeerID
from .route import RelayRefused, RelayRoute

if TYPE_CHECKING:
    from .connection import ConnectionHost

logger = logging.getLogger(__name__)

REFUSAL_LOG_PERIOD = 30.0  # at most one line per this many seconds about refused half-open connections
PeerLike = PeerAddress | PeerID | str
_AddressKey = tuple[str, int]


class ConnectionPool:
    """The connections of ``host`` (a ``P2P``), dialed or accepted."""

    def __init__(self, host: ConnectionHost, max_connections: int, idle_timeout: float,
                 route: RelayRoute | None = None) -> None:
        self.host = host
        self.route = route  # emulated regions: hosts of other regions are dialed through a relay
        self.loop = host.loop
        self.limits = host.limits
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self.connections: set[Connection] = set()  # every connection not yet closed (read it, do not change it)
        self.closed = False
        self._by_peer: dict[PeerID, Connection] = {}
        self._by_addr: dict[_AddressKey, Connection] = {}
        self._dialing: dict[_AddressKey, asyncio.Task] = {}
        self._half_open = 0
        self._refused_half_open = 0
        self._last_refusal_log = -REFUSAL_LOG_PERIOD
        self._sweeper: asyncio.Task | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._stall_marks: dict[Connection, int] = {}
        self._stall_since = 0.0
        self._closing: list[Connection] = []  # what close() closed and cancelled, for wait_closed()
        self._stopping: list[asyncio.Task] = []

    # ---- finding connections ---------------------------------------------------------------
    def cached(self, peer: PeerLike) -> Connection | None:
        """The pooled connection for ``peer`` if there is a usable one (no awaiting: the hot path)."""
        if isinstance(peer, str):
            try:
                peer = PeerAddress.parse(peer)
            except ValueError:
                return None  # connection() raises the readable error
        if isinstance(peer, PeerAddress):
            if peer.peer_id is None:
                conn = self._by_addr.get((peer.host, peer.port))
            else:
                conn = self._by_peer.get(peer.peer_id)
        elif isinstance(peer, PeerID):
            conn = self._by_peer.get(peer)
        else:
            return None
        if conn is None or conn.closed or conn.going_away:
            return None
        return conn

    async def connection(self, peer: PeerLike, deadline: float) -> Connection:
        """A ready connection to ``peer``: the pooled one, else one dialed by ``deadline`` (loop time).

        A PeerID alone can only be reached over a connection it opened; an address with a PeerID
        must prove that identity.  Calls that want the same address at once share one dial."""
        if self.closed:
            raise PeerUnreachable("this peer is shut down")
        conn = self.cached(peer)
        if conn is not None:
            return conn
        if isinstance(peer, PeerID):
            raise PeerUnreachable(f"no connection to {peer} and no address to dial")
        addr = PeerAddress.parse(peer)
        key = (addr.host, addr.port)
        conn = self._by_addr.get(key)  # with a peer id: the address's connection may prove it already
        if conn is not None and not conn.closed and not conn.going_away and conn.remote_id == addr.peer_id:
            return conn
        pending = self._dialing.get(key)
        if pending is None:
            pending = self.loop.create_task(self._dial(addr, deadline))
            self._dialing[key] = pending
            pending.add_done_callback(lambda t: self._dial_done(key, t))
        conn = await asyncio.shield(pending)
        if addr.peer_id is not None and conn.remote_id != addr.peer_id:
            raise PeerUnreachable(f"{addr.without_id()} is {conn.remote_id}, expected {addr.peer_id}")
        return conn

    def peer_connection(self, peer_id: PeerID) -> Connection | None:
        """The connection new calls to ``peer_id`` use, if any (it may be closing)."""
        return self._by_peer.get(peer_id)

    def peers(self) -> list[PeerID]:
        """The peers with a pooled connection."""
        return list(self._by_peer)

    @property
    def num_half_open(self) -> int:
        """Accepted connections that have not finished the handshake."""
        return self._half_open

    # ---- dialing ---------------------------------------------------------------------------
    def _dial_done(self, key: _AddressKey, task: asyncio.Task) -> None:
        self._dialing.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved here: every waiter may have been cancelled meanwhile

    async def _dial(self, addr: PeerAddress, deadline: float) -> Connection:
        conn = Connection(self.host, dialer=True, expected_peer=addr.peer_id)
        remaining = deadline - self.loop.time()
        if remaining <= 0:
            raise RPCTimeout(f"deadline passed before connecting to {addr}")
        route = self.route
        if route is not None and route.relayed(addr.host):
            connecting = route.dial(self.loop, lambda: conn, addr.host, addr.port)
        else:
            connecting = self.loop.create_connection(lambda: conn, addr.host, addr.port)
        try:
            await asyncio.wait_for(connecting, remaining)
        except (OSError, asyncio.TimeoutError) as e:
            # a relay's refusal is the relay's word, not proof that the peer is down
            gone = isinstance(e, ConnectionRefusedError) and not isinstance(e, RelayRefused)
            raise (PeerGone if gone else PeerUnreachable)(
                f"cannot connect to {addr}: {e or type(e).__name__}") from None
        if self.closed:
            conn.close("shutting down")
            raise PeerUnreachable("this peer is shut down")
        self._by_addr[(addr.host, addr.port)] = conn
        try:
            await asyncio.wait_for(asyncio.shield(conn.ready), max(deadline - self.loop.time(), 1e-3))
        except asyncio.TimeoutError:
            conn.close("handshake timed out")
            raise PeerUnreachable(f"handshake with {addr} timed out") from None
        except BaseException:
            conn.close("handshake failed")
            raise
        return conn

    # ---- what connections report -----------------------------------------------------------
    def admit(self, conn: Connection) -> bool:
        """A new connection is up.  A dialed one joins the pool; an accepted one counts as half-open
        until its handshake ends, and is refused (False: close it) past ``max_half_open``."""
        if conn.dialer:
            self.connections.add(conn)
            self._evict_if_over(conn)  # an accepted connection counts once its handshake proved who it is
            return True
        if self._half_open >= self.limits.max_half_open or self.closed:
            self._refused_half_open += 1
            self._report_refusals()
            return False
        self._half_open += 1
        conn.half_open = True
        self.connections.add(conn)
        return True

    def _report_refusals(self) -> None:
        """Log the refused half-open connections, at most once per REFUSAL_LOG_PERIOD."""
        now = self.loop.time()
        if now - self._last_refusal_log < REFUSAL_LOG_PERIOD:
            return
        logger.warning("%s: %d accepted connections have not finished the handshake "
                       "(max_half_open=%d): refusing new ones (%d since the last report)",
                       self.host, self._half_open, self.limits.max_half_open, self._refused_half_open)
        self._last_refusal_log = now
        self._refused_half_open = 0

    def handshake_over(self, conn: Connection) -> None:
        """``conn``'s handshake ended (it is ready, or it failed): it is no longer half-open."""
        if conn.half_open:
            conn.half_open = False
            self._half_open -= 1

    def ready(self, conn: Connection) -> None:
        """``conn`` proved who is on the other end: new calls to that peer use it."""
        if not conn.dialer:
            self._evict_if_over(conn)
        if conn.remote_id is not None and not conn.going_away and not conn.closed:
            self._by_peer[conn.remote_id] = conn

    def withdraw(self, conn: Connection) -> None:
        """``conn`` takes no new calls (it is going away): new calls find or dial another."""
        if conn.remote_id is not None and self._by_peer.get(conn.remote_id) is conn:
            del self._by_peer[conn.remote_id]
        for key, c in list(self._by_addr.items()):
            if c is conn:
                del self._by_addr[key]

    def remove(self, conn: Connection) -> None:
        """``conn`` is closed: forget it."""
        self.withdraw(conn)
        self.connections.discard(conn)

    def frame_budget_blocked(self) -> None:
        """A message waits for the node's frame budget: watch the connections holding it for a stall."""
        if self._stall_timer is not None or self.closed:
            return
        self._stall_marks = {c: c.bytes_in for c in self.connections if c.decoder.reserved}
        self._stall_since = self.loop.time()
        self._stall_timer = self.loop.call_later(self.limits.frame_stall_timeout, self._check_stalls)

    # ---- upkeep ----------------------------------------------------------------------------
    def _evict_if_over(self, exclude: Connection) -> None:
        """Over max_connections: close the least recently active idle connections (never busy ones).

        Accepted connections still in their handshake do not count, so strangers cannot push
        members' connections out; ``max_half_open`` bounds those instead."""
        excess = len(self.connections) - self._half_open - self.max_connections
        if excess <= 0:
            return
        idle = sorted((c for c in self.connections
                       if c.idle and c.is_ready and c is not exclude and not c.closed and not c.going_away),
                      key=lambda c: c.last_activity)
        for conn in idle[:excess]:
            conn.goaway()

    def _check_stalls(self) -> None:
        """Close holders of the budget that fed it less than min_frame_rate while others waited."""
        self._stall_timer = None
        marks, self._stall_marks = self._stall_marks, {}
        if not self.host.frame_budget.waiting:
            return
        elapsed = self.loop.time() - self._stall_since
        throttled = self.host.throttle is not None  # we slow our own reading: not the holders' fault
        for conn, mark in marks.items():
            # A connection we paused ourselves (its data is not consumed yet) is not stalling.
            if conn.closed or not conn.decoder.reserved or conn.flow_paused or throttled:
                continue
            got = conn.bytes_in - mark
            if got < self.limits.min_frame_rate * elapsed:
                conn.abort(f"stalled mid-message: {got} bytes in {elapsed:.1f} s while holding "
                           f"{conn.decoder.reserved} bytes of the frame budget that others wait for")
        if self.host.frame_budget.waiting:
            self.frame_budget_blocked()

    async def _sweep_idle(self) -> None:
        period = max(self.idle_timeout / 4, 0.05)
        while True:
            await asyncio.sleep(period)
            now = self.loop.time()
            for conn in list(self.connections):
                if conn.idle and now - conn.last_activity > self.idle_timeout:
                    conn.goaway()

    # ---- lifetime --------------------------------------------------------------------------
    def start(self) -> None:
        """Start closing idle connections (every ``idle_timeout / 4`` seconds)."""
        self._sweeper = self.loop.create_task(self._sweep_idle())

    def close(self) -> None:
        """Close every connection, cancel the dials under way and stop upkeep (``wait_closed`` waits)."""
        self.closed = True
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        self._stall_marks.clear()
        self._closing = list(self.connections)
        for conn in self._closing:
            conn.close("peer shut down")
        self._stopping = list(self._dialing.values())
        if self._sweeper is not None:
            self._stopping.append(self._sweeper)
        for task in self._stopping:
            task.cancel()

    async def wait_closed(self) -> None:
        """After ``close``: wait for the cancelled dials and upkeep, then for the sockets to close."""
        await asyncio.gather(*self._stopping, return_exceptions=True)
        await asyncio.gather(*(c.closed_future for c in self._closing))
