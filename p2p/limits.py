"""Hard limits of one connection, checked before any buffer is allocated."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Limits:
    """What a peer accepts from the other side of a connection.

    Each number bounds memory that a remote peer can make us allocate; a message over any of
    them closes the connection (or, for ``max_streams``, refuses that one call).

    Before the handshake has proved who is on the other end, a connection gets far less: one
    small header at a time (``max_handshake_header_bytes``), no frames, ``handshake_timeout``
    seconds to finish, and at most ``max_half_open`` such accepted connections at once, of which
    once half of them are taken, at most ``max_half_open_per_address`` (16) from one source address
    (an IPv6 source counts by its /64), so one address cannot take every slot.  With these defaults
    a stranger's connection costs the node a few KiB and at most 10 s.

    Frames: a message with frames holds its declared bytes of the node's frame budget
    (``max_pending_frame_bytes``) until it is complete.  The node keeps a further 1/16 of that
    budget spare for small messages (at most 1/256 of it each: 4 MiB of 64 MiB by default), which
    they use when the rest is taken or others wait, so one huge message cannot block other
    members' small calls.  A connection holding frame budget must always feed it: after
    ``frame_rate_grace`` seconds (2 s) the bytes it sent over the last ``frame_rate_window``
    seconds (10 s) must average at least ``frame_floor_rate`` (4 KiB/s), or it is closed and its
    budget taken back.  Time when this node itself stopped reading (flow control, its own rate
    limit, a busy event loop) does not count.  The floor is low on purpose: a link throttled to
    1 Mbit/s that sends to a dozen peers at once still clears it; the stricter ``min_frame_rate``
    (64 KiB/s over ``frame_stall_timeout``) applies only while other messages wait for the budget.
    """

    max_header_bytes: int = 8 * MiB
    max_frame_bytes: int = 1 * GiB
    max_frames: int = 4096
    max_message_bytes: int = 2 * GiB
    max_streams: int = 4096
    # Received-but-unconsumed bytes per connection before we stop reading from its socket.
    max_buffered_bytes: int = 8 * MiB
    # Before the handshake: the largest header (HELLO with a certificate is well under 1 KiB);
    # frames are not allowed at all.
    max_handshake_header_bytes: int = 4 * KiB
    # Seconds a connection may take to finish the handshake, dialed or accepted.
    handshake_timeout: float = 10.0
    # Accepted connections still in the handshake; further ones are closed at once.
    max_half_open: int = 256
    # Of those, at most this many from one source address (IPv4 address, IPv6 /64).
    max_half_open_per_address: int = 16
    # Bytes the whole node promises to frames declared but not yet received.  The decoder
    # allocates a tensor when its header arrives, so without this a peer could make us hold
    # max_message_bytes per connection that it never sends.  1 GiB admits the largest single
    # frame; a message that would go over waits (its connection stops reading) until others
    # finish, and one larger than the whole budget closes the connection.
    max_pending_frame_bytes: int = 1 * GiB
    # While a message waits for that budget, a connection holding part of it that received
    # fewer than min_frame_rate bytes/s over frame_stall_timeout seconds is closed.
    frame_stall_timeout: float = 30.0
    min_frame_rate: int = 64 * KiB
    # Always (others waiting or not): a connection holding frame budget is closed when, after
    # frame_rate_grace seconds, it fed fewer than frame_floor_rate bytes/s over the last
    # frame_rate_window seconds (time this node paused reading excluded).
    frame_floor_rate: int = 4 * KiB
    frame_rate_grace: float = 2.0
    frame_rate_window: float = 10.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "float":
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                kind = "number"
            else:
                ok = isinstance(value, int) and not isinstance(value, bool)
                kind = "int"
            if not ok or value <= 0:
                raise ValueError(f"Limits.{f.name} must be a positive {kind}, got {value!r}")
