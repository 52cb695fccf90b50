"""Butterfly all-reduce inside a formed group, streamed in chunks.

Peer i reduces part i of the flat vector.  Every other peer j opens one bidirectional call to i,
streams its slice of part i chunk by chunk, and reads back the averaged chunks as soon as i has
them, so reduce-scatter and all-gather overlap.  The reducer accumulates in place in its own
buffer (its own slice is never sent anywhere).

Flow control: a sender keeps at most ``window`` chunks unanswered per reducer.  An averaged chunk
comes back only once every sender delivered it, so fast senders cannot run ahead of the slowest
one: their surplus would only queue in the reducer's memory and crowd the slow sender's packets
out of the reducer's link, and hold the reducer's memory in bytes nobody reads yet.

Faults: a sender that makes no progress for ``sender_timeout`` is dropped and each chunk is
averaged over the weights that arrived; if a reducer dies, its senders keep their local values for
the chunks they did not get back, and say which parts those are (``unaveraged``): members that got
every part back hold the same values, the others do not.  Averaged chunks are served from the
reducer's buffer while the round lasts; at its end what a sender has yet to get is copied, and sends
under way are waited for, up to ``sender_timeout``: a member that takes nothing for that long loses
its connection, so no transport is left holding views of a buffer its owner changes.  Reducers
tell senders whom they dropped and why, so every peer can report every failure it was part of.

Hostile members: a chunk is averaged only once every sender delivered it (until then each
sender's decoded slice waits, at most ``window`` chunks per sender), and the reducer screens the
contributions first (``reduction.py``: malformed, foreign dtype, not finite, overflowing, or far
above the others' norms); a dropped sender is dropped for the rest of that part, from the chunk
where it was caught on.  A member whose declared weight is not finite, negative or over
``max_weight`` is dropped from every part by every member, since all apply that rule to the same
group description.  Replies are checked too: a reducer's chunk that is malformed or not finite is
refused, and the sender keeps its own values for that part.  Where the group verifies, averaged
chunks are held until the audit (``audit.py``) cleared their reducer, and only then written: our
values stay in place, so a caught reducer's part needs no copy to go back to.

This module is the round: the group, the calls between members, what each sends and receives, and
how a round ends; the averaging itself is ``reduction.py``'s.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from p2p import P2P, P2PError, PeerGone, PeerID, PeerIDMismatch
from p2p.codecs import BadChunk, Codec, check_decodable, decode, decode_into, encode, write_checked
from p2p.waiting import wait_event

from .audit import (
    Commitment,
    Secret,
    check_input,
    check_manifest,
    chosen_chunk,
    close_enough,
    fetch_all,
    manifest_statement,
    payload_digest,
    seed_of,
)
from .declarations import Declaration
from .partition import MIN_CHUNK, Chunk, FlatTensors, chunk_size_problem, describe_mismatch, part_bounds
from .reduction import DEFAULT_NORM_RATIO, Reducer, all_finite
from .robust import Byzantine

logger = logging.getLogger(__name__)

# Weights are sample counts (collaborative training weighs each peer by the samples it
# accumulated for one step); a global batch is at most a few 1e5 samples, so no honest peer
# declares 1e6, while a member that could would outweigh everyone else
DEFAULT_MAX_WEIGHT = 1e6
WINDOW_BYTES = 12 << 20  # a sender's unanswered chunks per reducer, in float32 bytes (with 6 of 64K: 1.5 MiB)
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


def capped_weights(weights: list[float], refused: set[int], ratio: float | None) -> list[float]:
    """Each member's weight, at most ``ratio`` times the median positive weight of the members not
    refused (every member computes the same from the same group description)."""
    positive = sorted(w for j, w in enumerate(weights) if j not in refused and w > 0)
    if ratio is None or not positive:
        return list(weights)
    cap = ratio * positive[(len(positive) - 1) // 2]
    return [min(w, cap) for w in weights]


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
    # where the group does not trust its leader: each member's signed declaration (declarations.py)
    declarations: list[Declaration | None] | None = None

    def to_wire(self) -> dict:
        wire = {"g": self.group_id, "p": [p.digest for p in self.peer_ids], "a": self.addresses,
                "s": self.part_sizes, "w": self.weights, "c": self.chunk_size}
        if self.declarations is not None:
            wire["j"] = [d.to_wire() if d is not None else None for d in self.declarations]
        return wire

    @classmethod
    def from_wire(cls, raw: Any, me: PeerID, numel: int, default_chunk_size: int = MIN_CHUNK) -> GroupInfo:
        """The group as its leader described it, for our vector of ``numel`` elements;
        ``default_chunk_size``: what a leader that names no chunk size (an older release) used."""
        try:
            info = cls(raw["g"], [PeerID(d) for d in raw["p"]], list(raw["a"]), [int(s) for s in raw["s"]],
                       [claimed_weight(w) for w in raw["w"]], chunk_size=raw.get("c", default_chunk_size))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"malformed group description: {e}") from None
        signed = raw.get("j")
        if isinstance(signed, list):
            info.declarations = [Declaration.from_wire(d) for d in signed[: len(info.peer_ids)]]
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
    # reducers an audit caught (byzantine="verify"), with the evidence; their parts are reverted
    caught: dict[int, str] = field(default_factory=dict)


def capped_window(window: int, chunk_size: int) -> int:
    """``window`` chunks, but at most WINDOW_BYTES of float32 per reducer; never under 2 (one chunk
    travelling while the next is reduced) unless ``window`` itself is."""
    return min(window, max(2, WINDOW_BYTES // (4 * chunk_size)))


def _payload_bytes(payload: dict) -> int:
    return sum(v.nbytes for v in payload.values() if isinstance(v, torch.Tensor))


class AllReduceRound:
    """One all-reduce of ``flat`` in ``group``; the P2P handler feeds it senders via ``serve``."""

    def __init__(self, p2p: P2P, method: str, group: GroupInfo, flat: FlatTensors, weight: float,
                 codec: Codec, chunk_size: int, sender_timeout: float, window: int, *,
                 max_weight: float = DEFAULT_MAX_WEIGHT, norm_ratio: float | None = DEFAULT_NORM_RATIO,
                 max_weight_ratio: float | None = None, byzantine: Byzantine = Byzantine.OFF,
                 finite: bool | None = None) -> None:
        """``finite``: whether ``flat`` holds only finite values, where the caller already looked (the
        averager does, while matchmaking waits on the network); None: this round looks, before any byte
        is sent.  ``max_weight_ratio``: a member weighs at most this many times the group's median
        (None: no such cap); ``byzantine``: how reducers aggregate (``robust.Byzantine``); ``snapshot``: a
        buffer of ``flat``'s size that a verified round copies our values into (None: a new one)."""
        self.byzantine = Byzantine(byzantine)
        self.p2p = p2p
        self.method = method
        self.group = group
        self.flat = flat
        self.declared_weight = weight  # what we tell reducers: the weight we joined with
        self.weight = weight  # what our own values weigh in our part
        self.codec = codec
        self.chunk_size = chunk_size
        self.sender_timeout = sender_timeout
        # a verified group's chunks are small (audits move whole chunks): as many bytes in flight as others
        self.window = capped_window(window if self.byzantine is not Byzantine.VERIFY else 1 << 10, chunk_size)
        self.bounds = part_bounds(group.part_sizes)
        self._chunk_lists: dict[int, list[Chunk]] = {}
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
        self.weight_refused = set(self.outcome.failed)
        self.weights = capped_weights(group.weights, self.weight_refused, max_weight_ratio)
        if not self.nonfinite:
            self.weight = weight = min(weight, self.weights[me])
        start, end = self.bounds[me]
        senders = {j: (0.0 if j in self.outcome.failed else self.weights[j]) for j in range(group.size) if j != me}
        self.norm_ratio = norm_ratio
        self.reducer = Reducer(flat, self._chunks(me), senders, weight, dict(self.outcome.failed), sender_timeout,
                                norm_ratio, self.byzantine) if end > start else None
        # byzantine="verify": averaged chunks held until their audit (a caught reducer's are never
        # written), the commitments that came with them, our share of the audit's randomness
        self.verifying = self.byzantine is Byzantine.VERIFY
        self.held: dict[tuple[int, int], tuple[Codec, dict]] = {}
        self.manifests: dict[int, tuple[list[bytes], bytes]] = {}  # senders' signed chunk digests
        self.commitments: dict[tuple[int, int], Commitment | None] = {}
        self.secret = Secret()
        self.finished = asyncio.Event()  # run() returned: audits of our part may start
        self.keys: dict[int, bytes] = {}  # senders' public keys, from their calls
        self.commits: dict[int, bytes] = {}  # members' audit commits, as they came with the round's calls
        self.shown_to: set[PeerID] = set()  # members we showed our part's inputs to
    def _chunks(self, part: int) -> list[Chunk]:
        chunks = self._chunk_lists.get(part)
        if chunks is None:
            start, end = self.bounds[part]
            chunks = self._chunk_lists[part] = self.flat.chunks(start, end, self.chunk_size, self.codec)
        return chunks

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
        self.finished.set()
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
        if await wait_event(reducer.idle, bound):
            return
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
                sender = asyncio.ensure_future(self._send_chunks(call, j, chunks, window))
                try:
                    for chunk in chunks:
                        payload = await call.recv()
                        window.release()
                        # checked before it is written: a refused chunk leaves our values in place
                        if self.verifying:  # written once its reducer passed the audit
                            self.held[j, received] = (check_decodable(payload, chunk.end - chunk.start), payload)
                        else:
                            decode_into(payload, self.flat.flat[chunk.start:chunk.end])
                        if self.verifying:
                            self.commitments[j, received] = Commitment.from_wire(payload.get("m"))
                            if received == 0 and isinstance(payload.get("h"), bytes):
                                self.commits[j] = payload["h"]
                        self.outcome.bytes_received += _payload_bytes(payload)
                        self._note_reported(j, payload.get("x"))
                        received += 1
                    await sender
                finally:
                    sender.cancel()
                    await asyncio.gather(sender, return_exceptions=True)
        except (P2PError, ValueError, StopAsyncIteration) as e:
            logger.info("reducer %d failed after %d/%d chunks: %s", j, received, len(chunks), e)
            if isinstance(e, (PeerGone, PeerIDMismatch)):
                self._gone(j, e)
            # the chunks not received keep their local values
            self._drop(j, f"part {j}: reducer failed after {received}/{len(chunks)} chunks: {e}")
        except asyncio.CancelledError:  # the round passed its deadline while reducer j kept silent
            if received < len(chunks):
                self._drop(j, f"part {j}: the round ended after {received}/{len(chunks)} chunks")
            raise
        finally:
            if received < len(chunks):
                self.outcome.unaveraged.add(j)

    def _gone(self, j: int, error: P2PError) -> None:
        """Member j no longer runs at its address: its slice of our part will not come, so our part
        is averaged without it now instead of at the deadline (the others, refused the same way,
        do the same for theirs)."""
        if self.reducer is not None and not self.reducer.finished_sending(j):
            self.reducer.fail(j, f"it is gone: {error}")

    def _note_reported(self, j: int, reported: Any) -> None:
        """Record whom reducer j says it dropped (its word: reasons are prefixed with its part)."""
        if not isinstance(reported, list):
            return
        for item in reported[: self.group.size]:
            if isinstance(item, list) and len(item) == 2 and type(item[0]) is int \
                    and 0 <= item[0] < self.group.size and isinstance(item[1], str):
                self._drop(item[0], f"part {j}: {item[1][:_MAX_REASON]}")

    def _header(self) -> dict:
        header = {"g": self.group.group_id, "i": self.group.my_index, "w": self.declared_weight,
                  "schema": self.flat.schema, "nonfinite": self.nonfinite, "z": self.byzantine.value}
        if self.verifying:
            header["k"] = self.p2p.identity.public_key
            header["h"] = self.secret.commit  # our audit commit: every member we call or who calls us has it
        return header

    def _outgoing(self, chunk: Chunk) -> dict:
        """The payload that carries our values of ``chunk``."""
        # a view, not a copy: the send returns once the kernel holds the bytes (p2p's contract)
        return encode(chunk.codec, self.flat.flat[chunk.start:chunk.end])

    async def _send_chunks(self, call: Any, part: int, chunks: list[Chunk], window: asyncio.Semaphore) -> None:
        signed = self._signed(part, chunks) if self.verifying else None
        for c, chunk in enumerate(chunks):
            await window.acquire()  # released when an averaged chunk comes back
            payload = self._outgoing(chunk) if signed is None else signed[c]
            await call.send(payload, end=c == len(chunks) - 1)  # the last one also ends our stream
            self.outcome.bytes_sent += _payload_bytes(payload)
        await call.done_writing()  # (only if there was no chunk)

    def _signed(self, part: int, chunks: list[Chunk]) -> list[dict]:
        """Our payloads for ``part``, the first carrying our signature on every chunk's digest: our word
        for what we sent, which the reducer shows to auditors.  (Views of our buffer, which a verified
        round leaves as it is until its audit.)"""
        payloads = [self._outgoing(chunk) for chunk in chunks]
        digests = [payload_digest(p) for p in payloads]
        if payloads:
            signature = self.p2p.identity.sign(manifest_statement(self.group.group_id, part, digests))
            payloads[0] = {**payloads[0], "sig": signature, "dg": digests}
        return payloads

    # ---- reducing side (one sender) ------------------------------------------------------------
    async def serve(self, sender: int, weight: Any, schema: Any, requests: Any, nonfinite: bool = False,
                    disconnect: Callable[[str], None] | None = None, byzantine: Any = Byzantine.OFF.value,
                    public_key: Any = None, commit: Any = None) -> Any:
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
        if byzantine != self.byzantine.value:
            reducer.fail(sender, f"it averages with byzantine={str(byzantine)[:16]}, this group with "
                                 f"{self.byzantine.value}")
        if self.verifying and isinstance(public_key, bytes):
            self.keys[sender] = public_key
        if self.verifying and isinstance(commit, bytes):
            self.commits[sender] = commit
        consumer = asyncio.ensure_future(self._consume(sender, requests))
        try:
            for c in range(len(reducer.chunks)):
                # shielded: if this sender's call is cancelled (it died), its handler must not take
                # the shared future down with it; the other senders still wait on it
                await asyncio.shield(reducer.done[c])
                payload = reducer.take(c)
                commitment = reducer.commitments[c]
                if commitment is not None:
                    payload = {**payload, "m": commitment.to_wire()}
                    if c == 0:
                        payload["h"] = self.secret.commit
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
                    if self.verifying:
                        self._add_signed(sender, c, payload)
                    else:
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

    def _add_signed(self, sender: int, c: int, payload: Any) -> None:
        """Take a verified group's chunk once it is the one its sender signed for."""
        assert self.reducer is not None
        if not isinstance(payload, dict):
            raise BadChunk("chunk payload must be a dict")
        signature, digests = payload.pop("sig", None), payload.pop("dg", None)
        if c == 0:
            problem = check_manifest(self.group.group_id, self.group.my_index, len(self.reducer.chunks), digests,
                                     signature, self.keys.get(sender), self.group.peer_ids[sender])
            if problem is not None:
                self.reducer.fail(sender, problem)
                return
            self.manifests[sender] = (digests, signature)
        manifest = self.manifests.get(sender)
        problem = "its first chunk was refused" if manifest is None else check_input(manifest[0], c, payload)
        if problem is not None:
            self.reducer.fail(sender, problem)
            return
        self.reducer.add(sender, c, payload)

    # ---- audits (byzantine="verify"; audit.py) ---------------------------------------------------
    def _audited_members(self) -> dict[int, str]:
        me = self.group.my_index
        return {i: a for i, a in enumerate(self.group.addresses) if i != me and a is not None}

    async def audit(self, method: str, timeout: float) -> None:
        """After the round: draw the seed with the others, then recompute one chunk of every part we got
        back, and write the averages of the reducers it cleared.  A reducer caught is named in
        ``outcome.caught``; its part keeps our own values.  An audit cut short writes nothing."""
        try:
            await self._audit(method, timeout)
        except BaseException:
            self.outcome.unaveraged.update(j for j, _ in self.held)
            self.held.clear()
            raise
        self._write_held()

    async def _audit(self, method: str, timeout: float) -> None:
        members = self._audited_members()
        missing = {i: a for i, a in members.items() if i not in self.commits}  # (a member we never exchanged with)
        fetched = await fetch_all(self.p2p, method, missing, {"g": self.group.group_id, "q": "commit"}, timeout)
        for i, answer in fetched.items():
            if isinstance(answer, dict) and isinstance(answer.get("h"), bytes):
                self.commits[i] = answer["h"]
        self.secret.committed.set()
        reveals = await fetch_all(self.p2p, method, {i: a for i, a in members.items() if i in self.commits},
                                  {"g": self.group.group_id, "q": "reveal"}, timeout)
        secrets = {self.group.my_index: self.secret.value}
        for i, answer in reveals.items():
            value = answer.get("r") if isinstance(answer, dict) else None
            if isinstance(value, bytes) and self.commits.get(i) == Secret(value).commit:
                secrets[i] = value
        seed = seed_of(self.group.group_id, secrets)
        parts = [j for j in range(self.group.size) if j != self.group.my_index and j not in self.outcome.unaveraged
                 and self.bounds[j][1] > self.bounds[j][0] and j not in self.outcome.failed]
        verdicts = await asyncio.gather(*(self._audit_part(method, j, chosen_chunk(seed, j, len(self._chunks(j))),
                                                           timeout) for j in parts))
        for j, evidence in zip(parts, verdicts, strict=True):
            if evidence is not None:
                self._convict(j, evidence)

    def _write_held(self) -> None:
        """Write the averaged chunks of every reducer the audit did not catch."""
        for (j, c), (codec, payload) in sorted(self.held.items()):
            if j not in self.outcome.caught:
                chunk = self._chunks(j)[c]
                write_checked(codec, payload, self.flat.flat[chunk.start:chunk.end])
        self.held.clear()

    def _convict(self, j: int, evidence: str) -> None:
        logger.warning("reducer %d (%s) caught by its audit: %s", j, self.group.peer_ids[j], evidence)
        self.outcome.caught[j] = evidence
        self.outcome.failed[j] = f"part {j}: caught by its audit: {evidence}"
        self.outcome.unaveraged.add(j)  # its averages are never written: our values stay

    async def _audit_part(self, method: str, j: int, c: int, timeout: float) -> str | None:
        """Why reducer j's chunk c is not the average of its inputs (evidence), or None if it is."""
        address = self.group.addresses[j]
        assert address is not None
        commitment = self.commitments.get((j, c))
        if commitment is None:
            return f"chunk {c} came without the commitment to its own values, weight and drops"
        try:
            answer = await self.p2p.call(address, method, {"g": self.group.group_id, "q": "inputs", "c": c},
                                         timeout=timeout)
        except (P2PError, ValueError, OSError) as e:
            return f"did not show the inputs of chunk {c}: {e}"
        try:
            return self._recompute(j, c, commitment, answer)
        except (KeyError, TypeError, ValueError, AttributeError, BadChunk) as e:
            return f"chunk {c}: malformed inputs: {type(e).__name__}: {str(e)[:_MAX_REASON]}"

    def _recompute(self, j: int, c: int, commitment: Commitment, answer: Any) -> str | None:
        """Run reducer j's code on the inputs it shows for chunk c; the evidence if they do not give what
        it served us."""
        chunk = self._chunks(j)[c]
        n = chunk.end - chunk.start
        own = answer["own"]
        if not isinstance(own, torch.Tensor) or own.dtype != torch.float32 or own.shape != (n,):
            return f"chunk {c}: its own values are not {n} float32 numbers"
        fair = 0.0 if j in self.weight_refused else self.weights[j]
        if commitment.own_weight not in (0.0, fair):
            return f"chunk {c}: it weighed its own values {commitment.own_weight:g}, not {fair:g}"
        before = {int(s): str(why)[:_MAX_REASON] for s, why in answer["before"]}
        shown = {int(s): (p, digests, sig, key) for s, p, digests, sig, key in answer["in"]}
        senders = {k: (0.0 if k in self.weight_refused else self.weights[k]) for k in range(self.group.size) if k != j}
        excluded = {k: "weight" for k in self.weight_refused if k != j}
        for s, why in before.items():
            if s in senders:
                excluded.setdefault(s, why)
        flat = FlatTensors([own.clone()])
        reducer = Reducer(flat, [Chunk(0, n, chunk.codec)], senders, commitment.own_weight, excluded,
                          float("inf"), self.norm_ratio, self.byzantine)
        for s in sorted(senders):
            if s in excluded:
                continue
            if s == self.group.my_index:  # what we sent, as we sent it: the reducer need not show it to us
                payload = self._outgoing(chunk)
            elif s not in shown:
                return f"chunk {c}: it does not show member {s}'s input, nor says why it dropped it"
            else:
                payload, digests, signature, key = shown[s]
                problem = check_manifest(self.group.group_id, j, len(self._chunks(j)), digests, signature, key,
                                         self.group.peer_ids[s]) or check_input(digests, c, payload)
                if problem is not None:
                    return f"chunk {c}: member {s}'s input as shown: {problem}"
            try:
                reducer.add(s, 0, payload)
            except BadChunk as e:
                reducer.fail(s, f"chunk {c}: {e}")
        if not reducer.done[0].done():
            return f"chunk {c}: its inputs do not complete the chunk"
        dropped = sorted(reducer.failed)
        if dropped != sorted(commitment.failed):
            return f"chunk {c}: it dropped members {commitment.failed}, its inputs drop {dropped}"
        received = decode(self.held[j, c][1], n)[0]
        if not close_enough(flat.flat, received):
            gap = float((flat.flat.double() - received.double()).norm())
            return (f"chunk {c}: the average it served is {gap:.3g} (L2) away from the average of the inputs "
                    f"it shows")
        return None

    async def answer_audit(self, request: dict, caller: PeerID, timeout: float) -> dict:
        """A member's audit request about this round: our commit, our secret, or our part's inputs."""
        me = self.group.my_index
        if caller not in self.group.peer_ids or caller == self.group.peer_ids[me]:
            raise PermissionError("only the group's members audit it")
        query = request.get("q")
        if not await wait_event(self.finished, timeout):
            raise ValueError("this round has not ended")
        if query == "commit":
            return {"h": self.secret.commit}
        if query == "reveal":  # only once we hold the others' commits: nobody picks its secret after ours
            if not await wait_event(self.secret.committed, timeout):
                raise ValueError("this member has not collected the commits yet")
            return {"r": self.secret.value}
        if query != "inputs":
            raise ValueError(f"unknown audit query {str(query)[:20]!r}")
        c = request.get("c")
        reducer = self.reducer
        if reducer is None or type(c) is not int or not 0 <= c < len(reducer.chunks):
            raise ValueError("no such chunk of our part")
        if caller in self.shown_to:  # an auditor asks once a round: more would only spend our upload
            raise ValueError("this member already audited our part of this round")
        self.shown_to.add(caller)
        own = reducer.own_inputs[c]
        if own is None:
            raise ValueError(f"chunk {c} of our part was not averaged")
        before = reducer.before[c]
        auditor = self.group.peer_ids.index(caller)  # (its own input, it has)
        shown = [[s, payload, *self.manifests[s], self.keys.get(s)]
                 for s, payload in sorted(reducer.kept[c].items()) if s not in before and s != auditor]
        return {"own": own, "before": [[s, why[:_MAX_REASON]] for s, why in sorted(before.items())], "in": shown}
