"""Dialing through a relay: how a peer in one emulated region reaches a peer in another.

The local simulator emulates regions on one machine (``provider.links``, ``orchestrator/sim/relay.py``):
each region's peers listen on a loopback address of their own (``127.77.<i>.1``), and a relay
process between the regions carries every cross-region connection, delayed and paced to the
link's rate.  A connection's bytes, the handshake and the framing cross real sockets unchanged.
What is not a real network is this routing decision: a peer with a ``RelayRoute`` dials a host of
another region through the relay instead of directly, where a router would have taken the same
packets over a slow link.  Doing it in the dialer is what needs no root: network namespaces (what
``benchmarks/bench_wan.py`` uses) need root, and a Ray actor cannot be put in one.

The relay protocol, on a fresh TCP connection to the relay, before anything else::

    dialer -> relay   b"SWRELAY1 <host>:<port>\\n"     the destination, at most MAX_HEADER_BYTES
    relay -> dialer   b"ok\\n"                          connected: from here on, the destination's bytes
                      b"error <reason>\\n", then EOF     refused (malformed header, unknown region, ...)

The dialer's socket is bound to its own region's address (``source``) so that the relay tells the
regions apart by where a connection comes from, as a network would; the destination sees the
relay's connection, from the source's address.  A peer without a route (the default) dials every
host directly: the route costs one ``is None`` check per dial, nothing per message.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass

MAGIC = b"SWRELAY1 "
OK = b"ok\n"
ERROR = b"error "
MAX_HEADER_BYTES = 300  # the header line, newline included
MAX_REPLY_BYTES = 1000  # of a refusal's reason


class RelayRefused(ConnectionRefusedError):
    """The relay would not carry the connection; the message is its reason."""


def relay_header(host: str, port: int) -> bytes:
    """The line that names the destination ``host:port`` to the relay."""
    line = MAGIC + f"{host}:{port}\n".encode("ascii")
    if len(line) > MAX_HEADER_BYTES:
        raise ValueError(f"destination {host!r} is too long for the relay's header")
    return line


def parse_relay_header(line: bytes) -> tuple[str, int]:
    """The destination a header line names; ValueError saying what is wrong with it."""
    if len(line) > MAX_HEADER_BYTES:
        raise ValueError(f"header longer than {MAX_HEADER_BYTES} bytes")
    if not line.startswith(MAGIC) or not line.endswith(b"\n"):
        raise ValueError(f"not a relay header (expected {MAGIC.decode().strip()} HOST:PORT): {line[:40]!r}")
    try:
        text = line[len(MAGIC):-1].decode("ascii")
    except UnicodeDecodeError:
        raise ValueError(f"destination is not ASCII: {line[:60]!r}") from None
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() for c in host):
        raise ValueError(f"destination must be HOST:PORT, got {text[:60]!r}")
    return host, int(port)


@dataclass(frozen=True)
class RelayRoute:
    """Reach the hosts in ``remote`` through the relay at ``relay``, leaving from ``source`` (this
    peer's own region's address); every other host directly."""

    relay: tuple[str, int]
    source: str
    remote: frozenset[str]

    def __post_init__(self) -> None:
        if not self.source or not self.relay[0] or not 0 < self.relay[1] < 65536:
            raise ValueError(f"a route needs a source host and the relay's HOST:PORT, got {self}")
        if self.source in self.remote:
            raise ValueError(f"{self.source} is this peer's own address; it cannot be reached through the relay")

    @classmethod
    def make(cls, relay: tuple[str, int], source: str, remote: Iterable[str]) -> RelayRoute:
        return cls((relay[0], int(relay[1])), source, frozenset(remote))

    def relayed(self, host: str) -> bool:
        """Whether a dial to ``host`` goes through the relay."""
        return host in self.remote

    def __str__(self) -> str:
        """The text form ``parse`` reads (a worker's ``route`` setting)."""
        return f"relay={self.relay[0]}:{self.relay[1]} source={self.source} remote={','.join(sorted(self.remote))}"

    @classmethod
    def parse(cls, text: str) -> RelayRoute:
        """``relay=HOST:PORT source=HOST remote=HOST,HOST,...``; ValueError naming what is wrong."""
        fields: dict[str, str] = {}
        for part in text.split():
            key, sep, value = part.partition("=")
            if not sep or key not in ("relay", "source", "remote") or key in fields:
                raise ValueError(f"a route is 'relay=HOST:PORT source=HOST remote=HOST,...', got {text!r}")
            fields[key] = value
        missing = {"relay", "source", "remote"} - set(fields)
        if missing:
            raise ValueError(f"route {text!r} lacks {', '.join(sorted(missing))}")
        host, sep, port = fields["relay"].rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"the route's relay must be HOST:PORT, got {fields['relay']!r}")
        return cls.make((host, int(port)), fields["source"], [h for h in fields["remote"].split(",") if h])

    async def dial(self, loop: asyncio.AbstractEventLoop, protocol_factory: Callable[[], asyncio.Protocol],
                   host: str, port: int) -> tuple[asyncio.Transport, asyncio.Protocol]:
        """``loop.create_connection`` to ``host:port`` through the relay: the protocol is attached
        once the relay said ok, so it sees the destination's bytes only.  OSError (``RelayRefused``
        with the relay's reason) when the relay cannot be reached or refuses."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.bind((self.source, 0))
            await loop.sock_connect(sock, self.relay)
            await loop.sock_sendall(sock, relay_header(host, port))
            await _expect_ok(loop, sock, self.relay)
            return await loop.create_connection(protocol_factory, sock=sock)
        except BaseException:
            sock.close()
            raise


async def _expect_ok(loop: asyncio.AbstractEventLoop, sock: socket.socket, relay: tuple[str, int]) -> None:
    """Read the relay's answer, exactly: the destination's bytes may follow ``ok`` at once."""
    reply = b""
    while len(reply) < len(OK) and OK.startswith(reply):
        data = await loop.sock_recv(sock, len(OK) - len(reply))
        if not data:
            break
        reply += data
    if reply == OK:
        return
    while len(reply) < MAX_REPLY_BYTES and not reply.endswith(b"\n"):  # a refusal: its reason, then EOF
        data = await loop.sock_recv(sock, MAX_REPLY_BYTES - len(reply))
        if not data:
            break
        reply += data
    reason = reply.removeprefix(ERROR).strip().decode("utf-8", "replace") or "closed without an answer"
    raise RelayRefused(f"relay {relay[0]}:{relay[1]} refused: {reason}")
