"""wait_event: a cancellation that arrives as the event is set still cancels the waiter."""

from __future__ import annotations

import asyncio

import pytest

from p2p.waiting import wait_event

pytestmark = pytest.mark.timeout(30)


async def started(coro) -> asyncio.Task:
    task = asyncio.ensure_future(coro)
    for _ in range(3):  # a few loop iterations: the waiter is parked on the event
        await asyncio.sleep(0)
    return task


async def test_a_cancel_that_arrives_as_the_event_is_set_is_not_lost():
    event = asyncio.Event()
    task = await started(wait_event(event, 10.0))
    event.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_the_event_or_the_timeout_decides():
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    task = await started(wait_event(event, 10.0))
    event.set()
    assert await task is True
    assert await wait_event(event, 0) is True
