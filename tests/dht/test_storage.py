"""Storage: later expiration wins, deterministic ties, subkey merges, expiry and capacity."""

from __future__ import annotations

from dht.storage import Entry, Storage, merge_entries
from tests.fakes.clock import FakeClock


def make(clock: FakeClock, **kw) -> Storage:
    return Storage(clock=clock, clock_drift=0.0, **kw)


def test_later_expiration_wins_and_ties_are_deterministic():
    clock = FakeClock()
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
    clock = FakeClock()
    s = make(clock)
    assert s.store(1, b"k", None, b"v", 1001)
    assert not s.store(2, b"k2", None, b"v", 999)
    clock.now = 1002
    assert s.get(1) is None and len(s) == 0


def test_subkeys_merge_and_expire_independently():
    clock = FakeClock()
    s = make(clock)
    assert s.store(1, b"k", b"a", b"1", 1010)
    assert s.store(1, b"k", b"b", b"2", 1020)
    assert not s.store(1, b"k", b"a", b"0", 1005)
    assert s.get(1).subkeys == {b"a": (b"1", 1010), b"b": (b"2", 1020)}
    clock.now = 1015
    assert s.get(1).subkeys == {b"b": (b"2", 1020)}


def test_a_live_dictionary_beats_any_plain_value():
    clock = FakeClock()
    s = make(clock)
    s.store(1, b"k", b"a", b"1", 1010)
    assert not s.store(1, b"k", None, b"plain", 1009)
    assert not s.store(1, b"k", None, b"plain", 1011)  # a later plain value does not wipe a shared dictionary
    assert s.get(1).subkeys == {b"a": (b"1", 1010)}
    clock.now = 1010.5  # every subkey expired: the key is free
    assert s.store(1, b"k", None, b"plain", 1011)
    assert s.get(1).value == b"plain"
    assert s.store(1, b"k", b"z", b"2", 1011)  # a subkey write replaces a plain value
    assert s.get(1).subkeys == {b"z": (b"2", 1011)}


def test_replicas_converge_on_plain_and_dictionary_records_in_any_order():
    records = [(None, b"p", 1020.0), (b"a", b"1", 1010.0), (None, b"q", 1030.0), (b"b", b"2", 1005.0)]
    views = []
    for order in (records, records[::-1], records[1:] + records[:1]):
        st = make(FakeClock())
        for sk, v, exp in order:
            st.store(1, b"k", sk, v, exp)
        views.append(st.get(1))
    assert all(v == views[0] for v in views) and views[0].subkeys == {b"a": (b"1", 1010.0), b"b": (b"2", 1005.0)}
    plain = Entry(b"k", b"p", 1020.0)
    assert merge_entries(plain, views[0]) == merge_entries(views[0], plain) == views[0]


def test_expirations_too_far_ahead_are_refused():
    clock = FakeClock()
    s = make(clock, max_expiration=100)
    assert not s.store(1, b"k", None, b"v", 1101)
    assert not s.store(1, b"k", b"sub", b"v", 1101)
    assert s.store(1, b"k", None, b"v", 1100)


def test_a_key_is_bounded_in_subkeys_and_bytes():
    clock = FakeClock()
    s = make(clock, max_subkeys=3, max_key_total_bytes=40)
    for i in range(3):
        assert s.store(1, b"k", b"s%d" % i, b"v", 1010)
    assert not s.store(1, b"k", b"s3", b"v", 1010)  # a fourth subkey
    assert s.store(1, b"k", b"s0", b"w", 1011)  # updating a held subkey is fine
    assert not s.store(1, b"k", b"s1", b"x" * 40, 1011)  # would total over 40 bytes
    assert s.get(1).subkeys == {b"s0": (b"w", 1011), b"s1": (b"v", 1010), b"s2": (b"v", 1010)}


def test_merge_entries_is_order_independent():
    a = Entry(b"k", subkeys={b"x": (b"1", 5.0), b"y": (b"2", 6.0)})
    b = Entry(b"k", subkeys={b"x": (b"3", 7.0), b"z": (b"4", 1.0)})
    assert merge_entries(a, b).subkeys == merge_entries(b, a).subkeys == {
        b"x": (b"3", 7.0), b"y": (b"2", 6.0), b"z": (b"4", 1.0)}


def test_capacity_evicts_the_soonest_expiring_record():
    clock = FakeClock()
    s = make(clock, max_records=3)
    for i, exp in enumerate([1050, 1010, 1030]):
        s.store(i, b"k%d" % i, None, b"v", exp)
    s.store(9, b"k9", None, b"v", 1040)
    assert sorted(s.keys()) == [0, 2, 9]
