"""What the kernel knows about a TCP connection's path: its delivery rate (Linux ``TCP_INFO``).

The kernel measures, for every acknowledged flight, the rate at which the path delivered our
bytes (``tcpi_delivery_rate``, the rate BBR paces at) and marks samples taken while the sender had
too little to send (``app_limited``: they say more about the application than the path).  Read
while a bulk transfer runs, a sample that is not application-limited is the path's bottleneck
rate: our uplink or the receiver's downlink, whichever is slower.  The load balancing of the
all-reduce declares it instead of a guessed bandwidth (``averaging/bandwidth.py``).

No library exposes these fields; the layout is ``struct tcp_info`` of ``linux/tcp.h`` (stable,
fields only ever appended).  Elsewhere, or on kernels older than 4.9, ``read_tcp_info`` returns None.
"""

from __future__ import annotations

import socket
import struct
import sys
from dataclasses import dataclass
from typing import Any

# offsets in struct tcp_info: 8 bytes of u8 fields (the 8th holds delivery_rate_app_limited in its
# lowest bit), 24 u32 fields, then u64 pacing_rate, max_pacing_rate, bytes_acked, bytes_received,
# 6 u32 fields, u64 delivery_rate
_FLAGS = 7
_RTT = 8 + 4 * 15  # tcpi_rtt, microseconds
_BYTES_ACKED = 8 + 4 * 24 + 8 * 2
_BYTES_RECEIVED = _BYTES_ACKED + 8
_DELIVERY_RATE = _BYTES_RECEIVED + 8 + 4 * 6
_SIZE = _DELIVERY_RATE + 8
_TCP_INFO = getattr(socket, "TCP_INFO", None)


@dataclass(frozen=True)
class TcpInfo:
    delivery_rate: int  # bytes per second, the kernel's latest sample
    app_limited: bool  # the sample was taken while we had too little to send
    bytes_acked: int  # sent and acknowledged over the connection's life
    bytes_received: int
    rtt_us: int  # smoothed round-trip time


def read_tcp_info(sock: Any) -> TcpInfo | None:
    """The kernel's view of ``sock`` (a socket, or an asyncio transport's socket), or None where
    the platform has no ``TCP_INFO`` with delivery rates or the socket is not TCP."""
    if _TCP_INFO is None or not sys.platform.startswith("linux") or sock is None:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _SIZE)
    except (OSError, ValueError):
        return None
    if len(raw) < _SIZE:
        return None  # a kernel older than delivery rates (4.9)
    (rtt,) = struct.unpack_from("=I", raw, _RTT)
    acked, received = struct.unpack_from("=QQ", raw, _BYTES_ACKED)
    (rate,) = struct.unpack_from("=Q", raw, _DELIVERY_RATE)
    return TcpInfo(delivery_rate=rate, app_limited=bool(raw[_FLAGS] & 1), bytes_acked=acked,
                   bytes_received=received, rtt_us=rtt)
