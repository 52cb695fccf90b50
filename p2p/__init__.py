"""p2p: peer identity and authenticated-ready RPC over asyncio TCP.

Everything above (DHT, averaging, experts) talks through :class:`P2P`: multiplexed unary and
streaming calls on one connection per peer pair, tensors as raw frames, hard limits on input,
and optional run membership (certificates from the run's authority, checked at the handshake).
"""

from .address import PeerAddress
from .errors import (
    NotAMember,
    P2PError,
    PeerGone,
    PeerIDMismatch,
    PeerUnreachable,
    ProtocolError,
    RemoteError,
    ResourceExhausted,
    RPCTimeout,
)
from .identity import Identity, PeerID
from .limits import Limits
from .membership import Authority, Certificate, Membership
from .node import P2P, AuthHook, CallContext, CallKind, spawn_peers
from .stream import Call
from .wire import EncodeError

__all__ = [
    "P2P", "AuthHook", "Authority", "Call", "CallContext", "CallKind", "Certificate", "EncodeError", "Identity",
    "Limits", "Membership", "NotAMember", "P2PError", "PeerAddress", "PeerGone", "PeerID",
    "PeerIDMismatch",
    "PeerUnreachable", "ProtocolError", "RemoteError", "ResourceExhausted", "RPCTimeout", "spawn_peers",
]
