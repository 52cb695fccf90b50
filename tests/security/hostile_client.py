"""A stranger with one address: opens many raw TCP connections to a peer and never proves anything.

    python tests/security/hostile_client.py --address 127.0.0.1:PORT --count 10000 \\
        --concurrency 2000 --mode mixed --hold-s 1

Each connection waits for the peer's first bytes (its HELLO: the peer accepted the connection),
then, by mode, sends nothing (silent), random bytes (garbage), a prefix declaring an 8 MiB header
(bigheader) or half of a plausible HELLO (partial-hello), and holds the connection open for
``--hold-s`` seconds or until the peer closes it.  ``mixed`` cycles through the four.  At the end
it prints one JSON line: opened, refused_or_closed_by_server, errors, seconds.

With ``--announce`` it also prints ``{"event": "holding", ...}`` once every connection has been
opened (so ``--count`` should not exceed ``--concurrency``) and then ends the hold early when a
line (or EOF) arrives on stdin, so a test can measure the peer while all of them are open.

Standard library and msgpack only: it must run without the project on the path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import struct
import sys
import time
from dataclasses import asdict, dataclass

import msgpack

MODES = ("silent", "garbage", "bigheader", "partial-hello")
GREETING_TIMEOUT = 10.0


@dataclass
class Tally:
    opened: int = 0
    refused_or_closed_by_server: int = 0
    errors: int = 0
    greeted: int = 0  # connections the peer sent its HELLO on (it accepted them)


def payload(mode: str) -> bytes:
    if mode == "silent":
        return b""
    if mode == "garbage":
        return os.urandom(256)
    if mode == "bigheader":
        return struct.pack("<II", 8 << 20, 0) + os.urandom(1024)
    if mode == "partial-hello":
        hello = msgpack.packb({"t": 1, "s": 0, "v": 1, "pk": os.urandom(32), "n": os.urandom(16), "c": 1,
                               "l": None}, use_bin_type=True)
        return struct.pack("<II", len(hello), 0) + hello[: len(hello) // 2]
    raise ValueError(f"unknown mode {mode!r}")


class Attack:
    def __init__(self, host: str, port: int, count: int, concurrency: int, mode: str, hold_s: float,
                 announce: bool, release_grace_s: float = 0.0) -> None:
        self.host, self.port, self.count, self.mode, self.hold_s = host, port, count, mode, hold_s
        self.release_grace_s = release_grace_s
        self.announce = announce
        self.slots = asyncio.Semaphore(concurrency)
        self.tally = Tally()
        self.settled = 0
        self.release = asyncio.Event()

    def mode_of(self, i: int) -> str:
        return MODES[i % len(MODES)] if self.mode == "mixed" else self.mode

    async def run(self) -> Tally:
        if self.announce:
            asyncio.get_running_loop().add_reader(sys.stdin.fileno(), self.release.set)
        try:
            await asyncio.gather(*(self.one(i) for i in range(self.count)))
        finally:
            if self.announce:
                asyncio.get_running_loop().remove_reader(sys.stdin.fileno())
        return self.tally

    def _settle(self) -> None:
        self.settled += 1
        if self.announce and self.settled == self.count:
            print(json.dumps({"event": "holding", **asdict(self.tally)}), flush=True)

    async def one(self, i: int) -> None:
        async with self.slots:
            writer = None
            settled = False
            try:
                try:
                    reader, writer = await asyncio.open_connection(self.host, self.port, limit=4096)
                except ConnectionRefusedError:
                    self.tally.refused_or_closed_by_server += 1
                    return
                self.tally.opened += 1
                first = await asyncio.wait_for(reader.read(4096), GREETING_TIMEOUT)
                if not first:
                    self.tally.refused_or_closed_by_server += 1
                    return
                self.tally.greeted += 1
                data = payload(self.mode_of(i))
                if data:
                    writer.write(data)
                self._settle()
                settled = True
                if await self._held_until_closed(reader):
                    self.tally.refused_or_closed_by_server += 1
            except (ConnectionResetError, BrokenPipeError):
                self.tally.refused_or_closed_by_server += 1
            except (OSError, asyncio.TimeoutError):
                self.tally.errors += 1
            finally:
                if not settled:
                    self._settle()
                if writer is not None:
                    writer.transport.abort()

    async def _held_until_closed(self, reader: asyncio.StreamReader) -> bool:
        """Hold for hold_s (or until released); True if the peer closed the connection first."""
        async def peer_closes() -> None:
            while await reader.read(4096):
                pass

        closed = asyncio.ensure_future(peer_closes())
        released = asyncio.ensure_future(self.release.wait())
        try:
            done, _ = await asyncio.wait({closed, released}, timeout=self.hold_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if released in done and closed not in done and self.release_grace_s > 0:
                # released: the peer still gets a bounded moment to close what it meant to close (on a
                # loaded machine it reads the last payloads late), so the tally does not race its reading
                done, _ = await asyncio.wait({closed}, timeout=self.release_grace_s)
        finally:
            for task in (closed, released):
                task.cancel()
            await asyncio.gather(closed, released, return_exceptions=True)
        if closed in done:
            closed.result()  # a reset surfaces as ConnectionResetError
            return True
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", required=True, help="host:port of the peer (or its full address)")
    parser.add_argument("--count", type=int, default=1000, help="connections to open in all")
    parser.add_argument("--concurrency", type=int, default=1000, help="connections open at once (<= ~2000)")
    parser.add_argument("--mode", choices=(*MODES, "mixed"), default="mixed")
    parser.add_argument("--release-grace-s", type=float, default=0.0,
                        help="after stdin ends the hold, how long a connection still waits for the peer's close")
    parser.add_argument("--hold-s", type=float, default=1.0, help="seconds each connection is held open")
    parser.add_argument("--announce", action="store_true",
                        help='print {"event": "holding"} once all are open; stdin input ends the hold')
    args = parser.parse_args()
    host, _, port = args.address.rpartition("@")[2].rpartition(":")  # a full PeerAddress works too
    started = time.monotonic()
    attack = Attack(host, int(port), args.count, args.concurrency, args.mode, args.hold_s, args.announce,
                    args.release_grace_s)
    tally = asyncio.run(attack.run())
    print(json.dumps({**asdict(tally), "seconds": round(time.monotonic() - started, 3)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
