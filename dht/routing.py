"""Kademlia ids and the routing table: k-buckets with a replacement cache and bucket splitting."""

from __future__ import annotations

import bisect
import hashlib
import heapq
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import msgpack

from p2p import PeerAddress, PeerID

ID_BITS = 160
ID_BYTES = ID_BITS // 8
MAX_ID = 1 << ID_BITS


def serialize_key(key: object) -> bytes:
    """Keys are msgpack-serializable values (str, bytes, int, tuples of those); bytes on the wire."""
    try:
        return msgpack.packb(key, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise TypeError(f"DHT keys and subkeys must be msgpack-serializable, got {type(key).__name__}: {e}") from None


def key_id(key_bytes: bytes) -> int:
    """Where a serialized key lives in id space."""
    return int.from_bytes(hashlib.sha256(b"spotswarm/dht/key\x00" + key_bytes).digest()[:ID_BYTES], "big")


def node_id_of(peer_id: PeerID) -> int:
    """A node's id follows from its PeerID, which the p2p handshake proves: ids cannot be chosen freely."""
    return int.from_bytes(peer_id.digest[:ID_BYTES], "big")


def id_to_bytes(value: int) -> bytes:
    return value.to_bytes(ID_BYTES, "big")


def id_from_bytes(raw: bytes) -> int:
    if not isinstance(raw, bytes) or len(raw) != ID_BYTES:
        raise ValueError(f"a DHT id is {ID_BYTES} bytes")
    return int.from_bytes(raw, "big")


@dataclass(frozen=True, slots=True)
class Contact:
    """A peer we can reach: its id in the DHT, its PeerID, and where it listens."""

    node_id: int
    peer_id: PeerID
    address: PeerAddress  # pinned to peer_id

    @classmethod
    def make(cls, peer_id: PeerID, host: str, port: int) -> Contact:
        return cls(node_id_of(peer_id), peer_id, PeerAddress(host, port, peer_id))

    def to_wire(self) -> list:
        return [self.peer_id.digest, self.address.host, self.address.port]

    @classmethod
    def from_wire(cls, raw: object) -> Contact:
        """Parse [peer id digest, host, port]; raises ValueError on anything else."""
        if not isinstance(raw, list) or len(raw) != 3:
            raise ValueError("contact must be [peer_id, host, port]")
        digest, host, port = raw
        if not isinstance(host, str) or not isinstance(port, int) or not isinstance(digest, bytes):
            raise ValueError("contact must be [bytes, str, int]")
        return cls.make(PeerID(digest), host, port)


class KBucket:
    """Contacts whose ids fall in [lower, upper), least recently seen first."""

    __slots__ = ("lower", "upper", "depth", "size", "nodes", "replacements", "last_updated")

    def __init__(self, lower: int, upper: int, depth: int, size: int) -> None:
        self.lower, self.upper, self.depth, self.size = lower, upper, depth, size
        self.nodes: OrderedDict[int, Contact] = OrderedDict()
        self.replacements: OrderedDict[int, Contact] = OrderedDict()
        self.last_updated = time.monotonic()

    def covers(self, node_id: int) -> bool:
        return self.lower <= node_id < self.upper

    def add_or_update(self, contact: Contact) -> bool:
        """Move a known contact to the most-recent end, or add it if there is room; False if full."""
        self.last_updated = time.monotonic()
        if contact.node_id in self.nodes:
            self.nodes[contact.node_id] = contact
            self.nodes.move_to_end(contact.node_id)
            return True
        if len(self.nodes) < self.size:
            self.nodes[contact.node_id] = contact
            return True
        self.replacements[contact.node_id] = contact
        self.replacements.move_to_end(contact.node_id)
        while len(self.replacements) > self.size:
            self.replacements.popitem(last=False)
        return False

    def remove(self, node_id: int) -> Contact | None:
        """Drop a contact; the freshest replacement takes its place and is returned."""
        self.replacements.pop(node_id, None)
        if self.nodes.pop(node_id, None) is not None and self.replacements:
            replacement_id, replacement = self.replacements.popitem(last=True)
            self.nodes[replacement_id] = replacement
            return replacement
        return None

    def least_recently_seen(self) -> Contact:
        return next(iter(self.nodes.values()))

    def split(self) -> tuple[KBucket, KBucket]:
        middle = (self.lower + self.upper) // 2
        left = KBucket(self.lower, middle, self.depth + 1, self.size)
        right = KBucket(middle, self.upper, self.depth + 1, self.size)
        for contact in self.nodes.values():
            (left if contact.node_id < middle else right).add_or_update(contact)
        for contact in self.replacements.values():
            (left if contact.node_id < middle else right).add_or_update(contact)
        return left, right


class RoutingTable:
    """The contacts a node knows, organized so that it knows many peers near itself and a few far away.

    ``depth_modulo`` relaxes Kademlia's split rule (split only the bucket holding our own id): a
    bucket also splits while its depth is not a multiple of it, which keeps lookups short in
    unbalanced id distributions.
    """

    def __init__(self, node_id: int, bucket_size: int = 20, depth_modulo: int = 5) -> None:
        self.node_id = node_id
        self.bucket_size = bucket_size
        self.depth_modulo = depth_modulo
        self.buckets = [KBucket(0, MAX_ID, 0, bucket_size)]
        self._lowers = [0]
        self._by_id: dict[int, Contact] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, node_id: int) -> bool:
        return node_id in self._by_id

    def get(self, node_id: int) -> Contact | None:
        return self._by_id.get(node_id)

    def contacts(self) -> list[Contact]:
        return list(self._by_id.values())

    def bucket_for(self, node_id: int) -> KBucket:
        return self.buckets[bisect.bisect_right(self._lowers, node_id) - 1]

    def add_or_update(self, contact: Contact) -> Contact | None:
        """Record that ``contact`` is alive.  Returns a contact to ping when the bucket is full:
        if that one turns out dead, ``remove`` it and the newcomer moves in from the replacements."""
        if contact.node_id == self.node_id:
            return None
        while True:
            bucket = self.bucket_for(contact.node_id)
            if bucket.add_or_update(contact):
                self._by_id[contact.node_id] = contact
                return None
            if bucket.covers(self.node_id) or bucket.depth % self.depth_modulo != 0:
                self._split(bucket)
                continue
            return bucket.least_recently_seen()

    def remove(self, node_id: int) -> None:
        bucket = self.bucket_for(node_id)
        promoted = bucket.remove(node_id)
        self._by_id.pop(node_id, None)
        if promoted is not None:
            self._by_id[promoted.node_id] = promoted

    def nearest(self, target: int, k: int, exclude: int | None = None) -> list[Contact]:
        """The ``k`` known contacts closest to ``target`` by XOR distance, closest first."""
        pool: Iterable[Contact] = self._by_id.values()
        if exclude is not None and exclude in self._by_id:
            pool = (c for c in pool if c.node_id != exclude)
        return heapq.nsmallest(k, pool, key=lambda c: c.node_id ^ target)

    def stale_buckets(self, older_than: float) -> list[KBucket]:
        now = time.monotonic()
        return [b for b in self.buckets if now - b.last_updated > older_than]

    def _split(self, bucket: KBucket) -> None:
        index = self.buckets.index(bucket)
        left, right = bucket.split()
        self.buckets[index:index + 1] = [left, right]
        self._lowers[index:index + 1] = [left.lower, right.lower]
        for half in (left, right):  # replacements may have moved into the room a split made
            self._by_id.update(half.nodes)
