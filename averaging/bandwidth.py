"""A peer's bandwidth for DeDLOC's load balancing, measured from its own all-reduce traffic.

Every member declares a bandwidth in matchmaking, and the leader splits the vector by the
load-balancing LP over the declared values.  A guessed constant splits equally whatever the links
are; a peer on a slow link then reduces as much as the others, and every round waits for it.

While a round runs, ``BandwidthMeter`` reads the kernel's delivery-rate samples of the
connections to the group (``p2p.tcp_info``) every ``interval``, keeping those taken while data
flowed (bytes acknowledged since the last read) and not application-limited.  A connection's
figure is the median of its samples (a shaper's bucket lets short bursts through at line rate: the
largest samples overstate the link).  A connection's rate is the slower of our share of our uplink
and the receiver's downlink, so a peer faster than its receivers never sees its uplink on any one
connection; but the connections flowing at one moment share that uplink, and their rates add up to
it when it is the bottleneck.  The round's figure is therefore the larger of the best connection's
median and the median summed rate over the moments when the most connections flowed (at least
``MIN_MOMENTS`` of them, taking in moments with fewer connections until there are, so that one
burst does not decide it).  Moments with fewer connections flowing are left out: at the end of a
round only the slowest receivers still take data, and counting those moments made a peer on a
200 Mbit/s link declare 74-125 in the shaped benchmark, against 137-189 without them.  Still an
underestimate when the receivers together are slower (one the LP forgives: it needs to know who is
slow, not by how much the fast ones are fast).  The estimate is the median
of the last ``window`` rounds' figures, capped at ``ceiling``: beyond about a gigabit per second a
peer's CPU, not its link, bounds its part of a Python all-reduce, and near-equal fast links should
split equally rather than by measurement noise.
Until a round gave a figure, the estimate is ``default`` — unless the peer probed first: a newcomer
streams ``PROBE_BYTES`` to each of a few live peers (``probe``, served by ``ProbeSink``) while the
same sampling runs, so even its first round is split by a measured figure.  A sink counts and drops
what it receives, at most ``PROBE_MAX_BYTES`` per call, ``PROBE_SLOTS`` calls at once and
``PROBE_MAX_SECONDS`` per call: a probe can cost a peer a few megabytes of download, never its
memory, and a stalled caller cannot hold the slots.
"""

from __future__ import annotations

import asyncio
import statistics
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any

from p2p import P2P, PeerID
from p2p.node import CallContext

BITS_PER_MBIT = 1e6
PROBE_BYTES = 4 << 20  # per peer probed: about 0.7 s at 50 Mbit/s, long enough for the rate samples
PROBE_MESSAGE = 256 << 10
PROBE_MAX_BYTES = 8 << 20  # what a sink accepts in one call
PROBE_SLOTS = 2  # probes a sink serves at once
PROBE_MAX_SECONDS = 60.0  # how long a sink serves one call: a caller that stalls does not keep its slot
MIN_MOMENTS = 3  # samples of the summed rate a round's figure rests on, where it has that many


class BandwidthMeter:
    def __init__(self, default: float = 100.0, *, ceiling: float = 1000.0, window: int = 5,
                 interval: float = 0.05) -> None:
        if not 0 < default <= ceiling:
            raise ValueError(f"default bandwidth must be in (0, ceiling={ceiling:g}] Mbit/s, got {default!r}")
        self.default = default
        self.ceiling = ceiling
        self.interval = interval
        self._rounds: deque[float] = deque(maxlen=window)
        self.last: float | None = None  # the newest figure (Mbit/s); ``probe`` clears it to see its own

    @property
    def estimate(self) -> float:
        """Mbit/s to declare: the median of the recent rounds' figures, ``default`` before any."""
        if not self._rounds:
            return self.default
        return min(statistics.median(self._rounds), self.ceiling)

    @property
    def rounds(self) -> list[float]:
        """The recent rounds' figures (Mbit/s), oldest first."""
        return list(self._rounds)

    def add(self, mbit: float) -> None:
        """One round's figure (Mbit/s); a figure that is not a positive finite number is ignored."""
        if 0 < mbit < float("inf"):
            self._rounds.append(float(mbit))
            self.last = float(mbit)

    async def watch(self, p2p: P2P, peers: Sequence[PeerID]) -> None:
        """Sample the connections to ``peers`` until cancelled (the round ended), then add the
        round's figure.  Owned by the averager's step: started with the round, cancelled and
        awaited after it."""
        acked: dict[PeerID, int] = {}
        samples: dict[PeerID, list[int]] = {peer: [] for peer in peers}
        totals: list[tuple[int, int]] = []  # per moment: (connections flowing, their summed rates)
        try:
            while True:
                total = flowing = 0
                for peer in peers:
                    info = p2p.tcp_info(peer)
                    if info is None:
                        continue
                    flowed = peer in acked and info.bytes_acked > acked[peer]
                    acked[peer] = info.bytes_acked
                    if flowed and not info.app_limited and info.delivery_rate > 0:
                        samples[peer].append(info.delivery_rate)
                        total += info.delivery_rate
                        flowing += 1
                if total:
                    totals.append((flowing, total))
                await asyncio.sleep(self.interval)
        finally:
            figure = self.round_figure([s for s in samples.values() if s], totals)
            if figure:
                self.add(figure * 8 / BITS_PER_MBIT)

    @staticmethod
    def round_figure(per_connection: Sequence[Sequence[int]], totals: Sequence[tuple[int, int]]) -> float:
        """Bytes/s: the best connection's median sample, or, if larger, the median summed rate over the
        moments when the most connections flowed (``totals``: (connections, summed rate) per moment)."""
        best = max((statistics.median(s) for s in per_connection if s), default=0.0)
        return max(best, statistics.median(_busiest(totals)) if totals else 0.0)


def _busiest(totals: Sequence[tuple[int, int]]) -> list[int]:
    """The summed rates of the moments with the most connections flowing, at least MIN_MOMENTS of them
    where there are that many (moments with fewer connections come in, most first, until there are)."""
    ranked = sorted(totals, key=lambda moment: -moment[0])
    cut = min(MIN_MOMENTS, len(ranked))
    while cut < len(ranked) and ranked[cut][0] == ranked[cut - 1][0]:
        cut += 1  # every moment with as many connections as the last one taken
    return [rate for _, rate in ranked[:cut]]


async def probe(meter: BandwidthMeter, p2p: P2P, method: str, peers: Sequence[PeerID], nbytes: int = PROBE_BYTES,
                timeout: float = 30.0) -> float | None:
    """Stream ``nbytes`` to each of ``peers``' sinks at once, sampling as in a round; the figure
    (Mbit/s) the meter added, or None (nothing measured: every peer failed before data flowed)."""
    meter.last = None
    loop = asyncio.get_running_loop()
    started = loop.time()
    watching = asyncio.ensure_future(meter.watch(p2p, peers))
    try:
        sent = await asyncio.gather(*(_send_probe(p2p, method, peer, nbytes, timeout) for peer in peers),
                                    return_exceptions=True)
    finally:
        elapsed = loop.time() - started
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
    delivered = sum(r for r in sent if r == nbytes)
    if meter.last is None and delivered and elapsed > 0:
        # over before a sample could see data flow (a link far faster than the sampling interval):
        # what arrived over how long it took, an underestimate that still lands at the ceiling
        meter.add(delivered * 8 / elapsed / BITS_PER_MBIT)
    return meter.last


async def _send_probe(p2p: P2P, method: str, peer: PeerID, nbytes: int, timeout: float) -> int:
    chunk = bytes(PROBE_MESSAGE)

    async def payload() -> AsyncIterator[bytes]:
        left = nbytes
        while left > 0:
            yield chunk[:left] if left < len(chunk) else chunk
            left -= len(chunk)

    return await p2p.call_client_stream(peer, method, payload(), timeout=timeout)


class ProbeSink:
    """The receiving end of ``probe``: counts and drops the bytes, answers with the count."""

    def __init__(self, max_bytes: int = PROBE_MAX_BYTES, slots: int = PROBE_SLOTS,
                 max_seconds: float = PROBE_MAX_SECONDS) -> None:
        self.max_bytes = max_bytes
        self.slots = slots
        self.max_seconds = max_seconds
        self._slots = asyncio.Semaphore(slots)

    async def __call__(self, requests: Any, ctx: CallContext) -> int:
        if self._slots.locked():
            raise RuntimeError(f"busy: already serving {self.slots} bandwidth probes")
        async with self._slots:
            try:
                return await asyncio.wait_for(self._count(requests), self.max_seconds)
            except asyncio.TimeoutError:
                raise TimeoutError(f"a bandwidth probe takes at most {self.max_seconds:g} s") from None

    async def _count(self, requests: Any) -> int:
        received = 0
        async for item in requests:
            if not isinstance(item, bytes):
                raise ValueError(f"a bandwidth probe carries bytes, got {type(item).__name__}")
            received += len(item)
            if received > self.max_bytes:
                raise ValueError(f"a bandwidth probe is at most {self.max_bytes} bytes")
        return received
