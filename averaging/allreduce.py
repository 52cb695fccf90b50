"""Butterfly all-reduce inside a formed group, streamed in chunks.

Peer i reduces part i of the flat vector.  Every other peer j opens one bidirectional call to i,
streams its slice of part i chunk by chunk, and reads back the averaged chunks as soon as i has
them, so reduce-scatter and all-gather overlap.  The reducer accumulates in place in its own
buffer (its own slice is never sent anywhere).

Flow control: a sender keeps at most ``window`` chunks unanswered per reducer.  An averaged chunk
comes back only once every sender delivered it, so fast senders cannot run ahead of the slowest
one: their surplus would only queue in the reducer's memory and crowd the slow sender's packets
out of the reducer's link (on shaped links this took the round from 0.80 to 0.91 of the
bandwidth bound, and the reducer's unread bytes from ~100 MB to ~8 MB at 100M elements).

Faults: a sender that makes no progress for ``sender_timeout`` is dropped and each chunk is
averaged over the weights that arrived; if a reducer dies, its senders keep their local values for
the chunks they did not get back, and say which parts those are (``unaveraged``): members that got
every part back hold the same values, the others do not.  Averaged chunks are served from the
reducer's buffer while the round lasts; at its end what a sender has yet to get is copied, and sends
under way are waited for, up to ``sender_timeout``: a member that takes nothing for that long loses
its connection, so no transport is left holding views of a buffer its owner changes.  Reducers
tell senders whom they dropped and why, so every peer can report every failure it was part of.

Hostile members: a chunk is averaged only once every sender delivered it (until then each
sender's decoded slice waits, at most ``window`` chunks per sender), and before averaging the
reducer drops any sender whose chunk is malformed or in a foreign dtype, not finite, large enough
to overflow the mean, or whose L2 norm is more than ``norm_ratio`` times the median norm of the
other contributions to that chunk; the weights are renormalized over the rest, so the result is the
average of the others.  A dropped sender is dropped for the rest of that part, from the chunk
where it was caught on.  A member whose declared weight is not finite, negative or over
``max_weight`` is dropped from every part by every member, since all apply that rule to the same
group description.  Replies are checked too: a reducer's chunk that is malformed or not finite is
refused, and the sender keeps its own values for that part.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from p2p import P2P, P2PError, PeerID
from p2p.codecs import FLOAT32_MAX, BadChunk, Codec, decode, decode_into, encode, norm

from .partition import MIN_CHUNK, Chunk, FlatTensors, chunk_size_problem, describe_mismatch, part_bounds

logger = logging.getLogger(__name__)

# Weights are sample counts (collaborative training weighs each peer by the samples it
# accumulated for one step); a global batch is at most a few 1e5 samples, so no honest peer
# declares 1e6, while a member that could would outweigh everyone else
DEFAULT_MAX_WEIGHT = 1e6
# Members average the same tensors of the same model, so their values per chunk agree on scale
# within a small factor (gradients of differing batches, a loss spike); 100x leaves room for that
# and limits what one member can add to a chunk to about 100/n times a typical chunk's norm
DEFAULT_NORM_RATIO = 100.0
WINDOW_BYTES = 12 << 20  # a sender's unanswered chunks per reducer, in float32 bytes (with 6 of 64K: 1.5 MiB)
_OWN = -1  # the reducer's own contribution, among the senders' indices
# The running mean takes differences of two admitted values: each must stay under half the range
_MAX_MAGNITUDE = FLOAT32_MAX / 2
_MAX_REASON = 200  # characters of a reason reported by another peer that we keep


def claimed_weight(value: Any) -> float:
    """A weight as a peer declared it, as a float; NaN (refused later) if it is not a number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return math.nan


def weight_problem(weight: float, max_weight: float) -> str | None:
    """Why a declared weight is refused, or None if it is fine."""
    if not math.isfinite(weight):
        return f"weight {weight!r} is not finite"
    if weight < 0:
        return f"weight {weight:g} is negative"
    if weight > max_weight:
        return f"weight {weight:g} is over max_weight {max_weight:g}"
    return None


@dataclass
class GroupInfo:
    """What every member knows about a formed group; index in the lists = position in the group."""

    group_id: bytes
    peer_ids: list[PeerID]
    addresses: list[str | None]  # None for client-mode members: they call, nobody calls them
    part_sizes: list[int]
    weights: list[float]  # as each member declared it when joining; every member checks them
    my_index: int = 0
    chunk_size: int = MIN_CHUNK  # elements per chunk, the leader's choice: every member cuts alike

    def to_wire(self) -> dict:
        return {"g": self.group_id, "p": [p.digest for p in self.peer_ids], "a": self.addresses,
                "s": self.part_sizes, "w": self.weights, "c": self.chunk_size}

    @classmethod
    def from_wire(cls, raw: Any, me: PeerID, numel: int, default_chunk_size: int = MIN_CHUNK) -> GroupInfo:
        """The group as its leader described it, for our vector of ``numel`` elements;
        ``default_chunk_size``: what a leader that names no chunk size (an older release) used."""
        try:
            info = cls(raw["g"], [PeerID(d) for d in raw["p"]], list(raw["a"]), [int(s) for s in raw["s"]],
                       [claimed_weight(w) for w in raw["w"]], chunk_size=raw.get("c", default_chunk_size))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"malformed group description: {e}") from None
        if any(s < 0 for s in info.part_sizes) or sum(info.part_sizes) != numel:
            raise ValueError(f"malformed group description: part sizes {str(info.part_sizes)[:80]} "
                             f"do not divide our {numel} elements")
        problem = chunk_size_problem(info.chunk_size, numel)
        if problem is not None:
            raise ValueError(f"malformed group description: {problem}")
        if not (len(info.peer_ids) == len(info.addresses) == len(info.part_sizes) == len(info.weights)) \
                or me not in info.peer_ids:
            raise ValueError("group description is inconsistent or does not include this peer")
        info.my_index = info.peer_ids.index(me)
        return info

    @property
    def size(self) -> int:
        return len(self.peer_ids)


@dataclass
class AllReduceOutcome:
    # index of every peer dropped from at least one part -> why, as this peer saw or was told it
    failed: dict[int, str] = field(default_factory=dict)
    # parts whose averaged values did not all come back from their reducer: our values there stay local
    unaveraged: set[int] = field(default_factory=set)
    bytes_sent: int = 0
    bytes_received: int = 0


def capped_window(window: int, chunk_size: int) -> int:
    """``window`` chunks, but at most WINDOW_BYTES of float32 per reducer; never under 2 (one chunk
    travelling while the next is reduced) unless ``window`` itself is."""
    return min(window, max(2, WINDOW_BYTES // (4 * chunk_size)))


def all_finite(x: torch.Tensor) -> bool:
    """NaN/inf check in one pass, without a per-element temporary (see ``p2p.codecs.norm``)."""
    return math.isfinite(norm(x))


def _payload_bytes(payload: dict) -> int:
    return sum(v.nbytes for v in payload.values() if isinstance(v, torch.Tensor))


class _Reducer:
    """Averages this peer's part over the senders' chunks and releases averaged chunks as they complete.

    A chunk is averaged once every expected sender delivered it or was dropped: the contributions
    are screened together, so the ones refused never enter the mean.
    """

    def __init__(self, flat: FlatTensors, chunks: list[Chunk], sender_weights: dict[int, float], weight: float,
                 excluded: dict[int, str], sender_timeout: float, norm_ratio: float | None) -> None:
        self.flat = flat
        self.chunks = chunks
        self.expected = set(sender_weights)
        self.sender_weight = sender_weights
        self.own_weight = weight if weight > 0 else 0.0
        self.failed: dict[int, str] = {s: why for s, why in excluded.items() if s in self.expected}
        self.connected: set[int] = set()
        self.sender_timeout = sender_timeout
        self.norm_ratio = norm_ratio
        loop = asyncio.get_running_loop()
        self.arrived: list[set[int]] = [set() for _ in chunks]
        self.pending: list[dict[int, tuple[torch.Tensor, float]]] = [{} for _ in chunks]
        self.done: list[asyncio.Future] = [loop.create_future() for _ in chunks]
        # averaged chunks as views of our buffer while the round lasts; copies from its end on (detach)
        self.encoded: list[dict | None] = [None] * len(chunks)
        self.detached = False
        self.in_flight: dict[int, int] = {}  # per sender: views handed to its stream, the send not returned yet
        self.cut: dict[int, Callable[[str], None]] = {}  # per sender: CallContext.disconnect of its call
        self.idle = asyncio.Event()
        self.idle.set()
        self.served = [0] * len(chunks)  # senders that were sent averaged chunk c
        self.progress: dict[int, float] = {s: time.monotonic() for s in self.expected}
        if self.own_weight == 0:  # our values (maybe not finite) must not enter the running mean
            for chunk in chunks:
                flat.flat[chunk.start:chunk.end].zero_()
        self._settle()

    def connect(self, sender: int) -> None:
        if sender not in self.expected or sender in self.connected:
            raise ValueError(f"peer {sender} is not an expected sender of this part, or already connected")
        self.connected.add(sender)
        self.progress[sender] = time.monotonic()

    def add(self, sender: int, c: int, payload: Any) -> None:
        """Take sender's chunk c; raises BadChunk (the caller drops the sender) if it is refused."""
        if sender in self.failed:
            return
        chunk = self.chunks[c]
        values, magnitude = decode(payload, chunk.end - chunk.start)
        self.pending[c][sender] = (values, magnitude)
        self.arrived[c].add(sender)
        self.progress[sender] = time.monotonic()
        self._maybe_complete(c)

    def fail(self, sender: int, reason: str) -> None:
        if sender in self.failed or sender not in self.expected:
            return
        logger.info("dropping sender %d from this part: %s", sender, reason)
        self.failed[sender] = reason
        for pending in self.pending:
            pending.pop(sender, None)
        self._settle()

    def finished_sending(self, sender: int) -> bool:
        return all(sender in a for a in self.arrived)

    def _settle(self) -> None:
        for c in range(len(self.chunks)):
            self._maybe_complete(c)

    def _maybe_complete(self, c: int) -> None:
        if self.done[c].done():
            return
        if any(s not in self.arrived[c] and s not in self.failed for s in self.expected):
            return
        contributions = {s: v for s, v in self.pending[c].items()
                         if s not in self.failed and self.sender_weight[s] > 0}
        self.pending[c] = {}
        view = self.flat.flat[self.chunks[c].start:self.chunks[c].end]
        refused = self._screen(c, contributions, view)
        # Our values, in place, become the running weighted mean: one pass per sender and none to
        # weight our values or divide at the end; every intermediate is a convex combination of
        # admitted values, so none can overflow once each is under half the float32 range.
        total = self.own_weight
        for s in sorted(contributions):  # a fixed order: the mean does not depend on arrival times
            if s not in refused:
                total += self.sender_weight[s]
                view.lerp_(contributions[s][0], self.sender_weight[s] / total)
        payload = encode(self.chunks[c].codec, view)
        if payload["c"] != Codec.NONE.value:
            decode_into(payload, view)  # keep exactly what the senders will decode
        self.encoded[c] = _owned(payload) if self.detached else payload
        self.done[c].set_result(None)
        for s, why in refused.items():
            self.fail(s, why)

    def _screen(self, c: int, contributions: dict[int, tuple[torch.Tensor, float]],
                view: torch.Tensor) -> dict[int, str]:
        """Senders whose chunk c must stay out of the mean, and why."""
        refused: dict[int, str] = {}
        for s, (_, magnitude) in contributions.items():  # max |x| <= L2 norm
            if magnitude > _MAX_MAGNITUDE:
                refused[s] = f"chunk {c}: values of norm {magnitude:.3g} could overflow the average"
        if self.norm_ratio is None or not contributions:
            return refused
        magnitudes = {s: m for s, (_, m) in contributions.items()}
        if self.own_weight > 0:
            # Our norm costs a pass over the chunk; it is needed only where it could change a verdict.
            # A median never falls when one of its values rises, so with ours taken as 0 every
            # sender's reference is a lower bound: if each sender passes against that bound, none fails.
            magnitudes[_OWN] = 0.0
            if not self._all_pass(contributions, magnitudes, refused):
                magnitudes[_OWN] = norm(view)
        for s, reference in self._references(contributions, magnitudes, refused).items():
            magnitude = contributions[s][1]
            # a reference of 0 (most others sent zeros: e.g. unused embedding rows) gives no scale
            if reference > 0 and magnitude > self.norm_ratio * reference:
                refused[s] = (f"chunk {c}: norm {magnitude:.3g}, over {self.norm_ratio:g} x the median norm "
                              f"{reference:.3g} of the other contributions")
        return refused

    def _all_pass(self, contributions: dict[int, tuple[torch.Tensor, float]], magnitudes: dict[int, float],
                  refused: dict[int, str]) -> bool:
        """Whether every sender not yet refused is within ``norm_ratio`` of a positive reference."""
        assert self.norm_ratio is not None
        return all(0 < reference and contributions[s][1] <= self.norm_ratio * reference
                   for s, reference in self._references(contributions, magnitudes, refused).items())

    @staticmethod
    def _references(contributions: dict[int, tuple[torch.Tensor, float]], magnitudes: dict[int, float],
                    refused: dict[int, str]) -> dict[int, float]:
        """Per sender still in: the lower median of the other magnitudes (ours among them)."""
        ordered = sorted(magnitudes.values())
        if len(ordered) < 2:
            return {}
        middle = (len(ordered) - 2) // 2  # the lower median of the others, once one is left out
        out = {}
        for s, (_, magnitude) in contributions.items():
            if s not in refused:
                position = bisect.bisect_left(ordered, magnitude)
                out[s] = ordered[middle + 1] if position <= middle else ordered[middle]
        return out

    def take(self, c: int) -> dict:
        """Averaged chunk c for one sender; once every expected sender had it, the copy is dropped
        (a round holds no more than the chunks some sender has yet to receive)."""
        payload = self.encoded[c]
        assert payload is not None
        self.served[c] += 1
        if self.served[c] >= len(self.expected):
            self.encoded[c] = None
        return payload

    def sending(self, sender: int) -> None:
        """A view of our buffer went to a sender's stream: the transport may hold it until the send returns."""
        self.in_flight[sender] = self.in_flight.get(sender, 0) + 1
        self.idle.clear()

    def sent(self, sender: int) -> None:
        self.in_flight[sender] -= 1
        if not self.in_flight[sender]:
            del self.in_flight[sender]
            if not self.in_flight:
                self.idle.set()

    def detach(self) -> None:
        """The round is over, and the owner of the buffer may change it (the optimizer step, the next
        accumulation): what a slow sender has yet to be sent becomes a copy."""
        self.detached = True
        for c, payload in enumerate(self.encoded):
            if payload is not None:
                self.encoded[c] = _owned(payload)

    def overdue(self, now: float) -> list[int]:
        return [s for s in self.expected if s not in self.failed and not self.finished_sending(s)
                and now - self.progress[s] > self.sender_timeout]

    async def wait(self) -> None:
        # shielded: the done futures are shared by every sender's handler, and cancelling a
        # waiter (or a gather) would cancel them for everybody
        await asyncio.shield(asyncio.gather(*self.done))


def _owned(payload: dict) -> dict:
    """A payload whose data is its own, not a view of the flat buffer.  An averaged chunk is served
    to every sender of the part, a slow one (a slow link, a paused process) possibly after our own
    round ended and the owner changed its buffer: a view would serve those later values instead, and
    members of one group would step on different averages.  While the round lasts, views are safe
    (and spare a copy of the part): the buffer is ours until ``run`` returns."""
    if payload["c"] == Codec.NONE.value and payload["d"].numel():
        return {**payload, "d": payload["d"].clone()}
    return payload


class AllReduceRound:
    """One all-reduce of ``flat`` in ``group``; the P2P handler feeds it senders via ``serve``."""

    def __init__(self, p2p: P2P, method: str, group: GroupInfo, flat: FlatTensors, weight: float,
                 codec: Codec, chunk_size: int, sender_timeout: float, window: int, *,
                 max_weight: float = DEFAULT_MAX_WEIGHT, norm_ratio: float | None = DEFAULT_NORM_RATIO,
                 finite: bool | None = None) -> None:
        """``finite``: whether ``flat`` holds only finite values, where the caller already looked (the
        averager does, while matchmaking waits on the network); None: this round looks, before any byte
        is sent."""
        self.p2p = p2p
        self.method = method
        self.group = group
        self.flat = flat
        self.declared_weight = weight  # what we tell reducers: the weight we joined with
        self.weight = weight  # what our own values weigh in our part
        self.codec = codec
        self.chunk_size = chunk_size
        self.sender_timeout = sender_timeout
        self.window = capped_window(window, chunk_size)
        self.bounds = part_bounds(group.part_sizes)
        self.outcome = AllReduceOutcome()
        me = group.my_index
        if group.weights[me] != weight:
            logger.warning("the group lists this peer with weight %r, not %r", group.weights[me], weight)
        # the same rule on the same group description: every member drops the same peers here
        for j, w in enumerate(group.weights):
            why = weight_problem(w, max_weight) if j != me else None
            if why is not None:
                self.outcome.failed[j] = why
        # A peer whose own values are not finite (e.g. a diverged step) takes no part in the mean
        # anywhere: it says so up front, and every reducer drops it (it still gets the average).
        self.nonfinite = not (all_finite(flat.flat) if finite is None else finite)
        if self.nonfinite:
            logger.warning("local tensors hold non-finite values: this peer is excluded from the average")
            self.weight = weight = 0.0
        start, end = self.bounds[me]
        senders = {j: (0.0 if j in self.outcome.failed else group.weights[j]) for j in range(group.size) if j != me}
        self.reducer = _Reducer(flat, self._chunks(me), senders, weight, dict(self.outcome.failed), sender_timeout,
                                norm_ratio) if end > start else None

    def _chunks(self, part: int) -> list[Chunk]:
        start, end = self.bounds[part]
        return self.flat.chunks(start, end, self.chunk_size, self.codec)

    def _drop(self, index: int, reason: str) -> None:
        """Record why a peer was dropped; the first reason heard is the one kept."""
        self.outcome.failed.setdefault(index, reason)

    async def run(self, deadline: float) -> AllReduceOutcome:
        """Exchange every part; returns by ``deadline`` (loop time) whatever happens to the others."""
        loop = asyncio.get_running_loop()
        work = [asyncio.ensure_future(self._exchange(j, deadline)) for j in range(self.group.size)
                if j != self.group.my_index and self.bounds[j][1] > self.bounds[j][0]]
        if self.reducer is not None:
            work.append(asyncio.ensure_future(self._reduce()))
        try:
            # each exchange fails on its own: one surprise must not cancel the others (or our part)
            results = await asyncio.wait_for(asyncio.gather(*work, return_exceptions=True),
                                             max(deadline - loop.time(), 0.0))
            for r in results:
                if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                    logger.error("all-reduce task failed unexpectedly", exc_info=r)
        except asyncio.TimeoutError:
            logger.warning("all-reduce %s passed its deadline", self.group.group_id.hex()[:8])
        finally:
            for task in work:
                task.cancel()
            await asyncio.gather(*work, return_exceptions=True)
            self._release_part("the round ended")
            if self.reducer is not None:
                self.reducer.detach()
        if self.reducer is not None:
            await self._sent(deadline)
            for s, why in self.reducer.failed.items():
                self._drop(s, f"part {self.group.my_index}: {why}")
        return self.outcome

    def _release_part(self, reason: str) -> None:
        """Complete every pending chunk of our part with what arrived, so no sender waits on us."""
        if self.reducer is not None:
            for s in sorted(self.reducer.expected):
                if not self.reducer.finished_sending(s):
                    self.reducer.fail(s, reason)

    async def _sent(self, deadline: float) -> None:
        """Wait for the sends of averaged chunks under way when the round ended: until they return, the
        transport holds views of our buffer, which the caller may change as soon as we return (what no
        sender had been sent yet is a copy by now).  A member that takes none of it for
        ``sender_timeout`` (or until the deadline) has stalled: its connection is dropped with what is
        queued for it, so it never reads values from after the round (it keeps its own for our part)."""
        reducer = self.reducer
        assert reducer is not None
        if not reducer.in_flight:
            return
        bound = min(self.sender_timeout, max(deadline - asyncio.get_running_loop().time(), 0.0))
        try:
            await asyncio.wait_for(reducer.idle.wait(), bound)
            return
        except asyncio.TimeoutError:
            pass
        why = f"took no averaged chunk for {bound:.3g} s after the round ended"
        for s in sorted(reducer.in_flight):
            self._drop(s, f"part {self.group.my_index}: {why}")
            cut = reducer.cut.get(s)
            if cut is not None:
                logger.info("dropping the connection of member %d: it %s", s, why)
                cut(f"member {s} {why}")

    async def _reduce(self) -> None:
        """Wait for this peer's part, dropping senders that stall."""
        assert self.reducer is not None
        period = max(min(self.sender_timeout / 4, 1.0), 0.01)
        waiting = asyncio.ensure_future(self.reducer.wait())
        try:
            while not waiting.done():
                await asyncio.wait([waiting], timeout=period)
                for s in self.reducer.overdue(time.monotonic()):
                    self.reducer.fail(s, f"no progress for {self.sender_timeout} s")
        finally:
            waiting.cancel()

    # ---- sending side --------------------------------------------------------------------------
    async def _exchange(self, j: int, deadline: float) -> None:
        """Send our slice of part j to reducer j and write the averaged chunks it returns into place."""
        address = self.group.addresses[j]
        chunks = self._chunks(j)
        received = 0
        try:
            if address is None:
                raise P2PError(f"reducer {j} has no address")
            timeout = max(deadline - asyncio.get_running_loop().time(), 1e-3)
            call = await self.p2p.open(address, self.method, timeout=timeout, first=self._header())
            async with call:
                window = asyncio.Semaphore(self.window)
                sender = asyncio.ensure_future(self._send_chunks(call, chunks, window))
                try:
                    for chunk in chunks:
                        payload = await call.recv()
                        window.release()
                        # checked before it is written: a refused chunk leaves our values in place
                        decode_into(payload, self.flat.flat[chunk.start:chunk.end])
                        self.outcome.bytes_received += _payload_bytes(payload)
                        self._note_reported(j, payload.get("x"))
                        received += 1
                    await sender
                finally:
                    sender.cancel()
                    await asyncio.gather(sender, return_exceptions=True)
        except (P2PError, ValueError, StopAsyncIteration) as e:
            logger.info("reducer %d failed after %d/%d chunks: %s", j, received, len(chunks), e)
            # the chunks not received keep their local values
            self._drop(j, f"part {j}: reducer failed after {received}/{len(chunks)} chunks: {e}")
        except asyncio.CancelledError:  # the round passed its deadline while reducer j kept silent
            if received < len(chunks):
                self._drop(j, f"part {j}: the round ended after {received}/{len(chunks)} chunks")
            raise
        finally:
            if received < len(chunks):
                self.outcome.unaveraged.add(j)

    def _note_reported(self, j: int, reported: Any) -> None:
        """Record whom reducer j says it dropped (its word: reasons are prefixed with its part)."""
        if not isinstance(reported, list):
            return
        for item in reported[: self.group.size]:
            if isinstance(item, list) and len(item) == 2 and type(item[0]) is int \
                    and 0 <= item[0] < self.group.size and isinstance(item[1], str):
                self._drop(item[0], f"part {j}: {item[1][:_MAX_REASON]}")

    def _header(self) -> dict:
        return {"g": self.group.group_id, "i": self.group.my_index, "w": self.declared_weight,
                "schema": self.flat.schema, "nonfinite": self.nonfinite}

    def _outgoing(self, chunk: Chunk) -> dict:
        """The payload that carries our values of ``chunk``."""
        # a view, not a copy: the send returns once the kernel holds the bytes (p2p's contract)
        return encode(chunk.codec, self.flat.flat[chunk.start:chunk.end])

    async def _send_chunks(self, call: Any, chunks: list[Chunk], window: asyncio.Semaphore) -> None:
        for c, chunk in enumerate(chunks):
            await window.acquire()  # released when an averaged chunk comes back
            payload = self._outgoing(chunk)
            await call.send(payload, end=c == len(chunks) - 1)  # the last one also ends our stream
            self.outcome.bytes_sent += _payload_bytes(payload)
        await call.done_writing()  # (only if there was no chunk)

    # ---- reducing side (one sender) ------------------------------------------------------------
    async def serve(self, sender: int, weight: Any, schema: Any, requests: Any, nonfinite: bool = False,
                    disconnect: Callable[[str], None] | None = None) -> Any:
        """Async generator run by the P2P handler for one sender of our part.

        A sender dropped for what it declared or sent is still served the average of the others.
        ``disconnect(reason)`` drops the connection the sender's call came on (None: no way to).
        """
        reducer = self.reducer
        if reducer is None:
            raise ValueError("this peer reduces no part in this group")
        if schema != self.flat.schema:
            reducer.fail(sender, "tensor shapes differ")
            raise ValueError(describe_mismatch(self.flat.schema, schema))
        reducer.connect(sender)
        if disconnect is not None:
            reducer.cut[sender] = disconnect
        joined = self.group.weights[sender]
        if claimed_weight(weight) != joined:
            reducer.fail(sender, f"called with weight {str(weight)[:40]} but joined with {joined:g}")
        if nonfinite:
            reducer.fail(sender, "it holds non-finite values")
        consumer = asyncio.ensure_future(self._consume(sender, requests))
        try:
            for c in range(len(reducer.chunks)):
                # shielded: if this sender's call is cancelled (it died), its handler must not take
                # the shared future down with it; the other senders still wait on it
                await asyncio.shield(reducer.done[c])
                payload = reducer.take(c)
                if reducer.failed:
                    payload = {**payload, "x": [[s, why] for s, why in sorted(reducer.failed.items())]}
                self.outcome.bytes_sent += _payload_bytes(payload)
                if reducer.detached:
                    yield payload
                    continue
                reducer.sending(sender)  # resumed once the handler's send returned: the kernel has the bytes
                try:
                    yield payload
                finally:
                    reducer.sent(sender)
        finally:
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)

    async def _consume(self, sender: int, requests: Any) -> None:
        assert self.reducer is not None
        reducer = self.reducer
        c = 0
        try:
            async for payload in requests:
                if c >= len(reducer.chunks):
                    raise ValueError("sender sent more chunks than the part has")
                try:
                    reducer.add(sender, c, payload)
                except BadChunk as e:  # dropped, but still read: its stream must not stall on us
                    reducer.fail(sender, f"chunk {c}: {e}")
                if isinstance(payload, dict):
                    self.outcome.bytes_received += _payload_bytes(payload)
                c += 1
            if c < len(reducer.chunks):
                reducer.fail(sender, f"stream ended after {c}/{len(reducer.chunks)} chunks")
        except (P2PError, ValueError, KeyError, TypeError, RuntimeError) as e:
            reducer.fail(sender, f"{type(e).__name__}: {e}")
