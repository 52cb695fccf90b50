"""The event loop the fake HTTP servers share: the fake clouds' APIs and metadata servers are aiohttp
apps, served on loopback from one loop in a thread of their own, so that a synchronous test (and the
real clients it drives) can reach them."""

from __future__ import annotations

import asyncio
import threading


class LoopServers:
    """aiohttp servers on one event loop in a thread (fake metadata servers, the API proxy)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fake-servers", daemon=True)
        self.thread.start()
        self.runners: list = []

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, app) -> int:
        from aiohttp import web

        async def start() -> int:
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.runners.append(runner)
            return runner.addresses[0][1]

        return self.call(start())

    def close(self) -> None:
        async def stop() -> None:
            for runner in self.runners:
                await runner.cleanup()

        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()
