"""Matchmaking: peers that want to average under a key meet through the DHT and form a group.

Each peer declares itself under ``<prefix>.mm.<group key>`` (its subkey is its PeerID) with the
time it started looking.  The earliest declared peer that accepts connections leads: the others
send it a join request, which it answers once the group is assembled — at ``target_group_size``,
or after ``min_matchmaking_time`` with at least ``min_group_size``.  A leader that sees an earlier
one appear steps down and redirects its followers; a dead or slow leader costs its followers one
request timeout and a retry with the next candidate, never a hang.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dht import DHTNode, ReplicaSets, SignatureValidator
from dht.replicas import REUSED_FOR
from dht.validation import owner_marker, owners_in
from p2p import P2PError, PeerID
from p2p.node import CallContext
from p2p.waiting import wait_event

from .allreduce import GroupInfo, claimed_weight
from .declarations import Declaration, check_group
from .leader_probe import LeaderProbes
from .load_balancing import claims_within_reason, load_balanced_parts
from .partition import MAX_CHUNKS, MIN_CHUNK, auto_chunk_size, describe_mismatch

logger = logging.getLogger(__name__)

# How long a key's replica set, once looked up, is used again for declaring and withdrawing (see
# dht/replicas.py).  A poll for the others' declarations asks the replicas we declared at (one small
# ``find`` each, no contacts in the answers): peers that found the same nearest replicas (all of them,
# but for churn) see each other at once.  A full lookup, first and at least every FULL_LOOKUP_EVERY
# seconds, finds the declarations of a peer whose set differs as long as one of its replicas is still
# among the key's nearest.
REPLICAS_REUSED_FOR = REUSED_FOR
FULL_LOOKUP_EVERY = 1.0
# A candidate leader's handshake gets this long at most (less when others answer: see leader_probe.py).
LEADER_CONNECT_TIMEOUT = 2.0
SETTLED_POLL_FACTOR = 5  # a leader's polls after its first FULL_LOOKUP_EVERY seconds: this many intervals apart


class ShapeMismatch(ValueError):
    """This peer's tensors differ from the group's; the message names the difference."""


@dataclass(order=True)
class Candidate:
    declared_at: float
    peer_id: PeerID
    address: str | None = field(compare=False)
    bandwidth: float = field(compare=False)
    schema_hash: str = field(compare=False, default="")
    weight: float = field(compare=False, default=1.0)  # as declared; every member checks it
    unit: int | None = field(compare=False, default=None)  # a follower's unit of the level below, if planned
    declaration: Declaration | None = field(compare=False, default=None)  # its signed word (signed groups)

    @property
    def can_lead(self) -> bool:
        return self.address is not None


class _CannotForm(Exception):
    """A planned group's leader knows that too many of its members are gone for it to reach its quorum."""


@dataclass(frozen=True)
class Planned:
    """What a planned group's members know of who should come (``averaging/grouped.py``), so that its
    leader waits for nobody who will not."""

    members: tuple[PeerID, ...] = ()  # the members planned for the group (level 0), if known
    unit: int | None = None  # which unit of the level below this peer stands for


@dataclass
class _Leadership:
    group_key: str
    followers: list[Candidate] = field(default_factory=list)
    replies: dict[PeerID, asyncio.Future] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False

    def dismiss(self, why: str) -> None:
        """Release every waiting follower with a refusal, so they look for another leader."""
        self.closed = True
        for fut in self.replies.values():
            if not fut.done():
                fut.set_result({"ok": False, "why": why})


class Matchmaker:
    def __init__(self, node: DHTNode, prefix: str, schema: list, schema_hash: str, numel: int, *,
                 target_group_size: int,
                 min_group_size: int, min_matchmaking_time: float, request_timeout: float, bandwidth: float,
                 poll_interval: float = 0.05, chunk_size: int | None = None, max_chunk_size: int | None = None,
                 banned: dict[PeerID, float] | None = None, signed: bool = False,
                 ban: Callable[[PeerID, str], None] | None = None) -> None:
        if not 1 <= min_group_size <= target_group_size:
            raise ValueError(f"need 1 <= min_group_size ({min_group_size}) <= target_group_size ({target_group_size})")
        self.node = node
        self.p2p = node.p2p
        self.prefix = prefix
        self.schema = schema
        self.schema_hash = schema_hash
        self.numel = numel
        self.target_group_size = target_group_size
        self._target = target_group_size  # this call's target: at most target_group_size
        self._weight = 1.0  # this call's weight in the average
        self._min_size = min_group_size  # this call's smallest group a leader closes
        self._patience = min_matchmaking_time  # this call's wait for a full group before closing a smaller one
        self.min_group_size = min_group_size
        self.min_matchmaking_time = min_matchmaking_time
        self.request_timeout = request_timeout
        self.bandwidth = 0.0
        self.declare_bandwidth(bandwidth)
        self.poll_interval = poll_interval
        self.chunk_size = chunk_size  # what groups we lead use; None: chosen from the members' bandwidths
        self.max_chunk_size = max_chunk_size  # where a group's chunks must stay small (audits move whole chunks)
        self.banned = banned if banned is not None else {}  # peers kept out of our groups, until (monotonic)
        # signed join declarations, checked by every member (declarations.py); ``ban`` keeps out a leader
        # caught changing one
        self.signed = signed
        self.ban = ban
        self.method = f"avg.join.{prefix}"
        self._leading: _Leadership | None = None
        self._replicas = ReplicaSets(node, REPLICAS_REUSED_FOR)
        self._polls = _Polls([])
        self._planned = Planned()  # this call's: who should come
        self._gone_peers: set[PeerID] = set()  # of the planned members, those that did not answer a ping
        self._gone_units: set[int] = set()  # units of the level below declared gone under this call's key
        self._background: set[asyncio.Task] = set()
        self._withdrawn: dict[str, float] = {}  # key -> the expiration of our last withdrawal there
        # our declarations' subkey: where members are not trusted (``signed``) and the DHT signs, signed by
        # our key (one declaration per member and key, in no one else's name: _parse_candidate), else our
        # bare id (a signature per declaration, checked by every reader, is what a trusted fleet saves)
        self.signed_subkeys = signed and _signs_for(node)
        self.subkey = (owner_marker(node.p2p.identity.public_key) if self.signed_subkeys else "") + str(self.me)
        self.p2p.register(self.method, self._rpc_join)

    def _banned_now(self) -> set[PeerID]:
        """Peers whose ban has not run out (expired bans are forgotten)."""
        now = time.monotonic()
        for peer in [p for p, until in self.banned.items() if until <= now]:
            del self.banned[peer]
        return set(self.banned)

    def declare_bandwidth(self, mbit: float) -> None:
        """What the next declarations say for the load-balancing LP."""
        self.bandwidth = self.declared(mbit)

    def declared(self, mbit: float) -> float:
        """What a bandwidth of ``mbit`` is declared as: 0 by a client-mode peer (it cannot accept
        connections, so it reduces nothing)."""
        return 0.0 if self.p2p.client_mode else float(mbit)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        if self._leading is not None:
            self._leading.dismiss("leader is shutting down")
        self.p2p.unregister(self.method)
        if self._background:  # let pending withdrawals land; they are bounded by the DHT's timeouts
            await asyncio.gather(*self._background, return_exceptions=True)

    @property
    def me(self) -> PeerID:
        return self.p2p.peer_id

    def _dht_key(self, group_key: str) -> str:
        return f"{self.prefix}.mm.{group_key}"

    # ---- the whole procedure -------------------------------------------------------------------
    async def form_group(self, group_key: str, deadline: float, target_group_size: int | None = None,
                         weight: float = 1.0, min_group_size: int | None = None,
                         patience: float | None = None, planned: Planned | None = None) -> GroupInfo | None:
        """Find a group before ``deadline`` (loop time); None if none formed.

        ``target_group_size`` overrides the configured target for this call (e.g. the number of
        peers known to be ready), so a leader can close the group as soon as everyone is in.
        ``weight`` is this peer's weight in the average, declared to the group.  ``min_group_size``
        overrides the smallest group a leader closes after ``patience`` (default ``min_matchmaking_time``;
        a leader short of it waits on, until ``deadline``), where a full group closes at once: a
        planned group whose members come over a few seconds waits for them all.  It waits for none
        that will not come (``planned``): of the planned members, those that do not answer a ping
        after ``min_matchmaking_time``, and the units of a level below that declared themselves gone
        under this key (``declare_gone``) and sent nobody.
        """
        loop = asyncio.get_running_loop()
        self._target = min(target_group_size or self.target_group_size, self.target_group_size)
        self._min_size = min(min_group_size or self.min_group_size, self._target)
        self._patience = self.min_matchmaking_time if patience is None else patience
        self._weight = weight
        self._planned = planned or Planned()
        self._gone_peers, self._gone_units = set(), set()
        declared_at = self.node.clock.now()  # compared with the others' declarations: the swarm's time
        expiration = declared_at + max(deadline - loop.time(), 0) + 1.0
        # our last withdrawal under this key must not outlive (and so hide) this declaration
        key = self._dht_key(group_key)
        expiration = max(expiration, self._withdrawn.get(key, 0.0) + 2e-3)
        declaration = {"a": self.p2p.listen_address_str and str(self.p2p.address), "t": declared_at,
                       "bw": self.bandwidth, "h": self.schema_hash}
        replicas = await self._replicas.of(key)  # where the withdrawal goes too, without a second lookup
        await self.node.store(key, declaration, expiration, subkey=self.subkey, at=replicas)
        myself = Candidate(declared_at, self.me, declaration["a"], self.bandwidth, self.schema_hash)
        unreachable: set[PeerID] = set()
        self._polls = _Polls(replicas)
        probes = LeaderProbes(self.p2p.connect, min(self.request_timeout, LEADER_CONNECT_TIMEOUT))
        try:
            while loop.time() < deadline:
                candidates = await self._candidates(key, myself)
                leader = _pick_leader(candidates, unreachable | self._banned_now())
                if leader is None:
                    await asyncio.sleep(self.poll_interval)
                    continue
                if leader.peer_id != self.me:
                    probes.start(_ahead_of(candidates, leader, myself, unreachable))
                    assert leader.address is not None
                    if not await probes.answers(leader.peer_id, leader.address):
                        unreachable.add(leader.peer_id)
                        continue
                if leader.peer_id == self.me:
                    try:
                        group = await self._lead(group_key, key, myself, unreachable, deadline)
                    except _CannotForm:
                        return None
                else:
                    group = await self._follow(group_key, leader, unreachable, deadline)
                if group is not None:
                    return group
            return None
        finally:
            await probes.close()
            # in the background: the group must not wait for a DHT round trip to start averaging
            self._spawn(self._withdraw(key, expiration, replicas))

    async def _candidates(self, key: str, myself: Candidate) -> list[Candidate]:
        found = await self.node.get(key, latest=True, at=self._polls.where(asyncio.get_running_loop().time()))
        out = {myself.peer_id: myself}  # our own declaration may not be readable yet
        if found is not None and isinstance(found.value, dict):
            for subkey, item in found.value.items():
                gone = _gone_unit(item.value)
                if gone is not None:
                    self._gone_units.add(gone)
                    continue
                cand = _parse_candidate(subkey, item.value, self.signed_subkeys)
                if cand is not None:
                    out[cand.peer_id] = cand
        return sorted(out.values())

    async def declare_gone(self, group_key: str, unit: int, lasts: float) -> None:
        """Say under ``group_key`` that unit ``unit`` of the level below (our group there) will not come:
        its leader then closes without waiting out its patience for it."""
        key = self._dht_key(group_key)
        value = {"a": None, "t": self.node.clock.now(), "g": int(unit)}
        try:
            await self.node.store(key, value, self.node.clock.now() + lasts, subkey=f"{self.subkey}.gone")
        except Exception as e:  # noqa: BLE001 - a courtesy: the leader's patience bounds its wait anyway
            logger.debug("could not declare unit %d of %s gone: %s", unit, group_key, e)

    async def _probe_planned(self, lead: _Leadership) -> None:
        """Ping the planned members that have not joined; those that do not answer are waited for no more.
        One whose address we do not know is waited for: not knowing it is no sign it is gone."""
        joined = {f.peer_id for f in lead.followers} | {self.me}
        absent = [p for p in self._planned.members if p not in joined and self.node.known_address(p) is not None]
        timeout = min(self.request_timeout, 1.0)
        answers = await asyncio.gather(*(self.node.answers(p, timeout) for p in absent))
        self._gone_peers.update(p for p, alive in zip(absent, answers, strict=True) if not alive)
        if self._gone_peers:
            lead.changed.set()

    def _wanted(self, lead: _Leadership) -> int:
        """The group size a leader closes at once: the target less the members known not to come."""
        joined = {f.peer_id for f in lead.followers}
        units = {f.unit for f in lead.followers} | {self._planned.unit}
        return max(self._target - len(self._gone_peers - joined) - len(self._gone_units - units), 1)

    async def _withdraw(self, key: str, expiration: float, replicas: list) -> None:
        """Overwrite our declaration where it was stored (a later expiration wins) so nobody tries to join us."""
        self._withdrawn[key] = expiration + 1e-3
        while len(self._withdrawn) > 256:  # keys of past groups (Moshpit's grid keys): the oldest go
            del self._withdrawn[next(iter(self._withdrawn))]
        try:
            await self.node.store(key, None, expiration + 1e-3, subkey=self.subkey, at=replicas)
        except Exception as e:  # the DHT may be shutting down with us
            logger.debug("could not withdraw matchmaking declaration: %s", e)

    # ---- following -----------------------------------------------------------------------------
    async def _follow(self, group_key: str, leader: Candidate, unreachable: set[PeerID],
                      deadline: float) -> GroupInfo | None:
        loop = asyncio.get_running_loop()
        address = self.p2p.listen_address_str and str(self.p2p.address)
        request = {"k": group_key, "schema": self.schema, "bw": self.bandwidth, "w": self._weight,
                   "a": address, "u": self._planned.unit}
        mine = None
        if self.signed:
            mine = Declaration.sign(self.p2p.identity, group_key, self._weight, self.bandwidth, address)
            request["d"] = mine.to_wire()
        timeout = min(deadline - loop.time(), self._patience + self.request_timeout)
        if timeout <= 0:
            return None
        try:
            assert leader.address is not None
            reply = await self.p2p.call(leader.address, self.method, request, timeout=timeout)
        except P2PError as e:
            logger.info("leader %s failed: %s", leader.peer_id, e)
            unreachable.add(leader.peer_id)
            return None
        if not isinstance(reply, dict):
            unreachable.add(leader.peer_id)
            return None
        if reply.get("error"):
            raise ShapeMismatch(f"group {group_key!r} refused this peer: {reply['error']}")
        if not reply.get("ok"):
            await asyncio.sleep(self.poll_interval)  # not leading (any more) or full: look again
            return None
        try:
            group = GroupInfo.from_wire(reply["group"], self.me, self.numel, self.chunk_size or MIN_CHUNK)
        except ValueError as e:
            logger.warning("leader %s sent a bad group: %s", leader.peer_id, e)
            unreachable.add(leader.peer_id)
            return None
        if mine is not None:
            problem = self._forged(group, group_key, mine)
            if problem is not None:
                logger.warning("leader %s altered the group: %s", leader.peer_id, problem)
                unreachable.add(leader.peer_id)
                if self.ban is not None:
                    self.ban(leader.peer_id, f"as leader, it altered the group: {problem}")
                return None
        return group

    def _forged(self, group: GroupInfo, group_key: str, mine: Declaration) -> str | None:
        """Why a signed group's description is not what its members declared, or None."""
        if group.declarations is None:
            return "it carries no signed declarations"
        if group.declarations[group.my_index] != mine:
            return "our own declaration in it is not the one we signed"
        return check_group(group.declarations, group.peer_ids, group_key, group.weights, group.addresses,
                           group.part_sizes, self.numel, _declared_bandwidth)

    # ---- leading -------------------------------------------------------------------------------
    async def _lead(self, group_key: str, key: str, myself: Candidate, unreachable: set[PeerID],
                    deadline: float) -> GroupInfo | None:
        loop = asyncio.get_running_loop()
        lead = self._leading = _Leadership(group_key)
        started = loop.time()
        next_check = started + self.poll_interval
        probe: asyncio.Task | None = None
        try:
            while True:
                now = loop.time()
                size = len(lead.followers) + 1
                if size >= self._target or (size >= self._min_size and (
                        size >= self._wanted(lead) or now - started >= self._patience or now >= deadline)):
                    return self._assemble(lead)
                if self._wanted(lead) < self._min_size:
                    lead.dismiss("too many of the planned members are gone")
                    raise _CannotForm  # it would never reach its quorum: no use waiting out the deadline
                if probe is None and self._planned.members and now - started >= self.min_matchmaking_time:
                    probe = asyncio.ensure_future(self._probe_planned(lead))
                if now >= deadline:
                    lead.dismiss("leader ran out of time")
                    return None
                if now >= next_check:
                    # an earlier declaration shows within a store's time: after the first second a leader that
                    # waits long for its planned group (seconds, at the top) checks less often
                    settled = now - started >= FULL_LOOKUP_EVERY
                    next_check = now + self.poll_interval * (SETTLED_POLL_FACTOR if settled else 1)
                    leader = _pick_leader(await self._candidates(key, myself), unreachable | self._banned_now())
                    if leader is not None and leader.peer_id != self.me:
                        lead.dismiss("another peer leads this group")
                        return None
                wake = min(next_check, started + self._patience, deadline)
                if probe is None and self._planned.members:
                    wake = min(wake, started + self.min_matchmaking_time)
                await wait_event(lead.changed, max(wake - loop.time(), 0))
                lead.changed.clear()
        finally:
            if probe is not None:
                probe.cancel()
                await asyncio.gather(probe, return_exceptions=True)
            if self._leading is lead:
                self._leading = None
            if not lead.closed:
                lead.dismiss("leader stopped")

    def _assemble(self, lead: _Leadership) -> GroupInfo:
        followers = lead.followers[: self._target - 1]
        address = self.p2p.listen_address_str and str(self.p2p.address)
        mine = Declaration.sign(self.p2p.identity, lead.group_key, self._weight, self.bandwidth, address) \
            if self.signed else None
        members = [Candidate(0.0, self.me, address, _declared_bandwidth(self.bandwidth), weight=self._weight,
                             declaration=mine), *followers]
        bandwidths = claims_within_reason([m.bandwidth for m in members])
        sizes = load_balanced_parts(self.numel, bandwidths, bounded=True)
        # weights go in as declared: each member refuses out-of-range ones itself, by the same rule
        chunk_size = self.chunk_size or auto_chunk_size(bandwidths, self.numel)
        if self.max_chunk_size is not None:
            chunk_size = max(min(chunk_size, self.max_chunk_size), -(-self.numel // MAX_CHUNKS))
        group = GroupInfo(os.urandom(16), [m.peer_id for m in members], [m.address for m in members], sizes,
                          [m.weight for m in members], 0, chunk_size=chunk_size,
                          declarations=[m.declaration for m in members] if self.signed else None)
        wire = group.to_wire()
        for f in followers:
            fut = lead.replies.get(f.peer_id)
            if fut is not None and not fut.done():
                fut.set_result({"ok": True, "group": wire})
        lead.dismiss("group is full")  # anyone beyond the target looks elsewhere
        return group

    async def _rpc_join(self, request: Any, ctx: CallContext) -> dict:
        if not isinstance(request, dict):
            raise ValueError("join request must be a dict")
        lead = self._leading
        if lead is None or lead.closed or lead.group_key != request.get("k"):
            return {"ok": False, "why": "not leading this group"}
        if request.get("schema") != self.schema:
            return {"ok": False, "error": describe_mismatch(self.schema, request.get("schema") or [])}
        if len(lead.followers) + 1 >= self._target or ctx.peer_id in lead.replies:
            return {"ok": False, "why": "group is full"}
        if ctx.peer_id in self._banned_now():
            return {"ok": False, "why": "banned from this peer's groups: caught cheating"}
        bandwidth = request.get("bw")
        address = request.get("a") if not ctx.remote_client_mode else None
        unit = request.get("u")
        follower = Candidate(0.0, ctx.peer_id, address if isinstance(address, str) else None,
                             _declared_bandwidth(bandwidth),
                             weight=claimed_weight(request.get("w")),
                             unit=unit if isinstance(unit, int) and not isinstance(unit, bool) else None)
        if self.signed:
            declaration = Declaration.from_wire(request.get("d"))
            problem = "no signed declaration" if declaration is None else \
                _unlike(declaration, ctx.peer_id, request, lead.group_key)
            if problem is not None:
                return {"ok": False, "error": f"this group takes signed declarations: {problem}"}
            follower.declaration = declaration
        reply: asyncio.Future = asyncio.get_running_loop().create_future()
        lead.followers.append(follower)
        lead.replies[ctx.peer_id] = reply
        lead.changed.set()
        try:
            return await reply
        finally:
            if not reply.done():  # the follower gave up before the group formed
                lead.followers.remove(follower)
                lead.replies.pop(ctx.peer_id, None)


@dataclass
class _Polls:
    """Where this call's next poll for declarations reads: a full lookup first and at least every
    ``FULL_LOOKUP_EVERY`` seconds, the replicas we declared at in between."""

    replicas: list
    next_lookup: float = 0.0  # loop time

    def where(self, now: float) -> list | None:
        """None: a full lookup (``DHTNode.get``'s default), else the replicas to ask."""
        if now >= self.next_lookup or not any(c is not None for c in self.replicas):
            self.next_lookup = now + FULL_LOOKUP_EVERY
            return None
        return self.replicas


def _pick_leader(candidates: list[Candidate], unreachable: set[PeerID]) -> Candidate | None:
    """The earliest reachable peer of the largest schema class (ties: the class declared first).

    Peers whose tensors differ from most others' thus never lead them; they ask the majority's
    leader, and its refusal tells them what differs.
    """
    classes: dict[str, list[Candidate]] = {}
    for c in sorted(candidates):
        classes.setdefault(c.schema_hash, []).append(c)
    for members in sorted(classes.values(), key=lambda m: (-len(m), m[0])):
        leaders = [c for c in members if c.can_lead and c.peer_id not in unreachable]
        if leaders:
            return leaders[0]
    return None


def _ahead_of(candidates: list[Candidate], leader: Candidate, myself: Candidate,
              unreachable: set[PeerID]) -> list[tuple[PeerID, str]]:
    """The leaders this peer would try, in order, before leading itself: ``leader``'s class, declared earlier."""
    return [(c.peer_id, c.address) for c in sorted(candidates)
            if c.schema_hash == leader.schema_hash and c.address is not None and c.peer_id not in unreachable
            and c.peer_id != myself.peer_id and c >= leader and c < myself]


def _unlike(declaration: Declaration, signer: PeerID, request: dict, group_key: str) -> str | None:
    """Why a follower's signed declaration does not say what its join request says, or None."""
    try:
        key, weight, bandwidth, address, _, _ = declaration.fields(signer)
    except ValueError as e:
        return str(e)
    if key != group_key or weight != claimed_weight(request.get("w")) or bandwidth != request.get("bw") \
            or (address or None) != (request.get("a") or None):
        return "it does not match the request it came with"
    return None


def _gone_unit(value: Any) -> int | None:
    """The unit a ``declare_gone`` record names, or None for anything else."""
    if not isinstance(value, dict):
        return None
    unit = value.get("g")
    return unit if isinstance(unit, int) and not isinstance(unit, bool) and unit >= 0 else None


def _declared_bandwidth(value: Any) -> float:
    """A follower's bandwidth (Mbit/s) for the load-balancing LP, which fails the whole group on inf,
    NaN or a denormal: below 1 kbit/s (or not a number) counts as 0, above 1 Tbit/s as 1 Tbit/s."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 1e-3:
        return 0.0
    return min(float(value), 1e6)


def _signs_for(node: DHTNode) -> bool:
    """Whether ``node`` signs the records its own key owns (a DHT made without signatures does not)."""
    return any(isinstance(v, SignatureValidator) and v.identity.public_key == node.p2p.identity.public_key
               for v in node.validator.validators)


def _declarer(subkey: str, signed: bool) -> PeerID:
    """The peer a declaration's subkey stands for: ``[owner:<key>]<its peer id>``, the id that key's, so a
    member declares itself only, once per key (the DHT checked the owner's signature); a bare peer id
    only where declarations are not signed.  ValueError otherwise."""
    owners = owners_in(subkey.encode())
    if not owners:
        if signed:
            raise ValueError("an unsigned declaration")
        return PeerID.from_string(subkey)
    marker = owner_marker(owners[0])
    peer_id = PeerID.from_string(subkey.removeprefix(marker)) if subkey.startswith(marker) else None
    if len(owners) != 1 or peer_id != PeerID.from_public_key(owners[0]):
        raise ValueError("a declaration in another peer's name")
    return peer_id


def _parse_candidate(subkey: Any, value: Any, signed: bool = False) -> Candidate | None:
    if not isinstance(value, dict) or not isinstance(subkey, str):
        return None  # withdrawn (None) or malformed
    try:
        peer_id = _declarer(subkey, signed)
        declared_at = float(value["t"])
        bandwidth = float(value.get("bw", 0.0))
    except (KeyError, TypeError, ValueError):
        return None
    address = value.get("a")
    schema_hash = value.get("h")
    return Candidate(declared_at, peer_id, address if isinstance(address, str) else None, max(bandwidth, 0.0),
                     schema_hash if isinstance(schema_hash, str) else "")
