"""Peer identity: an Ed25519 key pair, and a PeerID that is the hash of its public key.

A PeerID cannot be claimed without the private key: every connection starts with a handshake in
which each side signs the other's nonce (see ``connection.py``).
"""

from __future__ import annotations

import base64
import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

_PREFIX = "sw"  # printed ids start with this, so they are easy to tell from other strings


@dataclass(frozen=True, order=True)
class PeerID:
    """32-byte SHA-256 of a peer's raw public key; prints as ``sw`` + base32."""

    digest: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.digest, bytes) or len(self.digest) != 32:
            raise ValueError("PeerID digest must be 32 bytes")

    @classmethod
    def from_public_key(cls, public_key: bytes) -> PeerID:
        return cls(hashlib.sha256(public_key).digest())

    @classmethod
    def from_string(cls, text: str) -> PeerID:
        if not isinstance(text, str) or not text.startswith(_PREFIX):
            raise ValueError(f"not a PeerID (must start with {_PREFIX!r}): {text!r:.80}")
        body = text[len(_PREFIX):].upper()
        try:
            digest = base64.b32decode(body + "=" * (-len(body) % 8))
        except ValueError:
            raise ValueError(f"not a PeerID (bad base32): {text!r:.80}") from None
        return cls(digest)

    def to_string(self) -> str:
        return _PREFIX + base64.b32encode(self.digest).decode().rstrip("=").lower()

    def __str__(self) -> str:
        return self.to_string()

    def __repr__(self) -> str:
        return f"PeerID({self.to_string()[:14]}…)"


# A peer meets the same signed records again and again (every lookup of the swarm's progress
# returns each peer's latest record from several nodes), and a verification costs about a hundred
# times a hash: signatures that verified are remembered, by a digest of the data.
_VERIFIED_MAX = 4096
_verified: dict[tuple[bytes, bytes, bytes], None] = {}
_verified_lock = threading.Lock()


def verify(public_key: bytes, signature: bytes, data: bytes) -> bool:
    """True if ``signature`` is ``public_key``'s Ed25519 signature of ``data``."""
    seen = (public_key, signature, hashlib.blake2b(data).digest()) \
        if type(public_key) is bytes and type(signature) is bytes and type(data) is bytes else None
    if seen in _verified:
        return True
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except (InvalidSignature, ValueError, TypeError):
        return False  # not remembered: junk signatures cannot push out the ones that verified
    if seen is None:
        return True
    with _verified_lock:
        if len(_verified) >= _VERIFIED_MAX:
            del _verified[next(iter(_verified))]  # the oldest
        _verified[seen] = None
    return True


class Identity:
    """A peer's private key; the PeerID follows from it."""

    def __init__(self, private_key: Ed25519PrivateKey | None = None) -> None:
        self._key = private_key or Ed25519PrivateKey.generate()
        self.public_key: bytes = self._key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id = PeerID.from_public_key(self.public_key)

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    @classmethod
    def from_file(cls, path: str | os.PathLike, create: bool = True) -> Identity:
        """Load a PEM private key, creating it (mode 0600) if missing, so a restarted peer keeps its id."""
        path = Path(path)
        if path.exists():
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            if not isinstance(key, Ed25519PrivateKey):
                raise ValueError(f"{path} does not hold an Ed25519 private key")
            return cls(key)
        if not create:
            raise FileNotFoundError(f"identity file {path} does not exist")
        identity = cls()
        pem = identity._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        return identity
