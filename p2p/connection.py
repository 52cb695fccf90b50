"""One TCP connection between two peers: handshake, multiplexed streams, flow control.

Either side may open calls on a connection once the handshake proved both identities; the dialer
numbers its streams odd and the acceptor even, so ids never collide.  Protocol errors close the
connection with a logged reason and fail only the calls that were on it.

Until the handshake finishes a connection is a stranger's: small buffers, small headers, no
frames, a deadline.  With membership on, each HELLO carries the sender's certificate, checked as
soon as HELLO names the key: a side answers with its PROOF only if it accepts the other as a
member, otherwise with ERROR on stream 0 (``x="NotAMember"``), so a ready connection means both
sides accepted each other and a refused side learns why.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from .budget import FrameBudget
from .errors import (
    NotAMember,
    PeerIDMismatch,
    PeerUnreachable,
    ProtocolError,
    RemoteError,
    ResourceExhausted,
    RPCTimeout,
)
from .identity import Identity, PeerID, verify
from .limits import Limits
from .throttle import Throttle, wake
from .wire import Decoder, Encoder

if TYPE_CHECKING:
    from .membership import Certificate, Membership

logger = logging.getLogger(__name__)

# Message kinds (header key "t").  RENEW (s=0, "m": certificate bytes) replaces the sender's
# membership certificate on a ready connection.
HELLO, PROOF, OPEN, DATA, END, ERROR, CANCEL, GOAWAY, RENEW = range(1, 10)
VERSION = 1
_HANDSHAKE_CONTEXT = b"spotswarm/handshake/v1"
# A send returns once the kernel took every byte (nothing left in the transport's buffer): the
# transport keeps what it could not send as it was given, zero-copy views of the caller's tensors,
# and the caller changes those as soon as the send returns (the next accumulation, the step).
_WRITE_HIGH_WATER = 0


class Retry(PeerUnreachable):
    """The peer announced it would not process this call (GOAWAY); safe to retry elsewhere."""


class ConnectionHost(Protocol):
    """What a connection needs of the peer that owns it (``P2P``): who it is, its settings, and the
    hooks by which it joins and leaves the peer's pools and budgets and hands over the calls it gets."""

    loop: asyncio.AbstractEventLoop
    identity: Identity
    client_mode: bool
    limits: Limits
    encoder: Encoder
    frame_budget: FrameBudget
    membership: Membership | None
    throttle: Throttle | None  # the node's rate limit (None: unlimited)
    _certificate_bytes: bytes | None  # ours, as the run's authority issued it last

    @property
    def listen_address_str(self) -> str | None: ...
    def _attach(self, conn: Connection) -> bool: ...  # False: refuse it (past max_half_open)
    def _leave_half_open(self, conn: Connection) -> None: ...
    def _register(self, conn: Connection) -> None: ...  # ready: the pooled connection to its peer
    def _unregister(self, conn: Connection) -> None: ...  # going away: no new calls on it
    def _forget(self, conn: Connection) -> None: ...  # closed
    def _budget_blocked(self) -> None: ...
    def _start_handler(self, conn: Connection, sid: int, method: str, h: dict, size: int) -> None: ...


class Stream:
    """One call on a connection, as seen from either end: a queue of received items plus sending."""

    __slots__ = ("conn", "sid", "method", "items", "waiter", "eof", "error", "sent_end", "finished")

    def __init__(self, conn: Connection, sid: int, method: str) -> None:
        self.conn = conn
        self.sid = sid
        self.method = method
        self.items: deque[tuple[Any, int]] = deque()
        self.waiter: asyncio.Future | None = None
        self.eof = False
        self.error: BaseException | None = None
        self.sent_end = False
        self.finished = False  # removed from the connection; no further sends

    # ---- receiving -------------------------------------------------------------------------
    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def push(self, item: Any, nbytes: int) -> None:
        self.items.append((item, nbytes))
        self._wake()

    def push_eof(self) -> None:
        self.eof = True
        self._wake()

    def push_error(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self._wake()

    async def recv(self) -> Any:
        """Next item; raises StopAsyncIteration at the end of the remote's messages."""
        while not self.items:
            if self.error is not None:
                raise self.error
            if self.eof:
                raise StopAsyncIteration
            self.waiter = self.conn.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        item, nbytes = self.items.popleft()
        self.conn.consumed(nbytes)
        return item

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Any:
        return await self.recv()

    # ---- sending ---------------------------------------------------------------------------
    async def send(self, item: Any, end: bool = False) -> None:
        """Send one item; waits while the socket's write buffer is full (backpressure)."""
        if self.sent_end:
            raise RuntimeError(f"stream {self.method} already finished sending")
        self.sent_end = end
        await self.conn.send({"s": self.sid, "t": DATA, "e": int(end), "p": item})

    async def done_writing(self) -> None:
        if not self.sent_end:
            self.sent_end = True
            await self.conn.send({"s": self.sid, "t": END})

    def release(self) -> None:
        """Drop unread items (returning their bytes to flow control) and forget the stream."""
        self.finished = True
        while self.items:
            self.conn.consumed(self.items.popleft()[1])
        self.conn.streams.pop(self.sid, None)


class Connection(asyncio.BufferedProtocol):
    # Slots: thousands of connections (most of them strangers' in the handshake) stay small.
    __slots__ = (
        "host", "loop", "limits", "encoder", "decoder", "dialer", "expected_peer", "transport", "remote_addr",
        "remote_id", "remote_client_mode", "remote_listen", "remote_certificate", "ready", "is_ready",
        "closed_future", "streams", "handlers", "closed", "close_reason", "going_away", "remote_goaway",
        "last_activity", "bytes_in", "half_open", "_handshake_timer", "_sent_certificate", "_nonce",
        "_remote_pk", "_remote_nonce", "_next_sid", "_max_remote_sid", "_buffered", "_reading_paused",
        "_budget_paused", "_transport_paused", "_write_paused", "_drain_waiters", "_rate_timer", "_paced",
    )

    def __init__(self, host: ConnectionHost, dialer: bool, expected_peer: PeerID | None = None) -> None:
        self.host = host
        self.loop = host.loop
        self.limits = host.limits
        self.encoder = host.encoder
        self.decoder = Decoder(host.limits, host.frame_budget, handshake=True)
        self.decoder.on_granted = self._on_budget_granted
        self.dialer = dialer
        self.expected_peer = expected_peer
        self.transport: asyncio.Transport | None = None
        self.remote_addr: Any = None
        self.remote_id: PeerID | None = None
        self.remote_client_mode = False
        self.remote_listen: str | None = None
        self.remote_certificate: Certificate | None = None  # with membership on: what the remote proved
        self.ready: asyncio.Future = self.loop.create_future()
        self.is_ready = False
        self.closed_future: asyncio.Future = self.loop.create_future()
        self.streams: dict[int, Stream] = {}
        self.handlers: dict[int, asyncio.Task] = {}
        self.closed = False
        self.close_reason = ""
        self.going_away = False  # no new calls on this connection
        self.remote_goaway: int | None = None
        self.last_activity = self.loop.time()
        self.bytes_in = 0  # for the frame-budget stall rule
        self.half_open = False  # counted in the peer's accepted-but-not-ready connections
        self._handshake_timer: asyncio.TimerHandle | None = None
        self._sent_certificate: bytes | None = None
        self._nonce = os.urandom(16)
        self._remote_pk = b""
        self._remote_nonce = b""
        self._next_sid = 1 if dialer else 2
        self._max_remote_sid = 0
        self._buffered = 0
        self._reading_paused = False  # flow control: our side has not consumed enough
        self._budget_paused = False  # a message waits for the peer's frame budget
        self._transport_paused = False
        self._write_paused = False
        self._drain_waiters: list[asyncio.Future] = []
        self._rate_timer: asyncio.TimerHandle | None = None  # reading paused by the node's rate limit
        self._paced: set[asyncio.Future] | None = None  # senders waiting out the rate limit (made on first use)

    # ---- asyncio protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.remote_addr = transport.get_extra_info("peername")
        if not self.host._attach(self):
            self.closed = True
            self.close_reason = f"over max_half_open={self.limits.max_half_open}"
            transport.abort()  # connection_lost follows; nothing was allocated for it yet
            return
        transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER, low=0)
        self._handshake_timer = self.loop.call_later(self.limits.handshake_timeout, self._handshake_expired)
        host = self.host
        hello = {"t": HELLO, "s": 0, "v": VERSION, "pk": host.identity.public_key, "n": self._nonce,
                 "c": int(host.client_mode), "l": host.listen_address_str}
        if host.membership is not None:
            hello["m"] = self._sent_certificate = host._certificate_bytes
        self._write(self.encoder.encode(hello))

    def get_buffer(self, sizehint: int) -> memoryview:
        buf = self.decoder.get_buffer()
        throttle = self.host.throttle
        if throttle is not None and len(buf) > throttle.read_size:
            return buf[:throttle.read_size]  # small reads: no large read slips past the limit at once
        return buf

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed:
            return
        self.last_activity = now = self.loop.time()
        self.bytes_in += nbytes
        throttle = self.host.throttle
        if throttle is not None:
            delay = throttle.recv.delay(nbytes, now)
            if delay > 0 and self._rate_timer is None:
                self._rate_timer = self.loop.call_later(delay, self._end_rate_pause)
                self._update_reading()
        self._run_decoder(self.decoder.buffer_updated, nbytes)

    def _run_decoder(self, step: Any, *args: Any) -> None:
        """Dispatch what one decoder step produced; before the handshake the decoder stops after
        each message, so later bytes are judged by the limits the handshake leaves in force."""
        decoder = self.decoder
        try:
            out = step(*args)
            while True:
                for header, size in out:
                    self._dispatch(header, size)
                    if self.closed:
                        return
                if not decoder.stopped_early:
                    break
                out = decoder.more()
        except ProtocolError as e:
            self.abort(f"protocol error: {e}", logging.WARNING if self.is_ready else logging.INFO)
            return
        if decoder.blocked and not self._budget_paused:
            self._budget_paused = True
            self._update_reading()
            self.host._budget_blocked()

    def _on_budget_granted(self) -> None:
        # Called from inside whichever decoder released budget: continue on a fresh stack.
        self.loop.call_soon(self._resume_after_grant)

    def _resume_after_grant(self) -> None:
        if self.closed:
            return
        self._budget_paused = False
        self._run_decoder(self.decoder.more)
        if not self.closed:
            self._update_reading()

    def _update_reading(self) -> None:
        """Pause the socket while flow control, the frame budget or the rate limit says so; resume otherwise."""
        pause = self._reading_paused or self._budget_paused or self._rate_timer is not None
        if pause != self._transport_paused and self.transport is not None and not self.closed:
            self._transport_paused = pause
            if pause:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

    def _end_rate_pause(self) -> None:
        """Resume reading once the rate limit's debt is paid (or the limit changed)."""
        if self._rate_timer is not None:
            self._rate_timer.cancel()
            self._rate_timer = None
            self._update_reading()

    def rate_limit_changed(self) -> None:
        """The node's rate limit changed or ended: whatever waits on the old one goes on at once
        (the debt is carried over, so the new limit judges what comes next)."""
        self._end_rate_pause()
        self._wake_paced()

    def _wake_paced(self) -> None:
        if self._paced:
            for w in self._paced:
                wake(w)

    def _handshake_expired(self) -> None:
        self._handshake_timer = None
        if not self.is_ready and not self.closed:
            reason = f"no handshake within handshake_timeout={self.limits.handshake_timeout:g} s"
            self._fail_ready(PeerUnreachable(f"{self.remote_id or self.remote_addr}: {reason}"), logging.DEBUG)

    def eof_received(self) -> bool:
        return False

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        waiters, self._drain_waiters = self._drain_waiters, []
        for w in waiters:
            wake(w)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed:
            self.closed = True
            self.close_reason = self.close_reason or (f"connection lost: {exc}" if exc else "closed by peer")
        self._fail_everything()
        self.host._forget(self)
        if not self.closed_future.done():
            self.closed_future.set_result(None)

    # ---- writing ---------------------------------------------------------------------------
    def _write(self, bufs: list) -> None:
        assert self.transport is not None
        if len(bufs) == 1:
            self.transport.write(bufs[0])
        else:
            self.transport.writelines(bufs)

    def send_nowait(self, header: dict) -> list:
        """Encode and queue a message (EncodeError goes to the caller; nothing is sent then).

        Returns the buffers written, for the rate limit to count; the rate limit does not hold
        these back (control messages are small)."""
        bufs = self.encoder.encode(header)
        if self.closed:
            raise PeerUnreachable(self._unreachable_text())
        self.last_activity = self.loop.time()
        self._write(bufs)
        return bufs

    async def send(self, header: dict) -> None:
        """Like send_nowait, then wait out the node's rate limit if it has one, and until the socket
        took the bytes if its buffer was full.

        Returning means the kernel took every byte of the message, so the caller may modify the
        tensors in it (the transport holds the frames it could not send yet as views of them).
        """
        bufs = self.send_nowait(header)
        throttle = self.host.throttle
        if throttle is not None:
            await self._pace(throttle, bufs)
        if self._write_paused:
            await self.drain()

    async def _pace(self, throttle: Throttle, bufs: list) -> None:
        """After writing ``bufs``, wait until the node's send bucket has paid for them, so that the
        node's senders together keep to its rate; woken early when the limit changes or the
        connection closes (PeerUnreachable then).  Cancelling the wait leaves the debt in the bucket."""
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
            raise PeerUnreachable(self._unreachable_text())

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
            raise PeerUnreachable(self._unreachable_text())

    def _send_quiet(self, header: dict) -> None:
        """Best-effort control message (errors, cancels): a dead connection is not the sender's problem."""
        if not self.closed:
            try:
                self.send_nowait(header)
            except Exception as e:  # an unencodable error message must not kill the handler path
                logger.debug("could not send control message %s: %s", header.get("t"), e)

    # ---- dispatch --------------------------------------------------------------------------
    def _dispatch(self, h: dict, size: int) -> None:
        kind = h.get("t")
        sid = h.get("s")
        if type(sid) is not int or type(kind) is not int:
            raise ProtocolError("header lacks an integer stream id 's' or kind 't'")
        if not self.is_ready:
            if kind == HELLO or kind == PROOF:
                self._on_handshake(kind, h)
                return
            if kind == ERROR and sid == 0:
                self._on_refused(h)
                return
            raise ProtocolError(f"message kind {kind} before the handshake finished")
        if kind == OPEN:
            self._on_open(sid, h, size)
            return
        if kind == HELLO or kind == PROOF:
            raise ProtocolError("repeated handshake message")
        if kind == GOAWAY:
            self._on_goaway(h)
            return
        if sid == 0:
            if kind == RENEW:
                self._on_renew(h)
            elif kind == ERROR:
                self._on_refused(h)
            return
        stream = self.streams.get(sid)
        if kind == CANCEL:
            task = self.handlers.get(sid)
            if task is not None:
                task.cancel("the caller cancelled the call")
            return
        if stream is None:
            return  # a late message for a call we already finished or cancelled: harmless
        if kind == DATA:
            self._hold(size)
            stream.push(h.get("p"), size)
            if h.get("e"):
                stream.push_eof()
        elif kind == END:
            stream.push_eof()
        elif kind == ERROR:
            stream.push_error(_remote_error(h, stream.method, self.remote_id))
        else:
            raise ProtocolError(f"unknown message kind {kind}")

    def _on_handshake(self, kind: int, h: dict) -> None:
        me = self.host.identity
        if kind == HELLO:
            pk, nonce = h.get("pk"), h.get("n")
            if self._remote_pk or not isinstance(pk, bytes) or len(pk) != 32 \
                    or not isinstance(nonce, bytes) or len(nonce) != 16 or h.get("v") != VERSION:
                raise ProtocolError("bad or repeated HELLO")
            self._remote_pk, self._remote_nonce = pk, nonce
            self.remote_id = PeerID.from_public_key(pk)
            self.remote_client_mode = bool(h.get("c"))
            listen = h.get("l")
            self.remote_listen = listen if isinstance(listen, str) else None
            if self.expected_peer is not None and self.remote_id != self.expected_peer:
                self._fail_ready(PeerIDMismatch(
                    f"{self.remote_addr} is {self.remote_id}, expected {self.expected_peer}"))
                return
            membership = self.host.membership
            if membership is not None:
                # Checked against the key HELLO names; PROOF below must then prove that key.
                try:
                    self.remote_certificate = membership.check(self.remote_id, h.get("m"))
                except NotAMember as e:
                    self._refuse(str(e))
                    return
            sig = me.sign(_HANDSHAKE_CONTEXT + nonce + me.public_key)
            self._write(self.encoder.encode({"t": PROOF, "s": 0, "sig": sig}))
            return
        sig = h.get("sig")
        if not self._remote_pk or self.ready.done() or not isinstance(sig, bytes):
            raise ProtocolError("unexpected PROOF")
        if not verify(self._remote_pk, sig, _HANDSHAKE_CONTEXT + self._nonce + self._remote_pk):
            self._fail_ready(PeerIDMismatch(f"{self.remote_addr} failed to prove its identity"))
            return
        self.ready.set_result(None)
        self.is_ready = True
        self._end_handshake()
        self.decoder.handshake_done()
        self.host._register(self)
        current = self.host._certificate_bytes
        if current is not None and current is not self._sent_certificate:
            self.send_renew(current)  # renewed while this handshake was under way

    def _end_handshake(self) -> None:
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
            self._handshake_timer = None
        self.host._leave_half_open(self)

    def _fail_ready(self, exc: Exception, level: int = logging.WARNING) -> None:
        self._not_ready(exc)
        self.abort(str(exc), level)

    def _not_ready(self, exc: Exception) -> None:
        """The handshake failed with ``exc``, unless it already ended."""
        if not self.ready.done():
            self.ready.set_exception(exc)
            self.ready.exception()  # mark retrieved: the dialer may have given up already

    # ---- membership ------------------------------------------------------------------------
    def _refuse(self, reason: str) -> None:
        """Tell the remote it is not a member (so it can say why), then close."""
        who = self.remote_id or self.remote_addr
        logger.info("refusing %s at %s: %s", who, self.remote_addr, reason)
        self._send_quiet(_error_header(0, "NotAMember", reason))
        self._not_ready(NotAMember(f"{who} is not a member: {reason}"))
        self.close(f"not a member: {reason}")  # close, not abort: the error is flushed first

    def _on_refused(self, h: dict) -> None:
        """The remote refused us (ERROR on stream 0): fail the handshake or the connection with its reason."""
        type_name, message = str(h.get("x", "")), str(h.get("msg", ""))[:1000]
        reason = f"refused by {self.remote_id or self.remote_addr}: {message}"
        logger.info("%s (%s)", reason, type_name)
        self._not_ready(NotAMember(reason) if type_name == "NotAMember" else PeerUnreachable(f"{reason} ({type_name})"))
        self.close(reason)

    def _on_renew(self, h: dict) -> None:
        membership = self.host.membership
        if membership is None:
            return  # open mode never asked for a certificate
        assert self.remote_id is not None
        try:
            self.remote_certificate = membership.check(self.remote_id, h.get("m"))
        except NotAMember as e:
            self._refuse(f"renewed certificate refused: {e}")

    def send_renew(self, certificate: bytes) -> None:
        """Send our renewed certificate; the remote checks it like a HELLO's."""
        self._sent_certificate = certificate
        self._send_quiet({"t": RENEW, "s": 0, "m": certificate})

    def _remote_membership_lapsed(self) -> str | None:
        """Why the remote's certificate no longer makes it a member, or None while it does."""
        cert, membership = self.remote_certificate, self.host.membership
        if cert is None or membership is None:
            return None
        now = membership.clock()
        if not cert.expired(now, membership.skew):
            return None
        return f"certificate of {self.remote_id} expired {now - cert.expires:.0f} s ago"

    def _on_open(self, sid: int, h: dict, size: int) -> None:
        if sid % 2 == self._next_sid % 2 or sid <= self._max_remote_sid:
            raise ProtocolError(f"stream id {sid} is not a new id of the remote side")
        self._max_remote_sid = sid
        method = h.get("m")
        if not isinstance(method, str):
            raise ProtocolError("OPEN without a method name")
        if self.remote_certificate is not None:
            lapsed = self._remote_membership_lapsed()
            if lapsed is not None:
                self._send_quiet(_error_header(sid, "NotAMember", lapsed))
                self._refuse(lapsed)
                return
        if self.going_away:
            return  # the GOAWAY we sent tells the caller to retry elsewhere
        if len(self.handlers) >= self.limits.max_streams:
            self._send_quiet(_error_header(sid, "ResourceExhausted",
                                           f"too many concurrent streams (max_streams={self.limits.max_streams})"))
            return
        self.host._start_handler(self, sid, method, h, size)

    def _on_goaway(self, h: dict) -> None:
        last = h.get("l")
        self.remote_goaway = last if isinstance(last, int) else 0
        self.going_away = True
        self.host._unregister(self)
        for sid, stream in list(self.streams.items()):
            if sid % 2 == self._next_sid % 2 and sid > self.remote_goaway:
                stream.push_error(Retry(f"{self.remote_id} closed the connection before processing the call"))

    # ---- flow control ----------------------------------------------------------------------
    def _hold(self, nbytes: int) -> None:
        self._buffered += nbytes
        if not self._reading_paused and self._buffered > self.limits.max_buffered_bytes:
            self._reading_paused = True
            self._update_reading()

    def consumed(self, nbytes: int) -> None:
        self._buffered -= nbytes
        if self._reading_paused and self._buffered <= self.limits.max_buffered_bytes // 2:
            self._reading_paused = False
            self._update_reading()

    # ---- streams ---------------------------------------------------------------------------
    def new_stream(self, method: str) -> Stream:
        if self.closed or self.going_away:
            raise Retry(self._unreachable_text())
        sid = self._next_sid
        self._next_sid += 2
        stream = Stream(self, sid, method)
        self.streams[sid] = stream
        return stream

    def add_remote_stream(self, sid: int, method: str) -> Stream:
        stream = Stream(self, sid, method)
        self.streams[sid] = stream
        return stream

    def cancel_stream(self, stream: Stream) -> None:
        if not stream.finished:
            self._send_quiet({"s": stream.sid, "t": CANCEL})
        stream.release()

    @property
    def idle(self) -> bool:
        return not self.streams and not self.handlers

    # ---- closing ---------------------------------------------------------------------------
    def _unreachable_text(self) -> str:
        who = self.remote_id or self.remote_addr
        return f"connection to {who} closed ({self.close_reason or 'closed'})"

    def goaway(self) -> None:
        """Tell the remote we take no new calls, then close; used for idle connections."""
        if self.closed:
            return
        self.going_away = True
        self.host._unregister(self)
        self._send_quiet({"t": GOAWAY, "s": 0, "l": self._max_remote_sid})
        self.close("idle")

    def close(self, reason: str = "closed") -> None:
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        if self.transport is not None:
            self.transport.close()
        self._fail_everything()

    def abort(self, reason: str, level: int = logging.WARNING) -> None:
        """Drop the connection at once because of what the remote sent."""
        if self.closed:
            return
        logger.log(level, "closing connection with %s: %s", self.remote_id or self.remote_addr, reason)
        self.closed = True
        self.close_reason = reason
        if self.transport is not None:
            self.transport.abort()
        self._fail_everything()

    def _fail_everything(self) -> None:
        self._end_handshake()
        self.decoder.close()
        self.decoder.on_granted = None  # no cycle through the decoder once closed
        self._not_ready(PeerUnreachable(self._unreachable_text()))
        for sid, stream in list(self.streams.items()):  # ours past the remote's GOAWAY were never processed
            unprocessed = self.remote_goaway is not None and sid % 2 == self._next_sid % 2 and sid > self.remote_goaway
            stream.push_error((Retry if unprocessed else PeerUnreachable)(self._unreachable_text()))
        for task in list(self.handlers.values()):
            task.cancel(f"connection closed: {self.close_reason}")
        for w in self._drain_waiters:
            wake(w)
        self._drain_waiters.clear()
        self._wake_paced()
        if self._rate_timer is not None:
            self._rate_timer.cancel()
            self._rate_timer = None


def _error_header(sid: int, type_name: str, message: str) -> dict:
    return {"s": sid, "t": ERROR, "x": type_name, "msg": message}


def _remote_error(h: dict, method: str, peer: PeerID | None = None) -> Exception:
    type_name = str(h.get("x", "RemoteError"))
    message = str(h.get("msg", ""))
    if type_name == "NotAMember":
        return NotAMember(f"{method} refused by {peer}: {message}")
    if type_name == "ResourceExhausted":
        return ResourceExhausted(type_name, message, method)
    if type_name == "RPCTimeout":
        return RPCTimeout(f"{method}: {message}")
    return RemoteError(type_name, message, method)
