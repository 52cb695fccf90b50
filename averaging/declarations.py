"""Signed join declarations: what a member says about itself when it joins a group (its weight, its
bandwidth, its address), signed with its own key, so that no leader can change it.

Why: a group's leader assembles the group description every member acts on.  Trusting its word
let a leader write 2e6 as each follower's weight (every member then dropped the others) or hand
itself the whole vector.  Where a group does not trust its members (``byzantine`` clip or
verify), each follower signs its declaration, the leader passes the signatures on, and every
member checks them and recomputes the part sizes from the signed bandwidths by the leader's own
rule; a group description that does not match is refused and its leader banned.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import msgpack

from p2p import PeerID
from p2p.identity import Identity, verify

from .load_balancing import claims_within_reason, load_balanced_parts

_CONTEXT = b"spotswarm-join"
MAX_AGE_S = 120.0  # a declaration older than this (by its signer's clock) is a replay
_MAX_DECLARATION = 1024  # bytes of a packed declaration


@dataclass(frozen=True)
class Declaration:
    """One member's signed word about itself for one join."""

    raw: bytes  # msgpack [group key, weight, bandwidth, address, time, nonce]
    signature: bytes
    public_key: bytes

    @classmethod
    def sign(cls, identity: Identity, group_key: str, weight: float, bandwidth: float,
             address: str | None) -> Declaration:
        raw = msgpack.packb([group_key, float(weight), float(bandwidth), address or None, time.time(),
                             os.urandom(8)])
        return cls(raw, identity.sign(_CONTEXT + raw), identity.public_key)

    def to_wire(self) -> list:
        return [self.raw, self.signature, self.public_key]

    @classmethod
    def from_wire(cls, value: Any) -> Declaration | None:
        if not isinstance(value, list) or len(value) != 3 or not all(isinstance(v, bytes) for v in value) \
                or len(value[0]) > _MAX_DECLARATION:
            return None
        return cls(*value)

    def fields(self, signer: PeerID) -> tuple[str, float, float, str | None, float, bytes]:
        """The declaration's fields, once its signature and its signer hold; ValueError says what does not."""
        if PeerID.from_public_key(self.public_key) != signer:
            raise ValueError("it is signed with another peer's key")
        if not verify(self.public_key, self.signature, _CONTEXT + self.raw):
            raise ValueError("its signature does not verify")
        try:
            key, weight, bandwidth, address, at, nonce = msgpack.unpackb(self.raw)
        except (ValueError, TypeError, msgpack.UnpackException):
            raise ValueError("it does not parse") from None
        if not isinstance(key, str) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                               for v in (weight, bandwidth, at)) \
                or not (address is None or isinstance(address, str)) or not isinstance(nonce, bytes):
            raise ValueError("its fields are malformed")
        return key, float(weight), float(bandwidth), address, float(at), nonce


def check_group(declarations: list[Declaration | None], peer_ids: list[PeerID], group_key: str,
                weights: list[float], addresses: list[str | None], part_sizes: list[int], numel: int,
                bandwidth_of: Any, now: float | None = None) -> str | None:
    """Why a group description does not match its members' signed declarations, or None if it does.
    ``bandwidth_of``: how the leader reads a declared bandwidth (``matchmaking._declared_bandwidth``)."""
    now = time.time() if now is None else now
    if len(declarations) != len(peer_ids):
        return "it does not carry every member's signed declaration"
    bandwidths = []
    for i, (declaration, peer) in enumerate(zip(declarations, peer_ids, strict=True)):
        if declaration is None:
            return f"member {i}'s declaration is missing"
        try:
            key, weight, bandwidth, address, at, _ = declaration.fields(peer)
        except ValueError as e:
            return f"member {i}'s declaration: {e}"
        if key != group_key:
            return f"member {i} declared itself for group {key[:40]!r}"
        if abs(now - at) > MAX_AGE_S:
            return f"member {i}'s declaration is {now - at:.0f} s old"
        if not (weight == weights[i] or (math.isnan(weight) and math.isnan(weights[i]))):
            return f"member {i} signed weight {weight:g}, the group says {weights[i]:g}"
        if address is not None and addresses[i] is not None and address != addresses[i]:
            return f"member {i} signed address {address[:60]}, the group says {str(addresses[i])[:60]}"
        bandwidths.append(bandwidth_of(bandwidth) if addresses[i] is not None else 0.0)
    expected = load_balanced_parts(numel, claims_within_reason(bandwidths), bounded=True)
    if expected != list(part_sizes):
        return f"part sizes {str(list(part_sizes))[:80]} are not {str(expected)[:80]}, as the signed bandwidths give"
    return None
