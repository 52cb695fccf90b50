"""A node's records as its user sees them and as they travel: values in, signed checked records out, and back.

A user writes a key, an optional subkey and a value (msgpack-serializable data); the DHT stores and
sends ``DHTRecord``s of their serialized bytes, signed where the key or subkey names an owner and
checked by the node's validators, so a writer learns at once the reason a replica would refuse.
What peers answer is checked the same way before anyone believes it: a record that does not
validate or decode is left out, and only that one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from .routing import serialize_key
from .storage import Entry, Storage
from .validation import CompositeValidator, DHTRecord, ValidationError, decode_subkey, show_raw

# Records whose check passed, with the plain value it gave: a polled key comes back from every
# replica, read after read, and signatures and schemas are the same for the same bytes.
CHECKED_CACHE = 4096


class RecordTooLarge(ValueError):
    """A key, subkey or value is over the node's size limits."""


@dataclass(frozen=True)
class ValueWithExpiration:
    """A value read from the DHT.  For a dictionary key, ``value`` maps each subkey to one of these."""

    value: Any
    expiration_time: float


def check_size(what: str, raw: bytes, limit: int) -> None:
    """RecordTooLarge if the serialized ``what`` (key, subkey, value) is over ``limit`` bytes."""
    if len(raw) > limit:
        raise RecordTooLarge(f"{what} of {len(raw)} bytes exceeds the limit of {limit} bytes")


class RecordCodec:
    """Makes and reads one node's records: its validators, its size limits, its storage's clock.

    ``on_dropped(key, reasons)`` hears of the records of ``key`` left out of an answer or a read."""

    def __init__(self, validator: CompositeValidator, storage: Storage, *, max_key_bytes: int, max_value_bytes: int,
                 max_expiration: float, on_dropped: Callable[[bytes, list[str]], None]) -> None:
        self.validator = validator
        self.storage = storage
        self.max_key_bytes = max_key_bytes
        self.max_value_bytes = max_value_bytes
        self.max_expiration = max_expiration
        self.on_dropped = on_dropped
        self._checked: dict[DHTRecord, bytes] = {}  # oldest first

    def make(self, key: Any, value: Any, expiration_time: float, subkey: Any) -> DHTRecord:
        """The signed record a user's write stands for; ValueError, TypeError or RecordTooLarge if a
        replica could not take it, ValidationError if a validator would refuse it."""
        ahead = expiration_time - self.storage.clock()
        if not ahead <= self.max_expiration:  # NaN too
            raise ValueError(f"expiration time {expiration_time} for key {key!r} is {ahead:.0f} s from now; "
                             f"records may expire at most max_expiration={self.max_expiration:g} s ahead "
                             "(re-store before it passes to keep a record longer)")
        key_raw = serialize_key(key)
        check_size("key", key_raw, self.max_key_bytes)
        sub_raw = None if subkey is None else serialize_key(subkey)
        if sub_raw is not None:
            check_size("subkey", sub_raw, self.max_key_bytes)
        try:
            value_raw = msgpack.packb(value, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as e:
            raise TypeError(f"DHT values must be msgpack-serializable: {e}") from None
        check_size("value", value_raw, self.max_value_bytes)
        record = self.validator.sign(DHTRecord(key_raw, sub_raw, value_raw, expiration_time))
        check_size("signed value", record.value, self.max_value_bytes + 1024)
        self.validator.check(record)  # the writer gets the reason a replica would refuse with
        return record

    def user_value(self, record: DHTRecord) -> Any:
        """The value a received record carries; ValidationError if a validator refuses it or it does not decode."""
        plain = self._checked.get(record)
        if plain is None:
            plain = self.validator.check(record).value  # raises for a refused record: never cached
            if len(self._checked) >= CHECKED_CACHE:
                del self._checked[next(iter(self._checked))]
            self._checked[record] = plain
        try:
            return msgpack.unpackb(plain, raw=False, strict_map_key=False)
        except Exception:  # msgpack raises several types (ExtraData, FormatError, StackError, ...)
            sub = "" if record.subkey is None else f" subkey {show_raw(record.subkey)}"
            raise ValidationError(f"key {show_raw(record.key)}{sub}: value is not valid msgpack") from None

    def validated(self, key: bytes, entry: Entry) -> Entry | None:
        """``entry`` without the records that fail validation (a lying peer cannot forge them)."""
        now, limit = self.storage.now(), self.storage.clock() + self.max_expiration + self.storage.clock_drift
        good: dict[bytes | None, tuple[bytes, float]] = {}
        dropped: list[str] = []
        for subkey, value, exp in entry.records():
            if not now < exp <= limit:
                if exp > limit:
                    dropped.append(f"expiration {exp - now:.0f} s ahead")
                continue
            try:
                self.user_value(DHTRecord(key, subkey, value, exp))  # a copy seen before is not checked again
                if subkey is not None:
                    decode_subkey(subkey)
            except ValidationError as e:
                dropped.append(str(e))
                continue
            good[subkey] = (value, exp)
        self.on_dropped(key, dropped)
        if not good:
            return None
        if entry.subkeys is None:
            return Entry(key, *good[None])
        return Entry(key, subkeys={sk: vx for sk, vx in good.items() if sk is not None})

    def decode(self, entry: Entry | None) -> ValueWithExpiration | None:
        """The user's view of an entry; a record that does not validate or decode is left out, and only that one."""
        if entry is None:
            return None
        alive = entry.alive(self.storage.now())
        if alive is None:
            return None
        dropped: list[str] = []
        if alive.subkeys is None:
            assert alive.value is not None
            try:
                value = self.user_value(DHTRecord(alive.key, None, alive.value, alive.expiration_time))
            except ValidationError as e:
                self.on_dropped(alive.key, [str(e)])
                return None
            return ValueWithExpiration(value, alive.expiration_time)
        items: dict[Any, ValueWithExpiration] = {}
        for sk, (v, e) in alive.subkeys.items():
            try:
                items[decode_subkey(sk)] = ValueWithExpiration(self.user_value(DHTRecord(alive.key, sk, v, e)), e)
            except ValidationError as err:
                dropped.append(str(err))
        self.on_dropped(alive.key, dropped)
        if not items:
            return None
        return ValueWithExpiration(items, max(item.expiration_time for item in items.values()))
