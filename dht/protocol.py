"""The DHT's three RPCs over p2p: their names, the messages they carry, and the handlers that answer them.

``dht.ping`` says who is there (and the responder's wall clock, for the swarm clock), ``dht.find``
asks a peer for its records and its nearest contacts to up to ``MAX_KEYS_PER_REQUEST`` key ids,
``dht.store`` offers it records.  Every request names the sender's listen address, so the
responder can add it to its routing table.  docs/protocol.md ("DHT RPCs") describes the messages
for another implementation; the functions here build and check them, and :class:`DHTHandlers`
answers them from a node's storage and routing table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from p2p import P2P
from p2p.node import CallContext

from .routing import RoutingTable, id_from_bytes, id_to_bytes, key_id, node_id_of
from .storage import Entry, Storage
from .validation import DHTRecord, ValidationError, decode_subkey

PING, STORE, FIND = "dht.ping", "dht.store", "dht.find"
MAX_KEYS_PER_REQUEST = 256
RESPONSE_VALUE_BUDGET = 4 << 20  # bytes of values in one find response (and one store request)

# ---- keys of the requests and responses -----------------------------------------------------------
ADDRESS = "a"  # every request, and ping's answer: the sender's listen address "host:port" (None: client mode)
TIME = "t"  # ping's answer: the responder's local wall clock, uncorrected
KEYS = "k"  # find: the key ids asked about
WANT_VALUES = "v"  # find: whether to return the records held as well as contacts
CONTACTS = "c"  # find: at most this many contacts per key (absent: the bucket size), 0 for a read at known replicas
RECORDS = "r"  # store: the records offered, each [key, subkey, value, expiration]

FindAnswer = tuple[Entry | None, list]  # a peer's record for one key (if asked and held) and its contacts (wire form)


# ---- the caller's side ----------------------------------------------------------------------------
def ping_request(announce: str | None) -> dict:
    return {ADDRESS: announce}


def find_request(announce: str | None, targets: list[int], want_values: bool, contacts: int | None = None) -> dict:
    request = {ADDRESS: announce, KEYS: [id_to_bytes(t) for t in targets], WANT_VALUES: want_values}
    if contacts is not None:
        request[CONTACTS] = contacts
    return request


def find_answers(response: Any, n_targets: int, max_contacts: int) -> list[FindAnswer]:
    """A find response as one answer per target, each with at most ``max_contacts`` contacts;
    ValueError (or TypeError) if it does not have the protocol's shape."""
    if not isinstance(response, list) or len(response) != n_targets:
        raise ValueError("find answer has the wrong length")
    answers = []
    for item in response:
        if not isinstance(item, list) or len(item) != 2 or not isinstance(item[1], list):
            raise ValueError("find answer item must be [entry, contacts]")
        entry = None if item[0] is None else Entry.from_wire(b"", item[0])
        answers.append((entry, item[1][:max_contacts]))
    return answers


def store_chunks(records: list[DHTRecord], budget: int = RESPONSE_VALUE_BUDGET) -> list[list[DHTRecord]]:
    """``records`` cut into requests of at most ``budget`` bytes of values and MAX_KEYS_PER_REQUEST records."""
    chunks: list[list[DHTRecord]] = [[]]
    size = 0
    for r in records:
        if chunks[-1] and (size + len(r.value) > budget or len(chunks[-1]) >= MAX_KEYS_PER_REQUEST):
            chunks.append([])
            size = 0
        chunks[-1].append(r)
        size += len(r.value)
    return chunks


def store_request(announce: str | None, records: list[DHTRecord]) -> dict:
    return {ADDRESS: announce, RECORDS: [[r.key, r.subkey, r.value, r.expiration_time] for r in records]}


def store_results(response: Any, n_records: int) -> list[bool | str]:
    """A store response as one result per record: True (stored), False, or the reason it was refused;
    ValueError if it does not have one item per record."""
    if not isinstance(response, list) or len(response) != n_records:
        raise ValueError("store answer has the wrong length")
    return [r if isinstance(r, (bool, str)) else False for r in response]


# ---- the responder's side -------------------------------------------------------------------------
class DHTHandlers:
    """Answers the three RPCs for one node, from its storage and routing table.

    ``learn_sender(ctx, announced)`` lets the node add a caller to its routing table;
    ``check_value(record)`` raises ValidationError for a record the node's validators refuse (or
    whose value does not decode); ``local_time()`` is the node's uncorrected wall clock."""

    def __init__(self, p2p: P2P, storage: Storage, routing: RoutingTable, *, bucket_size: int, max_key_bytes: int,
                 max_value_bytes: int, local_time: Callable[[], float],
                 learn_sender: Callable[[CallContext, object], None],
                 check_value: Callable[[DHTRecord], Any]) -> None:
        self.p2p = p2p
        self.storage = storage
        self.routing = routing
        self.bucket_size = bucket_size
        self.max_key_bytes = max_key_bytes
        self.max_value_bytes = max_value_bytes
        self.local_time = local_time
        self.learn_sender = learn_sender
        self.check_value = check_value

    def register(self) -> None:
        self.p2p.register(PING, self.ping)
        self.p2p.register(STORE, self.store)
        self.p2p.register(FIND, self.find)

    def unregister(self) -> None:
        for method in (PING, STORE, FIND):
            self.p2p.unregister(method)

    async def ping(self, request: Any, ctx: CallContext) -> dict:
        if isinstance(request, dict):
            self.learn_sender(ctx, request.get(ADDRESS))
        # uncorrected: peers take the median of these
        return {ADDRESS: self.p2p.listen_address_str, TIME: self.local_time()}

    async def find(self, request: Any, ctx: CallContext) -> list:
        if not isinstance(request, dict) or not isinstance(request.get(KEYS), list):
            raise ValueError("find request must be {'k': [ids...], 'v': bool}")
        ids = request[KEYS]
        if len(ids) > MAX_KEYS_PER_REQUEST:
            raise ValueError(f"find request for {len(ids)} keys exceeds {MAX_KEYS_PER_REQUEST}")
        targets = [id_from_bytes(raw) for raw in ids]
        self.learn_sender(ctx, request.get(ADDRESS))
        requester = node_id_of(ctx.peer_id)
        wanted = request.get(CONTACTS, self.bucket_size)
        contacts = min(wanted, self.bucket_size) if type(wanted) is int and wanted >= 0 else self.bucket_size
        budget = RESPONSE_VALUE_BUDGET
        out = []
        for target in targets:
            entry = self.storage.get(target) if request.get(WANT_VALUES) else None
            wire = None
            if entry is not None:
                size = sum(len(v) for _, v, _ in entry.records())
                if size <= budget:
                    budget -= size
                    wire = entry.to_wire()
            out.append([wire, self._contacts_near(target, requester, contacts)])
        return out

    def _contacts_near(self, target: int, requester: int, count: int) -> list:
        if count == 0:
            return []
        return [c.to_wire() for c in self.routing.nearest(target, count, exclude=requester)]

    async def store(self, request: Any, ctx: CallContext) -> list:
        if not isinstance(request, dict) or not isinstance(request.get(RECORDS), list):
            raise ValueError("store request must be {'r': [[key, subkey, value, expiration]...]}")
        self.learn_sender(ctx, request.get(ADDRESS))
        return [self.store_one(item) for item in request[RECORDS]]

    def store_one(self, item: object) -> bool | str:
        """Store one offered record: True if stored, False if older than what is held (or otherwise
        not kept by storage's rules), or why it was refused."""
        if not isinstance(item, list) or len(item) != 4:
            return "record must be [key, subkey, value, expiration]"
        key, subkey, value, exp = item
        if not isinstance(key, bytes) or not (subkey is None or isinstance(subkey, bytes)) \
                or not isinstance(value, bytes) or not isinstance(exp, (int, float)):
            return "record fields must be bytes, bytes|None, bytes, number"
        if len(key) > self.max_key_bytes or (subkey is not None and len(subkey) > self.max_key_bytes):
            return f"key or subkey over {self.max_key_bytes} bytes"
        if len(value) > self.max_value_bytes + 1024:
            return f"value over {self.max_value_bytes} bytes"
        record = DHTRecord(key, subkey, value, float(exp))
        try:
            self.check_value(record)
            if subkey is not None:
                decode_subkey(subkey)
        except ValidationError as e:
            return str(e)
        return self.storage.store(key_id(key), key, subkey, value, float(exp))

