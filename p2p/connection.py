"""One TCP connection between two peers: multiplexed streams, flow control, and the socket.

Either side may open calls on a connection once the handshake proved both identities; the dialer
numbers its streams odd and the acceptor even, so ids never collide.  Protocol errors close the
connection with a logged reason and fail only the calls that were on it.

Until the handshake finishes a connection is a stranger's: small buffers, small headers, no
frames, a deadline.  What the handshake and run membership decide (who the remote is, whether it
is a member, what to answer) is ``handshake.py``'s; this module carries out its verdicts: it
writes the messages, times the handshake out, and closes the connection the way each verdict says.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from .budget import FrameBudget
from .errors import PeerUnreachable, ProtocolError, Retry
from .flow import FlowControl
from .handshake import Failed, Handshake, Ready, Refuse, Refused, Reply
from .headers import (
    CANCEL,
    DATA,
    END,
    END_OF_ITEMS,
    ERROR,
    FIRST_ITEM,
    GOAWAY,
    HELLO,
    KIND,
    LAST_STREAM,
    METHOD,
    OPEN,
    PAYLOAD,
    PROOF,
    RENEW,
    STREAM,
    error_header,
)
from .identity import Identity, PeerID
from .limits import Limits
from .stream import Stream, remote_error
from .throttle import Throttle
from .traffic import Traffic, buffers_size
from .wire import Decoder, Encoder

if TYPE_CHECKING:
    from .handshake import Outcome
    from .membership import Certificate, Membership

logger = logging.getLogger(__name__)

# A send returns once the kernel took every byte (nothing left in the transport's buffer): the
# transport keeps what it could not send as it was given, zero-copy views of the caller's tensors,
# and the caller changes those as soon as the send returns (the next accumulation, the step).
_WRITE_HIGH_WATER = 0
REFUSAL_LOG_PERIOD = 30.0  # at most one line per this many seconds about per-address refusals


class _SourceSlots:
    """One node's accepted connections still in the handshake, by source address (``max_half_open_per_address``)."""

    __slots__ = ("counts", "refused", "last_log", "__weakref__")

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.refused = 0
        self.last_log = -REFUSAL_LOG_PERIOD


# Keyed by the node's pool: the per-address counts live and die with the node (no global state).
_SOURCES: weakref.WeakKeyDictionary[Any, _SourceSlots] = weakref.WeakKeyDictionary()


def source_key(peername: Any) -> str | None:
    """What one source is, for the per-address bound: an IPv4 address, or an IPv6 /64 (None: not IP)."""
    if not isinstance(peername, tuple) or not peername or not isinstance(peername[0], str):
        return None
    try:
        ip = ipaddress.ip_address(peername[0].split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class PoolHooks(Protocol):
    """What a connection reports of its life to the pool that holds it (``pool.ConnectionPool``)."""

    def admit(self, conn: Connection) -> bool: ...
    def handshake_over(self, conn: Connection) -> None: ...
    def ready(self, conn: Connection) -> None: ...
    def withdraw(self, conn: Connection) -> None: ...
    def remove(self, conn: Connection) -> None: ...
    def frame_budget_blocked(self) -> None: ...
    @property
    def num_half_open(self) -> int: ...


class ConnectionHost(Protocol):
    """What a connection needs of the peer that owns it (``P2P``): who it is, its settings, the pool
    it reports its life to (``ConnectionPool``), and where the calls the remote opens go."""

    loop: asyncio.AbstractEventLoop
    identity: Identity
    client_mode: bool
    limits: Limits
    encoder: Encoder
    frame_budget: FrameBudget
    membership: Membership | None
    throttle: Throttle | None  # the node's rate limit (None: unlimited)
    pool: PoolHooks
    traffic: Traffic  # what the node's calls cost, by method

    @property
    def listen_address_str(self) -> str | None: ...

    @property
    def certificate_bytes(self) -> bytes | None:
        """Ours, as the run's authority issued it last (None: open mode)."""

    def start_handler(self, conn: Connection, sid: int, method: str, header: dict, size: int) -> None:
        """Serve the call the remote opened on ``conn`` as stream ``sid`` (its OPEN ``header``, of ``size`` bytes)."""


class Connection(FlowControl):
    """One TCP connection to a remote peer, dialed (``dialer``) or accepted, carrying many calls."""

    # Slots: thousands of connections (most of them strangers' in the handshake) stay small.
    __slots__ = (
        "host", "encoder", "decoder", "dialer", "expected_peer", "remote_addr", "handshake", "ready", "is_ready",
        "closed_future", "streams", "handlers", "close_reason", "going_away", "remote_goaway", "last_activity",
        "bytes_in", "half_open", "source", "_handshake_timer", "_next_sid", "_max_remote_sid",
        "_frame_timer", "_frame_due", "_frame_since", "_frame_samples", "_paused_total", "_paused_since",
    )

    def __init__(self, host: ConnectionHost, dialer: bool, expected_peer: PeerID | None = None) -> None:
        super().__init__(host.loop, host.limits)
        self.host = host
        self.encoder = host.encoder
        self.decoder = Decoder(host.limits, host.frame_budget, handshake=True)
        self.decoder.on_granted = self._on_budget_granted
        self.dialer = dialer
        self.expected_peer = expected_peer
        self.remote_addr: Any = None
        self.handshake = Handshake(host.identity, membership=host.membership, expected_peer=expected_peer)
        self.ready: asyncio.Future = self.loop.create_future()
        self.is_ready = False
        self.closed_future: asyncio.Future = self.loop.create_future()
        self.streams: dict[int, Stream] = {}
        self.handlers: dict[int, asyncio.Task] = {}
        self.close_reason = ""
        self.going_away = False  # no new calls on this connection
        self.remote_goaway: int | None = None
        self.last_activity = self.loop.time()
        self.bytes_in = 0  # for the frame-budget stall rule
        self.half_open = False  # counted in the peer's accepted-but-not-ready connections
        self.source: str | None = None  # counted in max_half_open_per_address under this key while half-open
        self._handshake_timer: asyncio.TimerHandle | None = None
        self._next_sid = 1 if dialer else 2
        self._max_remote_sid = 0
        # The frame-rate floor (Limits.frame_floor_rate): a timer while a message holds frame budget,
        # (active time, bytes_in) samples over the window, and the time our own side paused reading.
        self._frame_timer: asyncio.TimerHandle | None = None
        self._frame_due = 0.0
        self._frame_since = 0.0
        self._frame_samples: deque[tuple[float, int]] | None = None
        self._paused_total = 0.0
        self._paused_since: float | None = None

    # ---- who is on the other end (as the handshake found) ---------------------------------
    @property
    def remote_id(self) -> PeerID | None:
        return self.handshake.remote_id

    @property
    def remote_client_mode(self) -> bool:
        return self.handshake.remote_client_mode

    @property
    def remote_listen(self) -> str | None:
        """The listen address the remote's HELLO announced (stored, never dialed by this layer)."""
        return self.handshake.remote_listen

    @property
    def remote_certificate(self) -> Certificate | None:
        """With membership on: the certificate the remote proved last."""
        return self.handshake.remote_certificate

    # ---- asyncio protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.remote_addr = transport.get_extra_info("peername")
        slots = None if self.dialer else self._source_slots()
        key = source_key(self.remote_addr) if slots is not None else None
        if (key is not None and slots is not None and slots.counts.get(key, 0) >= self.limits.max_half_open_per_address
                and self.host.pool.num_half_open >= self.limits.max_half_open // 2):  # half the slots stay others''
            self._refuse_source(slots, key)
            self.closed = True
            self.close_reason = f"over max_half_open_per_address={self.limits.max_half_open_per_address}"
            transport.abort()  # connection_lost follows; nothing was allocated for it yet
            return
        if not self.host.pool.admit(self):
            self.closed = True
            self.close_reason = f"over max_half_open={self.limits.max_half_open}"
            transport.abort()  # connection_lost follows; nothing was allocated for it yet
            return
        if key is not None and slots is not None and self.half_open:
            self.source = key
            slots.counts[key] = slots.counts.get(key, 0) + 1
        transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER, low=0)
        self._handshake_timer = self.loop.call_later(self.limits.handshake_timeout, self._handshake_expired)
        host = self.host
        hello = self.handshake.start(self.remote_addr, host.client_mode, host.listen_address_str,
                                     host.certificate_bytes)
        self._write(self.encoder.encode(hello))

    def _source_slots(self) -> _SourceSlots | None:
        pool = self.host.pool
        try:
            slots = _SOURCES.get(pool)
            if slots is None:
                slots = _SOURCES[pool] = _SourceSlots()
        except TypeError:  # a pool that cannot be weakly referenced (a test's stand-in): no per-address bound
            return None
        return slots

    def _refuse_source(self, slots: _SourceSlots, key: str) -> None:
        """Count a connection refused for its address; log at most once per REFUSAL_LOG_PERIOD."""
        slots.refused += 1
        now = self.loop.time()
        if now - slots.last_log < REFUSAL_LOG_PERIOD:
            return
        logger.warning("%s: %d accepted connections from %s have not finished the handshake "
                       "(max_half_open_per_address=%d): refusing new ones from it (%d refused since the last report)",
                       self.host, slots.counts.get(key, 0), key, self.limits.max_half_open_per_address, slots.refused)
        slots.last_log = now
        slots.refused = 0

    def _release_source(self) -> None:
        key, self.source = self.source, None
        if key is None:
            return
        slots = _SOURCES.get(self.host.pool)
        if slots is None:
            return
        left = slots.counts.get(key, 0) - 1
        if left > 0:
            slots.counts[key] = left
        else:
            slots.counts.pop(key, None)

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
            self.pause_for_rate(throttle.recv.delay(nbytes, now))
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
        if decoder.reserved:
            if self._frame_timer is None:
                self._watch_frames()
        elif self._frame_timer is not None:
            self._unwatch_frames()
        if decoder.blocked and self.pause_for_budget():
            self.host.pool.frame_budget_blocked()

    # ---- the frame-rate floor --------------------------------------------------------------
    def update_reading(self) -> None:
        """FlowControl's, noting when our side paused reading: that time is not held against the remote."""
        was = self._transport_paused
        super().update_reading()
        if self._transport_paused != was:
            now = self.loop.time()
            if self._transport_paused:
                self._paused_since = now
            elif self._paused_since is not None:
                self._paused_total += now - self._paused_since
                self._paused_since = None

    def _active_time(self) -> float:
        """Loop time less the time our side kept this socket unread."""
        now = self.loop.time()
        paused = self._paused_total
        if self._paused_since is not None:
            paused += now - self._paused_since
        return now - paused

    def _frame_tick(self) -> float:
        return max(min(self.limits.frame_rate_grace, self.limits.frame_rate_window) / 4, 0.01)

    def _watch_frames(self) -> None:
        """A message holds frame budget (and is not complete): judge its feed rate until it is."""
        if self.closed:
            return
        now = self._active_time()
        self._frame_since = now
        self._frame_samples = deque([(now, self.bytes_in)])
        self._arm_frame_timer()

    def _arm_frame_timer(self) -> None:
        tick = self._frame_tick()
        self._frame_due = self.loop.time() + tick
        self._frame_timer = self.loop.call_at(self._frame_due, self._check_frame_rate)

    def _unwatch_frames(self) -> None:
        if self._frame_timer is not None:
            self._frame_timer.cancel()
            self._frame_timer = None
        self._frame_samples = None

    def _check_frame_rate(self) -> None:
        """Close the connection if, past the grace, it fed under frame_floor_rate over the window."""
        self._frame_timer = None
        samples = self._frame_samples
        if self.closed or not self.decoder.reserved or samples is None:
            self._frame_samples = None
            return
        lag = self.loop.time() - self._frame_due
        if lag > self._frame_tick() and self._paused_since is None:
            self._paused_total += lag  # our event loop was busy: the remote's bytes could not be read
        now, got_total = self._active_time(), self.bytes_in
        samples.append((now, got_total))
        lim = self.limits
        if now - self._frame_since >= lim.frame_rate_grace:
            cutoff = now - lim.frame_rate_window
            while len(samples) > 2 and samples[1][0] <= cutoff:
                samples.popleft()
            since, base = samples[0]
            span, got = now - since, got_total - base
            if span > 0 and got < lim.frame_floor_rate * span:
                self.abort(f"frames too slow: {got} bytes in {span:.1f} s, under frame_floor_rate="
                           f"{lim.frame_floor_rate} B/s, while holding {self.decoder.reserved} bytes of the "
                           f"frame budget; budget taken back")
                return
        self._arm_frame_timer()

    def _on_budget_granted(self) -> None:
        # Called from inside whichever decoder released budget: continue on a fresh stack.
        self.loop.call_soon(self._resume_after_grant)

    def _resume_after_grant(self) -> None:
        if self.closed:
            return
        self.budget_granted()
        self._run_decoder(self.decoder.more)
        if not self.closed:
            self.update_reading()

    def _handshake_expired(self) -> None:
        self._handshake_timer = None
        if not self.is_ready and not self.closed:
            reason = f"no handshake within handshake_timeout={self.limits.handshake_timeout:g} s"
            self._fail_ready(PeerUnreachable(f"{self.remote_id or self.remote_addr}: {reason}"), logging.DEBUG)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed:
            self.closed = True
            self.close_reason = self.close_reason or (f"connection lost: {exc}" if exc else "closed by peer")
        self._fail_everything()
        self.host.pool.remove(self)
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
            raise self.closed_error()
        self.last_activity = self.loop.time()
        self._write(bufs)
        self.host.traffic.sent(self._method_of(header), buffers_size(bufs))
        return bufs

    def _method_of(self, header: dict) -> str:
        """The method of the call a message belongs to ("" for none: handshake, connection-wide)."""
        method = header.get(METHOD) if header.get(KIND) == OPEN else None
        if isinstance(method, str):
            return method
        stream = self.streams.get(header.get(STREAM))  # type: ignore[arg-type]
        return stream.method if stream is not None else ""

    async def send(self, header: dict) -> None:
        """Like send_nowait, then wait out the node's rate limit if it has one, and until the socket
        took the bytes if its buffer was full.

        Returning means the kernel took every byte of the message, so the caller may modify the
        tensors in it (the transport holds the frames it could not send yet as views of them).
        """
        bufs = self.send_nowait(header)
        throttle = self.host.throttle
        if throttle is not None:
            await self.pace(throttle, bufs)
        if self.write_paused:
            await self.drain()

    def _send_quiet(self, header: dict) -> None:
        """Best-effort control message (errors, cancels): a dead connection is not the sender's problem."""
        if not self.closed:
            try:
                self.send_nowait(header)
            except Exception as e:  # an unencodable error message must not kill the handler path
                logger.debug("could not send control message %s: %s", header.get(KIND), e)

    def send_error(self, sid: int, type_name: str, message: str) -> None:
        """Best-effort ERROR on stream ``sid``: the call fails on the remote with ``type_name: message``."""
        self._send_quiet(error_header(sid, type_name, message))

    # ---- dispatch --------------------------------------------------------------------------
    def _dispatch(self, h: dict, size: int) -> None:
        kind = h.get(KIND)
        sid = h.get(STREAM)
        if type(sid) is not int or type(kind) is not int:
            raise ProtocolError(f"header lacks an integer stream id {STREAM!r} or kind {KIND!r}")
        self.host.traffic.received(self._method_of(h), size)
        if not self.is_ready:
            self._carry_out(self.handshake.receive(h))
            return
        if kind == OPEN:
            self._on_open(sid, h, size)
            return
        if kind == HELLO or kind == PROOF:
            self._carry_out(self.handshake.receive(h))  # raises: the handshake is over
            return
        if kind == GOAWAY:
            self._on_goaway(h)
            return
        if sid == 0:
            if kind == RENEW:
                self._on_renew(h)
            elif kind == ERROR:
                self._on_refused(self.handshake.refusal(h))
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
            self.hold(size)
            stream.push(h.get(PAYLOAD), size)
            if h.get(END_OF_ITEMS):
                stream.push_eof()
        elif kind == END:
            stream.push_eof()
        elif kind == ERROR:
            stream.push_error(remote_error(h, stream.method, self.remote_id))
        else:
            raise ProtocolError(f"unknown message kind {kind}")

    # ---- the handshake's verdicts ----------------------------------------------------------
    def _carry_out(self, outcome: Outcome) -> None:
        """Do what the handshake decided about the message it was given."""
        if isinstance(outcome, Reply):
            self._write(self.encoder.encode(outcome.message))
        elif isinstance(outcome, Ready):
            self._become_ready()
        elif isinstance(outcome, Failed):
            self._fail_ready(outcome.error)
        elif isinstance(outcome, Refuse):
            self._refuse(outcome)
        elif isinstance(outcome, Refused):
            self._on_refused(outcome)

    def _become_ready(self) -> None:
        self.ready.set_result(None)
        self.is_ready = True
        self._end_handshake()
        self.decoder.handshake_done()
        self.host.pool.ready(self)
        current = self.host.certificate_bytes
        if current is not None and current is not self.handshake.sent_certificate:
            self.send_renew(current)  # renewed while this handshake was under way

    def _end_handshake(self) -> None:
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
            self._handshake_timer = None
        if self.source is not None:
            self._release_source()
        self.host.pool.handshake_over(self)

    def _fail_ready(self, exc: Exception, level: int = logging.WARNING) -> None:
        self._not_ready(exc)
        self.abort(str(exc), level)

    def _not_ready(self, exc: Exception) -> None:
        """The handshake failed with ``exc``, unless it already ended."""
        if not self.ready.done():
            self.ready.set_exception(exc)
            self.ready.exception()  # mark retrieved: the dialer may have given up already

    # ---- membership ------------------------------------------------------------------------
    def _refuse(self, refusal: Refuse) -> None:
        """Tell the remote it is not a member (so it can say why), then close."""
        logger.info("refusing %s at %s: %s", self.handshake.who, self.remote_addr, refusal.reason)
        self._send_quiet(refusal.message)
        self._not_ready(refusal.error)
        self.close(f"not a member: {refusal.reason}")  # close, not abort: the error is flushed first

    def _on_refused(self, refused: Refused) -> None:
        """The remote refused us (ERROR on stream 0): fail the handshake or the connection with its reason."""
        logger.info("%s (%s)", refused.reason, refused.type_name)
        self._not_ready(refused.error)
        self.close(refused.reason)

    def _on_renew(self, h: dict) -> None:
        refusal = self.handshake.renew(h)
        if refusal is not None:
            self._refuse(refusal)

    def send_renew(self, certificate: bytes) -> None:
        """Send our renewed certificate; the remote checks it like a HELLO's."""
        self._send_quiet(self.handshake.renewal(certificate))

    def membership_lapsed(self) -> str | None:
        """Why the remote's certificate no longer makes it a member, or None while it does (or in open mode)."""
        return self.handshake.lapsed()

    def _on_open(self, sid: int, h: dict, size: int) -> None:
        if sid % 2 == self._next_sid % 2 or sid <= self._max_remote_sid:
            raise ProtocolError(f"stream id {sid} is not a new id of the remote side")
        self._max_remote_sid = sid
        method = h.get(METHOD)
        if not isinstance(method, str):
            raise ProtocolError("OPEN without a method name")
        if self.remote_certificate is not None:
            lapsed = self.handshake.lapsed()
            if lapsed is not None:
                self.send_error(sid, "NotAMember", lapsed)
                self._refuse(self.handshake.refuse(lapsed))
                return
        if self.going_away:
            return  # the GOAWAY we sent tells the caller to retry elsewhere
        if len(self.handlers) >= self.limits.max_streams:
            limit = self.limits.max_streams
            self.send_error(sid, "ResourceExhausted", f"too many concurrent streams (max_streams={limit})")
            return
        self.host.start_handler(self, sid, method, h, size)

    def _on_goaway(self, h: dict) -> None:
        last = h.get(LAST_STREAM)
        self.remote_goaway = last if isinstance(last, int) else 0
        self.going_away = True
        self.host.pool.withdraw(self)
        for sid, stream in list(self.streams.items()):
            if sid % 2 == self._next_sid % 2 and sid > self.remote_goaway:
                stream.push_error(Retry(f"{self.remote_id} closed the connection before processing the call"))

    # ---- streams ---------------------------------------------------------------------------
    def new_stream(self, method: str) -> Stream:
        if self.closed or self.going_away:
            raise Retry(self._unreachable_text())
        sid = self._next_sid
        self._next_sid += 2
        stream = Stream(self, sid, method)
        self.streams[sid] = stream
        return stream

    def accept_stream(self, sid: int, method: str, header: dict, size: int) -> Stream:
        """The stream of a call the remote opened, holding the first item and the end its OPEN
        ``header`` (of ``size`` bytes) carries, if it does."""
        stream = Stream(self, sid, method)
        self.streams[sid] = stream
        if header.get(FIRST_ITEM):
            self.hold(size)
            stream.push(header.get(PAYLOAD), size)
        if header.get(END_OF_ITEMS):
            stream.push_eof()
        return stream

    def cancel_stream(self, stream: Stream) -> None:
        if not stream.finished:
            self._send_quiet({STREAM: stream.sid, KIND: CANCEL})
        stream.release()

    @property
    def idle(self) -> bool:
        return not self.streams and not self.handlers

    # ---- closing ---------------------------------------------------------------------------
    def closed_error(self) -> PeerUnreachable:
        return PeerUnreachable(self._unreachable_text())

    def _unreachable_text(self) -> str:
        who = self.remote_id or self.remote_addr
        return f"connection to {who} closed ({self.close_reason or 'closed'})"

    def goaway(self) -> None:
        """Tell the remote we take no new calls, then close; used for idle connections."""
        if self.closed:
            return
        self.going_away = True
        self.host.pool.withdraw(self)
        self._send_quiet({KIND: GOAWAY, STREAM: 0, LAST_STREAM: self._max_remote_sid})
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
        self._unwatch_frames()
        self.decoder.close()
        self.decoder.on_granted = None  # no cycle through the decoder once closed
        self._not_ready(PeerUnreachable(self._unreachable_text()))
        for sid, stream in list(self.streams.items()):  # ours past the remote's GOAWAY were never processed
            unprocessed = self.remote_goaway is not None and sid % 2 == self._next_sid % 2 and sid > self.remote_goaway
            stream.push_error((Retry if unprocessed else PeerUnreachable)(self._unreachable_text()))
        for task in list(self.handlers.values()):
            task.cancel(f"connection closed: {self.close_reason}")
        self.stop_flow()
