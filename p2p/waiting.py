"""Waiting on an event with a timeout, without losing a cancellation.

``asyncio.wait_for(event.wait(), t)`` on Python 3.10 and 3.11 swallows a cancellation that arrives
in the same loop iteration as the event is set (the inner wait finished, so ``wait_for`` returns
its result): a loop that waits this way runs on, ``cancelling``, and whoever awaits its end (a
node's shutdown) waits for ever.  ``asyncio.wait`` never cancels what it waits on and lets the
caller's cancellation through.
"""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Whether ``event`` is set within ``timeout`` seconds (None: no limit)."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout)
    finally:
        if not waiter.done():
            waiter.cancel()
            await asyncio.gather(waiter, return_exceptions=True)
    return event.is_set()
