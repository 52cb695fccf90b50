"""Averagers: a list of tensors bound to a DHT node, averaged in place with whoever is around.

``DecentralizedAverager`` is the async API (on the DHT node's event loop); ``MoshpitAverager``
adds Moshpit All-Reduce's grid of group keys; ``Averager`` is the blocking face for a ``dht.DHT``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import logging
import random
import time
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dht import DHT, DHTNode
from p2p import CallKind, P2PError, PeerGone, PeerID, PeerIDMismatch
from p2p.codecs import Codec
from p2p.node import CallContext

from .allreduce import DEFAULT_MAX_WEIGHT, AllReduceRound, GroupInfo, weight_problem
from .audit import AUDIT_CHUNK
from .bandwidth import BandwidthMeter, ProbeSink, probe
from .matchmaking import Matchmaker, Planned
from .partition import FlatTensors, chunk_size_problem
from .reduction import DEFAULT_NORM_RATIO, all_finite
from .robust import Byzantine

logger = logging.getLogger(__name__)
OUTCOMES_KEPT = 64  # recent rounds whose outcome a member can still ask us about
AUDITS_KEPT = 8  # recent verified rounds whose members may still audit our part
DEFAULT_BAN_S = 600.0  # how long a reducer caught by an audit is kept out of our groups
BANS_LOGGED = 32


@dataclass
class StepResult:
    """What one averaging step did."""

    group_size: int
    failed_peers: list[PeerID] = field(default_factory=list)  # dropped from at least one part, in group order
    # why each of failed_peers was dropped, as this peer saw it or its reducer reported it
    # ("part 2: chunk 0: ..." names the part whose reducer decided)
    excluded: dict[PeerID, str] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    matchmaking_time: float = 0.0
    allreduce_time: float = 0.0
    group_id: str = ""
    my_index: int = 0
    group_peers: list[PeerID] = field(default_factory=list)  # in group order
    part_sizes: list[int] = field(default_factory=list)  # elements each member reduced
    # parts (by reducer index) whose average did not all come back: our tensors keep local values there
    unaveraged_parts: list[int] = field(default_factory=list)
    group: GroupInfo | None = field(default=None, repr=False)  # the group as formed (None: no group)
    # byzantine="verify": reducers our audit caught, with the evidence (also in excluded); banned since
    caught: dict[PeerID, str] = field(default_factory=dict)

    @property
    def averaged(self) -> bool:
        """True if this peer averaged with at least one other."""
        return self.group_size > 1

    @property
    def complete(self) -> bool:
        """True if every part of our tensors holds the group's average: the same values as every
        other member whose step is complete (a dead reducer leaves its part local to each sender)."""
        return self.averaged and not self.unaveraged_parts


class DecentralizedAverager:
    """Averages ``tensors`` (float; copied into one flat buffer unless a single contiguous float32
    tensor is given) with peers found under ``prefix``.  Read and modify the averaged values
    through ``tensors`` (views into the buffer), not while a step is running.

    ``max_weight`` bounds the weight a member may declare and ``norm_ratio`` how far a member's
    values may stand above the others' in a chunk (None: no such check); members outside either
    are dropped from the average (see ``allreduce``).  ``max_weight_ratio`` caps each member's
    weight at that many times the group's median (None: no cap with ``byzantine="off"``, 2 where the
    group clips, so that one member of a group of four holds under half the weight).  ``byzantine`` is how far
    reducers are trusted (``robust.Byzantine``: off, clip, verify).  Every member of a run should
    use the same.

    ``chunk_size`` (elements) is the leader's to choose for its group: None (the default) sizes
    chunks by the members' declared bandwidths (``partition.auto_chunk_size``); a number fixes it
    for the groups this peer leads.
    """

    round_class: type[AllReduceRound] = AllReduceRound  # the all-reduce this averager runs

    def __init__(self, tensors: Sequence[torch.Tensor], node: DHTNode, prefix: str, *,
                 target_group_size: int = 8, min_group_size: int = 2, min_matchmaking_time: float = 1.0,
                 request_timeout: float = 3.0, allreduce_timeout: float = 60.0, sender_timeout: float = 5.0,
                 compression: str | Codec = Codec.NONE, chunk_size: int | None = None, window: int = 6,
                 bandwidth: float | None = None, poll_interval: float = 0.05, max_weight: float = DEFAULT_MAX_WEIGHT,
                 norm_ratio: float | None = DEFAULT_NORM_RATIO,
                 max_weight_ratio: float | None = None,
                 byzantine: str | Byzantine = Byzantine.OFF, ban_s: float = DEFAULT_BAN_S) -> None:
        if "." in prefix or not prefix:
            raise ValueError(f"prefix must be a non-empty name without dots, got {prefix!r}")
        if not 0 < max_weight < float("inf"):
            raise ValueError(f"max_weight must be a positive finite number, got {max_weight!r}")
        if norm_ratio is not None and not 1 < norm_ratio < float("inf"):
            raise ValueError(f"norm_ratio must be a finite number above 1 or None, got {norm_ratio!r}")
        try:
            self.byzantine = Byzantine(byzantine)
        except ValueError:
            raise ValueError(f"byzantine must be one of {', '.join(b.value for b in Byzantine)}, "
                             f"got {byzantine!r}") from None
        if max_weight_ratio is None:
            max_weight_ratio = self.byzantine.max_weight_ratio
        if not 1 <= max_weight_ratio <= float("inf"):
            raise ValueError(f"max_weight_ratio must be a number >= 1 (inf: no cap) or None (the byzantine "
                             f"mode's default), got {max_weight_ratio!r}")
        self.max_weight = float(max_weight)
        self.max_weight_ratio = max_weight_ratio
        self._weight_ratio = max_weight_ratio  # this step's (step's weight_ratio_scale)
        if not 0 <= ban_s < float("inf"):
            raise ValueError(f"ban_s must be a finite number of seconds >= 0, got {ban_s!r}")
        self.ban_s = ban_s
        self.banned: dict[PeerID, float] = {}  # caught reducers -> until when (monotonic) they are kept out
        # the bans this averager decided, newest last: {"peer", "evidence", "at" (wall time)}, for reports
        self.ban_log: deque[dict] = deque(maxlen=BANS_LOGGED)
        self.norm_ratio = norm_ratio
        self.node = node
        self.prefix = prefix
        self.flat = FlatTensors(tensors)
        self.codec = Codec(compression)
        problem = None if chunk_size is None else chunk_size_problem(chunk_size, self.flat.numel)
        if problem is not None:
            raise ValueError(f"chunk_size: {problem} (None: chosen per group)")
        self.chunk_size = chunk_size
        if window < 1:
            raise ValueError(f"window must be at least one chunk, got {window}")
        self.window = window
        self.allreduce_timeout = allreduce_timeout
        self.sender_timeout = sender_timeout
        self.request_timeout = request_timeout
        self.min_matchmaking_time = min_matchmaking_time
        if bandwidth is not None and not 0 < bandwidth < float("inf"):
            raise ValueError(f"bandwidth must be a positive number of Mbit/s or None (measured), got {bandwidth!r}")
        # None: measured from our own rounds (see averaging/bandwidth.py); a number: declared as given
        self.meter = BandwidthMeter() if bandwidth is None else None
        self.matchmaker = Matchmaker(node, prefix, self.flat.schema, self.flat.schema_hash, self.flat.numel,
                                     target_group_size=target_group_size, min_group_size=min_group_size,
                                     min_matchmaking_time=min_matchmaking_time, request_timeout=request_timeout,
                                     bandwidth=self.meter.estimate if self.meter is not None else bandwidth,
                                     poll_interval=poll_interval, chunk_size=chunk_size,
                                     max_chunk_size=AUDIT_CHUNK if self.byzantine is Byzantine.VERIFY else None,
                                     banned=self.banned, signed=self.byzantine.clips, ban=self._ban)
        self.method = f"avg.allreduce.{prefix}"
        self._rounds: dict[bytes, asyncio.Future] = {}
        self._lock = asyncio.Lock()
        # one pass over the whole buffer per step (is every value finite?), run while matchmaking
        # waits on the network instead of between matchmaking and the round's first byte
        self._checker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"spotswarm-{prefix}-check")
        self.phase = "idle"  # or matchmaking / all-reduce: where a fault that hits this peer now lands
        node.p2p.register(self.method, self._rpc_allreduce, CallKind.BIDI)
        self.probe_method = f"avg.probe.{prefix}"
        node.p2p.register(self.probe_method, ProbeSink(), CallKind.CLIENT_STREAM)
        # group id -> (its members, whether our round with it came back complete), for members that ask
        self._outcomes: OrderedDict[bytes, tuple[frozenset[PeerID], bool]] = OrderedDict()
        self._outcome_known = asyncio.Condition()
        self.outcome_method = f"avg.outcome.{prefix}"
        node.p2p.register(self.outcome_method, self._rpc_outcome)
        self.audit_method = f"avg.audit.{prefix}"
        self._audits: OrderedDict[bytes, AllReduceRound] = OrderedDict()
        if self.byzantine is Byzantine.VERIFY:
            node.p2p.register(self.audit_method, self._rpc_audit)

    @property
    def bandwidth(self) -> float:
        """Mbit/s this peer declares in its next matchmaking: measured, or as configured; 0 in client mode."""
        if self.meter is not None:
            return self.matchmaker.declared(self.meter.estimate)
        return self.matchmaker.bandwidth

    async def probe_bandwidth(self, peers: Sequence[Any], timeout: float = 30.0) -> float | None:
        """Measure our upload before our first round, by streaming a few megabytes to ``peers``
        (addresses or connected peer ids of this averager's swarm) at once; the figure (Mbit/s) is
        declared from the next matchmaking on, like a round's.  None when the bandwidth is
        configured, or nothing could be measured (the peers unreachable: logged, never raised)."""
        if self.meter is None or not peers:
            return None
        ids = []
        for peer in peers:
            try:
                ids.append(peer if isinstance(peer, PeerID) else await self.node.p2p.connect(peer, timeout))
            except Exception as e:  # noqa: BLE001 - a dead peer only means one less to probe
                logger.info("bandwidth probe: %s unreachable: %s", peer, e)
        if not ids:
            return None
        figure = await probe(self.meter, self.node.p2p, self.probe_method, ids, timeout=timeout)
        logger.info("bandwidth probe to %d peers: %s", len(ids),
                    f"{figure:.0f} Mbit/s" if figure is not None else "nothing measured")
        return figure

    @property
    def tensors(self) -> list[torch.Tensor]:
        return self.flat.views

    @property
    def peer_id(self) -> PeerID:
        return self.node.peer_id

    async def step(self, weight: float = 1.0, timeout: float | None = None, group_key: str = "all",
                   target_group_size: int | None = None, abort: asyncio.Event | None = None,
                   min_group_size: int | None = None, patience: float | None = None,
                   planned: Planned | None = None, weight_ratio_scale: float = 1.0) -> StepResult:
        """Find a group under ``group_key`` and average with it; averages in place.

        ``weight`` (e.g. samples processed) weighs this peer in the mean; at most ``max_weight``.
        Never raises for other peers' faults: the result says who failed and why (``excluded``),
        and ``group_size == 1`` if no group formed.
        Raises ShapeMismatch if the group's tensors differ from ours.  Setting ``abort`` gives up
        matchmaking (e.g. the others have moved on without us); a round once started runs to its end.
        ``target_group_size`` and ``min_group_size`` override the averager's for this step, and
        ``patience`` how long a leader waits for a full group (``Matchmaker.form_group``; ``planned``:
        who should come, so that it waits for none that will not); matchmaking then lasts up to
        ``max(min_matchmaking_time, patience) + 2 * request_timeout``.  ``weight_ratio_scale``
        multiplies ``max_weight_ratio`` for this step (a representative of a group of groups weighs
        that group's total).
        """
        try:
            weight = float(weight)
        except (TypeError, ValueError):
            raise ValueError(f"weight must be a number, got {weight!r}") from None
        problem = weight_problem(weight, self.max_weight)
        if problem is not None:
            raise ValueError(f"{problem}: a weight must be finite, >= 0 and at most max_weight")
        async with self._lock:
            try:
                self._weight_ratio = self.max_weight_ratio * weight_ratio_scale
                return await self._step(weight, timeout, group_key, target_group_size, abort, min_group_size,
                                        patience, planned)
            finally:
                self.phase = "idle"
                self._weight_ratio = self.max_weight_ratio

    async def _step(self, weight: float, timeout: float | None, group_key: str, target_group_size: int | None,
                    abort: asyncio.Event | None, min_group_size: int | None, patience: float | None,
                    planned: Planned | None = None, weight_ratio_scale: float = 1.0) -> StepResult:
        """One matchmaking, then one round with the group found (if any)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        self.phase = "matchmaking"
        if self.meter is not None:
            self.matchmaker.declare_bandwidth(self.meter.estimate)
        # a leader waits for a full group up to ``patience`` (min_matchmaking_time by default), followers for it
        mm_budget = max(self.min_matchmaking_time, patience or 0.0) + 2 * self.request_timeout
        total = timeout if timeout is not None else mm_budget + self.allreduce_timeout
        deadline = started + total
        checking = loop.run_in_executor(self._checker, all_finite, self.flat.flat)
        try:
            group = await self._matchmake(group_key, min(started + mm_budget, deadline), target_group_size, abort,
                                          weight, min_group_size, patience, planned)
        finally:
            finite = await checking  # never left reading our buffer once the step is over
        matched = loop.time()
        if group is None or group.size < 2:
            return StepResult(1, matchmaking_time=matched - started)
        self.phase = "all-reduce"
        result = await self._run_round(group, weight, self.codec, min(matched + self.allreduce_timeout,
                                                                      max(deadline, matched + 1e-3)),
                                       self.sender_timeout, finite)
        result.matchmaking_time = matched - started
        return result

    async def broadcast(self, group: GroupInfo, source: int, timeout: float, *, failed: bool = False) -> StepResult:
        """Give every member of a group formed earlier (``StepResult.group``) member ``source``'s
        values, exactly: one more round among the same members, with source weighing 1, the others 0,
        no compression, and source reducing nothing, so nobody calls it before it is ready (it may come
        seconds after the others, from a group above).  ``failed``: source has nothing to give (its
        round above failed); it says so up front, and every member sees it in ``failed_peers`` at once.
        The members wait for source up to ``timeout``."""
        members = [i for i, address in enumerate(group.addresses) if i != source and address is not None]
        reducers = members or [source]  # every other member in client mode: source must reduce after all
        numel = self.flat.numel
        sizes = [0] * group.size
        for k, i in enumerate(reducers):
            sizes[i] = numel // len(reducers) + (1 if k < numel % len(reducers) else 0)
        copy_id = hashlib.sha256(b"copy" + group.group_id).digest()[:len(group.group_id)]
        copy = dataclasses.replace(group, group_id=copy_id, part_sizes=sizes,
                                   weights=[1.0 if i == source else 0.0 for i in range(group.size)])
        loop = asyncio.get_running_loop()
        async with self._lock:
            try:
                self.phase = "all-reduce"
                weight = copy.weights[copy.my_index]
                return await self._run_round(copy, weight, Codec.NONE, loop.time() + timeout, timeout,
                                             None if group.my_index != source else not failed,
                                             byzantine=Byzantine.OFF)  # a copy: nothing to clip or audit
            finally:
                self.phase = "idle"

    async def _run_round(self, group: GroupInfo, weight: float, codec: Codec, deadline: float,
                         sender_timeout: float, finite: bool | None, byzantine: Byzantine | None = None) -> StepResult:
        """One butterfly round with a formed group (audited where the group verifies); the result says
        what came back."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        byzantine = self.byzantine if byzantine is None else byzantine
        round_ = self.round_class(self.node.p2p, self.method, group, self.flat, weight, codec,
                                  group.chunk_size, sender_timeout, self.window,
                                  max_weight=self.max_weight, norm_ratio=self.norm_ratio,
                                  max_weight_ratio=self._weight_ratio, byzantine=byzantine, finite=finite)
        if round_.verifying:
            self._audits[group.group_id] = round_
            while len(self._audits) > AUDITS_KEPT:
                self._audits.popitem(last=False)
        future = self._rounds.setdefault(group.group_id, loop.create_future())
        if not future.done():
            future.set_result(round_)
        others = [peer for i, peer in enumerate(group.peer_ids) if i != group.my_index]
        watching = asyncio.ensure_future(self.meter.watch(self.node.p2p, others)) if self.meter else None
        try:
            outcome = await round_.run(deadline)
        finally:
            self._rounds.pop(group.group_id, None)
            if watching is not None:
                watching.cancel()
                await asyncio.gather(watching, return_exceptions=True)
        if round_.verifying:
            await round_.audit(self.audit_method, min(self.request_timeout, max(deadline - loop.time(), 1e-3)))
            for j, evidence in outcome.caught.items():
                self._ban(group.peer_ids[j], f"as reducer of part {j}: {evidence}", group.group_id)
        await self._record_outcome(group, not outcome.unaveraged)
        return StepResult(
            group_size=group.size,
            failed_peers=[group.peer_ids[i] for i in sorted(outcome.failed)],
            excluded={group.peer_ids[i]: outcome.failed[i] for i in sorted(outcome.failed)},
            bytes_sent=outcome.bytes_sent, bytes_received=outcome.bytes_received,
            allreduce_time=loop.time() - started,
            group_id=group.group_id.hex(), my_index=group.my_index,
            group_peers=list(group.peer_ids), part_sizes=list(group.part_sizes),
            unaveraged_parts=sorted(outcome.unaveraged), group=group,
            caught={group.peer_ids[j]: why for j, why in sorted(outcome.caught.items())})

    async def _matchmake(self, group_key: str, deadline: float, target_group_size: int | None,
                         abort: asyncio.Event | None, weight: float, min_group_size: int | None,
                         patience: float | None, planned: Planned | None = None) -> GroupInfo | None:
        forming = self.matchmaker.form_group(group_key, deadline, target_group_size, weight, min_group_size, patience,
                                             planned)
        if abort is None:
            return await forming
        task = asyncio.ensure_future(forming)
        aborted = asyncio.ensure_future(abort.wait())
        try:
            await asyncio.wait({task, aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            aborted.cancel()
            if not task.done():  # matchmaking cleans up after itself when cancelled
                task.cancel()
            await asyncio.gather(task, aborted, return_exceptions=True)
        return None if task.cancelled() else task.result()

    async def _rpc_allreduce(self, requests: Any, ctx: CallContext) -> Any:
        first = await requests.recv()
        if not isinstance(first, dict) or not isinstance(first.get("g"), bytes) or not isinstance(first.get("i"), int):
            raise ValueError("all-reduce stream must start with {'g': group id, 'i': index, 'w': weight, ...}")
        group_id = first["g"]
        future = self._rounds.get(group_id)
        if future is None:  # the sender learned of the group before we did: wait for our matchmaking
            future = self._rounds[group_id] = asyncio.get_running_loop().create_future()
        try:
            round_: AllReduceRound = await asyncio.wait_for(asyncio.shield(future), self.request_timeout)
        except asyncio.TimeoutError:
            if self._rounds.get(group_id) is future and not future.done():
                del self._rounds[group_id]
            raise ValueError("this peer is not in that group") from None
        index = first["i"]
        if not 0 <= index < round_.group.size or round_.group.peer_ids[index] != ctx.peer_id:
            raise PermissionError("sender index does not match the caller's identity")
        async for payload in round_.serve(index, first.get("w"), first.get("schema"), requests,
                                          bool(first.get("nonfinite")), ctx.disconnect,
                                          first.get("z", Byzantine.OFF.value), first.get("k"), first.get("h")):
            yield payload

    def _ban(self, peer: PeerID, evidence: str, group_id: bytes = b"") -> None:
        """Keep a member caught cheating out of our groups for ``ban_s``, and log it for the run's report."""
        self.banned[peer] = time.monotonic() + self.ban_s
        self.ban_log.append({"peer": str(peer), "evidence": evidence[:500], "at": time.time(),
                             "group": group_id.hex()})

    async def _rpc_audit(self, request: Any, ctx: CallContext) -> dict:
        """A member's audit of a recent verified round of ours (``audit.py``)."""
        if not isinstance(request, dict) or not isinstance(request.get("g"), bytes):
            raise ValueError("audit request must be {'g': group id, 'q': query, ...}")
        round_ = self._audits.get(request["g"])
        if round_ is None:
            raise ValueError("no recent verified round of that group here")
        return await round_.answer_audit(request, ctx.peer_id, self.request_timeout)

    # ---- after a round: did the others get its average? -----------------------------------------
    async def _record_outcome(self, group: GroupInfo, complete: bool) -> None:
        self._outcomes[group.group_id] = (frozenset(group.peer_ids), complete)
        while len(self._outcomes) > OUTCOMES_KEPT:
            self._outcomes.popitem(last=False)
        async with self._outcome_known:
            self._outcome_known.notify_all()

    async def _rpc_outcome(self, request: Any, ctx: CallContext) -> dict:
        """Whether our round with group ``g`` came back complete; ``None`` when we cannot tell (not
        a group of ours, or one we no longer remember).  A round still running is waited for."""
        if not isinstance(request, dict) or not isinstance(request.get("g"), bytes):
            raise ValueError("an outcome request is {'g': group id}")
        group_id = request["g"]
        if group_id in self._rounds:
            with contextlib.suppress(asyncio.TimeoutError):
                async with self._outcome_known:
                    await asyncio.wait_for(self._outcome_known.wait_for(lambda: group_id not in self._rounds),
                                           self.request_timeout)
        known = self._outcomes.get(group_id)
        if known is None or ctx.peer_id not in known[0]:
            return {"c": None}
        return {"c": known[1]}

    async def others_completed(self, result: StepResult, timeout: float | None = None) -> bool | None:
        """Whether another member of the round ``result`` came from holds the group's average (and so
        may have stepped on it): True if one says so, False if every other member says its round came
        back incomplete or is gone (refuses connections), None if one could not tell.  A member whose
        round came back incomplete must not average again for the same step while another may have
        stepped: a group counts with a strict majority of the peers, and a member counted twice lets
        two groups step apart."""
        group = result.group
        if group is None:
            return False
        timeout = self.request_timeout if timeout is None else timeout
        others = [group.addresses[i] or group.peer_ids[i] for i in range(group.size) if i != group.my_index]
        answers = await asyncio.gather(*(self._ask_outcome(peer, group.group_id, timeout) for peer in others))
        if True in answers:
            return True
        return None if None in answers else False

    async def _ask_outcome(self, peer: Any, group_id: bytes, timeout: float) -> bool | None:
        try:
            reply = await self.node.p2p.call(peer, self.outcome_method, {"g": group_id}, timeout=timeout)
        except (PeerGone, PeerIDMismatch) as e:  # not running there: it holds no state anyone could load
            logger.debug("%s is gone, so it did not step on round %s: %s", peer, group_id.hex()[:8], e)
            return False
        except P2PError as e:
            logger.debug("could not ask %s how round %s ended: %s", peer, group_id.hex()[:8], e)
            return None
        answer = reply.get("c") if isinstance(reply, dict) else None
        return answer if isinstance(answer, bool) else None

    async def shutdown(self) -> None:
        await self.matchmaker.close()
        self.node.p2p.unregister(self.method)
        self.node.p2p.unregister(self.probe_method)
        self.node.p2p.unregister(self.outcome_method)
        if self.byzantine is Byzantine.VERIFY:
            self.node.p2p.unregister(self.audit_method)
        self._audits.clear()
        for future in self._rounds.values():
            future.cancel()
        self._rounds.clear()
        self._checker.shutdown(wait=True)  # idle unless a step still runs: then one pass, milliseconds


class MoshpitAverager(DecentralizedAverager):
    """Moshpit All-Reduce: a peer holds a coordinate on a d-dimensional grid; round t groups peers
    that agree on every coordinate except dimension t mod d, and each member then takes its index
    in the group as its new coordinate there, so former group mates meet new peers next round.
    With N = M**d live peers in groups of M, the average is exact after d rounds."""

    def __init__(self, tensors: Sequence[torch.Tensor], node: DHTNode, prefix: str, *, grid: Sequence[int],
                 coordinates: Sequence[int] | None = None, **options: Any) -> None:
        if not grid or any(g < 1 for g in grid):
            raise ValueError(f"grid must be a non-empty sequence of positive sizes, got {grid!r}")
        options.setdefault("target_group_size", max(grid))
        super().__init__(tensors, node, prefix, **options)
        self.grid = list(grid)
        if coordinates is None:  # a random spot; pass coordinates to control the first rounds
            seed = int.from_bytes(node.peer_id.digest[:8], "big")
            coordinates = [(seed >> (8 * i)) % g for i, g in enumerate(self.grid)]
        if len(coordinates) != len(self.grid) or any(not 0 <= c < g for c, g in zip(coordinates, self.grid,
                                                                                       strict=True)):
            raise ValueError(f"coordinates {coordinates!r} do not fit grid {self.grid!r}")
        self.coordinates = list(coordinates)
        self.round = 0  # callers that know the swarm's round (e.g. from its progress records) may set it
        self._rng = random.Random(int.from_bytes(node.peer_id.digest[8:16], "big"))

    def group_key(self) -> str:
        dim = self.round % len(self.grid)
        others = ",".join(str(c) for i, c in enumerate(self.coordinates) if i != dim)
        return f"d{dim}:{others}"

    async def step(self, weight: float = 1.0, timeout: float | None = None, group_key: str | None = None) -> StepResult:
        dim = self.round % len(self.grid)
        result = await super().step(weight, timeout, group_key or self.group_key())
        if result.averaged:
            self.coordinates[dim] = result.my_index % self.grid[dim]
        else:
            # nobody shared our key: with few peers, random spots collide and leave some keys empty;
            # a fresh spot gives this peer a new chance, where retrying the same key may never succeed
            self.coordinates = [self._rng.randrange(g) for g in self.grid]
        # the round advances either way: peers that average on the same cadence stay in phase
        self.round += 1
        return result


class Averager:
    """The blocking face of an averager, for code that uses the synchronous ``dht.DHT``."""

    def __init__(self, tensors: Sequence[torch.Tensor], dht: DHT, prefix: str, *,
                 moshpit_grid: Sequence[int] | None = None, **options: Any) -> None:
        self.dht = dht

        async def build(node: DHTNode) -> DecentralizedAverager:
            if moshpit_grid is not None:
                return MoshpitAverager(tensors, node, prefix, grid=moshpit_grid, **options)
            return DecentralizedAverager(tensors, node, prefix, **options)

        self.inner: DecentralizedAverager = dht.run_coroutine(build)

    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[list[torch.Tensor]]:
        """The averaged tensors (views into the averager's buffer); do not hold them across ``step``."""
        yield self.inner.tensors

    def step(self, weight: float = 1.0, timeout: float | None = None, **kwargs: Any) -> StepResult:
        async def run(_node: DHTNode) -> StepResult:
            return await self.inner.step(weight, timeout, **kwargs)
        return self.dht.run_coroutine(run)

    def shutdown(self) -> None:
        async def stop(_node: DHTNode) -> None:
            await self.inner.shutdown()
        self.dht.run_coroutine(stop)

