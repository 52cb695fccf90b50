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


class FrameBudget:
    """Bytes one node has promised to frames declared but not yet received, over all connections.

    A decoder reserves a message's frame bytes when it reads the lengths, before allocating the
    tensors, and releases them when the message is complete or the connection is gone.  A
    request that does not fit waits in FIFO order (the decoder stops; its connection stops
    reading) and is granted, through the decoder's ``on_granted``, when enough is released.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.reserved = 0
        self._waiting: deque[tuple[Decoder, int]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def reserve(self, decoder: Decoder, nbytes: int) -> bool:
        """True if granted now; False if queued; ProtocolError if it could never fit."""
        if nbytes > self.capacity:
            raise ProtocolError(f"message declares {nbytes} frame bytes, over the node's "
                                f"max_pending_frame_bytes={self.capacity}")
        if not self._waiting and self.reserved + nbytes <= self.capacity:
            self.reserved += nbytes
            return True
        self._waiting.append((decoder, nbytes))
        return False

    def release(self, nbytes: int) -> None:
        self.reserved -= nbytes
        self._grant()

    def withdraw(self, decoder: Decoder) -> None:
        """Forget a waiting request (its connection closed); those behind it may fit now."""
        self._waiting = deque((d, n) for d, n in self._waiting if d is not decoder)
        self._grant()

    def _grant(self) -> None:
        while self._waiting and self.reserved + self._waiting[0][1] <= self.capacity:
            decoder, nbytes = self._waiting.popleft()
            self.reserved += nbytes
            decoder.granted(nbytes)
