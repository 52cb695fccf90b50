"""The frame budget: how many tensor bytes one node has promised to messages still arriving.

A remote declares a message's frame lengths before sending the frames, and the decoder allocates
the tensors they land in as soon as it has the header.  Without a node-wide bound, a few
connections declaring large messages and sending nothing would hold the node's memory; the budget
makes such a message wait (its connection stops reading) until others finish.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from .errors import ProtocolError


class Decoder(Protocol):
    """What the budget asks of a waiting decoder (``wire.Decoder``): to go on once its bytes are granted."""

    def granted(self, nbytes: int) -> None: ...


SPARE_FRACTION = 16  # the spare kept for small messages: capacity // 16 ...
SMALL_FRACTION = 256  # ... usable by messages of at most capacity // 256 bytes each


class FrameBudget:
    """Bytes one node has promised to frames declared but not yet received, over all connections.

    A decoder reserves a message's frame bytes when it reads the lengths, before allocating the
    tensors, and releases them when the message is complete or the connection is gone.  A
    request that does not fit waits in FIFO order (the decoder stops; its connection stops
    reading) and is granted, through the decoder's ``on_granted``, when enough is released.

    Beside ``capacity`` the budget keeps ``spare`` bytes (``capacity // 16``) for small messages
    (at most ``small`` bytes, ``capacity // 256``; one at a time per decoder): a small message
    that would wait (the rest is taken, or others wait before it) takes spare bytes instead, so a
    huge message holding or waiting for the budget cannot hold up other callers' small ones.
    At most ``capacity + spare`` bytes are ever promised.
    """

    def __init__(self, capacity: int, spare: int | None = None, small: int | None = None) -> None:
        self.capacity = capacity
        self.spare = capacity // SPARE_FRACTION if spare is None else spare
        self.small = min(capacity // SMALL_FRACTION if small is None else small, self.spare)
        self.reserved = 0  # all of it, spare included
        self.spare_reserved = 0
        self._spare_holders: dict[Decoder, int] = {}
        self._waiting: deque[tuple[Decoder, int]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def reserve(self, decoder: Decoder, nbytes: int) -> bool:
        """True if granted now; False if queued; ProtocolError if it could never fit."""
        if nbytes > self.capacity:
            raise ProtocolError(f"message declares {nbytes} frame bytes, over the node's "
                                f"max_pending_frame_bytes={self.capacity}")
        if not self._waiting and self._main_fits(nbytes):
            self.reserved += nbytes
            return True
        if self._spare_fits(decoder, nbytes):
            self._take_spare(decoder, nbytes)
            return True
        self._waiting.append((decoder, nbytes))
        return False

    def release(self, nbytes: int, holder: Decoder | None = None) -> None:
        """Give back ``nbytes`` that ``holder`` reserved (from the spare, if that is where they came from)."""
        self.reserved -= nbytes
        if holder is not None:
            self.spare_reserved -= self._spare_holders.pop(holder, 0)
        self._grant()

    def withdraw(self, decoder: Decoder) -> None:
        """Forget a waiting request (its connection closed); those behind it may fit now."""
        self._waiting = deque((d, n) for d, n in self._waiting if d is not decoder)
        self._grant()

    def _main_fits(self, nbytes: int) -> bool:
        return self.reserved - self.spare_reserved + nbytes <= self.capacity

    def _spare_fits(self, decoder: Decoder, nbytes: int) -> bool:
        return (nbytes <= self.small and self.spare_reserved + nbytes <= self.spare
                and decoder not in self._spare_holders)

    def _take_spare(self, decoder: Decoder, nbytes: int) -> None:
        self.reserved += nbytes
        self.spare_reserved += nbytes
        self._spare_holders[decoder] = nbytes

    def _grant(self) -> None:
        granted: list[tuple[Decoder, int]] = []
        while self._waiting and self._main_fits(self._waiting[0][1]):
            decoder, nbytes = self._waiting.popleft()
            self.reserved += nbytes
            granted.append((decoder, nbytes))
        if self._waiting and self.spare_reserved + 1 <= self.spare:
            still: deque[tuple[Decoder, int]] = deque()
            for decoder, nbytes in self._waiting:
                if self._spare_fits(decoder, nbytes):
                    self._take_spare(decoder, nbytes)
                    granted.append((decoder, nbytes))
                else:
                    still.append((decoder, nbytes))
            self._waiting = still
        for decoder, nbytes in granted:
            decoder.granted(nbytes)
