"""DHTNode: the async Kademlia node — RPC handlers, batched iterative lookups, store and get.

One lookup serves many keys at once: every round, each unfinished key picks up to ``alpha`` of its
closest not-yet-asked contacts, and a contact picked by several keys gets one request for all of
them.  Responses are processed as they arrive, so one slow peer delays only its own keys.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from p2p import P2P, Identity, NotAMember, P2PError, PeerAddress, PeerID, PeerUnreachable, RemoteError
from p2p.node import CallContext

from .clock import SwarmClock, local_time
from .routing import ID_BYTES, Contact, RoutingTable, id_from_bytes, id_to_bytes, key_id, node_id_of, serialize_key
from .storage import Entry, Storage, merge_entries
from .validation import CompositeValidator, DHTRecord, RecordValidator, SignatureValidator, ValidationError, show_raw

logger = logging.getLogger(__name__)

_MAX_SUSPECTS = 1024  # past this many, the expired ones are dropped

PING, STORE, FIND = "dht.ping", "dht.store", "dht.find"
_MAX_KEYS_PER_REQUEST = 256
_RESPONSE_VALUE_BUDGET = 4 << 20  # bytes of values in one find response; the rest answer "not here"


class RecordTooLarge(ValueError):
    """A key, subkey or value is over the node's size limits."""


@dataclass(frozen=True)
class ValueWithExpiration:
    """A value read from the DHT.  For a dictionary key, ``value`` maps each subkey to one of these."""

    value: Any
    expiration_time: float


@dataclass
class _Search:
    """The state of one key's lookup within a batched traversal."""

    target: int
    key: bytes | None  # set when looking for values: needed to validate what peers return
    want: int
    stop_on_value: bool
    candidates: dict[int, Contact] = field(default_factory=dict)
    queried: set[int] = field(default_factory=set)
    responded: list[tuple[int, Contact]] = field(default_factory=list)
    found: list[tuple[Contact, Entry]] = field(default_factory=list)
    in_flight: int = 0
    finished: bool = False

    def next_to_query(self, n: int) -> list[Contact]:
        """Closest unasked candidates that could still improve the ``want`` nearest responders."""
        if n <= 0:
            return []
        bound = self.responded[self.want - 1][0] if len(self.responded) >= self.want else None
        pool = sorted((c.node_id ^ self.target, i, c) for i, c in self.candidates.items() if i not in self.queried)
        return [c for d, _, c in pool[:n] if bound is None or d < bound]

    def add_responder(self, contact: Contact) -> None:
        self.responded.append((contact.node_id ^ self.target, contact))
        self.responded.sort(key=lambda dc: dc[0])

    def nearest(self, n: int) -> list[Contact]:
        return [c for _, c in self.responded[:n]]

    def update_finished(self) -> None:
        if self.stop_on_value and self.found:
            self.finished = True
        elif self.in_flight == 0 and not self.next_to_query(1):
            self.finished = True


class DHTNode:
    """A DHT peer on an event loop.  Create with ``await DHTNode.create(...)``.

    Values are any msgpack-serializable Python data (None, bool, int, float, str, bytes, lists,
    dicts; tuples come back as lists). Keys and subkeys are hashable msgpack-serializable data
    (a tuple subkey comes back as a tuple).  Expiration times are absolute wall-clock seconds by
    the swarm clock (``node.clock.now()``), at most ``max_expiration`` ahead.

    ``clock`` is this machine's wall clock (``dht.clock.local_time``: ``time.time()``); ``node.clock``
    is the swarm clock built on it, corrected toward the peers' clocks from a ping to
    ``clock_sample_peers`` contacts every ``clock_sample_interval`` seconds (0: no correction, for a
    clock that does not advance with ``time.monotonic()``, such as a test's frozen one).

    Owner signatures are checked even with no validators given (``verify_signatures``); a
    ``SignatureValidator`` passed in ``validators`` also signs this node's owned records.
    """

    def __init__(self, p2p: P2P, *, owns_p2p: bool, validators: Iterable[RecordValidator] = (),
                 bucket_size: int = 20, depth_modulo: int = 5, num_replicas: int = 5, alpha: int = 3,
                 rpc_timeout: float = 3.0, max_key_bytes: int = 1024, max_value_bytes: int = 1 << 20,
                 max_records: int = 100_000, clock_drift: float = 1.0, refresh_period: float = 600.0,
                 max_expiration: float = 86400.0, max_subkeys: int = 1024, max_key_total_bytes: int = 2 << 20,
                 verify_signatures: bool = True, clock: Callable[[], float] = local_time,
                 clock_sample_interval: float = 2.0, clock_sample_peers: int = 2, suspect_for: float = 10.0) -> None:
        self.p2p = p2p
        self._owns_p2p = owns_p2p
        self.node_id = node_id_of(p2p.peer_id)
        self.client_mode = p2p.client_mode
        self.routing = RoutingTable(self.node_id, bucket_size, depth_modulo)
        self.clock = SwarmClock(clock)  # what every cross-peer time comparison of this peer reads
        self.clock_sample_interval = clock_sample_interval
        self.clock_sample_peers = clock_sample_peers
        self.storage = Storage(max_records=max_records, clock=self.clock.now, clock_drift=clock_drift,
                               max_expiration=max_expiration, max_subkeys=max_subkeys,
                               max_key_total_bytes=max_key_total_bytes)
        validators = list(validators)
        if verify_signatures and not any(isinstance(v, SignatureValidator) for v in validators):
            # a replica that skipped owner signatures would store and serve forged records
            validators.append(SignatureValidator(p2p.identity))
        self.validator = CompositeValidator(validators)
        self.max_expiration = max_expiration
        self.bucket_size = bucket_size
        self.num_replicas = num_replicas
        self.alpha = alpha
        self.rpc_timeout = rpc_timeout
        self.max_key_bytes = max_key_bytes
        self.max_value_bytes = max_value_bytes
        self.refresh_period = refresh_period
        self._background: set[asyncio.Task] = set()
        self._pinging: set[int] = set()
        # contacts whose call failed, by node id: (monotonic time until which they stay out, contact)
        self.suspect_for = suspect_for
        self._suspects: dict[int, tuple[float, Contact]] = {}
        self._closed = False
        if not self.client_mode:
            p2p.register(PING, self._rpc_ping)
            p2p.register(STORE, self._rpc_store)
            p2p.register(FIND, self._rpc_find)

    @classmethod
    async def create(cls, initial_peers: Sequence[str | PeerAddress] = (), *, host: str = "127.0.0.1",
                     port: int = 0, client_mode: bool = False, identity: Identity | None = None,
                     announce_host: str | None = None, p2p: P2P | None = None, p2p_options: dict | None = None,
                     **options: Any) -> DHTNode:
        """Start a node (on its own P2P unless ``p2p`` is given) and join via ``initial_peers``."""
        owns = p2p is None
        if p2p is None:
            p2p = await P2P.create(host, port, client_mode=client_mode, identity=identity,
                                   announce_host=announce_host, **(p2p_options or {}))
        node = cls(p2p, owns_p2p=owns, **options)
        try:
            if initial_peers:
                await node.bootstrap(initial_peers)
        except BaseException:
            await node.shutdown()
            raise
        if node.refresh_period > 0:
            node.spawn(node._refresh_loop())
        if node.clock_sample_interval > 0:
            try:  # before the first record this node writes: a wrong local clock is corrected already
                await node._sample_clocks()
            except BaseException:
                await node.shutdown()
                raise
            node.spawn(node._clock_loop())
        return node

    # ---- identity ------------------------------------------------------------------------------
    @property
    def peer_id(self):
        return self.p2p.peer_id

    @property
    def address(self) -> PeerAddress | None:
        return self.p2p.address

    @property
    def _announce(self) -> str | None:
        return self.p2p.listen_address_str

    # ---- joining -------------------------------------------------------------------------------
    async def bootstrap(self, initial_peers: Sequence[str | PeerAddress]) -> None:
        """Learn the initial peers' identities, then look ourselves up to fill the routing table."""
        addresses = [PeerAddress.parse(p) for p in initial_peers]
        refusals: list[NotAMember] = []

        async def meet(addr: PeerAddress) -> Contact | None:
            try:
                peer_id = await self.p2p.connect(addr, timeout=self.rpc_timeout)
            except P2PError as e:
                logger.warning("initial peer %s is unreachable: %s", addr, e)
                if isinstance(e, NotAMember):
                    refusals.append(e)
                return None
            return Contact.make(peer_id, addr.host, addr.port)

        contacts = [c for c in await asyncio.gather(*(meet(a) for a in addresses)) if c is not None]
        contacts = [c for c in contacts if c.node_id != self.node_id]
        if addresses and not contacts and not any(a.peer_id == self.peer_id for a in addresses):
            if len(refusals) == len(addresses):  # say why: a missing or wrong certificate, not a dead network
                raise NotAMember(f"every initial peer refused this peer as a member of its run: {refusals[0]}")
            raise PeerUnreachable(f"none of the {len(addresses)} initial peers could be reached")
        search = _Search(self.node_id, None, self.bucket_size, stop_on_value=False)
        for c in contacts:
            search.candidates[c.node_id] = c
        await self._traverse([search], want_values=False)

    # ---- public API ----------------------------------------------------------------------------
    async def store(self, key: Any, value: Any, expiration_time: float, subkey: Any = None, *,
                    at: Sequence[Contact | None] | None = None) -> bool:
        """Store on the nearest peers; True if at least one replica took it (it was the newest).

        ``at``: the replicas ``nearest_replicas(key)`` found, to store there without looking again
        (a writer that updates one key soon after, as matchmaking withdraws its declaration).
        """
        if at is None:
            return (await self.store_many([key], [value], expiration_time, [subkey]))[0]
        record = self._make_record(key, value, float(expiration_time), subkey)
        kid = key_id(record.key)
        targets = [c for c in at if c is not None or not self.client_mode]  # a client keeps no records
        return (await self._put([record], {kid: [0]}, {kid: targets}))[0]

    async def nearest_replicas(self, key: Any) -> list[Contact | None]:
        """The ``num_replicas`` peers nearest to ``key`` by one lookup (None: this node), for ``store(at=)``."""
        raw = serialize_key(key)
        self._check_size("key", raw, self.max_key_bytes)
        search = self._new_search(key_id(raw), None, self.num_replicas, stop_on_value=False)
        await self._traverse([search], want_values=False)
        return self._replica_set(search)

    def still_reachable(self, replicas: Sequence[Contact | None]) -> bool:
        """Whether no peer of a replica set failed a call since it was found (a failed call drops the
        contact from the routing table), so the set may be used again without a lookup."""
        return all(c is None or c.node_id in self.routing for c in replicas)

    async def store_many(self, keys: Sequence[Any], values: Sequence[Any],
                         expiration_time: float | Sequence[float], subkeys: Sequence[Any] | None = None) -> list[bool]:
        """Store many records with one traversal; returns per record whether a replica accepted it."""
        if len(keys) != len(values):
            raise ValueError(f"store_many got {len(keys)} keys but {len(values)} values")
        exps = [expiration_time] * len(keys) if isinstance(expiration_time, (int, float)) else list(expiration_time)
        subs = list(subkeys) if subkeys is not None else [None] * len(keys)
        if len(exps) != len(keys) or len(subs) != len(keys):
            raise ValueError("store_many: keys, values, expiration times and subkeys must have equal lengths")
        records = [self._make_record(k, v, float(e), s) for k, v, e, s in zip(keys, values, exps, subs, strict=True)]
        by_key: dict[int, list[int]] = {}
        for i, rec in enumerate(records):
            by_key.setdefault(key_id(rec.key), []).append(i)
        searches = {kid: self._new_search(kid, None, self.num_replicas, stop_on_value=False) for kid in by_key}
        await self._traverse(list(searches.values()), want_values=False)
        return await self._put(records, by_key, {kid: self._replica_set(search) for kid, search in searches.items()})

    async def _put(self, records: list[DHTRecord], by_key: dict[int, list[int]],
                   replicas: dict[int, list[Contact | None]]) -> list[bool]:
        """Send each key's records to its replicas (None: keep them here), one call per peer."""
        accepted = [False] * len(records)
        outgoing: dict[int, tuple[Contact, list[int]]] = {}
        for kid, idxs in by_key.items():
            for target in replicas[kid]:
                if target is None:
                    for i in idxs:
                        rec = records[i]
                        accepted[i] |= self.storage.store(kid, rec.key, rec.subkey, rec.value, rec.expiration_time)
                else:
                    outgoing.setdefault(target.node_id, (target, []))[1].extend(idxs)

        async def send(contact: Contact, idxs: list[int]) -> None:
            results = await self._call_store(contact, [records[i] for i in idxs])
            for i, ok in zip(idxs, results, strict=True):
                if ok is True:
                    accepted[i] = True
                elif isinstance(ok, str):
                    logger.debug("%s refused a record: %s", contact.peer_id, ok)

        await asyncio.gather(*(send(c, idxs) for c, idxs in outgoing.values()))
        return accepted

    async def get(self, key: Any, latest: bool = False) -> ValueWithExpiration | None:
        """The value under ``key``, or None.  ``latest`` asks every nearest replica, not the first."""
        return (await self.get_many([key], latest))[key]

    async def get_many(self, keys: Sequence[Any], latest: bool = False) -> dict[Any, ValueWithExpiration | None]:
        serialized = {k: serialize_key(k) for k in keys}
        for raw in serialized.values():
            self._check_size("key", raw, self.max_key_bytes)
        local: dict[int, Entry | None] = {}
        searches: dict[int, _Search] = {}
        for raw in serialized.values():
            kid = key_id(raw)
            local[kid] = None if self.client_mode else self.storage.get(kid)
            if local[kid] is None or latest:
                searches[kid] = self._new_search(kid, raw, self.num_replicas, stop_on_value=not latest)
        if searches:
            await self._traverse(list(searches.values()), want_values=True)
        out: dict[Any, ValueWithExpiration | None] = {}
        for k, raw in serialized.items():
            kid = key_id(raw)
            search = searches.get(kid)
            found = search.found if search else []
            best = local[kid]
            for _, entry in found:
                best = merge_entries(best, entry)
            if best is not None and search is not None:
                self._refresh_stale(kid, best, search, local[kid], include_empty=latest)
            out[k] = self._decode(best)
        return out

    async def shutdown(self) -> None:
        """Stop background work and (if this node owns it) the P2P endpoint."""
        if self._closed:
            return
        self._closed = True
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._owns_p2p:
            await self.p2p.shutdown()
        else:
            for method in (PING, STORE, FIND):
                self.p2p.unregister(method)

    # ---- records -------------------------------------------------------------------------------
    def _check_size(self, what: str, raw: bytes, limit: int) -> None:
        if len(raw) > limit:
            raise RecordTooLarge(f"{what} of {len(raw)} bytes exceeds the limit of {limit} bytes")

    def _make_record(self, key: Any, value: Any, expiration_time: float, subkey: Any) -> DHTRecord:
        ahead = expiration_time - self.storage.clock()
        if not ahead <= self.max_expiration:  # NaN too
            raise ValueError(f"expiration time {expiration_time} for key {key!r} is {ahead:.0f} s from now; "
                             f"records may expire at most max_expiration={self.max_expiration:g} s ahead "
                             "(re-store before it passes to keep a record longer)")
        key_raw = serialize_key(key)
        self._check_size("key", key_raw, self.max_key_bytes)
        sub_raw = None if subkey is None else serialize_key(subkey)
        if sub_raw is not None:
            self._check_size("subkey", sub_raw, self.max_key_bytes)
        try:
            value_raw = msgpack.packb(value, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as e:
            raise TypeError(f"DHT values must be msgpack-serializable: {e}") from None
        self._check_size("value", value_raw, self.max_value_bytes)
        record = self.validator.sign(DHTRecord(key_raw, sub_raw, value_raw, expiration_time))
        self._check_size("signed value", record.value, self.max_value_bytes + 1024)
        self.validator.check(record)  # the writer gets the reason a replica would refuse with
        return record

    def _user_value(self, record: DHTRecord) -> Any:
        """The value a received record carries; ValidationError if a validator refuses it or it does not decode."""
        plain = self.validator.check(record).value
        try:
            return msgpack.unpackb(plain, raw=False, strict_map_key=False)
        except Exception:  # msgpack raises several types (ExtraData, FormatError, StackError, ...)
            sub = "" if record.subkey is None else f" subkey {show_raw(record.subkey)}"
            raise ValidationError(f"key {show_raw(record.key)}{sub}: value is not valid msgpack") from None

    def _validated(self, key: bytes, entry: Entry) -> Entry | None:
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
                self._user_value(DHTRecord(key, subkey, value, exp))
                if subkey is not None:
                    _decode_subkey(subkey)
            except ValidationError as e:
                dropped.append(str(e))
                continue
            good[subkey] = (value, exp)
        _log_dropped(key, dropped)
        if not good:
            return None
        if entry.subkeys is None:
            return Entry(key, *good[None])
        return Entry(key, subkeys={sk: vx for sk, vx in good.items() if sk is not None})

    def _decode(self, entry: Entry | None) -> ValueWithExpiration | None:
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
                value = self._user_value(DHTRecord(alive.key, None, alive.value, alive.expiration_time))
            except ValidationError as e:
                _log_dropped(alive.key, [str(e)])
                return None
            return ValueWithExpiration(value, alive.expiration_time)
        items: dict[Any, ValueWithExpiration] = {}
        for sk, (v, e) in alive.subkeys.items():
            try:
                items[_decode_subkey(sk)] = ValueWithExpiration(self._user_value(DHTRecord(alive.key, sk, v, e)), e)
            except ValidationError as err:
                dropped.append(str(err))
        _log_dropped(alive.key, dropped)
        if not items:
            return None
        return ValueWithExpiration(items, max(item.expiration_time for item in items.values()))

    # ---- lookups -------------------------------------------------------------------------------
    def _new_search(self, target: int, key: bytes | None, want: int, stop_on_value: bool) -> _Search:
        search = _Search(target, key, want, stop_on_value)
        for c in self.routing.nearest(target, self.bucket_size):
            search.candidates[c.node_id] = c
        return search

    def _replica_set(self, search: _Search) -> list[Contact | None]:
        """The ``num_replicas`` nearest peers to a key, ``None`` standing for this node itself."""
        ranked: list[tuple[int, Contact | None]] = list(search.responded[: self.num_replicas])
        if not self.client_mode:
            ranked.append((self.node_id ^ search.target, None))
            ranked.sort(key=lambda dc: dc[0])
        return [c for _, c in ranked[: self.num_replicas]]

    async def _traverse(self, searches: list[_Search], want_values: bool) -> None:
        tasks: dict[asyncio.Task, tuple[Contact, list[_Search]]] = {}
        try:
            while True:
                batch: dict[int, tuple[Contact, list[_Search]]] = {}
                for s in searches:
                    if s.finished:
                        continue
                    for c in s.next_to_query(self.alpha - s.in_flight):
                        s.queried.add(c.node_id)
                        s.in_flight += 1
                        batch.setdefault(c.node_id, (c, []))[1].append(s)
                for contact, group in batch.values():
                    for start in range(0, len(group), _MAX_KEYS_PER_REQUEST):
                        part = group[start:start + _MAX_KEYS_PER_REQUEST]
                        task = asyncio.ensure_future(self._call_find(contact, [s.target for s in part], want_values))
                        tasks[task] = (contact, part)
                for s in searches:
                    if not s.finished:
                        s.update_finished()
                if not tasks or all(s.finished for s in searches):
                    return
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    contact, group = tasks.pop(task)
                    answers = task.result()
                    if answers is None:  # dead or lying: no other key in this traversal asks it again
                        for s in searches:
                            s.queried.add(contact.node_id)
                    for i, s in enumerate(group):
                        s.in_flight -= 1
                        if answers is not None:
                            self._absorb(s, contact, *answers[i])
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    def _absorb(self, search: _Search, contact: Contact, entry: Entry | None, contacts: list) -> None:
        search.add_responder(contact)
        if entry is not None and search.key is not None:
            entry = self._validated(search.key, entry)
            if entry is not None:
                search.found.append((contact, entry))
        for raw in contacts:
            # most contacts in an answer are already known: check the id before parsing the rest
            digest = raw[0] if isinstance(raw, list) and raw else None
            if not isinstance(digest, bytes) or len(digest) < ID_BYTES:
                continue
            node_id = int.from_bytes(digest[:ID_BYTES], "big")
            if node_id == self.node_id or node_id in search.candidates or self._suspected(node_id):
                continue
            try:
                search.candidates[node_id] = Contact.from_wire(raw)
            except ValueError:
                continue  # one malformed contact does not spoil the rest of the answer

    def _refresh_stale(self, kid: int, best: Entry, search: _Search, local: Entry | None,
                       include_empty: bool) -> None:
        """Give the newest version to nearest replicas that answered with an older one (or, after a
        ``latest`` search that asked them all, with none)."""
        had = {c.node_id: e for c, e in search.found}
        for target in self._replica_set(search):
            seen = local if target is None else had.get(target.node_id)
            if seen is None and not include_empty:
                continue
            if seen is not None and merge_entries(seen, best) == seen:
                continue  # already up to date
            records = [DHTRecord(best.key, sk, v, exp) for sk, v, exp in best.records()]
            if target is None:
                for r in records:
                    self.storage.store(kid, r.key, r.subkey, r.value, r.expiration_time)
            else:
                self.spawn(self._call_store(target, records))

    # ---- outgoing RPCs -------------------------------------------------------------------------
    async def _call_find(self, contact: Contact, targets: list[int],
                         want_values: bool) -> list[tuple[Entry | None, list[Contact]]] | None:
        """Ask ``contact`` about ``targets``; None (and the contact forgotten) if it fails or lies."""
        request = {"a": self._announce, "k": [id_to_bytes(t) for t in targets], "v": want_values}
        try:
            response = await self.p2p.call(contact.address, FIND, request, timeout=self.rpc_timeout)
            if not isinstance(response, list) or len(response) != len(targets):
                raise ValueError("find answer has the wrong length")
            answers = []
            for item in response:
                if not isinstance(item, list) or len(item) != 2 or not isinstance(item[1], list):
                    raise ValueError("find answer item must be [entry, contacts]")
                entry = None if item[0] is None else Entry.from_wire(b"", item[0])
                answers.append((entry, item[1][: self.bucket_size]))
        except (P2PError, ValueError, TypeError) as e:
            self._forget(contact, e)
            return None
        self._seen(contact)
        return answers

    async def _call_store(self, contact: Contact, records: list[DHTRecord]) -> list[bool | str]:
        results: list[bool | str] = []
        for chunk in _chunks(records, _RESPONSE_VALUE_BUDGET):
            request = {"a": self._announce, "r": [[r.key, r.subkey, r.value, r.expiration_time] for r in chunk]}
            try:
                response = await self.p2p.call(contact.address, STORE, request, timeout=self.rpc_timeout)
                if not isinstance(response, list) or len(response) != len(chunk):
                    raise ValueError("store answer has the wrong length")
            except (P2PError, ValueError, TypeError) as e:
                self._forget(contact, e)
                return results + [False] * (len(records) - len(results))
            results.extend(r if isinstance(r, (bool, str)) else False for r in response)
        self._seen(contact)
        return results

    async def _ping(self, contact: Contact, timeout: float | None = None, forget: bool = True) -> bool:
        sent = time.monotonic()
        try:
            reply = await self.p2p.call(contact.address, PING, {"a": self._announce},
                                        timeout=self.rpc_timeout if timeout is None else timeout)
        except P2PError as e:
            if forget:
                self._forget(contact, e)
            else:
                logger.debug("clock sample from %s failed: %s", contact.peer_id, e)
            return False
        if self.clock_sample_interval > 0 and isinstance(reply, dict):
            self.clock.record(contact.node_id, reply.get("t"), sent, time.monotonic())
        self._seen(contact)
        return True

    # ---- routing table upkeep ------------------------------------------------------------------
    def _seen(self, contact: Contact) -> None:
        self._suspects.pop(contact.node_id, None)  # it answered, or called us: alive
        stale = self.routing.add_or_update(contact)
        if stale is not None and stale.node_id not in self._pinging and not self._closed:
            self._pinging.add(stale.node_id)
            self.spawn(self._check_stale(stale, contact))

    async def _check_stale(self, stale: Contact, newcomer: Contact) -> None:
        """Kademlia's rule: keep a full bucket's oldest contact if it still answers, else admit the newcomer."""
        try:
            if await self._ping(stale):
                return
            self.routing.add_or_update(newcomer)
        finally:
            self._pinging.discard(stale.node_id)

    def _forget(self, contact: Contact, reason: Exception) -> None:
        """Drop a contact whose call failed, and leave it out of lookups for ``suspect_for`` even when
        other peers' answers still list it: a stopped process (SIGSTOP, a frozen VM) keeps its socket
        open, so each call to it waits out the whole timeout, and every lookup that asked it again would
        hold up the records written through it (a peer's progress would look dead to the others)."""
        logger.debug("dropping contact %s: %s", contact.peer_id, reason)
        self.routing.remove(contact.node_id)
        if self.suspect_for > 0:
            now = time.monotonic()
            if len(self._suspects) >= _MAX_SUSPECTS:  # churn: peers that died and never came back
                self._suspects = {i: entry for i, entry in self._suspects.items() if entry[0] > now}
            self._suspects[contact.node_id] = (now + self.suspect_for, contact)

    def _suspected(self, node_id: int) -> bool:
        entry = self._suspects.get(node_id)
        if entry is None:
            return False
        if entry[0] <= time.monotonic():
            del self._suspects[node_id]
            return False
        return True

    def known_address(self, peer_id: PeerID) -> PeerAddress | None:
        """Where this node last reached ``peer_id`` (its routing table, else the suspects), if anywhere."""
        node_id = node_id_of(peer_id)
        contact = self.routing.get(node_id) or self._suspects.get(node_id, (0.0, None))[1]
        return None if contact is None else contact.address

    async def answers(self, peer_id: PeerID, timeout: float) -> bool:
        """Whether ``peer_id`` answers a ping now: direct evidence it is alive, where its records in
        the DHT may only be late.  A peer we know no address of counts as not answering."""
        address = self.known_address(peer_id)
        target: PeerAddress | PeerID = peer_id if address is None else address
        try:
            await self.p2p.call(target, PING, {"a": self._announce}, timeout=timeout)
        except RemoteError:
            return True  # it answered, if only to say it serves no DHT (a client-mode peer)
        except P2PError as e:
            logger.debug("%s does not answer: %s", peer_id, e)
            return False
        return True

    def _learn_sender(self, ctx: CallContext, announced: object) -> None:
        if ctx.remote_client_mode or not isinstance(announced, str):
            return
        try:
            addr = PeerAddress.parse(announced)
        except ValueError:
            return
        host = addr.host
        if host in ("0.0.0.0", "::") and isinstance(ctx.remote_address, tuple):
            host = ctx.remote_address[0]
        self._seen(Contact.make(ctx.peer_id, host, addr.port))

    async def _refresh_loop(self) -> None:
        """Look up a random id in every bucket nobody touched for a refresh period."""
        while True:
            await asyncio.sleep(self.refresh_period)
            for bucket in self.routing.stale_buckets(self.refresh_period):
                target = random.randrange(bucket.lower, bucket.upper)
                await self._traverse([self._new_search(target, None, self.bucket_size, False)], want_values=False)

    async def _sample_clocks(self) -> None:
        """Ping the ``clock_sample_peers`` least recently sampled contacts for their clocks.  A contact
        that does not answer stays: dropping contacts is for calls that needed an answer."""
        contacts = sorted(self.routing.contacts(), key=lambda c: (self.clock.last_sampled(c.node_id),
                                                                random.random()))
        timeout = min(self.rpc_timeout, 2 * self.clock.max_rtt)
        await asyncio.gather(*(self._ping(c, timeout, forget=False) for c in contacts[: self.clock_sample_peers]))
        self.clock.prune()

    async def _clock_loop(self) -> None:
        """Sample clocks every ``clock_sample_interval``: the DHT's own pings are too rare to notice
        a peer's clock step within seconds."""
        reported = self.clock.offset
        if abs(reported) > 0.5:
            logger.info("swarm clock: the local wall clock is %+.3f s off the swarm's", -reported)
        while True:
            await asyncio.sleep(self.clock_sample_interval)
            await self._sample_clocks()
            offset = self.clock.offset
            if abs(offset - reported) > 0.5:
                logger.info("swarm clock: the local wall clock is %+.3f s off the swarm's (%d peers' clocks)",
                            -offset, self.clock.voters)
                reported = offset

    def spawn(self, coro: Any) -> None:
        """Background work that lives as long as this node: cancelled and awaited at its shutdown."""
        if self._closed:
            coro.close()
            return
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- RPC handlers --------------------------------------------------------------------------
    async def _rpc_ping(self, request: Any, ctx: CallContext) -> dict:
        if isinstance(request, dict):
            self._learn_sender(ctx, request.get("a"))
        return {"a": self._announce, "t": self.clock.local()}  # uncorrected: peers take the median of these

    async def _rpc_find(self, request: Any, ctx: CallContext) -> list:
        if not isinstance(request, dict) or not isinstance(request.get("k"), list):
            raise ValueError("find request must be {'k': [ids...], 'v': bool}")
        ids = request["k"]
        if len(ids) > _MAX_KEYS_PER_REQUEST:
            raise ValueError(f"find request for {len(ids)} keys exceeds {_MAX_KEYS_PER_REQUEST}")
        targets = [id_from_bytes(raw) for raw in ids]
        self._learn_sender(ctx, request.get("a"))
        requester = node_id_of(ctx.peer_id)
        budget = _RESPONSE_VALUE_BUDGET
        out = []
        for target in targets:
            entry = self.storage.get(target) if request.get("v") else None
            wire = None
            if entry is not None:
                size = sum(len(v) for _, v, _ in entry.records())
                if size <= budget:
                    budget -= size
                    wire = entry.to_wire()
            contacts = [c.to_wire() for c in self.routing.nearest(target, self.bucket_size, exclude=requester)]
            out.append([wire, contacts])
        return out

    async def _rpc_store(self, request: Any, ctx: CallContext) -> list:
        if not isinstance(request, dict) or not isinstance(request.get("r"), list):
            raise ValueError("store request must be {'r': [[key, subkey, value, expiration]...]}")
        self._learn_sender(ctx, request.get("a"))
        return [self._store_one(item) for item in request["r"]]

    def _store_one(self, item: object) -> bool | str:
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
            self._user_value(record)
            if subkey is not None:
                _decode_subkey(subkey)
        except ValidationError as e:
            return str(e)
        return self.storage.store(key_id(key), key, subkey, value, float(exp))


def _decode_subkey(raw: bytes) -> Any:
    """A subkey as the user wrote it (tuples as tuples); ValidationError if it cannot be a dict key."""
    try:
        subkey = msgpack.unpackb(raw, raw=False, use_list=False)
        hash(subkey)
    except Exception:
        raise ValidationError(f"subkey {raw[:64]!r} does not decode to a hashable value") from None
    return subkey


def _log_dropped(key: bytes, reasons: list[str]) -> None:
    if reasons:
        logger.debug("left out %d record(s) of key %s that failed validation, first: %s",
                     len(reasons), show_raw(key), reasons[0])


def _chunks(records: list[DHTRecord], budget: int) -> list[list[DHTRecord]]:
    chunks: list[list[DHTRecord]] = [[]]
    size = 0
    for r in records:
        if chunks[-1] and (size + len(r.value) > budget or len(chunks[-1]) >= _MAX_KEYS_PER_REQUEST):
            chunks.append([])
            size = 0
        chunks[-1].append(r)
        size += len(r.value)
    return chunks
