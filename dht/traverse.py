"""The iterative Kademlia lookup, batched: one traversal finds the nearest peers (and values) of many keys.

Every round, each unfinished key picks up to ``alpha`` of its closest not-yet-asked contacts, and a
contact picked by several keys gets one request for all of them.  Answers are processed as they
arrive, so one slow peer delays only its own keys.  A key's lookup ends when it found a value (if
it stops on one) or when no unasked contact could come nearer than the ``want`` nearest that answered.

This module knows nothing of the network: the node passes in how to ask a contact (``find``) and
what to make of an answer (``absorb``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from .protocol import MAX_KEYS_PER_REQUEST, FindAnswer
from .routing import ID_BYTES, Contact
from .storage import Entry

# Ask ``contact`` about ``targets`` (key ids), for values too if asked: one answer per target, or None
# if the contact failed or lied (it is then asked nothing more in this traversal).
FindCall = Callable[[Contact, list[int], bool], Awaitable[list[FindAnswer] | None]]
# Take one answer of ``contact`` about one search's key: its record (if any) and its raw contacts.
Absorb = Callable[["Search", Contact, Entry | None, list], None]


@dataclass
class Search:
    """The state of one key's lookup within a batched traversal."""

    target: int
    key: bytes | None  # set when looking for values: needed to validate what peers return
    want: int
    stop_on_value: bool
    candidates: dict[int, Contact] = field(default_factory=dict)
    queried: set[int] = field(default_factory=set)
    responded: list[tuple[int, Contact]] = field(default_factory=list)
    found: list[tuple[Contact, Entry]] = field(default_factory=list)
    # (subkey, value, expiration) records of this key that validated already: replicas mostly answer
    # with identical copies, and each is checked once
    checked: set[tuple[bytes | None, bytes, float]] = field(default_factory=set)
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

    def add_candidates(self, contacts: list, skip: Callable[[int], bool]) -> None:
        """Learn the contacts (wire form) an answer named, but those already known and those ``skip`` refuses."""
        for raw in contacts:
            # most contacts in an answer are already known: check the id before parsing the rest
            digest = raw[0] if isinstance(raw, list) and raw else None
            if not isinstance(digest, bytes) or len(digest) < ID_BYTES:
                continue
            node_id = int.from_bytes(digest[:ID_BYTES], "big")
            if node_id in self.candidates or skip(node_id):
                continue
            try:
                self.candidates[node_id] = Contact.from_wire(raw)
            except ValueError:
                continue  # one malformed contact does not spoil the rest of the answer

    def nearest(self, n: int) -> list[Contact]:
        return [c for _, c in self.responded[:n]]

    def update_finished(self) -> None:
        if self.stop_on_value and self.found:
            self.finished = True
        elif self.in_flight == 0 and not self.next_to_query(1):
            self.finished = True


async def traverse(searches: list[Search], alpha: int, find: FindCall, absorb: Absorb, want_values: bool) -> None:
    """Run ``searches`` to their end, asking at most ``alpha`` contacts at once per search."""
    tasks: dict[asyncio.Task, tuple[Contact, list[Search]]] = {}
    try:
        while True:
            for contact, part in _requests(searches, alpha):
                task = asyncio.ensure_future(find(contact, [s.target for s in part], want_values))
                tasks[task] = (contact, part)
            for s in searches:
                if not s.finished:
                    s.update_finished()
            if not tasks or all(s.finished for s in searches):
                return
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                contact, group = tasks.pop(task)
                _take_answers(searches, contact, group, task.result(), absorb)
    finally:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def _requests(searches: list[Search], alpha: int) -> list[tuple[Contact, list[Search]]]:
    """The next round's requests: each contact picked by some searches, with those searches
    (at most MAX_KEYS_PER_REQUEST per request)."""
    batch: dict[int, tuple[Contact, list[Search]]] = {}
    for s in searches:
        if s.finished:
            continue
        for c in s.next_to_query(alpha - s.in_flight):
            s.queried.add(c.node_id)
            s.in_flight += 1
            batch.setdefault(c.node_id, (c, []))[1].append(s)
    return [(contact, group[start:start + MAX_KEYS_PER_REQUEST])
            for contact, group in batch.values() for start in range(0, len(group), MAX_KEYS_PER_REQUEST)]


def _take_answers(searches: list[Search], contact: Contact, group: list[Search],
                  answers: list[FindAnswer] | None, absorb: Absorb) -> None:
    if answers is None:  # dead or lying: no other key in this traversal asks it again
        for s in searches:
            s.queried.add(contact.node_id)
    for i, s in enumerate(group):
        s.in_flight -= 1
        if answers is not None:
            absorb(s, contact, *answers[i])
