"""Calls that may block (a cloud's API, a worker's boot) on thread pools, so that the policy's tick only
starts them and collects those that finished: a hanging API never delays a notice.  Provider polls
have a pool of their own, so they never queue behind a launch."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass
class Call:
    """One call running on a pool: what it is for and the future of its result."""

    kind: str  # "launch", "place", "adopt", "activate", "release"
    instance_id: str
    future: Future
    detail: Any = None


class Calls:
    def __init__(self, max_calls: int) -> None:
        self._pool = ThreadPoolExecutor(max_calls, thread_name_prefix="provider")
        self._polls = ThreadPoolExecutor(1, thread_name_prefix="provider-poll")
        self._poll: Future | None = None
        self._next_poll = float("-inf")
        self.running: list[Call] = []

    def submit(self, kind: str, instance_id: str, fn: Callable[..., Any], *args: Any, detail: Any = None) -> None:
        self.running.append(Call(kind, instance_id, self._pool.submit(fn, *args), detail))

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
        """``fn(*args)`` on the pool, waited for (adoption, before the first tick)."""
        return self._pool.submit(fn, *args).result(timeout)

    def of_kind(self, kind: str) -> list[Call]:
        return [c for c in self.running if c.kind == kind]

    def finished(self) -> list[Call]:
        """The calls that finished since the last time, no longer running."""
        finished = [(c, c.future.done()) for c in self.running]  # each call asked once: it may finish meanwhile
        self.running[:] = [c for c, done in finished if not done]  # one pass, not a removal per call
        return [c for c, done in finished if done]

    def start_poll(self, fn: Callable[[], Any], interval_s: float) -> None:
        """Start ``fn`` unless a poll runs or the last one started less than ``interval_s`` ago."""
        if self._poll is None and time.monotonic() >= self._next_poll:
            self._next_poll = time.monotonic() + interval_s
            self._poll = self._polls.submit(fn)

    def finished_poll(self) -> Future | None:
        """The poll that finished, once; None while it runs or when none was started."""
        if self._poll is None or not self._poll.done():
            return None
        poll, self._poll = self._poll, None
        return poll

    def poll_done(self) -> bool:
        """No poll runs (none started, or the last one finished)."""
        return self._poll is None or self._poll.done()

    def all_done(self) -> bool:
        """Every call and the poll have finished (collected or not)."""
        return self.poll_done() and all(c.future.done() for c in self.running)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._polls.shutdown(wait=False, cancel_futures=True)
