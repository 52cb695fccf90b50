"""Routing table: bucket splitting, the replacement cache, and nearest-contact queries."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from dht.routing import MAX_ID, Contact, RoutingTable, key_id, node_id_of, serialize_key
from p2p import Identity, PeerAddress, PeerID


def contact(node_id: int) -> Contact:
    """A contact with a chosen id (ids normally follow from PeerIDs; tests need to place them)."""
    pid = PeerID(node_id.to_bytes(20, "big") + b"\x00" * 12)
    return Contact(node_id, pid, PeerAddress("127.0.0.1", 1 + node_id % 60000, pid))


def test_node_ids_follow_from_peer_ids_and_keys_hash_stably():
    ident = Identity()
    assert node_id_of(ident.peer_id) == int.from_bytes(ident.peer_id.digest[:20], "big")
    assert key_id(serialize_key("a")) == key_id(serialize_key("a")) != key_id(serialize_key("b"))


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=MAX_ID - 1), st.lists(st.integers(min_value=0, max_value=MAX_ID - 1),
                                                              min_size=1, max_size=300, unique=True),
       st.integers(min_value=0, max_value=MAX_ID - 1), st.integers(min_value=1, max_value=30))
def test_nearest_matches_brute_force_over_what_the_table_kept(own, ids, target, k):
    table = RoutingTable(own, bucket_size=4, depth_modulo=5)
    for i in ids:
        if i != own:
            table.add_or_update(contact(i))
    kept = table.contacts()
    assert len({c.node_id for c in kept}) == len(kept) == len(table)
    expected = sorted(kept, key=lambda c: c.node_id ^ target)[:k]
    assert [c.node_id for c in table.nearest(target, k)] == [c.node_id for c in expected]
    # every bucket holds at most bucket_size contacts, all inside its range
    for b in table.buckets:
        assert len(b.nodes) <= 4 and all(b.covers(i) for i in b.nodes)


def test_buckets_near_our_own_id_split_and_keep_more_contacts():
    rng = random.Random(0)
    own = rng.randrange(MAX_ID)
    table = RoutingTable(own, bucket_size=5, depth_modulo=5)
    for _ in range(2000):
        table.add_or_update(contact(rng.randrange(MAX_ID)))
    for i in range(1, 40):  # close neighbours (differ in the lowest bits) are all kept
        table.add_or_update(contact(own ^ i))
    nearest = {c.node_id for c in table.nearest(own, 5)}
    assert nearest == {own ^ i for i in range(1, 6)}
    assert len(table.buckets) > 10


def test_full_bucket_offers_its_oldest_contact_and_promotes_a_replacement():
    own = 0
    table = RoutingTable(own, bucket_size=2, depth_modulo=1)  # modulo 1: only our own bucket splits
    far = [MAX_ID - 1 - i for i in range(3)]  # all in the far half, which cannot split
    assert table.add_or_update(contact(far[0])) is None
    assert table.add_or_update(contact(far[1])) is None
    stale = table.add_or_update(contact(far[2]))
    assert stale is not None and stale.node_id == far[0]  # least recently seen: ping it
    assert far[2] not in table
    table.remove(far[0])  # it did not answer
    assert far[2] in table and far[0] not in table
    table.add_or_update(contact(far[1]))  # refreshing a known contact never evicts
    assert set(c.node_id for c in table.contacts()) == {far[1], far[2]}
