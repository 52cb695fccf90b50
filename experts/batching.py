"""Per-expert request queues and the scheduler that turns them into batches for the runtime.

Each expert has two pools, forward and backward.  The scheduler runs one batch at a time: it picks
the pool whose oldest request has waited longest, takes whole requests from its head up to
``max_batch_size`` rows, concatenates them on the runtime thread, runs them, and splits the result
back to each requester.  Requests that arrive while a batch runs wait for the next one, so batches
grow with load without a fixed delay; ``batch_timeout`` > 0 additionally waits up to that long for
a pool to fill before running it.  Requests are checked (schema, finite values) before they enter a
pool, so one client's bad request never fails a batch it shares with others.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from p2p.waiting import wait_event

from .errors import NonFiniteValues
from .runtime import Runtime
from .schema import shape_signature

logger = logging.getLogger(__name__)

BatchFn = Callable[[list[torch.Tensor]], list["torch.Tensor | None"]]


@dataclass
class _Request:
    inputs: list[torch.Tensor]
    rows: int
    signature: tuple
    future: asyncio.Future
    arrived: float


@dataclass
class TaskPool:
    """Waiting requests of one kind for one expert; ``process`` runs a concatenated batch."""

    name: str
    process: BatchFn
    max_batch_size: int
    queue: collections.deque[_Request] = field(default_factory=collections.deque)
    batches: int = 0
    rows: int = 0  # rows of every batch run, so rows / batches is how full batches are
    busy_seconds: float = 0.0  # time its batches held the runtime

    def _drop_abandoned(self) -> None:
        while self.queue and self.queue[0].future.done():  # the caller gave up (deadline, cancel)
            self.queue.popleft()

    def oldest(self) -> float | None:
        self._drop_abandoned()
        return self.queue[0].arrived if self.queue else None

    @property
    def queued_rows(self) -> int:
        return sum(r.rows for r in self.queue if not r.future.done())

    def take_batch(self) -> list[_Request]:
        """Requests from the head, in order, while they fit and have the head's per-row shapes."""
        self._drop_abandoned()
        batch: list[_Request] = []
        rows = 0
        while self.queue:
            req = self.queue[0]
            if req.future.done():
                self.queue.popleft()
                continue
            if batch and (rows + req.rows > self.max_batch_size or req.signature != batch[0].signature):
                break
            batch.append(self.queue.popleft())
            rows += req.rows
        return batch


def _run_batch(process: BatchFn, inputs: list[list[torch.Tensor]], rows: list[int]) -> list[list | Exception]:
    """On the runtime thread: concatenate the requests, run, split the outputs back by rows.

    If a batch of several requests comes out non-finite, each request runs again on its own, so
    only the request that caused it fails (the backend applied nothing from the failed batch)."""
    if len(inputs) == 1:
        return [list(process(inputs[0]))]
    merged = [torch.cat([req[i] for req in inputs]) for i in range(len(inputs[0]))]
    try:
        outputs = process(merged)
    except NonFiniteValues as e:
        logger.info("a batch of %d requests failed (%s); running them one by one", len(inputs), e)
        return [_run_alone(process, req) for req in inputs]
    parts = [o.split(rows) if o is not None else [None] * len(rows) for o in outputs]
    return [[p[j] for p in parts] for j in range(len(rows))]


def _run_alone(process: BatchFn, inputs: list[torch.Tensor]) -> list | Exception:
    try:
        return list(process(inputs))
    except Exception as e:  # this request's own failure, handed to its caller alone
        return e


class BatchScheduler:
    """Feeds one runtime from many pools, one batch at a time, oldest request first."""

    def __init__(self, runtime: Runtime, batch_timeout: float = 0.0) -> None:
        self.runtime = runtime
        self.batch_timeout = batch_timeout
        self.pools: list[TaskPool] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None

    def add_pool(self, pool: TaskPool) -> TaskPool:
        self.pools.append(pool)
        return pool

    def remove_pool(self, pool: TaskPool, error: Callable[[], Exception]) -> None:
        """Stop scheduling ``pool``; each of its queued requests fails with a fresh ``error()`` (a
        batch of it already running on the runtime still answers its requests)."""
        if pool in self.pools:
            self.pools.remove(pool)
        while pool.queue:
            future = pool.queue.popleft().future
            if not future.done():
                future.set_exception(error())
        self._wakeup.set()  # a scheduler filling this pool looks again

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="expert-batch-scheduler")

    async def submit(self, pool: TaskPool, inputs: list[torch.Tensor], rows: int) -> list:
        """Queue one request and wait for its share of a batch's outputs."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        pool.queue.append(_Request(inputs, rows, shape_signature(inputs), future, loop.time()))
        self._wakeup.set()
        return await future

    def _pick(self) -> TaskPool | None:
        best, best_time = None, None
        for pool in self.pools:
            t = pool.oldest()
            if t is not None and (best_time is None or t < best_time):
                best, best_time = pool, t
        return best

    async def _fill(self, pool: TaskPool) -> None:
        """With ``batch_timeout``: give the pool until its oldest request is that old to fill up."""
        loop = asyncio.get_running_loop()
        while pool.queued_rows < pool.max_batch_size:
            oldest = pool.oldest()
            if oldest is None:
                return
            remaining = oldest + self.batch_timeout - loop.time()
            if remaining <= 0:
                return
            self._wakeup.clear()
            if not await wait_event(self._wakeup, remaining):
                return

    async def _run(self) -> None:
        while True:
            pool = self._pick()
            if pool is None:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if self.batch_timeout > 0:
                await self._fill(pool)
            batch = pool.take_batch()
            if not batch:
                continue
            pool.batches += 1
            pool.rows += sum(r.rows for r in batch)
            started = time.perf_counter()
            try:
                results = await self.runtime.run(_run_batch, pool.process, [r.inputs for r in batch],
                                                 [r.rows for r in batch])
            except asyncio.CancelledError:
                for r in batch:
                    r.future.cancel()
                raise
            except Exception as e:
                pool.busy_seconds += time.perf_counter() - started
                logger.warning("%s: a batch of %d requests failed: %r", pool.name, len(batch), e)
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(e)
            else:
                pool.busy_seconds += time.perf_counter() - started
                for r, out in zip(batch, results, strict=True):
                    if r.future.done():
                        continue
                    if isinstance(out, Exception):
                        r.future.set_exception(out)
                    else:
                        r.future.set_result(out)

    async def stop(self) -> None:
        """Stop scheduling; requests still queued are cancelled (their handlers end without a reply)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for pool in self.pools:
            while pool.queue:
                pool.queue.popleft().future.cancel()
