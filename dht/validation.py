"""Record validators: who may write a record, and what shape its value must have.

Every replica runs the same validators on every record it is asked to store, and a reader runs
them on every value it receives, so a forged or malformed record is refused everywhere.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace

import msgpack
import pydantic

from p2p import Identity
from p2p.identity import verify


class ValidationError(ValueError):
    """A record was refused; the message says why."""


@dataclass(frozen=True, slots=True)
class DHTRecord:
    key: bytes  # serialized key
    subkey: bytes | None  # serialized subkey, None for a plain value
    value: bytes  # serialized value, possibly wrapped by validators (e.g. signatures)
    expiration_time: float


class RecordValidator:
    """Base class: accepts everything and changes nothing.

    ``sign_value`` runs on the writer before the record leaves it, in ascending ``priority``;
    ``validate`` then ``strip_value`` run on every receiver, in descending ``priority``, so a
    high-priority validator (signatures) sees the bytes exactly as signed.
    """

    priority = 0

    def validate(self, record: DHTRecord) -> None:
        """Raise ValidationError to refuse the record."""

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value


class CompositeValidator(RecordValidator):
    def __init__(self, validators: Iterable[RecordValidator] = ()) -> None:
        self.validators = sorted(validators, key=lambda v: v.priority)

    def sign(self, record: DHTRecord) -> DHTRecord:
        for v in self.validators:
            record = replace(record, value=v.sign_value(record))
        return record

    def check(self, record: DHTRecord) -> DHTRecord:
        """Validate a received record; returns it with every wrapper stripped (the user's value)."""
        for v in reversed(self.validators):
            v.validate(record)
            record = replace(record, value=v.strip_value(record))
        return record


# ---- owner signatures ------------------------------------------------------------------------
_MARKER = re.compile(rb"\[owner:([A-Za-z0-9_-]{43})\]")
_SIGNED = b"\xc1"  # never starts valid msgpack, so a signed value cannot be mistaken for a plain one
_CONTEXT = b"spotswarm/dht/record/v1"


def owner_marker(public_key: bytes) -> str:
    return "[owner:" + base64.urlsafe_b64encode(public_key).decode().rstrip("=") + "]"


def _owners(record: DHTRecord) -> list[bytes]:
    found: list[bytes] = []
    for part in (record.key, record.subkey or b""):
        for match in _MARKER.finditer(part):
            pk = base64.urlsafe_b64decode(match.group(1) + b"=")
            if pk not in found:
                found.append(pk)
    return found


def _signed_payload(record: DHTRecord, value: bytes) -> bytes:
    return msgpack.packb([_CONTEXT, record.key, record.subkey, value, float(record.expiration_time)])


class SignatureValidator(RecordValidator):
    """A key or subkey containing ``[owner:<public key>]`` can only be written by that key's owner.

    Put ``validator.marker`` into a key or subkey to claim it.  The signature covers key, subkey,
    value and expiration, so nobody can replay an old value with a later expiration.
    """

    priority = 10

    def __init__(self, identity: Identity) -> None:
        self.identity = identity
        self.marker = owner_marker(identity.public_key)

    def sign_value(self, record: DHTRecord) -> bytes:
        owners = _owners(record)
        if not owners:
            return record.value
        if owners != [self.identity.public_key]:
            other = [owner_marker(pk) for pk in owners if pk != self.identity.public_key]
            raise ValidationError(f"record names owner(s) {other} whose key this peer does not hold")
        signature = self.identity.sign(_signed_payload(record, record.value))
        return _SIGNED + msgpack.packb([record.value, [signature]])

    def validate(self, record: DHTRecord) -> None:
        owners = _owners(record)
        if not owners:
            return
        inner, signatures = _unwrap(record.value)
        if inner is None or len(signatures) != len(owners):
            raise ValidationError(f"record claims owner {owner_marker(owners[0])} but carries no valid signature")
        payload = _signed_payload(record, inner)
        for pk, sig in zip(owners, signatures, strict=True):
            if not verify(pk, sig, payload):
                raise ValidationError(f"signature of owner {owner_marker(pk)} does not verify")

    def strip_value(self, record: DHTRecord) -> bytes:
        if not _owners(record):
            return record.value
        inner, _ = _unwrap(record.value)
        return record.value if inner is None else inner


def _unwrap(value: bytes) -> tuple[bytes | None, list[bytes]]:
    if not value.startswith(_SIGNED):
        return None, []
    try:
        inner, signatures = msgpack.unpackb(value[1:])
    except Exception:
        return None, []
    if not isinstance(inner, bytes) or not isinstance(signatures, list) \
            or not all(isinstance(s, bytes) for s in signatures):
        return None, []
    return inner, signatures


# ---- schemas ---------------------------------------------------------------------------------
class SchemaValidator(RecordValidator):
    """Values under keys that are strings starting with a prefix must match that prefix's pydantic model.

    For a dictionary key, each subkey's value is checked against the model.
    """

    priority = 0

    def __init__(self, schemas: dict[str, type[pydantic.BaseModel]]) -> None:
        self.schemas = dict(schemas)

    def validate(self, record: DHTRecord) -> None:
        try:
            key = msgpack.unpackb(record.key, raw=False)
        except Exception:
            return
        if not isinstance(key, str):
            return
        for prefix, model in self.schemas.items():
            if key.startswith(prefix):
                self._check(key, record, model)

    @staticmethod
    def _check(key: str, record: DHTRecord, model: type[pydantic.BaseModel]) -> None:
        where = f"key {key!r}" + (f" subkey {_show(record.subkey)}" if record.subkey is not None else "")
        try:
            value = msgpack.unpackb(record.value, raw=False)
        except Exception:
            raise ValidationError(f"{where}: value is not valid msgpack") from None
        try:
            model.model_validate(value)
        except pydantic.ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'value'}: {err['msg']}" for err in e.errors())
            raise ValidationError(f"{where}: value does not match schema {model.__name__}: {problems}") from None


def _show(raw: bytes | None) -> str:
    try:
        return repr(msgpack.unpackb(raw, raw=False)) if raw is not None else "None"
    except Exception:
        return repr(raw)
