"""Where synchronous torch code sends expert calls from: a P2P endpoint on an event-loop thread.

``RemoteExpert`` and ``RemoteMixtureOfExperts`` are called from ordinary threads (a training loop,
autograd's backward); they hand coroutines to the client's loop and block on the result.  A client
either owns its loop thread and a client-mode peer (``ExpertClient.create()``), or borrows a DHT's
(``ExpertClient.from_dht(dht)``) so one process keeps one endpoint.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from dht import DHT
from p2p import P2P
from p2p.loop_thread import LoopThread

T = TypeVar("T")


class ExpertClient:
    def __init__(self, p2p: P2P, dht: DHT | None = None, owned_thread: LoopThread | None = None) -> None:
        self.p2p = p2p
        self.dht = dht
        self._thread = owned_thread
        self._closed = False

    @classmethod
    def create(cls, **p2p_options: Any) -> ExpertClient:
        """A client with its own loop thread and a client-mode P2P endpoint."""
        thread = LoopThread(name="spotswarm-expert-client")
        try:
            p2p = thread.run(P2P.create(client_mode=True, **p2p_options), timeout=30)
        except BaseException:
            thread.stop()
            raise
        return cls(p2p, owned_thread=thread)

    @classmethod
    def from_dht(cls, dht: DHT) -> ExpertClient:
        """Call through the DHT's own P2P endpoint and loop (shut down with the DHT)."""
        return cls(dht.node.p2p, dht=dht)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self.p2p.loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._closed:
            coro.close()
            raise RuntimeError("this expert client is shut down")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            coro.close()
            raise RuntimeError("a blocking expert call from the client's own event loop would deadlock; "
                               "call remote experts from another thread")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the client's loop and wait for it (from any thread but that loop's)."""
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise

    def shutdown(self) -> None:
        """Close the endpoint and stop the loop thread, if this client owns them."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            try:
                self._thread.run(self.p2p.shutdown(), timeout=30)
            finally:
                self._thread.stop()

    def __enter__(self) -> ExpertClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


_default: ExpertClient | None = None
_default_lock = threading.Lock()


def default_client() -> ExpertClient:
    """This process's shared client, created on first use (its loop thread is a daemon)."""
    global _default
    with _default_lock:
        if _default is None or _default._closed:
            _default = ExpertClient.create()
        return _default
