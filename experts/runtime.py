"""The one thread that runs every expert's torch work, so the server's event loop never computes.

One thread serializes all batches: training steps of one expert never race each other or a
checkpoint save, and torch's own intra-op threads still use every core for each batch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Runtime:
    def __init__(self, name: str = "spotswarm-expert-runtime") -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._closed = False

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the runtime thread; the caller's event loop keeps serving meanwhile."""
        if self._closed:
            raise RuntimeError("the expert runtime is shut down")
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    def shutdown(self) -> None:
        """Wait for the batch in progress (if any) and stop the thread."""
        self._closed = True
        self._executor.shutdown(wait=True)
