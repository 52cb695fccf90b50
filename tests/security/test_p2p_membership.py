"""Run membership at the p2p handshake: only peers holding a certificate from the run's authority,
for their own key, for this run and not expired, get a connection; everyone else is refused and
told why.  Real peers over loopback; one stranger is a separate process."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import struct
import sys
import time
from pathlib import Path

import msgpack
import pytest

from p2p import P2P, Authority, Certificate, Identity, Membership, NotAMember
from p2p.headers import ERROR, HELLO, VERSION
from tests.fakes.clock import FakeClock

pytestmark = pytest.mark.timeout(30)
RUN = "run-a"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def authority() -> Authority:
    return Authority(Identity(), RUN)


@pytest.fixture
async def nodes():
    """``await nodes(identity=..., membership=...)``: a P2P peer shut down after the test."""
    made: list[P2P] = []

    async def make(**kwargs) -> P2P:
        node = await P2P.create(**kwargs)
        made.append(node)
        return node

    yield make
    await asyncio.gather(*(n.shutdown() for n in made))


async def member(nodes, authority: Authority, roles=(), ttl=3600.0, clock=time.time, skew=60.0) -> P2P:
    identity = Identity()
    cert = authority.issue(identity.peer_id, ttl, roles, now=clock())
    return await nodes(identity=identity, membership=Membership(RUN, authority.public_key, cert, skew, clock))


async def echo(request, ctx):
    return request


async def whoami(request, ctx):
    return {"peer": str(ctx.certificate.peer_id), "roles": list(ctx.certificate.roles), "run": ctx.certificate.run}


# ---- raw HELLO: what any client can put on the wire --------------------------------------------
async def read_message(reader: asyncio.StreamReader) -> dict:
    header_len, n_frames = struct.unpack("<II", await reader.readexactly(8))
    assert n_frames == 0
    return msgpack.unpackb(await reader.readexactly(header_len), raw=False)


async def hello_with(address, identity: Identity, cert: bytes | None) -> tuple[dict, bytes]:
    """Send a HELLO carrying ``cert``; return the peer's answer to it and what followed until EOF."""
    reader, writer = await asyncio.open_connection(address.host, address.port)
    try:
        assert (await read_message(reader))["t"] == HELLO
        hello = {"t": HELLO, "s": 0, "v": VERSION, "pk": identity.public_key, "n": os.urandom(16), "c": 1, "l": None}
        if cert is not None:
            hello["m"] = cert
        body = msgpack.packb(hello, use_bin_type=True)
        writer.write(struct.pack("<II", len(body), 0) + body)
        answer = await asyncio.wait_for(read_message(reader), 10)
        rest = await asyncio.wait_for(reader.read(), 10)  # the peer closes after refusing
        return answer, rest
    finally:
        writer.close()


# ---- tests -------------------------------------------------------------------------------------
async def test_members_talk_and_handlers_see_the_callers_roles(nodes, authority):
    a = await member(nodes, authority, roles=("worker",))
    b = await member(nodes, authority, roles=("experts:ffn.",))
    a.register("whoami", whoami)
    b.register("whoami", whoami)
    b.register("echo", echo)
    assert await a.call(b.address, "echo", {"x": [1, 2]}) == {"x": [1, 2]}
    assert await a.call(b.address, "whoami") == {"peer": str(a.peer_id), "roles": ["worker"], "run": RUN}
    # the acceptor calls back over the same connection and is seen with its own roles
    assert await b.call(a.peer_id, "whoami") == {"peer": str(b.peer_id), "roles": ["experts:ffn."], "run": RUN}
    (conn,) = [c for c in a._connections if c.is_ready]
    assert conn.remote_certificate.peer_id == b.peer_id


async def test_a_stranger_is_refused_as_dialer_and_as_acceptor(nodes, authority):
    m = await member(nodes, authority)
    m.register("echo", echo)
    stranger = await nodes()  # open mode, fresh identity, no certificate
    stranger.register("echo", echo)
    with pytest.raises(NotAMember, match=rf"refused by {m.peer_id}: no membership certificate"):
        await stranger.call(m.address, "echo", 1, timeout=10)
    with pytest.raises(NotAMember, match=rf"{stranger.peer_id} is not a member: no membership certificate"):
        await m.call(stranger.address, "echo", 1, timeout=10)
    assert stranger.peer_id not in m.connected_peers() and m.peer_id not in stranger.connected_peers()
    other = await member(nodes, authority)
    assert await other.call(m.address, "echo", "still serving") == "still serving"


async def test_membership_needs_a_certificate_of_our_own(authority):
    with pytest.raises(ValueError, match="membership without a certificate"):
        await P2P.create(membership=Membership(RUN, authority.public_key))
    someone_else = authority.issue(Identity().peer_id, 60)
    with pytest.raises(ValueError, match="issued for peer"):
        await P2P.create(membership=Membership(RUN, authority.public_key, someone_else))


def _tampered(cert: Certificate, what: str) -> bytes:
    if what == "flipped byte":
        sig = bytearray(cert.signature)
        sig[7] ^= 1
        return dataclasses.replace(cert, signature=bytes(sig)).to_bytes()
    return dataclasses.replace(cert, roles=("admin",)).to_bytes()


@pytest.mark.parametrize("case, reason", [
    ("other run", r"certificate is for run 'run-b', not 'run-a'"),
    ("other authority", r"certificate signed by another authority"),
    ("stolen", r"certificate was issued for peer sw\w+, not sw\w+"),
    ("expired", r"certificate expired 9\d\d s ago"),
    ("flipped byte", r"bad signature"),
    ("changed roles", r"bad signature"),
    ("garbage", r"malformed certificate: certificate is not msgpack"),
])
async def test_a_bad_certificate_is_refused_with_the_reason_on_the_wire(nodes, authority, case, reason):
    m = await member(nodes, authority)
    m.register("echo", echo)
    attacker = Identity()
    victim = Identity()
    certs = {
        "other run": lambda: Authority(authority.identity, "run-b").issue(attacker.peer_id, 3600).to_bytes(),
        "other authority": lambda: Authority(Identity(), RUN).issue(attacker.peer_id, 3600).to_bytes(),
        "stolen": lambda: authority.issue(victim.peer_id, 3600, ("worker",)).to_bytes(),
        "expired": lambda: authority.issue(attacker.peer_id, 10, now=time.time() - 1000).to_bytes(),
        "flipped byte": lambda: _tampered(authority.issue(attacker.peer_id, 3600), "flipped byte"),
        "changed roles": lambda: _tampered(authority.issue(attacker.peer_id, 3600, ("worker",)), "roles"),
        "garbage": lambda: b"\xc1" * 40,
    }
    answer, rest = await hello_with(m.address, attacker, certs[case]())
    assert answer["t"] == ERROR and answer["s"] == 0 and answer["x"] == "NotAMember", answer
    assert re.search(reason, answer["msg"]), answer["msg"]
    assert rest == b""  # refused: no PROOF, connection closed
    assert m.num_half_open == 0 and attacker.peer_id not in m.connected_peers()
    other = await member(nodes, authority)
    assert await other.call(m.address, "echo", case) == case


async def test_a_member_refuses_an_acceptor_with_a_certificate_for_another_run(nodes, authority):
    m = await member(nodes, authority)
    other_run = Authority(authority.identity, "run-b")
    identity = Identity()
    outsider = await nodes(identity=identity, membership=Membership(
        "run-b", authority.public_key, other_run.issue(identity.peer_id, 3600)))
    outsider.register("echo", echo)
    with pytest.raises(NotAMember, match=r"is not a member: certificate is for run 'run-b', not 'run-a'"):
        await m.call(outsider.address, "echo", 1, timeout=10)


async def test_the_dialer_learns_why_it_was_refused(nodes, authority):
    m = await member(nodes, authority)
    m.register("echo", echo)
    # A peer whose certificate lapsed 1000 s ago (its own clock is wrong, so it still offers it).
    identity = Identity()
    late = FakeClock(time.time())
    late.now -= 2000
    lapsed = authority.issue(identity.peer_id, 1000, now=late.now)
    peer = await nodes(identity=identity, membership=Membership(RUN, authority.public_key, lapsed, clock=late))
    with pytest.raises(NotAMember, match=rf"refused by {m.peer_id}: certificate expired 10\d\d s ago"):
        await peer.call(m.address, "echo", 1, timeout=10)


async def test_an_expired_certificate_is_refused_at_the_next_call_and_renewal_keeps_it(nodes, authority):
    clock = FakeClock(time.time())  # shared by both ends of a connection: expiry without sleeping
    a = await member(nodes, authority, ttl=100, clock=clock, skew=5)
    b = await member(nodes, authority, ttl=10_000, clock=clock, skew=5)
    b.register("echo", echo)
    assert await a.call(b.address, "echo", 1) == 1
    (conn,) = [c for c in b._connections if c.is_ready]

    clock.now += 90  # close to expiry: renew, then time passes beyond the old certificate's end
    a.renew_certificate(authority.issue(a.peer_id, 100, now=clock.now))
    assert await a.call(b.address, "echo", 2) == 2  # ordered after RENEW on the same connection
    clock.now += 20
    assert await a.call(b.address, "echo", 3) == 3
    assert not conn.closed and conn.remote_certificate.expires == pytest.approx(clock.now + 80)

    clock.now += 100  # now really lapsed: the call is refused and the connection closed
    with pytest.raises(NotAMember, match=r"echo refused by sw\w+: certificate of sw\w+ expired 2\d s ago"):
        await a.call(b.address, "echo", 4)
    await asyncio.wait_for(conn.closed_future, 5)
    # a new connection presents the same lapsed certificate and is refused at the handshake
    with pytest.raises(NotAMember, match="certificate expired"):
        await a.call(b.address, "echo", 5)


async def test_renewal_is_checked_like_a_hello(nodes, authority):
    a = await member(nodes, authority)
    b = await member(nodes, authority)
    b.register("echo", echo)
    assert await a.call(b.address, "echo", 1) == 1
    with pytest.raises(ValueError, match="issued for peer"):
        a.renew_certificate(authority.issue(b.peer_id, 100))
    with pytest.raises(ValueError, match="for run"):
        a.renew_certificate(Authority(authority.identity, "run-b").issue(a.peer_id, 100))
    (conn,) = [c for c in b._connections if c.is_ready]
    conn_a = next(c for c in a._connections if c.is_ready)
    conn_a.send_renew(authority.issue(b.peer_id, 100).to_bytes())  # what a modified peer could send
    await asyncio.wait_for(conn.closed_future, 5)
    assert "renewed certificate refused: certificate was issued for peer" in conn.close_reason
    await asyncio.wait_for(conn_a.closed_future, 5)
    assert "refused by" in conn_a.close_reason


async def test_open_mode_is_untouched(nodes):
    a = await nodes()
    b = await nodes()
    b.register("echo", echo)

    async def cert_of_caller(request, ctx):
        return ctx.certificate is None

    b.register("nocert", cert_of_caller)
    assert await a.call(b.address, "echo", "x") == "x"
    assert await a.call(b.address, "nocert") is True
    (conn,) = [c for c in a._connections if c.is_ready]
    assert conn.remote_certificate is None


def test_certificate_encodings_round_trip_and_garbage_is_named(authority):
    cert = authority.issue(Identity().peer_id, 60, ("worker", "experts:ffn."))
    assert Certificate.from_bytes(cert.to_bytes()) == cert
    assert Certificate.from_token(cert.to_token()) == cert
    with pytest.raises(ValueError, match="not url-safe base64"):
        Certificate.from_token("!!!")
    with pytest.raises(ValueError, match="must be a map with keys"):
        Certificate.from_bytes(msgpack.packb([1, 2]))
    with pytest.raises(ValueError, match="signature must be 64 bytes"):
        Certificate.from_bytes(dataclasses.replace(cert, signature=b"x").to_bytes())
    with pytest.raises(ValueError, match="exceeds"):
        Certificate.from_bytes(b"\x00" * 4096)


@pytest.mark.timeout(30)
async def test_a_stranger_in_another_process_is_refused_and_the_member_keeps_serving(nodes, authority, tmp_path):
    m = await member(nodes, authority)
    m.register("echo", echo)
    code = (
        "import asyncio, json, sys\n"
        "from p2p import P2P, NotAMember\n"
        "async def main():\n"
        "    node = await P2P.create(client_mode=True)\n"
        "    try:\n"
        "        await node.call(sys.argv[1], 'echo', 'let me in', timeout=10)\n"
        "        print(json.dumps({'outcome': 'served'}))\n"
        "    except NotAMember as e:\n"
        "        print(json.dumps({'outcome': 'NotAMember', 'message': str(e)}))\n"
        "    finally:\n"
        "        await node.shutdown()\n"
        "asyncio.run(main())\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, str(m.address), stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    out, _ = await asyncio.wait_for(proc.communicate(), 25)
    result = json.loads(out.decode().strip().splitlines()[-1])
    assert result["outcome"] == "NotAMember", result
    assert f"refused by {m.peer_id}: no membership certificate" in result["message"]
    assert m.connected_peers() == [] and m.num_half_open == 0
    other = await member(nodes, authority)
    assert await other.call(m.address, "echo", "after") == "after"


_FUZZ_AUTHORITY = Authority(Identity(), "fuzz")
_FUZZ_PEER = Identity()
_FUZZ_CERT = _FUZZ_AUTHORITY.issue(_FUZZ_PEER.peer_id, 7 * 86400, roles=("worker",)).to_bytes()  # outlives the session


def _fuzz_check(raw: object) -> None:
    """What a HELLO's or RENEW's ``m`` may hold: a membership either accepts it or says why, nothing else."""
    membership = Membership("fuzz", _FUZZ_AUTHORITY.public_key)
    try:
        membership.check(_FUZZ_PEER.peer_id, raw)
    except NotAMember as e:
        assert str(e)


def test_fuzz_certificates_are_accepted_only_intact():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=300, deadline=None)
    @given(st.binary(max_size=3000))
    def any_bytes(raw: bytes) -> None:
        _fuzz_check(raw)
        try:
            Certificate.from_token(raw.decode("latin-1"))
        except ValueError:
            pass

    @settings(max_examples=300, deadline=None)
    @given(st.integers(min_value=0, max_value=len(_FUZZ_CERT) - 1), st.integers(min_value=1, max_value=255))
    def one_byte_changed(at: int, flip: int) -> None:
        tampered = bytearray(_FUZZ_CERT)
        tampered[at] ^= flip
        with pytest.raises(NotAMember):
            Membership("fuzz", _FUZZ_AUTHORITY.public_key).check(_FUZZ_PEER.peer_id, bytes(tampered))

    @settings(max_examples=200, deadline=None)
    @given(st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
                        | st.binary(max_size=40),
                        lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=4), inner,
                                                                                     max_size=6), max_leaves=30))
    def any_msgpack(value: object) -> None:
        _fuzz_check(msgpack.packb(value))
        _fuzz_check(value)  # not even bytes

    any_bytes()
    one_byte_changed()
    any_msgpack()
    Membership("fuzz", _FUZZ_AUTHORITY.public_key).check(_FUZZ_PEER.peer_id, _FUZZ_CERT)  # the intact one passes
