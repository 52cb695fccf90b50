"""p2p: peer identity and authenticated-ready RPC over asyncio TCP.

Everything above (DHT, averaging, experts) talks through :class:`P2P`: multiplexed unary and
streaming calls on one connection per peer pair, tensors as raw frames, hard limits on input.
"""

from .address import PeerAddress
from .errors import (
    P2PError,
    PeerIDMismatch,
    PeerUnreachable,
    ProtocolError,
    RemoteError,
    ResourceExhausted,
    RPCTimeout,
)
from .identity import Identity, PeerID
from .limits import Limits
from .node import P2P, AuthHook, Call, CallContext, CallKind, spawn_peers
from .wire import EncodeError

__all__ = [
    "P2P", "AuthHook", "Call", "CallContext", "CallKind", "EncodeError", "Identity", "Limits",
    "P2PError", "PeerAddress", "PeerID", "PeerIDMismatch", "PeerUnreachable", "ProtocolError",
    "RemoteError", "ResourceExhausted", "RPCTimeout", "spawn_peers",
]
