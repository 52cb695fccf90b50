"""Audits of reducers (``byzantine="verify"``): every member recomputes one chunk of every other
member's part and catches a reducer whose average is not what its inputs give.

Why: a reducer decides what its part becomes, and nothing in a round tells its senders whether the
average they got back is the average of what they sent.  BTARD-SGD (Gorbunov et al. 2022) checks a
few randomly chosen parts per round; here:

1. **Signed inputs.**  A sender signs, once per part, the BLAKE3 hash of every chunk it sends
   (``manifest_statement``: group, part and the digests, which come with the first chunk) and the
   reducer checks the signature and every chunk's hash on arrival (a chunk that does not match drops
   its sender), so a reducer holds its senders' word for every input.
2. **Commitments.**  With every averaged chunk the reducer sends what else went in: its own weight
   and the senders it had dropped by then (``Commitment``).
3. **Joint randomness.**  Once its round is over, each member draws a secret, publishes its hash
   (commit) and, once it holds everyone's hash, the secret (reveal).  The seed hashes every secret
   that matched its commit, so no member (a reducer least of all) knows before its averages are
   out which chunk of its part will be checked.
4. **Recomputation.**  From the seed, every member picks one chunk of every other part and asks its
   reducer for that chunk's inputs: each other sender's signed payload and its own values.  It
   checks the signatures and the commitment, runs the very reducer code on them (screen, clip,
   mean, codec) and compares the result with what it received.  A reducer that does not answer,
   presents an input its sender did not sign, or whose average is not the inputs' is caught: named
   in ``StepResult.excluded`` with the evidence, its averages never written over our values, and
   banned by the averager.  Every honest member checks the same chunks, so honest members reach the same verdict.

A reducer that changes a fraction p of its part's chunks is caught in a round with probability at
least p (one chunk drawn per part); one that changes them all, in the first round.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

import blake3
import torch

from p2p import P2PError, PeerID
from p2p.identity import verify

logger = logging.getLogger(__name__)

# Chunks of a verified group are at most this long: an audit moves one chunk per sender and part
AUDIT_CHUNK = 1 << 18
# An average may differ from its recomputation by rounding (another torch build), never by more
RECOMPUTE_TOLERANCE = 1e-4
SECRET_BYTES = 16
DIGEST_BYTES = 32  # BLAKE3's


def payload_digest(payload: dict) -> bytes:
    """BLAKE3 of a chunk payload's codec, scalars and tensor bytes, in key order (extras ignored).
    Every chunk of a verified round is hashed twice (by its sender and its reducer): BLAKE3 does it at
    4 GB/s a core, SHA-256 at half that."""
    h = blake3.blake3(str(payload.get("c")).encode())
    for key in ("d", "lo", "s"):
        value = payload.get(key)
        if isinstance(value, torch.Tensor):
            h.update(key.encode() + str(value.dtype).encode() + str(tuple(value.shape)).encode())
            if value.numel():
                h.update(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        elif value is not None:
            h.update(key.encode() + repr(value).encode())
    return h.digest()


def manifest_statement(group_id: bytes, part: int, digests: list[bytes]) -> bytes:
    """What a sender signs, once per part: the digest of every chunk it sends, in order.  One signature
    a part, not one a chunk: an Ed25519 signature and its check cost as much as hashing 100K floats."""
    return (b"spotswarm-avg-inputs" + group_id + part.to_bytes(4, "big") + len(digests).to_bytes(4, "big")
            + b"".join(digests))


def check_manifest(group_id: bytes, part: int, chunks: int, digests: Any, signature: Any, public_key: Any,
                   sender: PeerID) -> str | None:
    """Why a sender's signed list of chunk digests is refused, or None if it holds."""
    if not isinstance(public_key, bytes) or PeerID.from_public_key(public_key) != sender:
        return "its public key is missing or not its peer id's"
    if not isinstance(signature, bytes) or not isinstance(digests, list):
        return "its chunks came without their signed digests"
    if len(digests) != chunks or not all(isinstance(d, bytes) and len(d) == DIGEST_BYTES for d in digests):
        return f"its signed digests are not {chunks} digests of {DIGEST_BYTES} bytes"
    if not verify(public_key, signature, manifest_statement(group_id, part, digests)):
        return "the signature on its chunks' digests does not verify"
    return None


def check_input(digests: list[bytes], chunk: int, payload: dict) -> str | None:
    """Why a chunk is not the one its sender signed for, or None."""
    if payload_digest(payload) != digests[chunk]:
        return f"chunk {chunk} is not the chunk its sender signed"
    return None


@dataclass
class Commitment:
    """What a reducer says went into an averaged chunk besides its senders' chunks: its own weight and
    whom it dropped.  Its own values need no commitment: whatever values it shows, the audit reruns
    CenteredClip with them as one input among the part's, which bounds what any values can do; a
    reducer that picked them after the seed could as well have picked them before."""

    own_weight: float
    failed: list[int]

    def to_wire(self) -> list:
        return [self.own_weight, self.failed]

    @classmethod
    def from_wire(cls, raw: Any) -> Commitment | None:
        if not isinstance(raw, list) or len(raw) != 2:
            return None
        weight, failed = raw
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) \
                or not isinstance(failed, list) or not all(type(f) is int for f in failed):
            return None
        return cls(float(weight), list(failed))


@dataclass
class Secret:
    """This member's share of a round's randomness."""

    value: bytes = field(default_factory=lambda: os.urandom(SECRET_BYTES))
    committed: asyncio.Event = field(default_factory=asyncio.Event)  # we hold the others' commits: reveal

    @property
    def commit(self) -> bytes:
        return hashlib.sha256(b"spotswarm-audit-commit" + self.value).digest()


def seed_of(group_id: bytes, secrets: dict[int, bytes]) -> bytes:
    h = hashlib.sha256(b"spotswarm-audit-seed" + group_id)
    for index in sorted(secrets):
        h.update(index.to_bytes(4, "big") + secrets[index])
    return h.digest()


def chosen_chunk(seed: bytes, part: int, chunks: int) -> int:
    """The chunk of ``part`` that every member audits, from the round's seed."""
    draw = hashlib.sha256(seed + part.to_bytes(4, "big")).digest()
    return int.from_bytes(draw[:8], "big") % chunks


def close_enough(recomputed: torch.Tensor, received: torch.Tensor) -> bool:
    """Whether an average matches its recomputation up to rounding (an L2 distance relative to its size)."""
    if torch.equal(recomputed, received):
        return True
    scale = float(received.double().norm())
    gap = float((recomputed.double() - received.double()).norm())
    return math.isfinite(gap) and gap <= RECOMPUTE_TOLERANCE * max(scale, 1e-30)


async def fetch_all(p2p: Any, method: str, addresses: dict[int, str], request: dict,
                    timeout: float) -> dict[int, Any]:
    """Ask every member at once; members that fail or time out are left out (logged)."""
    async def ask(index: int, address: str) -> Any:
        try:
            return await p2p.call(address, method, request, timeout=timeout)
        except (P2PError, ValueError, OSError) as e:
            logger.info("audit %s: member %d did not answer: %s", request.get("q"), index, e)
            return None

    answers = await asyncio.gather(*(ask(i, a) for i, a in addresses.items()))
    return {i: a for i, a in zip(addresses, answers, strict=True) if a is not None}
