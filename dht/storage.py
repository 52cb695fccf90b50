"""Records kept by one node: values with expiration times, or dictionaries of expiring subkeys.

The merge rule is the whole consistency model: the later expiration wins (ties go to the larger
serialized value, so every replica picks the same winner whatever order stores arrive in), and
dictionaries merge subkey by subkey.  Expired records vanish.

A dictionary is shared: many writers each own a subkey (their progress, their declaration), often
signed so that nobody else can overwrite it.  So a dictionary that still has a live subkey beats
any plain value, whatever its expiration: otherwise one writer could wipe everybody's subkeys with
a single plain value that expires later (hivemind's rule).  A plain value has no such owners:
anyone may overwrite it with a later one (unless its key names an owner, who alone may then write
it in either form), so a subkey write replacing it takes nothing a writer could not take already.
The rule is still a total order on what replicas hold, so they converge whatever order stores
arrive in.  A plain value meant for a live dictionary key is refused; once every subkey has
expired it is accepted as usual.

Limits bound what one writer can make a replica hold: expirations at most ``max_expiration``
seconds ahead, at most ``max_subkeys`` subkeys and ``max_key_total_bytes`` bytes per key.
"""

from __future__ import annotations

import functools
import heapq
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .validation import owners_in, show_raw

logger = logging.getLogger(__name__)


def _newer(value_a: bytes, exp_a: float, value_b: bytes, exp_b: float) -> bool:
    """True if (value_a, exp_a) beats (value_b, exp_b)."""
    return exp_a > exp_b or (exp_a == exp_b and value_a > value_b)


@functools.lru_cache(maxsize=1 << 16)
def _sole_owner(subkey: bytes) -> bytes | None:
    """The one owner a subkey names, or None: every store to a shared key counts its owner's subkeys,
    so each subkey's markers are parsed once, not once per store (a run's progress key holds hundreds)."""
    owners = owners_in(subkey)
    return owners[0] if len(owners) == 1 else None


@dataclass
class Entry:
    """What a node holds under one key: a single value, or subkeys each with their own expiration."""

    key: bytes
    value: bytes | None = None
    expiration_time: float = float("-inf")
    subkeys: dict[bytes, tuple[bytes, float]] | None = None

    @property
    def latest_expiration(self) -> float:
        if self.subkeys is not None:
            return max((exp for _, exp in self.subkeys.values()), default=float("-inf"))
        return self.expiration_time

    def alive(self, now: float) -> Entry | None:
        """This entry without what expired by ``now``; None if nothing is left."""
        if self.subkeys is None:
            return self if self.expiration_time > now else None
        live = {k: v for k, v in self.subkeys.items() if v[1] > now}
        if not live:
            return None
        return self if len(live) == len(self.subkeys) else Entry(self.key, subkeys=live)

    def to_wire(self) -> list:
        if self.subkeys is None:
            return [0, self.value, self.expiration_time]
        return [1, [[sk, v, exp] for sk, (v, exp) in self.subkeys.items()]]

    @classmethod
    def from_wire(cls, key: bytes, raw: object) -> Entry:
        """Parse a peer's answer; raises ValueError on anything malformed."""
        if not isinstance(raw, list) or len(raw) < 2 or raw[0] not in (0, 1):
            raise ValueError("entry must be [0, value, expiration] or [1, [[subkey, value, expiration]...]]")
        if raw[0] == 0:
            if len(raw) != 3 or not isinstance(raw[1], bytes) or not isinstance(raw[2], (int, float)):
                raise ValueError("bad single-value entry")
            return cls(key, raw[1], float(raw[2]))
        if not isinstance(raw[1], list):
            raise ValueError("bad dictionary entry")
        subkeys: dict[bytes, tuple[bytes, float]] = {}
        for item in raw[1]:
            if (not isinstance(item, list) or len(item) != 3 or not isinstance(item[0], bytes)
                    or not isinstance(item[1], bytes) or not isinstance(item[2], (int, float))):
                raise ValueError("bad subkey item")
            subkeys[item[0]] = (item[1], float(item[2]))
        return cls(key, subkeys=subkeys)

    def records(self) -> list[tuple[bytes | None, bytes, float]]:
        """(subkey, value, expiration) triples, for storing this entry elsewhere."""
        if self.subkeys is None:
            assert self.value is not None
            return [(None, self.value, self.expiration_time)]
        return [(sk, v, exp) for sk, (v, exp) in self.subkeys.items()]


def merge(old: Entry | None, key: bytes, subkey: bytes | None, value: bytes,
          expiration_time: float) -> Entry | None:
    """``old`` (only its live records) with one record applied, or None if the record loses to what is there."""
    if old is None:
        if subkey is None:
            return Entry(key, value, expiration_time)
        return Entry(key, subkeys={subkey: (value, expiration_time)})
    if subkey is None:
        if old.subkeys is not None:
            return None  # a live dictionary is shared: no single plain value replaces it (module docstring)
        assert old.value is not None
        wins = _newer(value, expiration_time, old.value, old.expiration_time)
        return Entry(key, value, expiration_time) if wins else None
    if old.subkeys is None:
        return Entry(key, subkeys={subkey: (value, expiration_time)})
    current = old.subkeys.get(subkey)
    if current is not None and not _newer(value, expiration_time, *current):
        return None
    return Entry(key, subkeys={**old.subkeys, subkey: (value, expiration_time)})


def merge_entries(a: Entry | None, b: Entry | None) -> Entry | None:
    """The union of two views of one key (live records only), by the same rule as storing b's records into a."""
    if a is None or b is None:
        return a or b
    if a.subkeys is None and b.subkeys is None:
        assert a.value is not None and b.value is not None
        return b if _newer(b.value, b.expiration_time, a.value, a.expiration_time) else a
    if a.subkeys is None or b.subkeys is None:
        return b if a.subkeys is None else a  # a live dictionary beats a plain value
    subkeys = dict(a.subkeys)
    for subkey, (value, exp) in b.subkeys.items():
        current = subkeys.get(subkey)
        if current is None or _newer(value, exp, *current):
            subkeys[subkey] = (value, exp)
    return Entry(a.key, subkeys=subkeys)


@dataclass
class Storage:
    """One node's records, bounded in count; the soonest-expiring record is evicted when full."""

    max_records: int = 100_000
    clock: Callable[[], float] = time.time
    clock_drift: float = 1.0  # a record stays alive this long past its expiration by our clock
    max_expiration: float = 86400.0  # seconds ahead of our clock (plus clock_drift) a record may expire
    max_subkeys: int = 1024  # per key: a run of several hundred peers, each with its own subkey
    max_key_total_bytes: int = 2 << 20  # per key: its live subkeys and values together
    # per owner of a shared key (subkeys naming [owner:...]): at most this fraction of either cap, but at
    # least the floors, so one member's padded or flooded subkeys cannot fill a key for everybody else
    owner_share: float = 1 / 8
    min_owner_subkeys: int = 16
    min_owner_bytes: int = 64 << 10
    _data: dict[int, Entry] = field(default_factory=dict)
    _expiry_heap: list[tuple[float, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self._data)

    def now(self) -> float:
        return self.clock() - self.clock_drift

    def store(self, key_id: int, key: bytes, subkey: bytes | None, value: bytes, expiration_time: float) -> bool:
        """Apply one record; True if it was accepted (newer than what we had, and within the limits)."""
        now = self.now()
        if expiration_time <= now:
            return False
        if not expiration_time <= self.clock() + self.max_expiration + self.clock_drift:  # NaN too
            return self._refuse(key, f"expiration {expiration_time - self.clock():.0f} s ahead exceeds "
                                     f"max_expiration={self.max_expiration:g} s")
        self._prune(now)
        old = self._data.get(key_id)
        if old is not None:
            old = old.alive(now)
        merged = merge(old, key, subkey, value, expiration_time)
        if merged is None:
            return False
        if subkey is not None and merged.subkeys is not None:
            reason = self._over_limits(merged) or self._over_owner_share(merged, subkey)
            if reason is not None:
                return self._refuse(key, f"subkey {show_raw(subkey)}: {reason}")
        if key_id not in self._data and len(self._data) >= self.max_records:
            self._evict_one()
        self._data[key_id] = merged
        heapq.heappush(self._expiry_heap, (merged.latest_expiration, key_id))
        return True

    def _over_limits(self, entry: Entry) -> str | None:
        assert entry.subkeys is not None
        if len(entry.subkeys) > self.max_subkeys:
            return f"the key already holds max_subkeys={self.max_subkeys} subkeys"
        total = sum(len(sk) + len(v) for sk, (v, _) in entry.subkeys.items())
        if total > self.max_key_total_bytes:
            return f"the key's subkeys would total {total} bytes, over max_key_total_bytes={self.max_key_total_bytes}"
        return None

    def _over_owner_share(self, entry: Entry, subkey: bytes) -> str | None:
        """The owner ``subkey`` names, over its share of the key (key filling); None for unowned subkeys."""
        assert entry.subkeys is not None
        owners = owners_in(subkey)
        if len(owners) != 1:
            return None
        owner = owners[0]
        mine = [(sk, v) for sk, (v, _) in entry.subkeys.items() if _sole_owner(sk) == owner]
        max_count = max(int(self.max_subkeys * self.owner_share), self.min_owner_subkeys)
        if len(mine) > max_count:
            return (f"its owner already holds its share of the key: {max_count} subkeys "
                    f"(owner_share={self.owner_share:g})")
        max_bytes = max(int(self.max_key_total_bytes * self.owner_share), self.min_owner_bytes)
        total = sum(len(sk) + len(v) for sk, v in mine)
        if total > max_bytes:
            return (f"its owner's subkeys would total {total} bytes, over its share of the key: {max_bytes} bytes "
                    f"(owner_share={self.owner_share:g})")
        return None

    @staticmethod
    def _refuse(key: bytes, reason: str) -> bool:
        logger.debug("refusing a record for key %s: %s", show_raw(key), reason)
        return False

    def get(self, key_id: int) -> Entry | None:
        entry = self._data.get(key_id)
        if entry is None:
            return None
        alive = entry.alive(self.now())
        if alive is None:
            del self._data[key_id]
        elif alive is not entry:
            self._data[key_id] = alive
        return alive

    def keys(self) -> list[int]:
        return list(self._data)

    def _prune(self, now: float) -> None:
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            _, key_id = heapq.heappop(heap)
            self.get(key_id)  # drops it if (still) expired; a re-stored key stays
        if len(heap) > 4 * max(len(self._data), 1024):  # stale heap entries from re-stores
            self._expiry_heap = [(e.latest_expiration, k) for k, e in self._data.items()]
            heapq.heapify(self._expiry_heap)

    def _evict_one(self) -> None:
        while self._expiry_heap:
            _, key_id = heapq.heappop(self._expiry_heap)
            if key_id in self._data:
                del self._data[key_id]
                return
