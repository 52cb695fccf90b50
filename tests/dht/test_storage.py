"""Storage: later expiration wins, deterministic ties, subkey merges, expiry and capacity."""

from __future__ import annotations

from dht.storage import Entry, Storage, merge_entries


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(clock: Clock, **kw) -> Storage:
    return Storage(clock=clock, clock_drift=0.0, **kw)


def test_later_expiration_wins_and_ties_are_deterministic():
    clock = Clock()
    s = make(clock)
    assert s.store(1, b"k", None, b"a", 1010)
    assert not s.store(1, b"k", None, b"b", 1005)  # older: refused
    assert s.get(1).value == b"a"
    assert s.store(1, b"k", None, b"c", 1020)
    assert s.get(1).value == b"c"
    # a tie goes to the larger value, whatever the arrival order
    other = make(clock)
    for order in ([b"x", b"y"], [b"y", b"x"]):
        st = make(clock)
        for v in order:
            st.store(2, b"k2", None, v, 1030)
        assert st.get(2).value == b"y"
    assert other.get(2) is None


def test_expired_records_vanish_and_expired_stores_are_refused():
    clock = Clock()
    s = make(clock)
    assert s.store(1, b"k", None, b"v", 1001)
    assert not s.store(2, b"k2", None, b"v", 999)
    clock.now = 1002
    assert s.get(1) is None and len(s) == 0


def test_subkeys_merge_and_expire_independently():
    clock = Clock()
    s = make(clock)
    assert s.store(1, b"k", b"a", b"1", 1010)
    assert s.store(1, b"k", b"b", b"2", 1020)
    assert not s.store(1, b"k", b"a", b"0", 1005)
    assert s.get(1).subkeys == {b"a": (b"1", 1010), b"b": (b"2", 1020)}
    clock.now = 1015
    assert s.get(1).subkeys == {b"b": (b"2", 1020)}


def test_plain_values_and_dictionaries_replace_each_other_by_expiration():
    clock = Clock()
    s = make(clock)
    s.store(1, b"k", b"a", b"1", 1010)
    assert not s.store(1, b"k", None, b"plain", 1009)
    assert s.store(1, b"k", None, b"plain", 1011)
    assert s.get(1).value == b"plain"
    assert s.store(1, b"k", b"z", b"2", 1012)
    assert s.get(1).subkeys == {b"z": (b"2", 1012)}


def test_merge_entries_is_order_independent():
    a = Entry(b"k", subkeys={b"x": (b"1", 5.0), b"y": (b"2", 6.0)})
    b = Entry(b"k", subkeys={b"x": (b"3", 7.0), b"z": (b"4", 1.0)})
    assert merge_entries(a, b).subkeys == merge_entries(b, a).subkeys == {
        b"x": (b"3", 7.0), b"y": (b"2", 6.0), b"z": (b"4", 1.0)}


def test_capacity_evicts_the_soonest_expiring_record():
    clock = Clock()
    s = make(clock, max_records=3)
    for i, exp in enumerate([1050, 1010, 1030]):
        s.store(i, b"k%d" % i, None, b"v", exp)
    s.store(9, b"k9", None, b"v", 1040)
    assert sorted(s.keys()) == [0, 2, 9]
