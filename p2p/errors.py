"""Typed errors of the RPC layer, so callers can tell a dead peer from a slow one from a bug."""

from __future__ import annotations


class P2PError(Exception):
    """Base class of every error raised by the p2p layer."""


class ProtocolError(P2PError):
    """The bytes on a connection broke the wire format or its limits; the connection is closed."""


class PeerUnreachable(P2PError):
    """The peer could not be reached, or the connection died before the call finished."""


class PeerGone(PeerUnreachable):
    """Nothing listens at the peer's address any more (connection refused): it is down, not slow, so
    waiting for it is pointless."""


class Retry(PeerUnreachable):
    """The peer announced it would not process this call (GOAWAY); safe to retry elsewhere."""


class PeerIDMismatch(PeerUnreachable):
    """The peer at an address proved a different identity than the caller expected."""


class NotAMember(PeerUnreachable):
    """The other side is not (or no longer) a member of the run, or refused us as one."""


class RPCTimeout(P2PError, TimeoutError):
    """The call's deadline passed before it finished; the remote handler was told to stop."""


class RemoteError(P2PError):
    """The remote handler raised; carries the remote exception's type name and message."""

    def __init__(self, type_name: str, message: str, method: str = "") -> None:
        self.type_name = type_name
        self.message = message
        self.method = method
        where = f" in {method}" if method else ""
        super().__init__(f"{type_name}{where}: {message}")


class ResourceExhausted(RemoteError):
    """The remote side refused the call because a limit (e.g. concurrent streams) was reached."""
