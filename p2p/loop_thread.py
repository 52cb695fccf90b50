"""Synchronous APIs over async nodes (``dht.DHT``, the experts' client and background server).

A training loop calls blocking methods; they hand coroutines to an event loop on a background
thread and wait for the results.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")
Face = TypeVar("Face", bound="BlockingFace")


class BlockingFace:
    """Blocking ``run`` / ``submit`` of coroutines on an event loop that runs in another thread.

    A face either borrows a loop (another face's) or owns one, on a daemon thread; an owner sets
    itself up with ``_start`` and, at ``shutdown``, closes what lives on its loop (``_aclose``) and
    stops the thread.  After shutdown, and from the loop's own thread (where waiting would
    deadlock), calls are refused with RuntimeError.
    """

    shutdown_timeout = 30.0

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None, thread_name: str = "spotswarm-loop") -> None:
        self._closed = False
        self._thread: threading.Thread | None = None
        if loop is None:
            loop = uvloop.new_event_loop()
            self._thread = threading.Thread(target=_run_forever, args=(loop,), name=thread_name, daemon=True)
            self._thread.start()
        self.loop = loop

    def _start(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run the coroutine that sets this face up; if it fails, the face is closed (its thread stopped)."""
        try:
            return self.run(coro, timeout)
        except BaseException:
            self._stop()
            raise

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if self._closed or running is self.loop:
            coro.close()
            raise RuntimeError(f"this {type(self).__name__} is shut down" if self._closed else
                               f"a blocking {type(self).__name__} call from its own event loop would deadlock")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for it; it is cancelled if the wait ends early."""
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise

    async def _aclose(self) -> None:
        """Close what this face owns on its loop (run by ``shutdown`` when the face owns the loop)."""

    def shutdown(self) -> None:
        if self._closed:
            return
        try:
            if self._thread is not None:
                self.run(self._aclose(), self.shutdown_timeout)
        finally:
            self._stop()

    def _stop(self) -> None:
        """Refuse further calls; stop the owned loop and join its thread (its tasks are finished by now)."""
        self._closed = True
        if self._thread is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()

    def __enter__(self: Face) -> Face:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _run_forever(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    loop.run_forever()
    _finish_tasks(loop)
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


def _finish_tasks(loop: asyncio.AbstractEventLoop, timeout: float = 5.0) -> None:
    """Cancel what still runs once the loop stopped and let it unwind, as ``asyncio.run`` does: a task
    left pending would leave its async generators mid-iteration, and closing those at the loop's end
    fails ("aclose(): asynchronous generator is already running")."""
    pending = asyncio.all_tasks(loop)
    if not pending:
        return
    logging.getLogger(__name__).debug("cancelling %d tasks still running at the loop's end", len(pending))
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.wait(pending, timeout=timeout))
