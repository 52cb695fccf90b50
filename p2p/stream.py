"""The two ends of one call on a connection: the stream both ends read and write, and the caller's
handle on it, bounded by the call's deadline.

A connection (``connection.py``) routes each received item to its stream; the stream queues it
until read, and gives its bytes back to the connection's flow control once it is.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Protocol

from .errors import NotAMember, RemoteError, ResourceExhausted, RPCTimeout
from .headers import DATA, END, END_OF_ITEMS, ERROR_MESSAGE, ERROR_TYPE, KIND, PAYLOAD, STREAM
from .identity import PeerID


class Carrier(Protocol):
    """What a stream needs of its connection (``connection.Connection``): to send, to be told what
    was consumed, and to drop or cancel the stream."""

    loop: asyncio.AbstractEventLoop
    remote_id: PeerID | None
    streams: dict[int, Stream]

    async def send(self, header: dict[str, Any]) -> None: ...
    def consumed(self, nbytes: int) -> None: ...
    def cancel_stream(self, stream: Stream) -> None: ...


class Looped(Protocol):
    """The node a call belongs to (``node.P2P``): its event loop times the deadline."""

    loop: asyncio.AbstractEventLoop


class Stream:
    """One call on a connection, as seen from either end: a queue of received items plus sending."""

    __slots__ = ("conn", "sid", "method", "items", "waiter", "eof", "error", "sent_end", "finished")

    def __init__(self, conn: Carrier, sid: int, method: str) -> None:
        self.conn = conn
        self.sid = sid
        self.method = method
        self.items: deque[tuple[Any, int]] = deque()
        self.waiter: asyncio.Future | None = None
        self.eof = False
        self.error: BaseException | None = None
        self.sent_end = False
        self.finished = False  # removed from the connection; no further sends

    # ---- receiving -------------------------------------------------------------------------
    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def push(self, item: Any, nbytes: int) -> None:
        self.items.append((item, nbytes))
        self._wake()

    def push_eof(self) -> None:
        self.eof = True
        self._wake()

    def push_error(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self._wake()

    async def recv(self) -> Any:
        """Next item; raises StopAsyncIteration at the end of the remote's messages."""
        while not self.items:
            if self.error is not None:
                raise self.error
            if self.eof:
                raise StopAsyncIteration
            self.waiter = self.conn.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        item, nbytes = self.items.popleft()
        self.conn.consumed(nbytes)
        return item

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Any:
        return await self.recv()

    # ---- sending ---------------------------------------------------------------------------
    async def send(self, item: Any, end: bool = False) -> None:
        """Send one item; waits while the socket's write buffer is full (backpressure)."""
        if self.sent_end:
            raise RuntimeError(f"stream {self.method} already finished sending")
        self.sent_end = end
        await self.conn.send({STREAM: self.sid, KIND: DATA, END_OF_ITEMS: int(end), PAYLOAD: item})

    async def done_writing(self) -> None:
        if not self.sent_end:
            self.sent_end = True
            await self.conn.send({STREAM: self.sid, KIND: END})

    def release(self) -> None:
        """Drop unread items (returning their bytes to flow control) and forget the stream."""
        self.finished = True
        while self.items:
            self.conn.consumed(self.items.popleft()[1])
        self.conn.streams.pop(self.sid, None)


class Call:
    """The caller's end of one RPC: send items, read items, cancel; bounded by one deadline."""

    def __init__(self, node: Looped, stream: Stream, deadline: float) -> None:
        self.node = node
        self.stream = stream
        self.method = stream.method
        self.deadline = deadline
        self.timed_out = False
        self._timer = node.loop.call_at(deadline, self._on_deadline)

    @property
    def peer_id(self) -> PeerID | None:
        return self.stream.conn.remote_id

    def _on_deadline(self) -> None:
        if not self.stream.finished:
            self.timed_out = True
            self.stream.push_error(RPCTimeout(f"{self.method} to {self.peer_id} passed its deadline"))
            self.stream.conn.cancel_stream(self.stream)

    def _done(self) -> None:
        self._timer.cancel()
        self.stream.release()

    async def send(self, item: Any, end: bool = False) -> None:
        """Send one item; ``end``: it is the last (what ``done_writing`` says, in the same message)."""
        if self.stream.error is not None:
            raise self.stream.error
        await self.stream.send(item, end)

    async def done_writing(self) -> None:
        await self.stream.done_writing()

    async def recv(self) -> Any:
        """Next item from the remote; StopAsyncIteration when the remote finished."""
        try:
            item = await self.stream.recv()
        except StopAsyncIteration:
            self._done()
            raise
        except asyncio.CancelledError:
            self.cancel()
            raise
        except BaseException:
            self._done()
            raise
        if self.stream.eof and not self.stream.items:
            self._done()
        return item

    def __aiter__(self) -> Call:
        return self

    async def __anext__(self) -> Any:
        return await self.recv()

    def cancel(self) -> None:
        """Stop the call; the remote handler is cancelled."""
        self._timer.cancel()
        self.stream.conn.cancel_stream(self.stream)

    async def aclose(self) -> None:
        if not self.stream.finished:
            self.cancel()

    async def __aenter__(self) -> Call:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


def remote_error(h: dict, method: str, peer: PeerID | None = None) -> Exception:
    """The exception an ERROR on a call's stream stands for, as the caller raises it."""
    type_name = str(h.get(ERROR_TYPE, "RemoteError"))
    message = str(h.get(ERROR_MESSAGE, ""))
    if type_name == "NotAMember":
        return NotAMember(f"{method} refused by {peer}: {message}")
    if type_name == "ResourceExhausted":
        return ResourceExhausted(type_name, message, method)
    if type_name == "RPCTimeout":
        return RPCTimeout(f"{method}: {message}")
    return RemoteError(type_name, message, method)
