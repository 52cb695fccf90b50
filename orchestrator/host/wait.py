"""Waiting for a condition with a deadline: one place that polls, so that every wait in the code is
bounded and, when it runs out, says what it was waiting for."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class _Poll:
    """One wait's condition and deadline; ``done()`` asks the condition once."""

    def __init__(self, condition: Callable[[], Any], timeout: float, what: str) -> None:
        self.condition, self.timeout, self.what = condition, timeout, what
        self.deadline = time.monotonic() + timeout
        self.value: Any = None

    def done(self) -> bool:
        """True once the condition holds; a TimeoutError naming the wait once the deadline passed
        (the condition is asked once more at the deadline)."""
        self.value = self.condition()
        if self.value:
            return True
        if time.monotonic() >= self.deadline:
            raise TimeoutError(f"timed out waiting for {self.what} ({self.timeout:g} s)")
        return False


def wait_for(condition: Callable[[], T], timeout: float, what: str, every: float = 0.05) -> T:
    """Poll ``condition`` every ``every`` seconds until it returns something true, and return that;
    a TimeoutError naming ``what`` after ``timeout`` seconds.

    An exception the condition raises ends the wait at once: a condition that can tell the wait is
    hopeless (the process it waits on exited) says so instead of running out the clock."""
    poll = _Poll(condition, timeout, what)
    while not poll.done():
        time.sleep(every)  # polling a condition, bounded by the deadline
    return poll.value


async def wait_for_async(condition: Callable[[], T], timeout: float, what: str, every: float = 0.05) -> T:
    """``wait_for`` inside an event loop: the loop runs between polls, so the tasks that bring the
    condition about keep running."""
    poll = _Poll(condition, timeout, what)
    while not poll.done():
        await asyncio.sleep(every)
    return poll.value
