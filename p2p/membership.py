"""Run membership (DeDLOC's authorization): the run's authority signs each member's certificate.

A certificate binds a PeerID to a run until an expiry time, optionally with roles.  Peers present
their certificate in the handshake and refuse anyone whose certificate does not check against the
run's name and the authority's public key; because the PeerID is the hash of a key the peer
proves it holds, a certificate cannot be lent or stolen.
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgpack

from .errors import NotAMember
from .identity import Identity, PeerID, verify

_CONTEXT = b"spotswarm/membership/v1\x00"  # signatures over certificates mean nothing elsewhere
MAX_CERTIFICATE_BYTES = 2048  # fits the pre-handshake header limit with room for the rest of HELLO
# The roles a run's authority writes into certificates.  A worker is one of the run's own instances
# (it trains, averages, serves experts and hands their state on); a volunteer trains and averages
# only; the supervisor runs the run.  Methods name the roles they are served to (P2P.register).
WORKER, VOLUNTEER, SUPERVISOR = "worker", "volunteer", "supervisor"
EXPERTS = "experts:"  # "experts:<uid prefix>": a standalone expert server's, for the experts under that prefix
SERVING_ROLES = frozenset({WORKER, SUPERVISOR, EXPERTS + "*"})  # who may serve experts and their state


def role_matches(held: str, wanted: str) -> bool:
    """Whether a certificate's role ``held`` is ``wanted``; a wanted role ending in ``*`` is a prefix."""
    return held.startswith(wanted[:-1]) if wanted.endswith("*") else held == wanted


def serves_experts(roles: Sequence[str], uid: str | None = None) -> bool:
    """Whether a certificate with ``roles`` may serve experts (``uid``: that one; an ``experts:<prefix>``
    role covers the uids under its prefix)."""
    if WORKER in roles or SUPERVISOR in roles:
        return True
    return any(r.startswith(EXPERTS) and (uid is None or uid.startswith(r[len(EXPERTS):])) for r in roles)
_KEYS = ("p", "r", "e", "a", "s", "o")


def _short(key: bytes) -> str:
    return key[:6].hex() + "…"


@dataclass(frozen=True)
class Certificate:
    """The authority's statement that ``peer_id`` is a member of ``run`` until ``expires``."""

    peer_id: PeerID
    run: str
    expires: float  # unix time (time.time())
    authority: bytes  # the authority's raw 32-byte Ed25519 public key
    signature: bytes  # over signed_bytes(): everything above and the roles
    roles: tuple[str, ...] = ()

    def signed_bytes(self) -> bytes:
        """The domain-separated encoding the authority signs (every field but the signature)."""
        body = [self.peer_id.digest, self.run, float(self.expires), self.authority, list(self.roles)]
        return _CONTEXT + msgpack.packb(body, use_bin_type=True)

    def to_bytes(self) -> bytes:
        return msgpack.packb({"p": self.peer_id.digest, "r": self.run, "e": float(self.expires),
                              "a": self.authority, "s": self.signature, "o": list(self.roles)},
                             use_bin_type=True)

    @classmethod
    def from_bytes(cls, raw: bytes) -> Certificate:
        """Parse a certificate; ValueError says what is malformed (the signature is not checked here)."""
        if not isinstance(raw, (bytes, bytearray)):
            raise ValueError(f"a certificate must be bytes, got {type(raw).__name__}")
        if len(raw) > MAX_CERTIFICATE_BYTES:
            raise ValueError(f"certificate of {len(raw)} bytes exceeds {MAX_CERTIFICATE_BYTES}")
        try:
            d = msgpack.unpackb(bytes(raw), raw=False, strict_map_key=True)
        except Exception as e:
            raise ValueError(f"certificate is not msgpack: {type(e).__name__}: {e}") from None
        if not isinstance(d, dict) or set(d) != set(_KEYS):
            raise ValueError(f"certificate must be a map with keys {_KEYS}")
        p, run, expires, authority, signature, roles = (d[k] for k in _KEYS)
        if not isinstance(p, bytes) or len(p) != 32:
            raise ValueError("certificate peer id must be 32 bytes")
        if not isinstance(run, str) or not run:
            raise ValueError("certificate run must be a non-empty string")
        if isinstance(expires, bool) or not isinstance(expires, (int, float)) or not math.isfinite(expires):
            raise ValueError(f"certificate expiry must be a finite number, got {expires!r:.40}")
        if not isinstance(authority, bytes) or len(authority) != 32:
            raise ValueError("certificate authority must be a 32-byte public key")
        if not isinstance(signature, bytes) or len(signature) != 64:
            raise ValueError("certificate signature must be 64 bytes")
        if not isinstance(roles, list) or not all(isinstance(r, str) for r in roles):
            raise ValueError("certificate roles must be a list of strings")
        return cls(PeerID(p), run, float(expires), authority, signature, tuple(roles))

    def to_token(self) -> str:
        return base64.urlsafe_b64encode(self.to_bytes()).decode().rstrip("=")

    @classmethod
    def from_token(cls, text: str) -> Certificate:
        if not isinstance(text, str):
            raise ValueError(f"a certificate token must be a string, got {type(text).__name__}")
        text = text.strip()
        try:
            raw = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"certificate token is not url-safe base64: {text!r:.40}") from None
        return cls.from_bytes(raw)

    def check(self, *, run: str, authority: bytes, peer_id: PeerID, now: float, skew: float = 60.0) -> None:
        """Raise NotAMember naming the first thing wrong with this certificate for ``peer_id``."""
        if self.authority != authority:
            raise NotAMember(f"certificate signed by another authority ({_short(self.authority)}, "
                             f"this run's is {_short(authority)})")
        if not verify(authority, self.signature, self.signed_bytes()):
            raise NotAMember("certificate has a bad signature (forged or tampered with)")
        if self.run != run:
            raise NotAMember(f"certificate is for run {self.run!r}, not {run!r}")
        if self.peer_id != peer_id:
            raise NotAMember(f"certificate was issued for peer {self.peer_id}, not {peer_id}")
        if now > self.expires + skew:
            raise NotAMember(f"certificate expired {now - self.expires:.0f} s ago")

    def expired(self, now: float, skew: float = 60.0) -> bool:
        return now > self.expires + skew


class Authority:
    """The run's authority key: signs members' certificates."""

    def __init__(self, identity: Identity, run: str) -> None:
        if not isinstance(run, str) or not run:
            raise ValueError("a run name must be a non-empty string")
        self.identity = identity
        self.run = run
        self.public_key: bytes = identity.public_key

    @classmethod
    def from_file(cls, path: str | os.PathLike, run: str, create: bool = True) -> Authority:
        """The authority key kept in a PEM file (created, mode 0600, if missing and ``create``)."""
        return cls(Identity.from_file(path, create=create), run)

    def issue(self, peer_id: PeerID, ttl: float, roles: Sequence[str] = (), now: float | None = None) -> Certificate:
        if not isinstance(peer_id, PeerID):
            raise TypeError(f"peer_id must be a PeerID, got {type(peer_id).__name__}")
        if not ttl > 0 or not math.isfinite(ttl):
            raise ValueError(f"ttl must be a positive number of seconds, got {ttl!r}")
        if isinstance(roles, str) or not all(isinstance(r, str) for r in roles):
            raise ValueError(f"roles must be a sequence of strings, got {roles!r:.80}")
        expires = (time.time() if now is None else now) + ttl
        unsigned = Certificate(peer_id, self.run, float(expires), self.public_key, b"", tuple(roles))
        cert = Certificate(peer_id, self.run, float(expires), self.public_key,
                           self.identity.sign(unsigned.signed_bytes()), tuple(roles))
        if len(cert.to_bytes()) > MAX_CERTIFICATE_BYTES:
            raise ValueError(f"certificate would exceed {MAX_CERTIFICATE_BYTES} bytes: fewer or shorter roles")
        return cert


class Membership:
    """What a node needs to take part in a run with membership on: the run, the authority's public
    key, and (for a member) its own certificate, which can be renewed while the node runs.

    ``clock`` is where "now" comes from (``time.time`` unless a test injects its own)."""

    def __init__(self, run: str, authority: bytes, certificate: Certificate | None = None,
                 skew: float = 60.0, clock: Callable[[], float] = time.time) -> None:
        if not isinstance(run, str) or not run:
            raise ValueError("a run name must be a non-empty string")
        if not isinstance(authority, bytes) or len(authority) != 32:
            raise ValueError("the authority must be a raw 32-byte Ed25519 public key")
        if certificate is not None and not isinstance(certificate, Certificate):
            raise TypeError(f"certificate must be a Certificate, got {type(certificate).__name__}")
        self.run = run
        self.authority = authority
        self.skew = skew
        self.clock = clock
        self._certificate = certificate

    @property
    def certificate(self) -> Certificate | None:
        return self._certificate

    @classmethod
    def from_token(cls, token: str, identity: Identity, run: str | None = None) -> Membership:
        """The membership a token (``Certificate.to_token``) gives ``identity``: a token that is not one,
        names another run, or was issued for another key is a ValueError saying which, here, rather
        than a refusal by every peer later."""
        cert = Certificate.from_token(token)
        if run is not None and cert.run != run:
            raise ValueError(f"the token is for run {cert.run!r}, not {run!r}")
        if cert.peer_id != identity.peer_id:
            raise ValueError(f"the token was issued for peer {cert.peer_id}, this peer is {identity.peer_id} "
                             "(use the identity file the token was issued for)")
        return cls(cert.run, cert.authority, cert)

    def adopt(self, certificate: Certificate, peer_id: PeerID) -> None:
        """Make ``certificate`` ours after checking it (ValueError if it would not be accepted)."""
        try:
            certificate.check(run=self.run, authority=self.authority, peer_id=peer_id, now=self.clock(),
                              skew=self.skew)
        except NotAMember as e:
            raise ValueError(f"certificate not valid for this node: {e}") from None
        self._certificate = certificate

    def check(self, peer_id: PeerID, raw: object, now: float | None = None) -> Certificate:
        """The certificate ``peer_id`` presented as ``raw`` bytes, if it makes it a member; else NotAMember."""
        if raw is None:
            raise NotAMember("no membership certificate presented")
        try:
            cert = Certificate.from_bytes(raw)  # type: ignore[arg-type]
        except ValueError as e:
            raise NotAMember(f"malformed certificate: {e}") from None
        cert.check(run=self.run, authority=self.authority, peer_id=peer_id,
                   now=self.clock() if now is None else now, skew=self.skew)
        return cert
