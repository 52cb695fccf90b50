"""An event loop on a background thread, for synchronous APIs over async nodes (e.g. ``dht.DHT``).

A training loop calls blocking methods; they hand coroutines to this loop and wait for results.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str = "spotswarm-loop", use_uvloop: bool = True) -> None:
        if use_uvloop:
            try:
                import uvloop

                self.loop = uvloop.new_event_loop()
            except ImportError:  # pragma: no cover - uvloop is a dependency, but stay usable without it
                self.loop = asyncio.new_event_loop()
        else:
            self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("blocking call from the loop's own thread would deadlock; use the async API")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        """Stop the loop and join the thread (pending tasks should have been finished by the caller)."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
