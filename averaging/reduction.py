"""The reducing side of the all-reduce: this peer's part averaged over what the senders deliver.

A chunk is averaged once every sender delivered it (or was dropped), so the contributions are
screened together before any enters the mean.  A sender is dropped, for the rest of the part, if its
chunk is malformed for its codec or in a foreign dtype (``p2p.codecs.decode`` refuses it), not
finite, large enough to overflow the mean, or has an L2 norm over ``norm_ratio`` times the upper
median norm of the other contributions to that chunk (over ``norm_ratio`` times a strict majority of
them); the weights are renormalized over the rest, so the result is the average of the others.
The upper median, not the lower: in a group of three, the lower median of a sender's two others is
the smaller, and one member sending a tiny chunk (an honest peer near its optimum, or an attacker)
would have the others' ordinary chunks refused.

The mean is computed in place in this peer's own buffer, as a running weighted mean in a fixed
order of senders, and every sender receives exactly the encoded bits the reducer kept.  The round
that drives the calls (``allreduce.py``) feeds a :class:`Reducer` chunks and takes averaged chunks
from it.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from p2p.codecs import FLOAT32_MAX, Codec, decode, decode_into, encode, norm

from .audit import Commitment
from .partition import Chunk, FlatTensors
from .robust import Byzantine, clip_coefficients, squared_distances

logger = logging.getLogger(__name__)

# Members average the same tensors of the same model, so their values per chunk agree on scale
# within a small factor (gradients of differing batches, a loss spike); 100x leaves room for that
# and limits what one member can add to a chunk to about 100/n times a typical chunk's norm
DEFAULT_NORM_RATIO = 100.0
_OWN = -1  # the reducer's own contribution, among the senders' indices
# The running mean takes differences of two admitted values: each must stay under half the range
_MAX_MAGNITUDE = FLOAT32_MAX / 2


def all_finite(x: torch.Tensor) -> bool:
    """NaN/inf check in one pass, without a per-element temporary (see ``p2p.codecs.norm``)."""
    return math.isfinite(norm(x))


class Reducer:
    """Averages this peer's part over the senders' chunks and releases averaged chunks as they complete.

    A chunk is averaged once every expected sender delivered it or was dropped: the contributions
    are screened together, so the ones refused never enter the mean.
    """

    def __init__(self, flat: FlatTensors, chunks: list[Chunk], sender_weights: dict[int, float], weight: float,
                 excluded: dict[int, str], sender_timeout: float, norm_ratio: float | None,
                 byzantine: Byzantine = Byzantine.OFF) -> None:
        self.flat = flat
        self.byzantine = byzantine
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
        # byzantine="verify": what went into each chunk, for members that audit it (``audit.py``)
        self.keeps = byzantine is Byzantine.VERIFY
        self.kept: list[dict[int, dict]] = [{} for _ in chunks]  # sender -> its payload (its signature: the round's)
        self.own_inputs: list[torch.Tensor | None] = [None] * len(chunks)
        self.before: list[dict[int, str]] = [{} for _ in chunks]  # senders dropped before the chunk completed
        self.commitments: list[Commitment | None] = [None] * len(chunks)
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
        if self.keeps:
            self.kept[c][sender] = payload
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
        if self.keeps:
            self.before[c] = dict(self.failed)
            self.own_inputs[c] = view.clone()
        refused = self._screen(c, contributions, view)
        # a fixed order: the result does not depend on arrival times
        admitted = [s for s in sorted(contributions) if s not in refused]
        own, coefficients = self._coefficients(view, admitted, contributions)
        # Our values, in place, become the running weighted sum: one pass per sender and none to
        # weight our values or divide at the end; every intermediate is a convex combination of
        # admitted values, so none can overflow once each is under half the float32 range.
        total = own
        for s, coefficient in zip(admitted, coefficients, strict=True):
            if coefficient > 0:
                total += coefficient
                view.lerp_(contributions[s][0], coefficient / total)
        payload = encode(self.chunks[c].codec, view)
        if payload["c"] != Codec.NONE.value:
            decode_into(payload, view)  # keep exactly what the senders will decode
        self.encoded[c] = _owned(payload) if self.detached else payload
        if self.keeps:
            self.commitments[c] = Commitment(self.own_weight, sorted({*self.failed, *refused}))
        self.done[c].set_result(None)
        for s, why in refused.items():
            self.fail(s, why)

    def _coefficients(self, view: torch.Tensor, admitted: list[int],
                      contributions: dict[int, tuple[torch.Tensor, float]]) -> tuple[float, list[float]]:
        """What our values and each admitted sender's weigh in the chunk's result: the weights (a
        weighted mean), or CenteredClip's coefficients where the group clips."""
        weights = [self.sender_weight[s] for s in admitted]
        if not self.byzantine.clips or len(admitted) + (self.own_weight > 0) < 2:
            return self.own_weight, weights
        xs = [contributions[s][0] for s in admitted]
        if self.own_weight > 0:
            xs, weights = [view, *xs], [self.own_weight, *weights]
        coefficients, _ = clip_coefficients(squared_distances(xs), weights)
        return (coefficients[0], coefficients[1:]) if self.own_weight > 0 else (0.0, coefficients)

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
        """Per sender still in: the upper median of the other magnitudes (ours among them)."""
        ordered = sorted(magnitudes.values())
        if len(ordered) < 2:
            return {}
        middle = (len(ordered) - 1) // 2  # the upper median of the others, once one is left out
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
