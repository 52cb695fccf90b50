"""Record validators: who may write a record, and what shape its value must have.

Every replica runs the same validators on every record it is asked to store, and a reader runs
them on every value it receives, so a forged or malformed record is refused everywhere.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

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
            stripped = v.strip_value(record)
            if stripped is not record.value:  # most records carry no wrapper: no copy for them
                record = replace(record, value=stripped)
        return record


# ---- owner signatures ------------------------------------------------------------------------
_MARKER = re.compile(rb"\[owner:([A-Za-z0-9_-]{43})\]")
_SIGNED = b"\xc1"  # never starts valid msgpack, so a signed value cannot be mistaken for a plain one
_CONTEXT = b"spotswarm/dht/record/v1"


def owner_marker(public_key: bytes) -> str:
    return "[owner:" + base64.urlsafe_b64encode(public_key).decode().rstrip("=") + "]"


def owners_in(*parts: bytes) -> list[bytes]:
    """The public keys that ``[owner:...]`` markers in ``parts`` (a key, a subkey) claim, each once."""
    found: list[bytes] = []
    for part in parts:
        if b"[owner:" not in part:  # the common case, checked on every record received: skip the regex
            continue
        for match in _MARKER.finditer(part):
            pk = base64.urlsafe_b64decode(match.group(1) + b"=")
            if pk not in found:
                found.append(pk)
    return found


def _owners(record: DHTRecord) -> list[bytes]:
    return owners_in(record.key, record.subkey or b"")


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
@dataclass(frozen=True)
class KeyRule:
    """What may be stored under the string keys ``matches`` accepts.

    The keys belong to the layers above the DHT, so they declare their rules and every node of a
    swarm installs the same list (``SchemaValidator(rules=[...])``).  Build one with ``exact``,
    ``prefix``, ``regex`` or ``where``.
    """

    matches: Callable[[str], bool]
    name: str  # how refusals name the rule, e.g. "keys starting with 'run.'"
    dictionary: bool | None = None  # True: subkey writes only; False: plain values only; None: either
    value: Any = None  # a pydantic model, or any type pydantic validates (``str | None``); None: anything
    allow_none: bool = False  # a None value (a withdrawal) passes besides ``value``
    subkey: type | None = None  # what every subkey must be (``str``, ``int``); None: anything
    owned_subkeys: bool = False  # every subkey must name its owner ([owner:...]), so only the owner writes it
    _adapter: pydantic.TypeAdapter | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.value is not None:
            object.__setattr__(self, "_adapter", pydantic.TypeAdapter(self.value))

    @classmethod
    def exact(cls, key: str, **options: Any) -> KeyRule:
        return cls(key.__eq__, f"key {key!r}", **options)

    @classmethod
    def prefix(cls, prefix: str, **options: Any) -> KeyRule:
        return cls(lambda key: key.startswith(prefix), f"keys starting with {prefix!r}", **options)

    @classmethod
    def regex(cls, pattern: str, name: str | None = None, **options: Any) -> KeyRule:
        """Keys the whole of which match ``pattern`` (e.g. a name with an epoch in it)."""
        compiled = re.compile(pattern)
        return cls(lambda key: compiled.fullmatch(key) is not None, name or f"keys matching {pattern!r}", **options)

    @classmethod
    def where(cls, predicate: Callable[[str], bool], name: str, **options: Any) -> KeyRule:
        return cls(predicate, name, **options)

    def check(self, key: str, record: DHTRecord) -> None:
        where = f"key {key!r}" + (f" subkey {show_raw(record.subkey)}" if record.subkey is not None else "")
        if self.dictionary is True and record.subkey is None:
            raise ValidationError(f"{where}: refused a plain value ({self.name}: a dictionary, subkey writes only)")
        if self.dictionary is False and record.subkey is not None:
            raise ValidationError(f"{where}: refused a subkey write ({self.name}: plain values only)")
        if record.subkey is not None:
            self._check_subkey(where, record)
        if self._adapter is None:
            return
        value = _unpack_value(where, record.value)
        if value is None and self.allow_none:
            return
        try:
            self._adapter.validate_python(value)
        except pydantic.ValidationError as e:
            raise ValidationError(f"{where}: value does not match schema {_type_name(self.value)}: "
                                  f"{_problems(e)}") from None

    def _check_subkey(self, where: str, record: DHTRecord) -> None:
        assert record.subkey is not None
        if self.owned_subkeys and not _MARKER.search(record.subkey):
            raise ValidationError(f"{where}: refused a subkey that names no owner ({self.name}: every subkey "
                                  "carries [owner:...], so that only its owner can write it)")
        if self.subkey is None:
            return
        try:
            sub = msgpack.unpackb(record.subkey, raw=False)
        except Exception:
            raise ValidationError(f"{where}: subkey is not valid msgpack") from None
        if not isinstance(sub, self.subkey) or (self.subkey is int and isinstance(sub, bool)):
            raise ValidationError(f"{where}: refused a {type(sub).__name__} subkey ({self.name}: "
                                  f"subkeys are {self.subkey.__name__})")


class SchemaValidator(RecordValidator):
    """Values under string keys must satisfy every rule that matches the key.

    ``SchemaValidator({"prefix": Model})`` is shorthand for ``KeyRule.prefix("prefix", value=Model)``:
    each value (for a dictionary key, each subkey's value) must match the pydantic model.
    ``rules`` adds any ``KeyRule``: dictionary-only keys, subkey types, owned subkeys.
    """

    priority = 0

    def __init__(self, schemas: dict[str, type[pydantic.BaseModel]] | None = None,
                 rules: Iterable[KeyRule] = ()) -> None:
        self.schemas = dict(schemas or {})
        self.rules = [KeyRule.prefix(p, value=model) for p, model in self.schemas.items()] + list(rules)

    def validate(self, record: DHTRecord) -> None:
        try:
            key = msgpack.unpackb(record.key, raw=False)
        except Exception:
            return
        if not isinstance(key, str):
            return
        for rule in self.rules:
            if rule.matches(key):
                rule.check(key, record)


def _unpack_value(where: str, raw: bytes) -> Any:
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception:
        raise ValidationError(f"{where}: value is not valid msgpack") from None


def _problems(e: pydantic.ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'value'}: {err['msg']}" for err in e.errors())


def _type_name(t: Any) -> str:
    return getattr(t, "__name__", None) or str(t)


def decode_subkey(raw: bytes) -> Any:
    """A subkey as the user wrote it (tuples as tuples); ValidationError if it cannot be a dict key."""
    try:
        subkey = msgpack.unpackb(raw, raw=False, use_list=False)
        hash(subkey)
    except Exception:
        raise ValidationError(f"subkey {raw[:64]!r} does not decode to a hashable value") from None
    return subkey


def show_raw(raw: bytes | None) -> str:
    """A serialized key, subkey or value as readable text, for messages."""
    try:
        return repr(msgpack.unpackb(raw, raw=False)) if raw is not None else "None"
    except Exception:
        return repr(raw)


def default_validators(identity: Identity | None = None, rules: Iterable[KeyRule] = ()) -> list[RecordValidator]:
    """The validators a node installs unless it knows better: owner signatures (made with ``identity``,
    checked for everyone) and the swarm's key rules, if it has any."""
    validators: list[RecordValidator] = [SignatureValidator(identity or Identity())]
    rules = list(rules)
    if rules:
        validators.append(SchemaValidator(rules=rules))
    return validators
