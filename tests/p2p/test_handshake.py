"""The handshake state machine driven directly, with no sockets: two sides trade HELLO and PROOF,
and every way the handshake or run membership refuses a remote ends in its own exact outcome."""

from __future__ import annotations

import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from p2p import Authority, Certificate, Identity, Limits, Membership, NotAMember, PeerUnreachable, ProtocolError
from p2p.errors import PeerIDMismatch
from p2p.handshake import HANDSHAKE_CONTEXT, Failed, Handshake, Ready, Refuse, Refused, Reply, State
from p2p.headers import DATA, ERROR, OPEN, PROOF, RENEW
from p2p.wire import Encoder

RUN = "run-a"
ADDR_A, ADDR_B = ("10.0.0.1", 4001), ("10.0.0.2", 4002)


class Clock:
    """Fake time shared by both sides: expiry without sleeping."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def fixed_identity(seed: int) -> Identity:
    return Identity(Ed25519PrivateKey.from_private_bytes(bytes(range(seed, seed + 32))))


def started(identity: Identity, remote_addr, membership: Membership | None = None, certificate: bytes | None = None,
            expected=None, nonce: bytes | None = None, client_mode: bool = False) -> tuple[Handshake, dict]:
    hs = Handshake(identity, membership=membership, expected_peer=expected, nonce=nonce)
    hello = hs.start(remote_addr, client_mode, None if client_mode else "127.0.0.1:4000", certificate)
    return hs, hello


def proof_for(hs: Handshake, their_hello: dict) -> dict:
    """``hs`` accepts ``their_hello``; returns the PROOF it answers with."""
    outcome = hs.receive(their_hello)
    assert isinstance(outcome, Reply), outcome
    return outcome.message


def wire(header: dict) -> str:
    return b"".join(Encoder(Limits()).encode(header)).hex()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def authority() -> Authority:
    return Authority(Identity(), RUN)


def membership_of(authority: Authority, identity: Identity, clock: Clock, ttl: float = 3600.0,
                  skew: float = 60.0) -> tuple[Membership, bytes]:
    cert = authority.issue(identity.peer_id, ttl, ["worker"], now=clock())
    return Membership(RUN, authority.public_key, cert, skew, clock), cert.to_bytes()


# ---- success -------------------------------------------------------------------------------------
def test_both_sides_prove_their_keys_and_become_ready():
    a, b = Identity(), Identity()
    hs_a, hello_a = started(a, ADDR_B, client_mode=True)
    hs_b, hello_b = started(b, ADDR_A, expected=None)
    proof_a, proof_b = proof_for(hs_a, hello_b), proof_for(hs_b, hello_a)
    assert hs_a.state is hs_b.state is State.AWAITING_PROOF
    assert hs_a.receive(proof_b) == Ready() and hs_b.receive(proof_a) == Ready()
    assert hs_a.state is hs_b.state is State.READY
    assert (hs_a.remote_id, hs_b.remote_id) == (b.peer_id, a.peer_id)
    assert (hs_a.remote_client_mode, hs_b.remote_client_mode) == (False, True)
    assert (hs_a.remote_listen, hs_b.remote_listen) == ("127.0.0.1:4000", None)
    assert hs_a.remote_certificate is None and hs_a.lapsed() is None  # open mode: nothing checked


def test_a_dialer_that_expects_the_peer_it_meets_becomes_ready():
    a, b = Identity(), Identity()
    hs_a, hello_a = started(a, ADDR_B, expected=b.peer_id)
    hs_b, hello_b = started(b, ADDR_A)
    proof_a, proof_b = proof_for(hs_a, hello_b), proof_for(hs_b, hello_a)
    assert hs_a.receive(proof_b) == Ready() and hs_b.receive(proof_a) == Ready()


def test_members_accept_each_other_and_know_each_others_certificates(authority, clock):
    a, b = Identity(), Identity()
    (ma, ca), (mb, cb) = membership_of(authority, a, clock), membership_of(authority, b, clock)
    hs_a, hello_a = started(a, ADDR_B, ma, ca)
    hs_b, hello_b = started(b, ADDR_A, mb, cb)
    assert hello_a["m"] == ca and hs_a.sent_certificate == ca
    proof_a, proof_b = proof_for(hs_a, hello_b), proof_for(hs_b, hello_a)
    assert hs_a.receive(proof_b) == Ready() and hs_b.receive(proof_a) == Ready()
    assert hs_a.remote_certificate == Certificate.from_bytes(cb)
    assert hs_b.remote_certificate.roles == ("worker",)


def test_the_messages_are_the_bytes_the_protocol_has_always_sent():
    a = fixed_identity(0)
    hs, hello = started(a, ADDR_B, nonce=bytes(range(16)))
    assert list(hello) == ["t", "s", "v", "pk", "n", "c", "l"]
    assert wire(hello) == (
        "570000000000000087a17401a17300a17601a2706bc42003a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664"
        "125531b8a16ec410000102030405060708090a0b0c0d0e0fa16300a16cae3132372e302e302e313a34303030")
    other = fixed_identity(32)
    _, their_hello = started(other, ADDR_A, nonce=bytes(range(16, 32)))
    assert wire(proof_for(hs, their_hello)) == (
        "4d0000000000000083a17402a17300a3736967c440bd7ca6013cd5e141dfb4cc60ac0bc003808e843d7493a6608138d95db2a238"
        "b3008947b080e358a6fef31b67246fbef0e096c9c38b32918abaec1a917162640e")
    assert wire(hs.renewal(b"cert")) == "0f0000000000000083a17409a17300a16dc40463657274"


def test_a_members_hello_carries_its_certificate_last(authority, clock):
    a = fixed_identity(0)
    membership, _ = membership_of(authority, a, clock)
    _, hello = started(a, ADDR_B, membership, b"cert", nonce=bytes(range(16)), client_mode=True)
    assert wire(hello) == (
        "510000000000000088a17401a17300a17601a2706bc42003a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664"
        "125531b8a16ec410000102030405060708090a0b0c0d0e0fa16301a16cc0a16dc40463657274")


# ---- malformed or out-of-order messages ----------------------------------------------------------
@pytest.mark.parametrize("change", [
    {"pk": b"k" * 31}, {"pk": "k" * 32}, {"pk": None}, {"n": b"n" * 15}, {"n": "n" * 16}, {"v": 2}, {"v": None},
])
def test_a_malformed_hello_closes_the_connection(change):
    hs, _ = started(Identity(), ADDR_B)
    _, hello = started(Identity(), ADDR_A)
    with pytest.raises(ProtocolError, match=r"^bad or repeated HELLO$"):
        hs.receive({**hello, **change})


def test_a_second_hello_closes_the_connection():
    hs, _ = started(Identity(), ADDR_B)
    _, hello = started(Identity(), ADDR_A)
    proof_for(hs, hello)
    with pytest.raises(ProtocolError, match=r"^bad or repeated HELLO$"):
        hs.receive(hello)


def test_a_proof_before_hello_or_without_a_binary_signature_closes_the_connection():
    hs, _ = started(Identity(), ADDR_B)
    with pytest.raises(ProtocolError, match=r"^unexpected PROOF$"):
        hs.receive({"t": PROOF, "s": 0, "sig": b"s" * 64})
    _, hello = started(Identity(), ADDR_A)
    proof_for(hs, hello)
    with pytest.raises(ProtocolError, match=r"^unexpected PROOF$"):
        hs.receive({"t": PROOF, "s": 0, "sig": "s" * 64})


@pytest.mark.parametrize("header", [
    {"t": OPEN, "s": 1, "m": "echo"}, {"t": DATA, "s": 1, "e": 1, "p": None}, {"t": ERROR, "s": 1, "x": "E", "msg": ""},
])
def test_any_other_message_before_the_handshake_closes_the_connection(header):
    hs, _ = started(Identity(), ADDR_B)
    with pytest.raises(ProtocolError, match=rf"^message kind {header['t']} before the handshake finished$"):
        hs.receive(header)


def test_hello_or_proof_after_the_handshake_closes_the_connection():
    a, b = Identity(), Identity()
    hs_a, hello_a = started(a, ADDR_B)
    hs_b, hello_b = started(b, ADDR_A)
    proof_for(hs_a, hello_b)
    proof_b = proof_for(hs_b, hello_a)
    assert hs_a.receive(proof_b) == Ready()
    for again in (hello_b, proof_b):
        with pytest.raises(ProtocolError, match=r"^repeated handshake message$"):
            hs_a.receive(again)


# ---- identity ------------------------------------------------------------------------------------
def test_a_dialer_meeting_another_key_than_it_expects_fails_without_a_proof():
    expected, impostor = Identity(), Identity()
    hs, _ = started(Identity(), ADDR_B, expected=expected.peer_id)
    _, hello = started(impostor, ADDR_A)
    outcome = hs.receive(hello)
    assert isinstance(outcome, Failed) and type(outcome.error) is PeerIDMismatch
    assert str(outcome.error) == f"{ADDR_B} is {impostor.peer_id}, expected {expected.peer_id}"
    assert hs.state is State.FAILED and hs.remote_id == impostor.peer_id


@pytest.mark.parametrize("forge", ["another key", "another nonce", "garbage"])
def test_a_proof_that_does_not_verify_fails_the_handshake(forge):
    a, b = Identity(), Identity()
    hs_a, _ = started(a, ADDR_B)
    _, hello_b = started(b, ADDR_A)
    proof_for(hs_a, hello_b)
    signed = {"another key": Identity().sign(HANDSHAKE_CONTEXT + hs_a.nonce + b.public_key),
              "another nonce": b.sign(HANDSHAKE_CONTEXT + bytes(16) + b.public_key),  # a replayed PROOF
              "garbage": b"x" * 64}[forge]
    outcome = hs_a.receive({"t": PROOF, "s": 0, "sig": signed})
    assert isinstance(outcome, Failed) and type(outcome.error) is PeerIDMismatch
    assert str(outcome.error) == f"{ADDR_B} failed to prove its identity"
    assert hs_a.state is State.FAILED


# ---- membership: we refuse the remote ------------------------------------------------------------
def refusal_of(hs: Handshake, hello: dict, reason: str) -> Refuse:
    """``hs`` refuses ``hello``'s sender with exactly ``reason``, sending ERROR on stream 0 instead of PROOF."""
    outcome = hs.receive(hello)
    assert isinstance(outcome, Refuse), outcome
    assert outcome.reason == reason
    assert outcome.message == {"s": 0, "t": ERROR, "x": "NotAMember", "msg": reason}
    assert type(outcome.error) is NotAMember
    assert str(outcome.error) == f"{hs.remote_id} is not a member: {reason}"
    assert hs.state is State.FAILED
    return outcome


@pytest.fixture
def gate(authority, clock) -> Handshake:
    """A member's handshake, waiting for the remote's HELLO."""
    me = Identity()
    membership, cert = membership_of(authority, me, clock, skew=5)
    return started(me, ADDR_B, membership, cert)[0]


def test_a_hello_without_a_certificate_is_refused(gate):
    _, hello = started(Identity(), ADDR_A)  # open mode: no "m"
    refusal = refusal_of(gate, hello, "no membership certificate presented")
    assert wire(refusal.message) == ("3d0000000000000084a17300a17406a178aa4e6f74414d656d626572a36d7367d9236e6f206d656d"
                                     "626572736869702063657274696669636174652070726573656e746564")


def test_a_malformed_certificate_is_refused(gate):
    _, hello = started(Identity(), ADDR_A)
    refusal_of(gate, {**hello, "m": b"\x93\x01\x02\x03"}, "malformed certificate: certificate must be a map with keys "
                                                          "('p', 'r', 'e', 'a', 's', 'o')")


def test_a_certificate_of_another_run_is_refused(gate, clock):
    other_run = Authority(Identity(), "run-b")
    stranger = Identity()
    cert = other_run.issue(stranger.peer_id, 3600, now=clock())
    _, hello = started(stranger, ADDR_A, Membership("run-b", other_run.public_key, cert, clock=clock), cert.to_bytes())
    refusal_of(gate, hello, f"certificate signed by another authority ({other_run.public_key[:6].hex()}…, "
                            f"this run's is {gate.membership.authority[:6].hex()}…)")


def test_a_certificate_for_another_run_name_by_the_same_authority_is_refused(gate, authority, clock):
    stranger = Identity()
    cert = Authority(authority.identity, "run-b").issue(stranger.peer_id, 3600, now=clock())
    _, hello = started(stranger, ADDR_A)
    refusal_of(gate, {**hello, "m": cert.to_bytes()}, "certificate is for run 'run-b', not 'run-a'")


def test_a_certificate_issued_to_another_peer_is_refused(gate, authority, clock):
    owner, borrower = Identity(), Identity()
    cert = authority.issue(owner.peer_id, 3600, now=clock())
    _, hello = started(borrower, ADDR_A)
    refusal_of(gate, {**hello, "m": cert.to_bytes()},
               f"certificate was issued for peer {owner.peer_id}, not {borrower.peer_id}")


def test_a_tampered_certificate_is_refused(gate, authority, clock):
    stranger = Identity()
    cert = authority.issue(stranger.peer_id, 3600, now=clock())
    longer = Certificate(cert.peer_id, cert.run, cert.expires + 10_000, cert.authority, cert.signature, cert.roles)
    _, hello = started(stranger, ADDR_A)
    refusal_of(gate, {**hello, "m": longer.to_bytes()}, "certificate has a bad signature (forged or tampered with)")


def test_an_expired_certificate_is_refused(gate, authority, clock):
    stranger = Identity()
    cert = authority.issue(stranger.peer_id, 10, now=clock() - 100)  # expired 90 s ago; skew is 5 s
    _, hello = started(stranger, ADDR_A)
    refusal_of(gate, {**hello, "m": cert.to_bytes()}, "certificate expired 90 s ago")


# ---- membership: the remote refuses us ------------------------------------------------------------
def test_the_remotes_refusal_before_the_handshake_says_why():
    hs, _ = started(Identity(), ADDR_B)
    outcome = hs.receive({"s": 0, "t": ERROR, "x": "NotAMember", "msg": "certificate expired 5 s ago"})
    assert isinstance(outcome, Refused) and outcome.type_name == "NotAMember"
    assert outcome.reason == f"refused by {ADDR_B}: certificate expired 5 s ago"
    assert type(outcome.error) is NotAMember and str(outcome.error) == outcome.reason
    assert hs.state is State.FAILED


def test_a_refusal_of_another_type_is_an_unreachable_peer_and_its_reason_is_cut():
    hs, _ = started(Identity(), ADDR_B)
    outcome = hs.receive({"s": 0, "t": ERROR, "x": "Busy", "msg": "x" * 5000})
    assert isinstance(outcome, Refused)
    assert outcome.reason == f"refused by {ADDR_B}: {'x' * 1000}"
    assert type(outcome.error) is PeerUnreachable and str(outcome.error) == f"{outcome.reason} (Busy)"


# ---- membership after the handshake --------------------------------------------------------------
@pytest.fixture
def members(authority, clock) -> tuple[Handshake, Handshake, Identity]:
    """Two ready members' handshakes (a's view of b, b's view of a) and b's identity; skew 5 s."""
    a, b = Identity(), Identity()
    (ma, ca), (mb, cb) = membership_of(authority, a, clock, 100, 5), membership_of(authority, b, clock, 100, 5)
    hs_a, hello_a = started(a, ADDR_B, ma, ca)
    hs_b, hello_b = started(b, ADDR_A, mb, cb)
    proof_a, proof_b = proof_for(hs_a, hello_b), proof_for(hs_b, hello_a)
    assert hs_a.receive(proof_b) == Ready() and hs_b.receive(proof_a) == Ready()
    return hs_a, hs_b, b


def test_a_renewed_certificate_replaces_the_old_one(members, authority, clock):
    hs_a, hs_b, b = members
    clock.now += 90
    renewed = authority.issue(b.peer_id, 100, now=clock())
    message = hs_b.renewal(renewed.to_bytes())
    assert message == {"t": RENEW, "s": 0, "m": renewed.to_bytes()} and hs_b.sent_certificate == renewed.to_bytes()
    assert hs_a.renew(message) is None
    assert hs_a.remote_certificate == renewed
    clock.now += 90  # past the old certificate's end, within the new one's
    assert hs_a.lapsed() is None


def test_a_bad_renewal_is_refused(members, authority, clock):
    hs_a, _, _ = members
    someone_else = authority.issue(Identity().peer_id, 100, now=clock())
    refusal = hs_a.renew({"t": RENEW, "s": 0, "m": someone_else.to_bytes()})
    assert isinstance(refusal, Refuse)
    assert refusal.reason.startswith("renewed certificate refused: certificate was issued for peer ")
    assert refusal.message["x"] == "NotAMember" and refusal.message["msg"] == refusal.reason


def test_open_mode_ignores_renewals():
    hs, _ = started(Identity(), ADDR_B)
    _, hello = started(Identity(), ADDR_A)
    proof_for(hs, hello)
    assert hs.renew({"t": RENEW, "s": 0, "m": b"anything"}) is None


def test_a_certificate_lapses_once_expired_beyond_the_skew(members, clock):
    hs_a, _, b = members
    clock.now += 104
    assert hs_a.lapsed() is None  # 100 s to live, 5 s of skew
    clock.now += 2
    assert hs_a.lapsed() == f"certificate of {b.peer_id} expired 6 s ago"
    assert hs_a.refuse(hs_a.lapsed()).error.args == (f"{b.peer_id} is not a member: certificate of {b.peer_id} "
                                                     "expired 6 s ago",)
