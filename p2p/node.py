"""A peer on the network: listens (unless in client mode), dials, and runs RPC handlers.

Many peers can live in one event loop (``spawn_peers``); nothing here is global.  With a
:class:`~p2p.membership.Membership` a peer talks only to the run's members (see ``connection.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import sys
from collections.abc import AsyncIterable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .address import PeerAddress
from .allocator import keep_freed_buffers
from .budget import FrameBudget
from .connection import DATA, END, ERROR, OPEN, Connection, Retry, Stream
from .errors import PeerUnreachable, RemoteError, RPCTimeout
from .identity import Identity, PeerID
from .limits import Limits
from .membership import Certificate, Membership
from .tcp_info import TcpInfo, read_tcp_info
from .throttle import Throttle, check_rate
from .wire import EncodeError, Encoder

EAGER_TASKS = sys.version_info >= (3, 12)  # asyncio.Task(..., eager_start=True)

logger = logging.getLogger(__name__)
_NOTHING: Any = object()
_LISTEN_BACKLOG = 1024  # a burst of dials (or of strangers) queues in the kernel, not in SYN retries
_REFUSAL_LOG_PERIOD = 30.0  # at most one line per this many seconds about refused half-open connections
PeerLike = PeerAddress | PeerID | str


class CallKind(enum.Enum):
    UNARY = "unary"
    SERVER_STREAM = "server_stream"
    CLIENT_STREAM = "client_stream"
    BIDI = "bidi"


@dataclass
class CallContext:
    """What a handler knows about the call it serves."""

    peer_id: PeerID
    method: str
    remote_address: Any
    remote_client_mode: bool
    header: dict = field(repr=False)  # the OPEN header, e.g. for auth fields under "a"
    certificate: Certificate | None = None  # the caller's membership certificate (roles), if membership is on
    # drops the connection this call came on at once, with whatever is still queued for it: for a
    # handler whose caller stopped reading while the transport holds views of the handler's memory
    disconnect: Callable[[str], None] | None = field(default=None, repr=False, compare=False)


class AuthHook(Protocol):
    """Request authentication: fills the OPEN header's "a" field and checks it on arrival.

    ``outgoing`` returns the value for "a" (a token, timestamp, nonce and signature fit there);
    ``check`` raises PermissionError to refuse a call.
    """

    def outgoing(self, method: str, header: dict) -> Any: ...

    def check(self, method: str, header: dict, peer_id: PeerID) -> None: ...


Handler = Callable[..., Any]


class Call:
    """The caller's end of one RPC: send items, read items, cancel; bounded by one deadline."""

    def __init__(self, node: P2P, stream: Stream, deadline: float) -> None:
        self.node = node
        self.stream = stream
        self.method = stream.method
        self.deadline = deadline
        self.timed_out = False
        self._timer = node.loop.call_at(deadline, self._on_deadline)

    @property
    def peer_id(self) -> PeerID | None:
        return self.stream.conn.remote_id

    def _on_deadline(self) -> None:
        if not self.stream.finished:
            self.timed_out = True
            self.stream.push_error(RPCTimeout(f"{self.method} to {self.peer_id} passed its deadline"))
            self.stream.conn.cancel_stream(self.stream)

    def _done(self) -> None:
        self._timer.cancel()
        self.stream.release()

    async def send(self, item: Any, end: bool = False) -> None:
        """Send one item; ``end``: it is the last (what ``done_writing`` says, in the same message)."""
        if self.stream.error is not None:
            raise self.stream.error
        await self.stream.send(item, end)

    async def done_writing(self) -> None:
        await self.stream.done_writing()

    async def recv(self) -> Any:
        """Next item from the remote; StopAsyncIteration when the remote finished."""
        try:
            item = await self.stream.recv()
        except StopAsyncIteration:
            self._done()
            raise
        except asyncio.CancelledError:
            self.cancel()
            raise
        except BaseException:
            self._done()
            raise
        if self.stream.eof and not self.stream.items:
            self._done()
        return item

    def __aiter__(self) -> Call:
        return self

    async def __anext__(self) -> Any:
        return await self.recv()

    def cancel(self) -> None:
        """Stop the call; the remote handler is cancelled."""
        self._timer.cancel()
        self.stream.conn.cancel_stream(self.stream)

    async def aclose(self) -> None:
        if not self.stream.finished:
            self.cancel()

    async def __aenter__(self) -> Call:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


class P2P:
    """One peer.  Create with ``await P2P.create(...)``; stop with ``await shutdown()``."""

    def __init__(
        self,
        identity: Identity | None = None,
        client_mode: bool = False,
        limits: Limits | None = None,
        idle_timeout: float = 120.0,
        default_timeout: float = 30.0,
        auth: AuthHook | None = None,
        max_connections: int = 1024,
        membership: Membership | None = None,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.identity = identity or Identity()
        self.client_mode = client_mode
        self.limits = limits or Limits()
        self.encoder = Encoder(self.limits)
        self.membership = membership
        self._certificate_bytes: bytes | None = None
        if membership is not None:
            if membership.certificate is None:
                raise ValueError("membership without a certificate: this peer could not join the run "
                                 "(the authority issues one for its peer id)")
            membership.adopt(membership.certificate, self.identity.peer_id)  # ValueError says what is wrong
            self._certificate_bytes = membership.certificate.to_bytes()
        self.frame_budget = FrameBudget(self.limits.max_pending_frame_bytes)
        self.idle_timeout = idle_timeout
        self.default_timeout = default_timeout
        self.auth = auth
        self.max_connections = max_connections
        self.address: PeerAddress | None = None
        self._server: asyncio.Server | None = None
        self._handlers: dict[str, tuple[Handler, CallKind]] = {}
        self._connections: set[Connection] = set()
        self._by_peer: dict[PeerID, Connection] = {}
        self._by_addr: dict[tuple[str, int], Connection] = {}
        self._dialing: dict[tuple[str, int], asyncio.Future] = {}
        self._handler_tasks: set[asyncio.Task] = set()
        self._sweeper: asyncio.Task | None = None
        self._closed = False
        self._half_open = 0
        self._refused_half_open = 0
        self._last_refusal_log = -_REFUSAL_LOG_PERIOD
        self._stall_timer: asyncio.TimerHandle | None = None
        self._stall_marks: dict[Connection, int] = {}
        self._stall_since = 0.0
        self.throttle: Throttle | None = None  # set_rate_limit; None (unlimited) costs one check per send and read

    @classmethod
    async def create(cls, host: str = "127.0.0.1", port: int = 0, *, client_mode: bool = False,
                     announce_host: str | None = None, **kwargs: Any) -> P2P:
        """Start a peer; it listens on ``host:port`` (port 0 picks a free one) unless ``client_mode``.

        ``announce_host`` is the host others dial: a peer listening on 0.0.0.0 must announce the
        address other machines reach it at (its node's IP), never the wildcard.  With
        ``membership=Membership(...)`` (which must hold this peer's certificate) it talks only to
        the run's members."""
        keep_freed_buffers()
        node = cls(client_mode=client_mode, **kwargs)
        if not client_mode:
            node._server = await node.loop.create_server(
                lambda: Connection(node, dialer=False), host, port, reuse_address=True, backlog=_LISTEN_BACKLOG)
            sock_host, sock_port = node._server.sockets[0].getsockname()[:2]
            node.address = PeerAddress(announce_host or sock_host, sock_port, node.peer_id)
        node._sweeper = node.loop.create_task(node._sweep_idle())
        return node

    @property
    def peer_id(self) -> PeerID:
        return self.identity.peer_id

    @property
    def listen_address_str(self) -> str | None:
        return str(self.address.without_id()) if self.address else None

    def __repr__(self) -> str:
        return f"P2P({self.peer_id!r}, {self.listen_address_str or 'client mode'})"

    # ---- handlers --------------------------------------------------------------------------
    def register(self, method: str, handler: Handler, kind: CallKind = CallKind.UNARY) -> None:
        """Serve ``method``.  Unary: ``async (request, ctx) -> response``; server-stream: an async
        generator ``(request, ctx)``; client-stream: ``async (requests, ctx) -> response``;
        bidi: an async generator ``(requests, ctx)``; ``requests`` is an async iterator."""
        if method in self._handlers:
            raise ValueError(f"method {method!r} is already registered")
        self._handlers[method] = (handler, CallKind(kind))

    def unregister(self, method: str) -> None:
        self._handlers.pop(method, None)

    def _start_handler(self, conn: Connection, sid: int, method: str, h: dict, size: int) -> None:
        entry = self._handlers.get(method)
        if self._closed:  # a call that arrived while we shut down: its task would outlive our loop
            conn._send_quiet({"s": sid, "t": ERROR, "x": "PeerUnreachable", "msg": "the peer is shutting down"})
            return
        if entry is None:
            conn._send_quiet({"s": sid, "t": ERROR, "x": "UnknownMethod", "msg": f"no handler for {method!r}"})
            return
        if self.auth is not None:
            try:
                assert conn.remote_id is not None
                self.auth.check(method, h, conn.remote_id)
            except Exception as e:
                conn._send_quiet({"s": sid, "t": ERROR, "x": "Unauthorized", "msg": str(e)})
                return
        stream = conn.add_remote_stream(sid, method)
        if h.get("i"):
            conn._hold(size)
            stream.push(h.get("p"), size)
        if h.get("e"):
            stream.push_eof()
        task = self._start_eagerly(self._serve(entry, conn, stream, h))
        if task is None:
            return
        conn.handlers[sid] = task
        self._handler_tasks.add(task)
        timeout = h.get("d")
        if isinstance(timeout, (int, float)) and timeout > 0:
            timer = self.loop.call_later(timeout, task.cancel, "the call's deadline passed")
            task.add_done_callback(lambda _: timer.cancel())
        task.add_done_callback(self._handler_tasks.discard)

    def _start_eagerly(self, coro: Coroutine) -> asyncio.Task | None:
        """A handler's task, its first step already run (most handlers answer without waiting on
        anything); None if it finished there.  Python 3.12+ runs that step inside the task, so code
        that needs a current task (``asyncio.timeout``, 3.12's ``wait_for``) works from the first line."""
        if EAGER_TASKS:
            task = asyncio.Task(coro, loop=self.loop, eager_start=True)
            if task.done():
                task.result()  # an exception the handler let out reaches the caller, as it did eagerly
                return None
            return task
        try:
            first = coro.send(None)
        except StopIteration:
            return None
        return self.loop.create_task(_Resumed(coro, first))

    async def _serve(self, entry: tuple[Handler, CallKind], conn: Connection, stream: Stream, h: dict) -> None:
        fn, kind = entry
        sid = stream.sid
        assert conn.remote_id is not None
        ctx = CallContext(conn.remote_id, stream.method, conn.remote_addr, conn.remote_client_mode, h,
                          conn.remote_certificate, functools.partial(conn.abort, level=logging.INFO))
        try:
            if kind is CallKind.UNARY or kind is CallKind.SERVER_STREAM:
                try:
                    request = await stream.recv()
                except StopAsyncIteration:
                    raise ValueError(f"{stream.method} expects a request and got none") from None
            else:
                request = stream
            if kind is CallKind.UNARY or kind is CallKind.CLIENT_STREAM:
                response = await fn(request, ctx)
                await conn.send({"s": sid, "t": DATA, "e": 1, "p": response})
            else:
                # closed here, in this task, whatever ends it: left to the event loop's finalizer, a
                # generator cancelled mid-send is closed at the loop's shutdown, while already closing
                items = fn(request, ctx)
                async with contextlib.aclosing(items) if hasattr(items, "aclose") else contextlib.nullcontext():
                    async for item in items:
                        await conn.send({"s": sid, "t": DATA, "e": 0, "p": item})
                await conn.send({"s": sid, "t": END})
        except asyncio.CancelledError as e:  # the caller cancelled, the deadline passed, or shutdown
            logger.debug("handler %s for %s stopped: %s", stream.method, conn.remote_id, e.args[0] if e.args else
                         "cancelled")
        except PeerUnreachable as e:
            if not conn.closed:  # the handler's own call to a third peer failed: tell our caller
                conn._send_quiet({"s": sid, "t": ERROR, "x": type(e).__name__, "msg": str(e)})
        except Exception as e:
            logger.debug("handler %s failed: %r", stream.method, e, exc_info=True)
            conn._send_quiet({"s": sid, "t": ERROR, "x": type(e).__name__, "msg": str(e)})
        finally:
            conn.handlers.pop(sid, None)
            stream.release()

    # ---- calling ---------------------------------------------------------------------------
    def _deadline(self, timeout: float | None) -> float:
        return self.loop.time() + (self.default_timeout if timeout is None else timeout)

    async def open(self, peer: PeerLike, method: str, timeout: float | None = None, first: Any = _NOTHING) -> Call:
        """Open a bidirectional call; send with ``send``/``done_writing``, read by iterating.
        ``first``: the call's first item, carried by the opening message (one message less)."""
        return await self._open(peer, method, self._deadline(timeout), first)

    async def _open(self, peer: PeerLike, method: str, deadline: float,
                    first: Any = _NOTHING, end: bool = False) -> Call:
        for _ in range(3):
            conn = self._cached_connection(peer) or await self._connection(peer, deadline)
            if conn.remote_certificate is not None:
                lapsed = conn._remote_membership_lapsed()
                if lapsed is not None:  # dial again: the remote's HELLO carries its current certificate
                    conn.close(lapsed)
                    continue
            try:
                stream = conn.new_stream(method)
            except Retry:
                continue
            h: dict[str, Any] = {"s": stream.sid, "t": OPEN, "m": method,
                                 "d": max(deadline - self.loop.time(), 1e-3)}
            if first is not _NOTHING:
                h["i"], h["p"] = 1, first
            if end:
                h["e"] = 1
                stream.sent_end = True
            if self.auth is not None:
                h["a"] = self.auth.outgoing(method, h)
            try:
                await conn.send(h)
            except EncodeError:
                stream.release()  # nothing was sent
                raise
            except BaseException:  # sent, then cancelled (waiting out a full buffer or the rate limit)
                conn.cancel_stream(stream)
                raise
            return Call(self, stream, deadline)
        raise PeerUnreachable(f"{peer}: every connection was going away")

    async def call(self, peer: PeerLike, method: str, request: Any = None, timeout: float | None = None) -> Any:
        """Unary call: one request, one response."""
        deadline = self._deadline(timeout)
        for attempt in range(3):
            call = await self._open(peer, method, deadline, request, end=True)
            try:
                return await call.recv()
            except StopAsyncIteration:
                raise RemoteError("EmptyResponse", "the handler finished without a response", method) from None
            except Retry:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def call_stream(self, peer: PeerLike, method: str, request: Any = None,
                          timeout: float | None = None) -> Call:
        """Server-streaming call: one request; iterate the returned Call for the responses."""
        return await self._open(peer, method, self._deadline(timeout), request, end=True)

    async def call_client_stream(self, peer: PeerLike, method: str,
                                 requests: AsyncIterable[Any] | Iterable[Any], timeout: float | None = None) -> Any:
        """Client-streaming call: many requests, one response."""
        call = await self._open(peer, method, self._deadline(timeout))
        try:
            if isinstance(requests, AsyncIterable):
                async for item in requests:
                    await call.send(item)
            else:
                for item in requests:
                    await call.send(item)
            await call.done_writing()
            return await call.recv()
        except StopAsyncIteration:
            raise RemoteError("EmptyResponse", "the handler finished without a response", method) from None
        finally:
            await call.aclose()

    # ---- connections -----------------------------------------------------------------------
    async def connect(self, peer: PeerLike, timeout: float | None = None) -> PeerID:
        """Make sure a connection to ``peer`` exists; returns the PeerID its handshake proved."""
        conn = self._cached_connection(peer) or await self._connection(peer, self._deadline(timeout))
        assert conn.remote_id is not None
        return conn.remote_id

    def _cached_connection(self, peer: PeerLike) -> Connection | None:
        """The pooled connection for ``peer`` if there is a usable one (no awaiting: the hot path)."""
        if isinstance(peer, str):
            try:
                peer = PeerAddress.parse(peer)
            except ValueError:
                return None  # _connection raises the readable error
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

    async def _connection(self, peer: PeerLike, deadline: float) -> Connection:
        if self._closed:
            raise PeerUnreachable("this peer is shut down")
        conn = self._cached_connection(peer)
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

    def _dial_done(self, key: tuple[str, int], task: asyncio.Task) -> None:
        self._dialing.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved here: every waiter may have been cancelled meanwhile

    async def _dial(self, addr: PeerAddress, deadline: float) -> Connection:
        conn = Connection(self, dialer=True, expected_peer=addr.peer_id)
        remaining = deadline - self.loop.time()
        if remaining <= 0:
            raise RPCTimeout(f"deadline passed before connecting to {addr}")
        try:
            await asyncio.wait_for(self.loop.create_connection(lambda: conn, addr.host, addr.port), remaining)
        except (OSError, asyncio.TimeoutError) as e:
            raise PeerUnreachable(f"cannot connect to {addr}: {e or type(e).__name__}") from None
        if self._closed:
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

    def _attach(self, conn: Connection) -> bool:
        """Pool a new connection; an accepted one counts as half-open until its handshake ends, and
        is refused (False) past max_half_open."""
        if conn.dialer:
            self._connections.add(conn)
            self._evict_if_over(conn)  # an accepted connection counts once its handshake proved who it is
            return True
        if self._half_open >= self.limits.max_half_open or self._closed:
            self._refused_half_open += 1
            now = self.loop.time()
            if now - self._last_refusal_log >= _REFUSAL_LOG_PERIOD:
                logger.warning("%s: %d accepted connections have not finished the handshake "
                               "(max_half_open=%d): refusing new ones (%d since the last report)",
                               self, self._half_open, self.limits.max_half_open, self._refused_half_open)
                self._last_refusal_log = now
                self._refused_half_open = 0
            return False
        self._half_open += 1
        conn.half_open = True
        self._connections.add(conn)
        return True

    def _evict_if_over(self, exclude: Connection) -> None:
        """Over max_connections: close the least recently active idle connections (never busy ones).

        Accepted connections still in their handshake do not count, so strangers cannot push
        members' connections out; ``max_half_open`` bounds those instead."""
        excess = len(self._connections) - self._half_open - self.max_connections
        if excess <= 0:
            return
        idle = sorted((c for c in self._connections
                       if c.idle and c.is_ready and c is not exclude and not c.closed and not c.going_away),
                      key=lambda c: c.last_activity)
        for conn in idle[:excess]:
            conn.goaway()

    def _leave_half_open(self, conn: Connection) -> None:
        if conn.half_open:
            conn.half_open = False
            self._half_open -= 1

    @property
    def num_half_open(self) -> int:
        """Accepted connections that have not finished the handshake."""
        return self._half_open

    def _register(self, conn: Connection) -> None:
        if not conn.dialer:
            self._evict_if_over(conn)
        if conn.remote_id is not None and not conn.going_away and not conn.closed:
            self._by_peer[conn.remote_id] = conn

    def _unregister(self, conn: Connection) -> None:
        if conn.remote_id is not None and self._by_peer.get(conn.remote_id) is conn:
            del self._by_peer[conn.remote_id]
        for key, c in list(self._by_addr.items()):
            if c is conn:
                del self._by_addr[key]

    def _forget(self, conn: Connection) -> None:
        self._unregister(conn)
        self._connections.discard(conn)

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    def connected_peers(self) -> list[PeerID]:
        return list(self._by_peer)

    def tcp_info(self, peer_id: PeerID) -> TcpInfo | None:
        """The kernel's view of the pooled connection to ``peer_id`` (its delivery rate: the path's
        bottleneck rate while data flows), None if not connected or the platform has no ``TCP_INFO``."""
        conn = self._by_peer.get(peer_id)
        if conn is None or conn.transport is None or conn.closed:
            return None
        return read_tcp_info(conn.transport.get_extra_info("socket"))

    def peer_certificate(self, peer_id: PeerID) -> Certificate | None:
        """The membership certificate a connected peer presented last (None: not connected, or open mode)."""
        conn = self._by_peer.get(peer_id)
        return conn.remote_certificate if conn is not None else None

    # ---- frame budget ----------------------------------------------------------------------
    def _budget_blocked(self) -> None:
        """A message waits for the frame budget: watch those holding it for a stall."""
        if self._stall_timer is not None or self._closed:
            return
        self._stall_marks = {c: c.bytes_in for c in self._connections if c.decoder.reserved}
        self._stall_since = self.loop.time()
        self._stall_timer = self.loop.call_later(self.limits.frame_stall_timeout, self._check_stalls)

    def _check_stalls(self) -> None:
        """Close holders of the budget that fed it less than min_frame_rate while others waited."""
        self._stall_timer = None
        marks, self._stall_marks = self._stall_marks, {}
        if not self.frame_budget.waiting:
            return
        elapsed = self.loop.time() - self._stall_since
        throttled = self.throttle is not None  # we slow our own reading: not the holders' fault
        for conn, mark in marks.items():
            # A connection we paused ourselves (its data is not consumed yet) is not stalling.
            if conn.closed or not conn.decoder.reserved or conn._reading_paused or throttled:
                continue
            got = conn.bytes_in - mark
            if got < self.limits.min_frame_rate * elapsed:
                conn.abort(f"stalled mid-message: {got} bytes in {elapsed:.1f} s while holding "
                           f"{conn.decoder.reserved} bytes of the frame budget that others wait for")
        if self.frame_budget.waiting:
            self._budget_blocked()

    # ---- rate limit ------------------------------------------------------------------------
    def set_rate_limit(self, bytes_per_s: float | None) -> None:
        """Limit the bytes this node sends, and separately those it receives, over all its connections,
        to ``bytes_per_s`` each (None: unlimited, the default) -- a slow link where ``tc`` is unavailable.

        Callable from any thread: a bad value raises ValueError at once; from another thread the
        change takes effect at the loop's next turn.  Changing or clearing it wakes every sender and
        reader waiting on the old limit at once."""
        rate = check_rate(bytes_per_s)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            self._apply_rate_limit(rate)
        else:
            self.loop.call_soon_threadsafe(self._apply_rate_limit, rate)

    def _apply_rate_limit(self, rate: float | None) -> None:
        old = self.throttle
        if old is None and rate is None:
            return
        self.throttle = None if rate is None else Throttle(rate, self.loop.time(), old)
        logger.info("%s: rate limit %s", self, "off" if rate is None else f"{rate:g} bytes/s each way")
        if old is not None:
            for conn in list(self._connections):
                conn.rate_limit_changed()

    # ---- renewal ---------------------------------------------------------------------------
    def renew_certificate(self, cert: Certificate) -> None:
        """Adopt a renewed membership certificate and send it on every ready connection.

        ValueError if membership is off or ``cert`` is not a valid certificate of this peer for
        this run; new connections present it in their HELLO."""
        if self.membership is None:
            raise ValueError("renew_certificate needs membership (this peer runs in open mode)")
        self.membership.adopt(cert, self.peer_id)
        raw = self._certificate_bytes = cert.to_bytes()
        for conn in list(self._connections):
            if conn.is_ready and not conn.closed:
                conn.send_renew(raw)

    async def _sweep_idle(self) -> None:
        period = max(self.idle_timeout / 4, 0.05)
        while True:
            await asyncio.sleep(period)
            now = self.loop.time()
            for conn in list(self._connections):
                if conn.idle and now - conn.last_activity > self.idle_timeout:
                    conn.goaway()

    # ---- lifetime --------------------------------------------------------------------------
    async def shutdown(self) -> None:
        """Close every connection and handler; returns when all sockets are closed."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        self._stall_marks.clear()
        conns = list(self._connections)
        for conn in conns:
            conn.close("peer shut down")
        tasks = list(self._handler_tasks) + list(self._dialing.values())
        if self._sweeper is not None:
            tasks.append(self._sweeper)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(c.closed_future for c in conns))
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> P2P:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()


class _Resumed(Coroutine):
    """A coroutine that was started eagerly, continued inside a Task (what 3.12's eager tasks do;
    before 3.12 the first step has no current task).

    A class, not a generator: a task cancelled before its first step throws into the coroutine it
    runs, and a generator that has not started yet would end there without passing the throw on,
    leaving the handler suspended for good (its async generators still mid-iteration when the
    loop closes)."""

    def __init__(self, coro: Any, first: Any) -> None:
        self._coro = coro
        self._first = first
        self._started = False

    def send(self, value: Any) -> Any:
        if not self._started:  # the task's first step: hand it what the eager step waits on
            self._started = True
            return self._first
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        self._started = True
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)

    def close(self) -> None:
        self._coro.close()

    def __next__(self) -> Any:
        return self.send(None)

    def __iter__(self) -> Any:
        return self

    def __await__(self) -> Any:
        return self


async def spawn_peers(n: int, host: str = "127.0.0.1", **kwargs: Any) -> list[P2P]:
    """Start ``n`` listening peers in the running event loop (simulations, tests)."""
    return list(await asyncio.gather(*(P2P.create(host, 0, **kwargs) for _ in range(n))))

