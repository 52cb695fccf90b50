"""The handshake and run membership of one connection, as a state machine with no sockets in it.

Each side sends HELLO (its key, a fresh nonce and, with membership on, its certificate) as soon as
the connection is up, answers the other's HELLO with a PROOF (a signature over the other's nonce),
and is ready once the other's PROOF verifies.  With membership on, a side checks the other's
certificate when its HELLO arrives and answers with ERROR on stream 0 (``NotAMember``) instead of
PROOF if it refuses it, so a ready connection means both sides accepted each other.  After the
handshake the same object judges RENEW messages and whether the remote's certificate lapsed.

``Handshake`` consumes decoded headers and returns what the connection must do: send a message,
become ready, or close in one of three ways.  It raises :class:`ProtocolError` for input that
closes the connection at once.  Timers, sockets and logging stay with the connection
(``connection.py``), so every path here can be driven directly (``tests/p2p/test_handshake.py``).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import NotAMember, P2PError, PeerIDMismatch, PeerUnreachable, ProtocolError
from .headers import (
    CERTIFICATE,
    CLIENT_MODE,
    ERROR,
    ERROR_MESSAGE,
    ERROR_TYPE,
    HELLO,
    KIND,
    LISTEN,
    NONCE,
    PROOF,
    PROTOCOL_VERSION,
    PUBLIC_KEY,
    RENEW,
    SIGNATURE,
    STREAM,
    VERSION,
    error_header,
)
from .identity import Identity, PeerID, verify

if TYPE_CHECKING:
    from .membership import Certificate, Membership

HANDSHAKE_CONTEXT = b"spotswarm/handshake/v1"  # what a PROOF signs, before the nonce and the key
NONCE_BYTES = 16
PUBLIC_KEY_BYTES = 32
MAX_REFUSAL_CHARS = 1000  # of the reason a remote gives for refusing us


class State(enum.Enum):
    AWAITING_HELLO = "awaiting HELLO"
    AWAITING_PROOF = "awaiting PROOF"  # we accepted the remote's HELLO and sent our PROOF
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class Reply:
    """Send ``message`` (our PROOF) and wait for the remote's PROOF."""

    message: dict


@dataclass(frozen=True)
class Ready:
    """The remote proved its key (and, with membership on, was accepted): calls may start."""


@dataclass(frozen=True)
class Failed:
    """The remote is not who it must be: drop the connection at once, failing the handshake with ``error``."""

    error: PeerIDMismatch


@dataclass(frozen=True)
class Refuse:
    """We refuse the remote as a member: send ``message`` (ERROR on stream 0) so it learns ``reason``,
    then close; whoever waits on the handshake gets ``error``."""

    reason: str
    message: dict
    error: NotAMember


@dataclass(frozen=True)
class Refused:
    """The remote refused us (ERROR on stream 0, ``type_name`` and its reason): close, failing the
    handshake with ``error``."""

    reason: str
    type_name: str
    error: P2PError


Outcome = Reply | Ready | Failed | Refuse | Refused


class Handshake:
    """One side's view of the handshake with one remote, and of the remote's membership after it.

    ``expected_peer``: the PeerID the dialer was told to reach (a HELLO with another key fails the
    handshake); ``membership``: the run's membership (None: open mode, nothing sent or checked);
    ``nonce``: this connection's nonce (random unless a test fixes it).
    """

    def __init__(self, identity: Identity, *, membership: Membership | None = None,
                 expected_peer: PeerID | None = None, nonce: bytes | None = None) -> None:
        self.identity = identity
        self.membership = membership
        self.expected_peer = expected_peer
        self.nonce = os.urandom(NONCE_BYTES) if nonce is None else nonce
        self.state = State.AWAITING_HELLO
        self.remote_addr: Any = None  # where the remote is, as the transport says: for messages only
        self.remote_public_key = b""
        self.remote_nonce = b""
        self.remote_id: PeerID | None = None
        self.remote_client_mode = False
        self.remote_listen: str | None = None
        self.remote_certificate: Certificate | None = None  # with membership on: what the remote proved
        self.sent_certificate: bytes | None = None  # ours, as last presented to the remote

    @property
    def who(self) -> Any:
        """The remote as messages name it: its PeerID once HELLO named one, else its address."""
        return self.remote_id or self.remote_addr

    # ---- the handshake ---------------------------------------------------------------------
    def start(self, remote_addr: Any, client_mode: bool, listen: str | None, certificate: bytes | None) -> dict:
        """The connection is up: our HELLO, to send at once.  ``certificate`` is ours (membership on)."""
        self.remote_addr = remote_addr
        hello = {KIND: HELLO, STREAM: 0, PROTOCOL_VERSION: VERSION, PUBLIC_KEY: self.identity.public_key,
                 NONCE: self.nonce, CLIENT_MODE: int(client_mode), LISTEN: listen}
        if self.membership is not None:
            hello[CERTIFICATE] = self.sent_certificate = certificate
        return hello

    def receive(self, header: dict) -> Outcome:
        """Judge a message that arrived before the connection was ready, or a HELLO or PROOF at any
        time; ``header`` has integer stream id and kind.  ProtocolError: close the connection."""
        kind = header.get(KIND)
        if self.state is State.READY and (kind == HELLO or kind == PROOF):
            raise ProtocolError("repeated handshake message")
        if kind == HELLO:
            return self._on_hello(header)
        if kind == PROOF:
            return self._on_proof(header)
        if kind == ERROR and header.get(STREAM) == 0:
            self.state = State.FAILED
            return self.refusal(header)
        raise ProtocolError(f"message kind {kind} before the handshake finished")

    def _on_hello(self, header: dict) -> Outcome:
        pk, nonce = header.get(PUBLIC_KEY), header.get(NONCE)
        if self.state is not State.AWAITING_HELLO or not _is_bin(pk, PUBLIC_KEY_BYTES) \
                or not _is_bin(nonce, NONCE_BYTES) or header.get(PROTOCOL_VERSION) != VERSION:
            raise ProtocolError("bad or repeated HELLO")
        assert isinstance(pk, bytes) and isinstance(nonce, bytes)
        self.remote_public_key, self.remote_nonce = pk, nonce
        self.remote_id = remote_id = PeerID.from_public_key(pk)
        self.remote_client_mode = bool(header.get(CLIENT_MODE))
        listen = header.get(LISTEN)
        self.remote_listen = listen if isinstance(listen, str) else None
        if self.expected_peer is not None and remote_id != self.expected_peer:
            self.state = State.FAILED
            return Failed(PeerIDMismatch(f"{self.remote_addr} is {remote_id}, expected {self.expected_peer}"))
        if self.membership is not None:
            # Checked against the key HELLO names; the PROOF that follows must then prove that key.
            try:
                self.remote_certificate = self.membership.check(remote_id, header.get(CERTIFICATE))
            except NotAMember as e:
                self.state = State.FAILED
                return self.refuse(str(e))
        self.state = State.AWAITING_PROOF
        me = self.identity
        return Reply({KIND: PROOF, STREAM: 0, SIGNATURE: me.sign(HANDSHAKE_CONTEXT + nonce + me.public_key)})

    def _on_proof(self, header: dict) -> Outcome:
        sig = header.get(SIGNATURE)
        if self.state is not State.AWAITING_PROOF or not isinstance(sig, bytes):
            raise ProtocolError("unexpected PROOF")
        pk = self.remote_public_key
        if not verify(pk, sig, HANDSHAKE_CONTEXT + self.nonce + pk):
            self.state = State.FAILED
            return Failed(PeerIDMismatch(f"{self.remote_addr} failed to prove its identity"))
        self.state = State.READY
        return Ready()

    # ---- membership ------------------------------------------------------------------------
    def refuse(self, reason: str) -> Refuse:
        """How to tell the remote it is not a member, and why."""
        error = NotAMember(f"{self.who} is not a member: {reason}")
        return Refuse(reason, error_header(0, "NotAMember", reason), error)

    def refusal(self, header: dict) -> Refused:
        """The remote's ERROR on stream 0: it refuses us, with the reason it gives."""
        type_name = str(header.get(ERROR_TYPE, ""))
        message = str(header.get(ERROR_MESSAGE, ""))[:MAX_REFUSAL_CHARS]
        reason = f"refused by {self.who}: {message}"
        error = NotAMember(reason) if type_name == "NotAMember" else PeerUnreachable(f"{reason} ({type_name})")
        return Refused(reason, type_name, error)

    def renew(self, header: dict) -> Refuse | None:
        """A RENEW from the remote: its new certificate is checked like a HELLO's (None: accepted,
        or open mode, which ignores RENEW)."""
        if self.membership is None:
            return None
        assert self.remote_id is not None
        try:
            self.remote_certificate = self.membership.check(self.remote_id, header.get(CERTIFICATE))
        except NotAMember as e:
            return self.refuse(f"renewed certificate refused: {e}")
        return None

    def renewal(self, certificate: bytes) -> dict:
        """The RENEW that presents our renewed ``certificate`` to the remote."""
        self.sent_certificate = certificate
        return {KIND: RENEW, STREAM: 0, CERTIFICATE: certificate}

    def lapsed(self) -> str | None:
        """Why the remote's certificate no longer makes it a member, or None while it does."""
        cert, membership = self.remote_certificate, self.membership
        if cert is None or membership is None:
            return None
        now = membership.clock()
        if not cert.expired(now, membership.skew):
            return None
        return f"certificate of {self.remote_id} expired {now - cert.expires:.0f} s ago"


def _is_bin(value: object, size: int) -> bool:
    return isinstance(value, bytes) and len(value) == size
