"""What a peer's calls cost on the wire, by method: messages and bytes, each way.

A swarm's control plane (DHT lookups, progress, matchmaking) must cost each peer little more as the
swarm grows; that is measured, not assumed, so every connection counts what it sends and reads
under the method of the call each message belongs to.  Counting is a dict lookup and two additions
per message; handshake messages, which belong to no call, count under ``""``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class MethodTraffic:
    """One method's messages and bytes, sent and received, as calls and as their handlers."""

    messages_out: int = 0
    bytes_out: int = 0
    messages_in: int = 0
    bytes_in: int = 0

    @property
    def messages(self) -> int:
        return self.messages_out + self.messages_in

    @property
    def bytes(self) -> int:
        return self.bytes_out + self.bytes_in

    def __add__(self, other: MethodTraffic) -> MethodTraffic:
        return MethodTraffic(self.messages_out + other.messages_out, self.bytes_out + other.bytes_out,
                             self.messages_in + other.messages_in, self.bytes_in + other.bytes_in)


class Traffic:
    """A peer's wire traffic by method name, since it started or since the last ``reset``."""

    def __init__(self) -> None:
        self.by_method: dict[str, MethodTraffic] = {}

    def sent(self, method: str, nbytes: int) -> None:
        entry = self._entry(method)
        entry.messages_out += 1
        entry.bytes_out += nbytes

    def received(self, method: str, nbytes: int) -> None:
        entry = self._entry(method)
        entry.messages_in += 1
        entry.bytes_in += nbytes

    def _entry(self, method: str) -> MethodTraffic:
        entry = self.by_method.get(method)
        if entry is None:
            entry = self.by_method[method] = MethodTraffic()
        return entry

    def total(self, prefixes: Iterable[str] | None = None) -> MethodTraffic:
        """The sum over every method, or over the methods starting with one of ``prefixes``."""
        wanted = None if prefixes is None else tuple(prefixes)
        out = MethodTraffic()
        # a snapshot of the items (one C call): another thread may read the totals while the loop counts
        for method, entry in list(self.by_method.items()):
            if wanted is None or method.startswith(wanted):
                out = out + entry
        return out

    def reset(self) -> None:
        self.by_method = {}


def buffers_size(bufs: list) -> int:
    """Bytes in an encoder's output buffers (bytes, bytearrays or memoryviews of any format)."""
    return sum(b.nbytes if isinstance(b, memoryview) else len(b) for b in bufs)
