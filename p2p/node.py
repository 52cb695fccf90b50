"""A peer on the network: listens (unless in client mode), dials, and runs RPC handlers.

Many peers can live in one event loop (``spawn_peers``); nothing here is global.  With a
:class:`~p2p.membership.Membership` a peer talks only to the run's members (see ``handshake.py``).
Its connections live in its :class:`~p2p.pool.ConnectionPool`; each call's two ends are in
``stream.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import sys
from collections.abc import AsyncIterable, Callable, Collection, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .address import PeerAddress
from .allocator import keep_freed_buffers
from .budget import FrameBudget
from .connection import Connection
from .errors import PeerUnreachable, RemoteError, Retry
from .headers import AUTH, DATA, DEADLINE, END, END_OF_ITEMS, FIRST_ITEM, KIND, METHOD, OPEN, PAYLOAD, STREAM
from .identity import Identity, PeerID
from .limits import Limits
from .membership import Certificate, Membership, role_matches
from .pool import ConnectionPool, PeerLike
from .route import RelayRoute
from .stream import Call, Stream
from .tcp_info import TcpInfo, read_tcp_info
from .throttle import Throttle, check_rate
from .traffic import Traffic
from .wire import EncodeError, Encoder

EAGER_TASKS = sys.version_info >= (3, 12)  # asyncio.Task(..., eager_start=True)

logger = logging.getLogger(__name__)
_NOTHING: Any = object()
_LISTEN_BACKLOG = 1024  # a burst of dials (or of strangers) queues in the kernel, not in SYN retries


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
        route: RelayRoute | None = None,
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
        self.default_timeout = default_timeout
        self.auth = auth
        self.address: PeerAddress | None = None
        self._server: asyncio.Server | None = None
        self._handlers: dict[str, tuple[Handler, CallKind]] = {}
        self._roles: dict[str, frozenset[str]] = {}  # method -> the certificate roles it is served to
        self._handler_tasks: set[asyncio.Task] = set()
        self._closed = False
        self.throttle: Throttle | None = None  # set_rate_limit; None (unlimited) costs one check per send and read
        self.traffic = Traffic()  # what our calls and our handlers' answers cost, by method
        self.route = route  # emulated regions only: dial other regions' hosts through a relay (``route.py``)
        self.pool = ConnectionPool(self, max_connections, idle_timeout, route)
        self._connections = self.pool.connections  # the pool's live set, which this peer walks
        self._cached_connection = self.pool.cached  # the hot path's lookup: no awaiting

    @classmethod
    async def create(cls, host: str = "127.0.0.1", port: int = 0, *, client_mode: bool = False,
                     announce_host: str | None = None, **kwargs: Any) -> P2P:
        """Start a peer; it listens on ``host:port`` (port 0 picks a free one) unless ``client_mode``.

        ``announce_host`` is the host others dial: a peer listening on 0.0.0.0 must announce the
        address other machines reach it at (its node's IP), never the wildcard.  With
        ``membership=Membership(...)`` (which must hold this peer's certificate) it talks only to
        the run's members.  ``route=RelayRoute(...)`` (emulated regions, ``route.py``) dials the
        hosts of other regions through the regions' relay."""
        keep_freed_buffers()
        node = cls(client_mode=client_mode, **kwargs)
        if not client_mode:
            node._server = await node.loop.create_server(
                lambda: Connection(node, dialer=False), host, port, reuse_address=True, backlog=_LISTEN_BACKLOG)
            sock_host, sock_port = node._server.sockets[0].getsockname()[:2]
            node.address = PeerAddress(announce_host or sock_host, sock_port, node.peer_id)
        node.pool.start()
        return node

    @property
    def peer_id(self) -> PeerID:
        return self.identity.peer_id

    @property
    def listen_address_str(self) -> str | None:
        return str(self.address.without_id()) if self.address else None

    @property
    def certificate_bytes(self) -> bytes | None:
        """Our membership certificate, as the run's authority issued it last (None: open mode)."""
        return self._certificate_bytes

    def __repr__(self) -> str:
        return f"P2P({self.peer_id!r}, {self.listen_address_str or 'client mode'})"

    # ---- handlers --------------------------------------------------------------------------
    def register(self, method: str, handler: Handler, kind: CallKind = CallKind.UNARY,
                 roles: Collection[str] | None = None) -> None:
        """Serve ``method``.  Unary: ``async (request, ctx) -> response``; server-stream: an async
        generator ``(request, ctx)``; client-stream: ``async (requests, ctx) -> response``;
        bidi: an async generator ``(requests, ctx)``; ``requests`` is an async iterator.
        ``roles``: with membership on, only callers whose certificate names one of them (None: any member)."""
        if method in self._handlers:
            raise ValueError(f"method {method!r} is already registered")
        self._handlers[method] = (handler, CallKind(kind))
        if roles is not None:
            self._roles[method] = frozenset(roles)

    def unregister(self, method: str) -> None:
        self._handlers.pop(method, None)
        self._roles.pop(method, None)

    def _role_problem(self, method: str, conn: Connection) -> str | None:
        """Why the caller on ``conn`` may not call ``method`` (its certificate's roles), or None."""
        wanted = self._roles.get(method)
        if wanted is None or self.membership is None:
            return None
        held = conn.remote_certificate.roles if conn.remote_certificate is not None else ()
        if any(role_matches(h, w) for h in held for w in wanted):
            return None
        return (f"{method} is served to roles {', '.join(sorted(wanted))}; the caller's certificate names "
                f"{', '.join(held) or 'no role'}")

    def start_handler(self, conn: Connection, sid: int, method: str, header: dict, size: int) -> None:
        """Serve a call the remote opened on ``conn`` (stream ``sid``, its OPEN ``header`` of ``size``
        bytes): refused with ERROR when shutting down, unknown or unauthorized, else a handler task
        bounded by the call's deadline."""
        entry = self._handlers.get(method)
        if self._closed:  # a call that arrived while we shut down: its task would outlive our loop
            conn.send_error(sid, "PeerUnreachable", "the peer is shutting down")
            return
        if entry is None:
            conn.send_error(sid, "UnknownMethod", f"no handler for {method!r}")
            return
        if self.auth is not None:
            try:
                assert conn.remote_id is not None
                self.auth.check(method, header, conn.remote_id)
            except Exception as e:
                conn.send_error(sid, "Unauthorized", str(e))
                return
        problem = self._role_problem(method, conn)
        if problem is not None:
            conn.send_error(sid, "Unauthorized", problem)
            return
        stream = conn.accept_stream(sid, method, header, size)
        task = self._start_eagerly(self._serve(entry, conn, stream, header))
        if task is None:
            return
        conn.handlers[sid] = task
        self._handler_tasks.add(task)
        timeout = header.get(DEADLINE)
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
                await conn.send({STREAM: sid, KIND: DATA, END_OF_ITEMS: 1, PAYLOAD: response})
            else:
                # closed here, in this task, whatever ends it: left to the event loop's finalizer, a
                # generator cancelled mid-send is closed at the loop's shutdown, while already closing
                items = fn(request, ctx)
                async with contextlib.aclosing(items) if hasattr(items, "aclose") else contextlib.nullcontext():
                    async for item in items:
                        await conn.send({STREAM: sid, KIND: DATA, END_OF_ITEMS: 0, PAYLOAD: item})
                await conn.send({STREAM: sid, KIND: END})
        except asyncio.CancelledError as e:  # the caller cancelled, the deadline passed, or shutdown
            logger.debug("handler %s for %s stopped: %s", stream.method, conn.remote_id, e.args[0] if e.args else
                         "cancelled")
        except PeerUnreachable as e:
            if not conn.closed:  # the handler's own call to a third peer failed: tell our caller
                conn.send_error(sid, type(e).__name__, str(e))
        except Exception as e:
            logger.debug("handler %s failed: %r", stream.method, e, exc_info=True)
            conn.send_error(sid, type(e).__name__, str(e))
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
            conn = self._cached_connection(peer) or await self.pool.connection(peer, deadline)
            if conn.remote_certificate is not None:
                lapsed = conn.membership_lapsed()
                if lapsed is not None:  # dial again: the remote's HELLO carries its current certificate
                    conn.close(lapsed)
                    continue
            try:
                stream = conn.new_stream(method)
            except Retry:
                continue
            h: dict[str, Any] = {STREAM: stream.sid, KIND: OPEN, METHOD: method,
                                 DEADLINE: max(deadline - self.loop.time(), 1e-3)}
            if first is not _NOTHING:
                h[FIRST_ITEM], h[PAYLOAD] = 1, first
            if end:
                h[END_OF_ITEMS] = 1
                stream.sent_end = True
            if self.auth is not None:
                h[AUTH] = self.auth.outgoing(method, h)
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
        conn = self._cached_connection(peer) or await self.pool.connection(peer, self._deadline(timeout))
        assert conn.remote_id is not None
        return conn.remote_id

    @property
    def idle_timeout(self) -> float:
        """Seconds without traffic after which an idle connection is closed (the pool's setting)."""
        return self.pool.idle_timeout

    @idle_timeout.setter
    def idle_timeout(self, seconds: float) -> None:
        self.pool.idle_timeout = seconds

    @property
    def max_connections(self) -> int:
        """Connections past which idle ones are closed (the pool's setting)."""
        return self.pool.max_connections

    @max_connections.setter
    def max_connections(self, n: int) -> None:
        self.pool.max_connections = n

    @property
    def num_half_open(self) -> int:
        """Accepted connections that have not finished the handshake."""
        return self.pool.num_half_open

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    def connected_peers(self) -> list[PeerID]:
        return self.pool.peers()

    def tcp_info(self, peer_id: PeerID) -> TcpInfo | None:
        """The kernel's view of the pooled connection to ``peer_id`` (its delivery rate: the path's
        bottleneck rate while data flows), None if not connected or the platform has no ``TCP_INFO``."""
        conn = self.pool.peer_connection(peer_id)
        if conn is None or conn.transport is None or conn.closed:
            return None
        return read_tcp_info(conn.transport.get_extra_info("socket"))

    def peer_certificate(self, peer_id: PeerID) -> Certificate | None:
        """The membership certificate a connected peer presented last (None: not connected, or open mode)."""
        conn = self.pool.peer_connection(peer_id)
        return conn.remote_certificate if conn is not None else None

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

    # ---- lifetime --------------------------------------------------------------------------
    async def shutdown(self) -> None:
        """Close every connection and handler; returns when all sockets are closed."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        self.pool.close()
        tasks = list(self._handler_tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.pool.wait_closed()
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

