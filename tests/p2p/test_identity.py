from __future__ import annotations

import os
import stat

import pytest

from p2p import Identity, PeerAddress, PeerID


def test_peer_id_prints_and_parses_back():
    ident = Identity()
    text = str(ident.peer_id)
    assert text.startswith("sw")
    assert PeerID.from_string(text) == ident.peer_id
    assert PeerID.from_public_key(ident.public_key) == ident.peer_id


@pytest.mark.parametrize("bad", ["", "xx", "swNOT*BASE32", "sw" + "a" * 10, 42])
def test_bad_peer_id_text_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="PeerID"):
        PeerID.from_string(bad)


def test_key_file_keeps_identity_across_restarts(tmp_path):
    path = tmp_path / "keys" / "peer.pem"
    first = Identity.from_file(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    second = Identity.from_file(path)
    assert first.peer_id == second.peer_id
    with pytest.raises(FileNotFoundError):
        Identity.from_file(tmp_path / "missing.pem", create=False)


def test_signatures_verify_only_for_the_signer():
    from p2p.identity import verify

    a, b = Identity(), Identity()
    sig = a.sign(b"data")
    assert verify(a.public_key, sig, b"data")
    assert not verify(b.public_key, sig, b"data")
    assert not verify(a.public_key, sig, b"other")
    assert not verify(b"short", sig, b"data")


def test_a_remembered_signature_vouches_for_nothing_else(monkeypatch: pytest.MonkeyPatch):
    """Verified signatures are remembered; only the same key, signature and data come back verified
    without Ed25519, and inputs that are not bytes are verified (and refused) as before."""
    import p2p.identity as identity

    a, b = Identity(), Identity()
    sig = a.sign(b"data")
    assert identity.verify(a.public_key, sig, b"data")

    checked = []
    real = identity.Ed25519PublicKey.from_public_bytes
    monkeypatch.setattr(identity.Ed25519PublicKey, "from_public_bytes",
                        lambda key: checked.append(key) or real(key))
    assert identity.verify(a.public_key, sig, b"data")
    assert checked == []  # remembered
    assert not identity.verify(a.public_key, sig, b"data2")
    assert not identity.verify(b.public_key, sig, b"data")
    assert not identity.verify(a.public_key, bytes(64), b"data")
    assert not identity.verify(a.public_key, sig[:-1] + bytes([sig[-1] ^ 1]), b"data")
    assert not identity.verify(a.public_key, bytearray(sig), b"data2")
    assert not identity.verify(None, sig, b"data")  # type: ignore[arg-type]
    assert len(checked) == 6  # every other combination was verified, and refused
    assert identity.verify(a.public_key, bytearray(sig), b"data")  # not bytes: verified, not remembered
    assert len(checked) == 7


def test_the_memory_of_verified_signatures_is_bounded(monkeypatch: pytest.MonkeyPatch):
    import p2p.identity as identity

    monkeypatch.setattr(identity, "_verified", {})
    monkeypatch.setattr(identity, "_VERIFIED_MAX", 3)
    a = Identity()
    messages = [bytes([i]) for i in range(5)]
    for m in messages:
        assert identity.verify(a.public_key, a.sign(m), m)
    assert len(identity._verified) == 3
    assert [m for m in messages if (a.public_key, a.sign(m), identity.hashlib.blake2b(m).digest())
            in identity._verified] == messages[2:]  # the oldest went first


def test_addresses_parse_with_and_without_peer_id():
    ident = Identity()
    assert PeerAddress.parse("127.0.0.1:8000") == PeerAddress("127.0.0.1", 8000)
    pinned = PeerAddress.parse(f"{ident.peer_id}@[::1]:9")
    assert pinned.host == "::1" and pinned.port == 9 and pinned.peer_id == ident.peer_id
    assert PeerAddress.parse(str(pinned)) == pinned
    for bad in ["nohost", "host:", "host:99999", ":80", "a:b"]:
        with pytest.raises(ValueError):
            PeerAddress.parse(bad)
