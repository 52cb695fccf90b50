"""Key filling: one owner cannot take a shared key, and progress records cannot be padded."""

from __future__ import annotations

import os

import pydantic
import pytest

from dht.storage import Storage
from dht.validation import owner_marker
from workers.progress import PeerProgress

pytestmark = pytest.mark.timeout(30)

KEY_ID, KEY = 42, b"run.progress"


def owned(public_key: bytes, name: str) -> bytes:
    return f"{owner_marker(public_key)}{name}".encode()


def test_one_owner_flooding_a_key_leaves_room_for_everyone_else():
    storage = Storage(clock=lambda: 1000.0)
    rogue = os.urandom(32)
    accepted = sum(storage.store(KEY_ID, KEY, owned(rogue, f"fake{i}"), b"x" * 16, 2000.0) for i in range(1024))
    share = int(storage.max_subkeys * storage.owner_share)
    assert accepted == share  # the rest refused: over its share of the key
    newcomers = [os.urandom(32) for _ in range(4)]
    assert all(storage.store(KEY_ID, KEY, owned(pk, "report"), b"y" * 64, 2000.0) for pk in newcomers)
    assert len(storage.get(KEY_ID).subkeys) == share + len(newcomers)


def test_padded_records_by_one_owner_cannot_fill_the_key_bytes():
    storage = Storage(clock=lambda: 1000.0)
    rogue = os.urandom(32)
    padded = b"p" * (1 << 20)  # two of these would fill the key's 2 MiB
    assert not storage.store(KEY_ID, KEY, owned(rogue, "a"), padded, 2000.0)
    assert storage.store(KEY_ID, KEY, owned(rogue, "a"), b"p" * 1000, 2000.0)  # its own fair share is fine
    assert storage.store(KEY_ID, KEY, owned(os.urandom(32), "report"), b"y" * 64, 2000.0)


def test_unowned_subkeys_keep_the_per_key_limits_only():
    storage = Storage(clock=lambda: 1000.0, max_subkeys=200)
    assert all(storage.store(KEY_ID, KEY, f"plain{i}".encode(), b"v", 2000.0) for i in range(200))
    assert not storage.store(KEY_ID, KEY, b"plain-over", b"v", 2000.0)


def test_a_progress_record_with_an_extra_field_is_refused_by_name():
    good = {"epoch": 3, "samples": 10, "samples_per_second": 1.5, "time": 1000.0}
    assert PeerProgress.model_validate(good).epoch == 3
    with pytest.raises(pydantic.ValidationError, match="padding"):
        PeerProgress.model_validate({**good, "padding": "x" * 100_000})
