"""Validators: owner signatures, pydantic schemas and key rules."""

from __future__ import annotations

from dataclasses import replace

import msgpack
import pydantic
import pytest

from dht.routing import serialize_key
from dht.validation import (
    CompositeValidator,
    DHTRecord,
    KeyRule,
    SchemaValidator,
    SignatureValidator,
    ValidationError,
    default_validators,
)
from p2p import Identity


def record(key, value, exp=100.0, subkey=None) -> DHTRecord:
    return DHTRecord(serialize_key(key), None if subkey is None else serialize_key(subkey),
                     msgpack.packb(value), exp)


def test_owner_signed_records_verify_and_strip_to_the_plain_value():
    alice = SignatureValidator(Identity())
    signed = CompositeValidator([alice]).sign(record("progress", {"epoch": 3}, subkey=alice.marker))
    assert signed.value != msgpack.packb({"epoch": 3})
    checked = CompositeValidator([SignatureValidator(Identity())]).check(signed)  # any peer can verify
    assert msgpack.unpackb(checked.value) == {"epoch": 3}


def test_records_without_a_marker_need_no_signature():
    v = CompositeValidator([SignatureValidator(Identity())])
    rec = record("plain", 1)
    assert v.check(v.sign(rec)) == rec


def test_forged_tampered_and_replayed_records_are_refused():
    alice, mallory = SignatureValidator(Identity()), SignatureValidator(Identity())
    checker = CompositeValidator([SignatureValidator(Identity())])
    rec = record(f"key{alice.marker}", "mine")
    with pytest.raises(ValidationError, match="whose key this peer does not hold"):
        CompositeValidator([mallory]).sign(rec)
    with pytest.raises(ValidationError, match="no valid signature"):
        checker.check(rec)  # unsigned
    signed = CompositeValidator([alice]).sign(rec)
    forged = CompositeValidator([mallory]).sign(record(f"key{mallory.marker}", "theirs"))
    with pytest.raises(ValidationError):  # mallory's signature on alice's key
        checker.check(replace(forged, key=rec.key))
    with pytest.raises(ValidationError, match="does not verify"):  # replay with a later expiration
        checker.check(replace(signed, expiration_time=signed.expiration_time + 1000))
    tampered = signed.value[:-3] + bytes(b ^ 1 for b in signed.value[-3:])
    with pytest.raises(ValidationError):
        checker.check(replace(signed, value=tampered))


class Progress(pydantic.BaseModel):
    epoch: int
    samples: int = pydantic.Field(ge=0)


def test_schema_violations_are_refused_with_a_readable_reason():
    v = CompositeValidator([SchemaValidator({"progress": Progress})])
    v.check(record("progress_run1", {"epoch": 1, "samples": 5}, subkey="peer1"))
    v.check(record("other", "anything"))
    with pytest.raises(ValidationError) as info:
        v.check(record("progress_run1", {"epoch": "soon", "samples": -1}, subkey="peer1"))
    text = str(info.value)
    assert "progress_run1" in text and "peer1" in text and "Progress" in text
    assert "epoch" in text and "samples" in text


def test_signature_and_schema_compose():
    alice = SignatureValidator(Identity())
    writer = CompositeValidator([alice, SchemaValidator({"progress": Progress})])
    reader = CompositeValidator([SignatureValidator(Identity()), SchemaValidator({"progress": Progress})])
    signed = writer.sign(record("progress", {"epoch": 2, "samples": 1}, subkey=alice.marker))
    assert msgpack.unpackb(reader.check(signed).value) == {"epoch": 2, "samples": 1}
    with pytest.raises(ValidationError, match="Progress"):
        writer.check(writer.sign(record("progress", {"epoch": "x", "samples": 1}, subkey=alice.marker)))


def test_key_rules_fix_each_keys_shape():
    owner = SignatureValidator(Identity())
    rules = [
        KeyRule.exact("run.progress", dictionary=True, subkey=str, owned_subkeys=True, value=Progress,
                      allow_none=True),
        KeyRule.regex(r"run_\w+\.mm\..+", dictionary=True, subkey=str),
        KeyRule.prefix("uid.", dictionary=False, value=str, allow_none=True),
        KeyRule.where(lambda k: k.endswith("/"), "grid prefixes", subkey=int),
    ]
    v = CompositeValidator([owner, SchemaValidator(rules=rules)])
    mine = f"{owner.marker}me"
    ok = [record("run.progress", {"epoch": 1, "samples": 2}, subkey=mine), record("run.progress", None, subkey=mine),
          record("run_grad.mm.e5", {"any": "thing"}, subkey="peer"), record("uid.3", "host:1"), record("uid.3", None),
          record("g/", "x", subkey=3), record("unruled", 1)]
    for rec in ok:
        v.check(v.sign(rec))
    refused = {
        "refused a plain value": record("run.progress", {"epoch": 1, "samples": 2}),
        "names no owner": record("run.progress", {"epoch": 1, "samples": 2}, subkey="me"),
        "value does not match schema Progress": record("run.progress", {"epoch": -1.5, "samples": 2}, subkey=mine),
        "keys matching": record("run_grad.mm.e5", 1),
        "refused a subkey write (keys starting with 'uid.'": record("uid.3", "host:1", subkey="s"),
        "schema str": record("uid.3", 7),
        "refused a bool subkey (grid prefixes": record("g/", "x", subkey=True),
    }
    for reason, rec in refused.items():
        with pytest.raises(ValidationError) as info:
            v.check(v.sign(rec))
        assert reason in str(info.value), str(info.value)


def test_default_validators_check_signatures_and_install_rules():
    identity = Identity()
    sig, *rest = default_validators(identity)
    assert isinstance(sig, SignatureValidator) and sig.identity is identity and rest == []
    _, schema = default_validators(identity, [KeyRule.exact("k", dictionary=True)])
    with pytest.raises(ValidationError, match="refused a plain value"):
        schema.validate(record("k", 1))
