"""Slow links between the local simulator's regions (``provider.links``): a userspace relay.

Layout, for regions sorted by name (``region_hosts``)::

    region i (1..)   its instances' workers listen on, announce and dial from 127.77.<i>.1
    the relay        listens on 127.77.0.1 (a free port), one process per run, started and
                     stopped by the simulator (``RelayProcess``)

Linux routes all of 127.0.0.0/8 to ``lo`` without root, so every region has an address of its own.
A worker's ``route`` (``p2p/route.py``) dials the hosts of the other regions through the relay,
naming the destination in a one-line header; the relay tells the source's region by the address a
connection comes from, connects to the destination (from the source's address), and carries both
directions: each chunk ``rtt / 2`` late, and no faster than the link's rate, paced by one token
bucket per direction of each region pair that every connection between the two shares, as they
would share a shaped WAN link.  A connect costs one round trip before the relay answers, as TCP's
handshake does over the link.  Within a region, peers talk over plain loopback.

Real bytes cross real sockets, the handshake and framing unchanged; what is not a real network is
only the dialer's routing decision (network namespaces, as ``benchmarks/bench_wan.py`` uses them,
need root and cannot hold Ray actors).  The kernel's ``TCP_INFO`` on a relayed connection sees the
loopback leg to the relay; while data flows its delivery rate follows the link's (the relay stops
reading a connection that holds its share of the link: bytes in flight plus a router's queue).

``carry`` (one direction of a connection over a ``Link``) is also ``benchmarks/_delay_relay.py``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import logging
import os
import selectors
import signal
import stat
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from p2p.route import ERROR, OK, RelayRoute, parse_relay_header
from p2p.throttle import TokenBucket

logger = logging.getLogger("orchestrator.sim.relay")  # its name under ``python -m`` too

CHUNK = 1 << 16  # bytes read at a time
QUEUE_S = 0.1  # a paced link's queue, in seconds of its rate (a router's buffer), besides the bytes in flight
HEADER_TIMEOUT_S = 5.0  # a dialer names its destination within this, or is refused
CONNECT_TIMEOUT_S = 5.0
REFUSAL_LINGER_S = 2.0  # a refused dialer has this long to read the reason and close
REPORT_EVERY_S = 60.0  # the relay logs the bytes each pair carried this often (and at exit)
READY_S = 30.0  # how long the simulator waits for a starting relay
STOP_S = 5.0  # how long a stopping relay has before it is killed
RELAY_HOST = "127.77.0.1"
MAX_REGIONS = 254


@dataclass(frozen=True)
class LinkSpec:
    """Every link between two different regions: its rate each way and its round-trip time."""

    mbit: float
    rtt_ms: float

    def __post_init__(self) -> None:
        if not self.mbit > 0 or not self.rtt_ms >= 0:
            raise ValueError(f"a link needs mbit > 0 and rtt_ms >= 0, got {self.mbit}, {self.rtt_ms}")

    @property
    def rate(self) -> float:
        """Bytes per second, each way."""
        return self.mbit * 1e6 / 8

    @property
    def rtt_s(self) -> float:
        return self.rtt_ms / 1000


class Link:
    """One direction of a link: what crosses it arrives ``delay_s`` later and, with a ``rate`` (bytes
    per second), leaves no faster than that, every connection over it paying into one token bucket."""

    def __init__(self, delay_s: float, rate: float | None = None) -> None:
        if delay_s < 0 or (rate is not None and not rate > 0):
            raise ValueError(f"a link needs delay_s >= 0 and rate > 0 or None, got {delay_s}, {rate}")
        self.delay_s = delay_s
        self.rate = rate
        self.bucket: TokenBucket | None = None  # made at first use, on the loop's clock
        self.bytes = 0
        self.connections = 0
        # what one connection may hold in the link before its reading stops: the bytes in flight
        # (rate x delay) and a router's queue; unpaced, it is never held back (a delay, not a limit)
        self.window = None if rate is None else max(4 * CHUNK, rate * (delay_s + QUEUE_S))

    def due(self, nbytes: int, now: float) -> float:
        """When ``nbytes`` read ``now`` arrive at the far end: once the bucket paid for them, plus the delay."""
        self.bytes += nbytes
        if self.rate is None:
            return now + self.delay_s
        if self.bucket is None:
            self.bucket = TokenBucket.for_rate(self.rate, now)
        return now + self.bucket.delay(nbytes, now) + self.delay_s


async def carry(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link) -> None:
    """Bytes from ``reader`` to ``writer`` across ``link``, in order, each chunk when the link says it
    arrives; the end of the stream last.  Reading waits while the link holds ``link.window`` bytes of
    this connection, so a sender faster than the link feels it as TCP backpressure."""
    loop = asyncio.get_running_loop()
    queue: collections.deque[tuple[float, bytes]] = collections.deque()
    arrived, drained = asyncio.Event(), asyncio.Event()
    held = 0

    async def read() -> None:
        nonlocal held
        while True:
            while link.window is not None and held >= link.window:
                drained.clear()
                await drained.wait()
            try:
                data = await reader.read(CHUNK)
            except OSError:  # reset: the same as its end, for what is carried
                data = b""
            queue.append((link.due(len(data), loop.time()), data))
            held += len(data)
            arrived.set()
            if not data:
                return

    async def write() -> None:
        nonlocal held
        while True:
            while not queue:
                arrived.clear()
                await arrived.wait()
            due, data = queue.popleft()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            held -= len(data)
            drained.set()
            try:
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
            except OSError:  # the other side is gone: nothing more to carry this way
                return

    reading = asyncio.ensure_future(read())
    try:
        await write()
    finally:
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)


async def splice(a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 b: tuple[asyncio.StreamReader, asyncio.StreamWriter], a_to_b: Link, b_to_a: Link) -> None:
    """Carry both directions between two connections until both ended; then close both."""
    try:
        await asyncio.gather(carry(a[0], b[1], a_to_b), carry(b[0], a[1], b_to_a))
    finally:
        await _close(a[1], b[1])


async def _refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reason: str) -> None:
    """Tell a dialer why, then wait (briefly) for its end: closing on bytes still unread would reset
    the connection, and the reason with it."""
    with contextlib.suppress(OSError):
        writer.write(ERROR + reason.encode("utf-8", "replace")[:900] + b"\n")
        if writer.can_write_eof():
            writer.write_eof()

    async def discard() -> None:
        while await reader.read(CHUNK):
            pass

    with contextlib.suppress(OSError, asyncio.TimeoutError):
        await asyncio.wait_for(discard(), REFUSAL_LINGER_S)


async def _close(*writers: asyncio.StreamWriter) -> None:
    """Close connections (again, harmlessly, if they were) and wait until they are."""
    for writer in writers:
        writer.close()
    for writer in writers:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            await writer.wait_closed()


class _Refused(Exception):
    """Why a connection is not carried (sent to the dialer, and logged at ``level``: a destination
    that is down, a preempted peer's, is ordinary; a dialer that breaks the protocol is not)."""

    def __init__(self, reason: str, level: int = logging.WARNING) -> None:
        super().__init__(reason)
        self.level = level


class RegionRelay:
    """Carries the connections between regions (``regions``: each host's region) over ``link``;
    refuses, with a logged reason, what is not one: a malformed header, a host in no region, a
    destination in the dialer's own region."""

    def __init__(self, regions: Mapping[str, str], link: LinkSpec, host: str = RELAY_HOST, port: int = 0) -> None:
        self.regions = dict(regions)
        self.link = link
        self.host, self.port = host, port
        self.links: dict[tuple[str, str], Link] = {}  # (from region, to region): one per direction of a pair
        self.refused = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> tuple[str, int]:
        """Listen; the address the routes name."""
        self._server = await asyncio.start_server(self._accepted, self.host, self.port)
        self.host, self.port = self._server.sockets[0].getsockname()[:2]
        logger.info("relay at %s:%d between %s: %g Mbit/s, %g ms", self.host, self.port,
                    ", ".join(f"{r} ({h})" for h, r in sorted(self.regions.items(), key=lambda kv: kv[1])),
                    self.link.mbit, self.link.rtt_ms)
        return self.host, self.port

    async def close(self) -> None:
        """Stop listening and cut every connection carried."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def link_of(self, source: str, destination: str) -> Link:
        """The direction ``source`` -> ``destination`` (regions), shared by every connection between them."""
        key = (source, destination)
        if key not in self.links:
            self.links[key] = Link(self.link.rtt_s / 2, self.link.rate)
        return self.links[key]

    def report(self) -> list[str]:
        """What each direction of each pair carried: one line each."""
        return [f"{src} -> {dst}: {link.bytes:,} bytes over {link.connections} "
                f"connection{'' if link.connections == 1 else 's'}" for (src, dst), link in sorted(self.links.items())]

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(self._serve(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One dialer: its destination connected, then both directions carried; or refused."""
        peer = writer.get_extra_info("peername")
        target: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            try:
                source_host, source, (host, port) = await self._admit(reader, peer)
                target = await self._connect((host, port), source_host)
            except _Refused as e:
                self.refused += 1
                logger.log(e.level, "relay: refused a connection from %s:%s: %s", *peer[:2], e)
                await _refuse(reader, writer, str(e))
                return
            await asyncio.sleep(self.link.rtt_s)  # the connect's round trip over the link
            writer.write(OK)
            forward, back = self.link_of(source, self.regions[host]), self.link_of(self.regions[host], source)
            forward.connections += 1
            back.connections += 1
            await splice((reader, writer), target, forward, back)
        finally:
            await _close(writer, *([target[1]] if target is not None else []))

    async def _admit(self, reader: asyncio.StreamReader, peer: tuple) -> tuple[str, str, tuple[str, int]]:
        """The dialer's host and region, and its destination, once its header says one that the relay carries."""
        source_host = peer[0]
        source = self.regions.get(source_host)
        if source is None:
            raise _Refused(f"{source_host} is in no region (a route dials from its region's address)")
        try:
            line = await asyncio.wait_for(reader.readuntil(b"\n"), HEADER_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise _Refused(f"no header within {HEADER_TIMEOUT_S:g} s") from None
        except asyncio.IncompleteReadError as e:
            raise _Refused(f"closed before its header ended: {e.partial[:40]!r}") from None
        except asyncio.LimitOverrunError:
            raise _Refused("no end of header in the first 64 KiB") from None
        try:
            host, port = parse_relay_header(line)
        except ValueError as e:
            raise _Refused(f"malformed header: {e}") from None
        region = self.regions.get(host)
        if region is None:
            raise _Refused(f"destination {host}:{port} is in no region")
        if region == source:
            raise _Refused(f"destination {host}:{port} is in {source}, the dialer's own region: dial it directly")
        return source_host, source, (host, port)

    async def _connect(self, destination: tuple[str, int],
                       source_host: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to the destination, from the dialer's own address (what the destination sees)."""
        try:
            return await asyncio.wait_for(asyncio.open_connection(*destination, local_addr=(source_host, 0)),
                                          CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as e:
            raise _Refused(f"cannot connect to {destination[0]}:{destination[1]}: {e or type(e).__name__}",
                           logging.INFO) from None


# ---- the regions of a run --------------------------------------------------------------------------
def region_hosts(regions: list[str]) -> dict[str, str]:
    """Each region's loopback address, by the regions' sorted names: 127.77.1.1, 127.77.2.1, ..."""
    names = sorted(set(regions))
    if len(names) > MAX_REGIONS:
        raise ValueError(f"{len(names)} regions; at most {MAX_REGIONS} are emulated")
    return {name: f"127.77.{i}.1" for i, name in enumerate(names, start=1)}


def worker_networks(hosts: Mapping[str, str], node_regions: Mapping[str, str],
                    relay: tuple[str, int]) -> dict[str, dict[str, str]]:
    """What each node type's workers listen on, announce and dial with (``host``, ``announce_host``,
    ``route``), given each region's address, each node type's region and the relay's address."""
    out = {}
    for node_type, region in node_regions.items():
        own = hosts[region]
        route = RelayRoute.make(relay, own, [h for h in hosts.values() if h != own])
        out[node_type] = {"host": own, "announce_host": own, "route": str(route)}
    return out


class RelayProcess:
    """The relay of one run, in a process of its own: started by the simulator, stopped with it.
    It also ends by itself when the simulator's end of its stdin closes (the simulator died), so it
    never outlives it."""

    def __init__(self, hosts: Mapping[str, str], link: LinkSpec, log_file: Path | None = None,
                 lifetime_s: float | None = None) -> None:
        self.hosts = dict(hosts)  # region -> its address
        self.link = link
        self.log_file = log_file
        self.lifetime_s = lifetime_s
        self.address: tuple[str, int] | None = None
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        argv = [sys.executable, "-m", "orchestrator.sim.relay", "--mbit", repr(self.link.mbit),
                "--rtt-ms", repr(self.link.rtt_ms), *(f"--region={r}={h}" for r, h in sorted(self.hosts.items()))]
        if self.log_file is not None:
            argv += ["--log-file", str(self.log_file)]
        if self.lifetime_s is not None:
            argv += ["--lifetime-s", repr(self.lifetime_s)]
        return argv

    def start(self, timeout: float = READY_S) -> tuple[str, int]:
        """Start it; its address once it listens.  RuntimeError (and nothing left running) if it does not."""
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     start_new_session=True)
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            line = self.proc.stdout.readline() if sel.select(timeout) else b""
        self.proc.stdout.close()
        words = line.decode("utf-8", "replace").split()
        if len(words) != 2 or words[0] != "ready":
            self.stop()
            raise RuntimeError(f"the regions' relay did not start within {timeout:g} s: {line[:200]!r}")
        host, _, port = words[1].rpartition(":")
        self.address = (host, int(port))
        return self.address

    def stop(self, grace_s: float = STOP_S) -> int | None:
        """End it (it logs what it carried), at most ``grace_s`` and then SIGKILL; its exit status."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()  # its cue: it stops listening, cuts what it carries, reports and exits
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None:
                with contextlib.suppress(OSError):
                    proc.send_signal(sig)
            try:
                return proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                logger.warning("the regions' relay (pid %d) did not exit within %g s%s", proc.pid, grace_s,
                            "" if sig is None else f" of {signal.Signals(sig).name}")
        return None


# ---- the relay's process ---------------------------------------------------------------------------
class _StdinClosed(asyncio.Protocol):
    def __init__(self, stop: asyncio.Event) -> None:
        self.stop = stop

    def connection_lost(self, exc: Exception | None) -> None:
        self.stop.set()


async def _report_every(relay: RegionRelay, period: float) -> None:
    """The bytes per pair, logged each ``period`` while they change (a long run's log shows its traffic)."""
    last: list[str] = []
    while True:
        await asyncio.sleep(period)
        lines = relay.report()
        if lines != last:
            logger.info("relay carried so far: %s", "; ".join(lines) or "nothing")
            last = lines


async def serve(relay: RegionRelay, lifetime_s: float | None, report_every_s: float = REPORT_EVERY_S) -> None:
    """Run ``relay`` until SIGTERM or SIGINT, the end of stdin when it is a pipe (its parent is done
    or gone), or ``lifetime_s``; then log what it carried."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    pipe = None
    if stat.S_ISFIFO(os.fstat(sys.stdin.fileno()).st_mode):
        pipe, _ = await loop.connect_read_pipe(lambda: _StdinClosed(stop), sys.stdin)
    host, port = await relay.start()
    print(f"ready {host}:{port}", flush=True)
    reporter = asyncio.ensure_future(_report_every(relay, report_every_s))
    try:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), lifetime_s)
    finally:
        reporter.cancel()
        await asyncio.gather(reporter, return_exceptions=True)
        await relay.close()
        if pipe is not None:
            pipe.close()
        for line in relay.report() or ["nothing"]:
            logger.info("relay carried %s", line)
        logger.info("relay refused %d connections; stopped", relay.refused)


def _region(text: str) -> tuple[str, str]:
    """``NAME=HOST``."""
    name, sep, host = text.partition("=")
    if not sep or not name or not host:
        raise argparse.ArgumentTypeError(f"a region is NAME=HOST, got {text!r}")
    return name, host


def _log_to(path: Path | None) -> None:
    """Everything to ``path`` (the run's ``logs/relay.log``) and warnings to stderr; without it, all to stderr."""
    from orchestrator.runs.logs import FORMAT, log_to_file

    stderr = logging.StreamHandler()
    stderr.setFormatter(logging.Formatter(FORMAT))
    stderr.setLevel(logging.WARNING if path is not None else logging.INFO)
    root = logging.getLogger()
    root.addHandler(stderr)
    root.setLevel(logging.INFO)
    if path is not None:
        log_to_file(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.sim.relay",
                                     description="carry connections between emulated regions, delayed and paced")
    parser.add_argument("--mbit", type=float, required=True, help="each link's rate, each way")
    parser.add_argument("--rtt-ms", type=float, required=True, help="each link's round-trip time")
    parser.add_argument("--region", type=_region, action="append", required=True, metavar="NAME=HOST",
                        help="a region and its address (one per region)")
    parser.add_argument("--listen", default=f"{RELAY_HOST}:0", metavar="HOST:PORT")
    parser.add_argument("--lifetime-s", type=float, default=None, help="stop after this long at most")
    parser.add_argument("--log-file", type=Path, default=None)
    args = parser.parse_args(argv)
    _log_to(args.log_file)
    host, _, port = args.listen.rpartition(":")
    relay = RegionRelay({h: name for name, h in args.region}, LinkSpec(args.mbit, args.rtt_ms), host, int(port))
    asyncio.run(serve(relay, args.lifetime_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
