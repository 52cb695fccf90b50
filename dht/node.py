"""DHTNode: the async Kademlia node — joining, store and get, and the upkeep of its routing table.

The node ties the parts together: its records are made and read in ``records.py``, kept in
``storage.py``, and its contacts in ``routing.py``; lookups run in ``traverse.py`` (one traversal
serves many keys); the messages and the handlers that answer other peers are ``protocol.py``'s.
What stays here is what a node decides: which records to write where, what to believe of what
peers answer, and whom to keep as contacts.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt

from p2p import (
    P2P,
    Identity,
    NotAMember,
    P2PError,
    PeerAddress,
    PeerGone,
    PeerID,
    PeerIDMismatch,
    PeerUnreachable,
    RemoteError,
)
from p2p.node import CallContext

from . import protocol
from .clock import SwarmClock, local_time
from .protocol import FIND, PING, STORE, DHTHandlers, FindAnswer
from .records import RecordCodec, ValueWithExpiration, check_size
from .routing import Contact, RoutingTable, key_id, node_id_of, serialize_key
from .storage import Entry, Storage, merge_entries
from .traverse import Search, traverse
from .validation import CompositeValidator, DHTRecord, RecordValidator, SignatureValidator, show_raw

logger = logging.getLogger(__name__)

_MAX_SUSPECTS = 1024  # past this many, the expired ones are dropped
JOIN_ATTEMPTS = 3  # tries of an initial peer that is slow to answer (a busy head), each within rpc_timeout


def _worth_another_try(error: BaseException) -> bool:
    """An initial peer that refused the connection (nothing listens), proved another identity or
    refused us as a member will do the same again; one that did not answer in time may be busy."""
    return isinstance(error, P2PError) and not isinstance(error, (PeerGone, PeerIDMismatch, NotAMember))


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
        self.records = RecordCodec(self.validator, self.storage, max_key_bytes=max_key_bytes,
                                   max_value_bytes=max_value_bytes, max_expiration=max_expiration,
                                   on_dropped=_log_dropped)
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
        # what this node asked of the network, for cost measurements: RPCs sent by method name
        # ("dht.find", ...), "get_many" calls and the "keys_traversed" that needed a lookup
        self.stats: collections.Counter[str] = collections.Counter()
        self.handlers = DHTHandlers(p2p, self.storage, self.routing, bucket_size=bucket_size,
                                    max_key_bytes=max_key_bytes, max_value_bytes=max_value_bytes,
                                    local_time=self.clock.local, learn_sender=self._learn_sender,
                                    check_value=self.records.user_value)
        if not self.client_mode:
            self.handlers.register()

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
    def peer_id(self) -> PeerID:
        return self.p2p.peer_id

    @property
    def address(self) -> PeerAddress | None:
        return self.p2p.address

    @property
    def _announce(self) -> str | None:
        return self.p2p.listen_address_str

    # ---- joining -------------------------------------------------------------------------------
    async def _greet(self, addr: PeerAddress) -> PeerID:
        """The identity of initial peer ``addr``; one slow to answer gets ``JOIN_ATTEMPTS`` tries."""
        def retrying(state: RetryCallState) -> None:
            logger.info("initial peer %s did not answer (attempt %d of %d): %s", addr, state.attempt_number,
                        JOIN_ATTEMPTS, state.outcome.exception() if state.outcome else None)

        async for attempt in AsyncRetrying(stop=stop_after_attempt(JOIN_ATTEMPTS), reraise=True,
                                           retry=retry_if_exception(_worth_another_try), before_sleep=retrying):
            with attempt:
                peer_id = await self.p2p.connect(addr, timeout=self.rpc_timeout)
        return peer_id

    async def bootstrap(self, initial_peers: Sequence[str | PeerAddress]) -> None:
        """Learn the initial peers' identities, then look ourselves up to fill the routing table."""
        addresses = [PeerAddress.parse(p) for p in initial_peers]
        refusals: list[NotAMember] = []

        async def meet(addr: PeerAddress) -> Contact | None:
            try:
                peer_id = await self._greet(addr)
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
        search = Search(self.node_id, None, self.bucket_size, stop_on_value=False)
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
        record = self.records.make(key, value, float(expiration_time), subkey)
        kid = key_id(record.key)
        targets = [c for c in at if c is not None or not self.client_mode]  # a client keeps no records
        return (await self._put([record], {kid: [0]}, {kid: targets}))[0]

    async def nearest_replicas(self, key: Any) -> list[Contact | None]:
        """The ``num_replicas`` peers nearest to ``key`` by one lookup (None: this node), for ``store(at=)``."""
        raw = serialize_key(key)
        check_size("key", raw, self.max_key_bytes)
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
        records = [self.records.make(k, v, float(e), s) for k, v, e, s in zip(keys, values, exps, subs, strict=True)]
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

    async def get(self, key: Any, latest: bool = False, *,
                  at: Sequence[Contact | None] | None = None) -> ValueWithExpiration | None:
        """The value under ``key``, or None.  ``latest`` asks every nearest replica, not the first.

        ``at``: the replicas ``nearest_replicas(key)`` found: ask each of them once, with no lookup and
        no contacts in the answers (a reader that polls one key, as a progress view does).
        """
        if at is not None:
            return await self._get_at(key, at)
        return (await self.get_many([key], latest))[key]

    async def _get_at(self, key: Any, replicas: Sequence[Contact | None]) -> ValueWithExpiration | None:
        raw = serialize_key(key)
        check_size("key", raw, self.max_key_bytes)
        kid = key_id(raw)
        local = self.storage.get(kid) if None in replicas and not self.client_mode else None
        search = Search(kid, raw, self.num_replicas, stop_on_value=False)
        contacts = [c for c in replicas if c is not None]
        answers = await asyncio.gather(*(self._call_find(c, [kid], True, contacts=0) for c in contacts))
        for contact, answer in zip(contacts, answers, strict=True):
            if answer is not None:
                self._absorb(search, contact, answer[0][0], [])
        best = local
        for _, entry in search.found:
            best = merge_entries(best, entry)
        return self.records.decode(best)

    async def get_many(self, keys: Sequence[Any], latest: bool = False,
                       alpha: int | None = None) -> dict[Any, ValueWithExpiration | None]:
        """The values under ``keys`` (None where there is none), with one traversal for all of them.
        ``alpha``: contacts asked at once per key (default the node's); 1 for a read that may be slow
        but should cost little (a background refresh: one replica asked, not three).
        """
        serialized = {k: serialize_key(k) for k in keys}
        for raw in serialized.values():
            check_size("key", raw, self.max_key_bytes)
        local: dict[int, Entry | None] = {}
        searches: dict[int, Search] = {}
        for raw in serialized.values():
            kid = key_id(raw)
            local[kid] = None if self.client_mode else self.storage.get(kid)
            if local[kid] is None or latest:
                searches[kid] = self._new_search(kid, raw, self.num_replicas, stop_on_value=not latest)
        self.stats["get_many"] += 1
        self.stats["keys_traversed"] += len(searches)
        if searches:
            await self._traverse(list(searches.values()), want_values=True, alpha=alpha)
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
            out[k] = self.records.decode(best)
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
            self.handlers.unregister()

    # ---- lookups -------------------------------------------------------------------------------
    def _new_search(self, target: int, key: bytes | None, want: int, stop_on_value: bool) -> Search:
        search = Search(target, key, want, stop_on_value)
        for c in self.routing.nearest(target, self.bucket_size):
            search.candidates[c.node_id] = c
        return search

    def _replica_set(self, search: Search) -> list[Contact | None]:
        """The ``num_replicas`` nearest peers to a key, ``None`` standing for this node itself."""
        ranked: list[tuple[int, Contact | None]] = list(search.responded[: self.num_replicas])
        if not self.client_mode:
            ranked.append((self.node_id ^ search.target, None))
            ranked.sort(key=lambda dc: dc[0])
        return [c for _, c in ranked[: self.num_replicas]]

    async def _traverse(self, searches: list[Search], want_values: bool, alpha: int | None = None) -> None:
        await traverse(searches, alpha or self.alpha, self._call_find, self._absorb, want_values)

    def _absorb(self, search: Search, contact: Contact, entry: Entry | None, contacts: list) -> None:
        """Take ``contact``'s answer about ``search``'s key: only records that validate count as found,
        and neither this node nor a suspect becomes a candidate."""
        search.add_responder(contact)
        if entry is not None and search.key is not None:
            entry = self.records.validated(search.key, entry)
            if entry is not None:
                search.found.append((contact, entry))
        search.add_candidates(contacts, self._excluded)

    def _excluded(self, node_id: int) -> bool:
        return node_id == self.node_id or self._suspected(node_id)

    def _refresh_stale(self, kid: int, best: Entry, search: Search, local: Entry | None,
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
    async def _send(self, target: PeerAddress | PeerID, method: str, request: Any, timeout: float) -> Any:
        """One DHT RPC, counted in ``stats`` (what a lookup costs is measured in these)."""
        self.stats[method] += 1
        return await self.p2p.call(target, method, request, timeout=timeout)

    async def _call_find(self, contact: Contact, targets: list[int], want_values: bool,
                         contacts: int | None = None) -> list[FindAnswer] | None:
        """Ask ``contact`` about ``targets`` (and at most ``contacts`` contacts near each, None: a
        bucket's worth); None (and the contact forgotten) if it fails or lies."""
        request = protocol.find_request(self._announce, targets, want_values, contacts)
        try:
            response = await self._send(contact.address, FIND, request, self.rpc_timeout)
            answers = protocol.find_answers(response, len(targets), self.bucket_size)
        except (P2PError, ValueError, TypeError) as e:
            self._forget(contact, e)
            return None
        self._seen(contact)
        return answers

    async def _call_store(self, contact: Contact, records: list[DHTRecord]) -> list[bool | str]:
        results: list[bool | str] = []
        for chunk in protocol.store_chunks(records):
            request = protocol.store_request(self._announce, chunk)
            try:
                response = await self._send(contact.address, STORE, request, self.rpc_timeout)
                chunk_results = protocol.store_results(response, len(chunk))
            except (P2PError, ValueError, TypeError) as e:
                self._forget(contact, e)
                return results + [False] * (len(records) - len(results))
            results.extend(chunk_results)
        self._seen(contact)
        return results

    async def _ping(self, contact: Contact, timeout: float | None = None, forget: bool = True) -> bool:
        sent = time.monotonic()
        try:
            reply = await self._send(contact.address, PING, protocol.ping_request(self._announce),
                                     self.rpc_timeout if timeout is None else timeout)
        except P2PError as e:
            if forget:
                self._forget(contact, e)
            else:
                logger.debug("clock sample from %s failed: %s", contact.peer_id, e)
            return False
        if self.clock_sample_interval > 0 and isinstance(reply, dict):
            self.clock.record(contact.node_id, reply.get(protocol.TIME), sent, time.monotonic())
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
            await self._send(target, PING, protocol.ping_request(self._announce), timeout)
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

def _log_dropped(key: bytes, reasons: list[str]) -> None:
    if reasons:
        logger.debug("left out %d record(s) of key %s that failed validation, first: %s",
                     len(reasons), show_raw(key), reasons[0])

