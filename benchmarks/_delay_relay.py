"""A userspace TCP relay that delays what it carries: latency between emulated regions, where the
kernel's netem is missing (``tc tbf``, which ``_netns.py`` installs, shapes rate but adds no delay).

Every connection accepted on the relay's address is carried to ``target`` over a connection of its
own; each chunk read from either side is written to the other ``delay_s`` seconds after it arrived,
in order, so a request and its reply each take ``delay_s`` more: a round trip ``2 * delay_s`` more.
Real bytes through real sockets; the relay reads ahead without limit while it waits, so it delays a
stream without slowing it (rate is the tbf qdisc's job).  Run it in the namespace of the side that
listens, or in the root namespace between two of them.  Each direction is carried by the local
simulator's relay code (``orchestrator/sim/relay.py``: ``carry`` over an unpaced ``Link``).

Usage from a benchmark::

    relay = DelayRelay(("10.213.0.11", 7000), delay_s=0.05)
    host, port = await relay.start()    # connect here instead of to the target
    ...
    await relay.close()                 # every connection and task ends with it
"""

from __future__ import annotations

import asyncio
import logging

from orchestrator.sim.relay import Link, splice

log = logging.getLogger(__name__)


class DelayRelay:
    def __init__(self, target: tuple[str, int], delay_s: float, host: str = "127.0.0.1", port: int = 0) -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.target = target
        self.delay_s = delay_s
        self.host, self.port = host, port
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> tuple[str, int]:
        """Listen; the address to connect to."""
        self._server = await asyncio.start_server(self._accepted, self.host, self.port)
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    async def close(self) -> None:
        """Stop listening and cut every connection carried."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(self._carry(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _carry(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        """One accepted connection: a connection to the target, and both directions delayed."""
        try:
            target = await asyncio.open_connection(*self.target)
        except OSError as e:
            log.info("relay: target %s:%d unreachable: %s", *self.target, e)
            client_w.close()
            return
        await splice((client_r, client_w), target, Link(self.delay_s), Link(self.delay_s))


def _pair(text: str) -> tuple[tuple[str, int], tuple[str, int]]:
    """``LISTEN_HOST:PORT=TARGET_HOST:PORT``."""
    listen, _, target = text.partition("=")
    (lh, _, lp), (th, _, tp) = listen.rpartition(":"), target.rpartition(":")
    if not (lh and lp.isdigit() and th and tp.isdigit()):
        raise ValueError(f"a relay is LISTEN_HOST:PORT=TARGET_HOST:PORT, got {text!r}")
    return (lh, int(lp)), (th, int(tp))


async def _serve(pairs: list[tuple[tuple[str, int], tuple[str, int]]], delay_s: float) -> None:
    """Relay every pair until stdin closes (the parent's end of the pipe: it went away or is done)."""
    relays = [DelayRelay(target, delay_s, host=host, port=port) for (host, port), target in pairs]
    try:
        for relay in relays:
            await relay.start()
        print("ready", flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, __import__("sys").stdin.read)
    finally:
        for relay in relays:
            await relay.close()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="delaying TCP relays, one per LISTEN=TARGET pair, until stdin closes")
    parser.add_argument("--delay", type=float, required=True, help="seconds added to each direction")
    parser.add_argument("pairs", nargs="+", type=_pair, metavar="LISTEN_HOST:PORT=TARGET_HOST:PORT")
    args = parser.parse_args()
    asyncio.run(_serve(args.pairs, args.delay))
