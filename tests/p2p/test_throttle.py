"""The node-wide rate limit over real loopback TCP: sending and receiving at about the rate, clearing
it mid-transfer, cancelling a paced send, and the token bucket's arithmetic.

Timings are measured, with wide bounds: the machine running the tests may be small and shared."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time

import numpy as np
import pytest
import uvloop

from p2p import P2P, CallKind, Limits, spawn_peers
from p2p.throttle import Throttle, TokenBucket

logger = logging.getLogger(__name__)

RATE = 125_000  # 1 Mbit/s
SIZE = 256 * 1024
NOMINAL = SIZE / RATE  # about 2.1 s
CHUNKS = 16


@pytest.fixture
async def pair():
    a, b = await spawn_peers(2)
    yield a, b
    await asyncio.gather(a.shutdown(), b.shutdown())


def payload(nbytes: int) -> np.ndarray:
    return np.random.default_rng(nbytes).integers(0, 255, size=nbytes, dtype=np.uint8)


async def sink(request: np.ndarray, ctx) -> int:
    return int(request.nbytes)


async def sink_stream(requests, ctx) -> int:
    return sum([int(x.nbytes) async for x in requests])


def serve(node: P2P) -> None:
    node.register("sink", sink)
    node.register("sink_stream", sink_stream, CallKind.CLIENT_STREAM)


async def transfer(a: P2P, b: P2P, chunks: int, nbytes: int = SIZE) -> float:
    """Seconds for ``a`` to send ``nbytes`` to ``b`` in ``chunks`` messages and hear back that all arrived."""
    started = time.perf_counter()
    if chunks == 1:
        got = await a.call(b.address, "sink", payload(nbytes), timeout=60)
    else:
        got = await a.call_client_stream(b.address, "sink_stream",
                                         [payload(nbytes // chunks) for _ in range(chunks)], timeout=60)
    elapsed = time.perf_counter() - started
    assert got == nbytes
    return elapsed


async def connected_pair_serving(a: P2P, b: P2P) -> None:
    serve(b)
    await a.connect(b.address)  # the handshake is not what is measured


def assert_about_nominal(elapsed: float, what: str) -> None:
    logger.info("%s: %.2f s for %d bytes at %d B/s (nominal %.2f s)", what, elapsed, SIZE, RATE, NOMINAL)
    assert 0.7 * NOMINAL <= elapsed <= 2 * NOMINAL, f"{what}: {elapsed:.2f} s, nominal {NOMINAL:.2f} s"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunks", [1, CHUNKS])
@pytest.mark.parametrize("side", ["sender", "receiver"])
async def test_a_throttled_side_takes_about_size_over_rate(pair, side, chunks):
    a, b = pair
    await connected_pair_serving(a, b)
    (a if side == "sender" else b).set_rate_limit(RATE)
    assert_about_nominal(await transfer(a, b, chunks), f"{side} throttled, {chunks} message(s)")


@pytest.mark.timeout(60)
def test_throttled_receiver_on_uvloop():
    """Workers run their nodes on uvloop: pausing the transport from buffer_updated must hold there too."""
    async def main() -> float:
        a, b = await spawn_peers(2)
        try:
            await connected_pair_serving(a, b)
            b.set_rate_limit(RATE)
            return await transfer(a, b, 1)
        finally:
            await asyncio.gather(a.shutdown(), b.shutdown())

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert_about_nominal(runner.run(main()), "receiver throttled on uvloop")


@pytest.mark.timeout(60)
async def test_throttled_receiver_with_tight_flow_control_does_not_deadlock():
    """Both pauses at once: the handler holds off reading (flow control stops the socket) while the
    rate limit holds; each lifts in its own time and the transfer still keeps to about the rate."""
    a = await P2P.create()
    b = await P2P.create(limits=Limits(max_buffered_bytes=32 * 1024))
    flow_paused: list[bool] = []
    try:
        async def late_sink(requests, ctx) -> int:
            total = 0
            async for x in requests:
                if not total:
                    await asyncio.sleep(0.5)  # a busy consumer: more than 32 KiB arrive meanwhile
                    flow_paused.append(any(c._reading_paused for c in b._connections))
                total += int(x.nbytes)
            return total

        b.register("sink_stream", late_sink, CallKind.CLIENT_STREAM)
        await a.connect(b.address)
        b.set_rate_limit(RATE)
        assert_about_nominal(await transfer(a, b, 32), "receiver throttled, flow control tight")
        assert flow_paused == [True]
    finally:
        await asyncio.gather(a.shutdown(), b.shutdown())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("side", ["sender", "receiver"])
async def test_clearing_the_limit_mid_transfer_lets_it_finish_promptly(pair, side):
    a, b = pair
    # About 8.4 s throttled; a throttled sender waits 2.1 s after each chunk, a throttled receiver
    # takes 2.1 s to read each: finishing well within that after clearing shows the waits end at once.
    nbytes, chunks = 1 << 20, 4
    first_arrived = asyncio.Event()

    async def sink_stream_signalling(requests, ctx) -> int:
        total = 0
        async for x in requests:
            total += int(x.nbytes)
            first_arrived.set()
        return total

    b.register("sink_stream", sink_stream_signalling, CallKind.CLIENT_STREAM)
    await a.connect(b.address)
    throttled = a if side == "sender" else b
    throttled.set_rate_limit(RATE)
    task = asyncio.create_task(transfer(a, b, chunks, nbytes))
    await first_arrived.wait()
    cleared_at = time.perf_counter()
    await asyncio.to_thread(throttled.set_rate_limit, None)  # from another thread, as a fault injector would
    total = await task
    after_clear = time.perf_counter() - cleared_at
    logger.info("%s throttled, cleared mid-transfer: %.2f s in all, %.2f s after clearing", side, total, after_clear)
    assert after_clear < 1.0, f"{after_clear:.2f} s to finish after clearing ({nbytes / RATE:.1f} s throttled)"
    assert throttled.throttle is None


@pytest.mark.timeout(60)
async def test_unthrottled_transfers_are_unaffected():
    a, b, c = await spawn_peers(3)
    try:
        serve(b)
        await a.connect(b.address)
        await c.connect(b.address)
        plain = await transfer(c, b, CHUNKS)
        a.set_rate_limit(RATE)  # another node's limit is not c's
        slow = asyncio.create_task(transfer(a, b, CHUNKS))
        beside = await transfer(c, b, CHUNKS)
        a.set_rate_limit(None)
        after = await transfer(a, b, CHUNKS)
        await slow
        logger.info("unthrottled: %.3f s; beside a throttled node: %.3f s; after clearing: %.3f s",
                    plain, beside, after)
        for elapsed in (plain, beside, after):
            assert elapsed < 0.25 * NOMINAL
        assert c.throttle is None and a.throttle is None
    finally:
        await asyncio.gather(a.shutdown(), b.shutdown(), c.shutdown())


@pytest.mark.timeout(60)
async def test_cancelling_a_paced_send_leaves_the_connection_usable(pair):
    a, b = pair
    handler_started, handler_stopped = asyncio.Event(), asyncio.Event()

    async def never_answers(request, ctx):
        handler_started.set()
        try:
            await asyncio.Event().wait()
        finally:
            handler_stopped.set()

    b.register("hang", never_answers)
    await connected_pair_serving(a, b)
    a.set_rate_limit(RATE)
    call = asyncio.create_task(a.call(b.address, "hang", payload(SIZE), timeout=60))
    await handler_started.wait()  # the request was written; the caller now waits out its debt
    conn = next(iter(a._connections))
    assert conn._paced, "the call should be waiting out the rate limit"
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert not conn._paced
    await asyncio.wait_for(handler_stopped.wait(), 5)  # the remote handler was cancelled too
    a.set_rate_limit(None)
    assert await a.call(b.address, "sink", payload(1024), timeout=5) == 1024


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", [-1, 0, 0.0, -0.5, math.nan, math.inf, -math.inf, True, "fast"])
async def test_invalid_rate_limits_raise_value_error_naming_the_value(pair, bad):
    a, _ = pair
    a.set_rate_limit(RATE)
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        a.set_rate_limit(bad)
    assert a.throttle is not None and a.throttle.rate == RATE  # the limit in force is kept


@pytest.mark.timeout(10)
def test_token_bucket_arithmetic():
    bucket = TokenBucket.for_rate(1000.0, now=0.0)
    assert bucket.burst == 64 * 1024 and bucket.tokens == 0.0  # starts empty
    assert bucket.delay(500, 0.0) == pytest.approx(0.5)  # 500 bytes of debt at 1000 B/s
    assert bucket.delay(500, 0.25) == pytest.approx(0.75)  # 250 paid, 750 owed
    assert bucket.delay(0, 1.0) == 0.0  # paid off exactly
    assert bucket.level(1000.0) == bucket.burst  # credit never grows past the burst
    assert bucket.delay(bucket.burst, 1000.0) == 0.0  # a full bucket lets one burst through at once
    assert bucket.delay(1000, 1000.0) == pytest.approx(1.0)

    fast = TokenBucket.for_rate(10e6, now=0.0)
    assert fast.burst == pytest.approx(0.05 * 10e6)  # 50 ms of a fast rate is more than 64 KiB

    old = Throttle(1000.0, 0.0)
    old.send.delay(2000, 0.0)  # 2 s of debt
    new = Throttle(2000.0, 0.5, old)  # half of it paid when the rate doubles
    assert new.send.level(0.5) == pytest.approx(-1500.0)  # the debt is carried over, not forgiven
    assert new.send.delay(0, 0.5) == pytest.approx(0.75)
    assert new.recv.level(0.5) == pytest.approx(500.0)  # and so is credit, up to the new burst
    assert Throttle(RATE, 0.0).read_size == 4096


@pytest.mark.timeout(60)
def test_training_peer_throttle_reaches_its_p2p_node_from_another_thread():
    from workers.peer import TrainingPeer, WorkerConfig  # here: the rest of this file needs p2p only

    peer = TrainingPeer(WorkerConfig(task="synthetic", device="cpu"))
    try:
        async def limit(node) -> float | None:
            return None if node.p2p.throttle is None else node.p2p.throttle.rate

        peer.throttle(RATE)  # from this thread, not the peer's loop thread
        assert peer.dht.run_coroutine(limit) == RATE  # handed over in order: in force by the next call
        with pytest.raises(ValueError, match="-5"):
            peer.throttle(-5)
        peer.throttle(None)
        assert peer.dht.run_coroutine(limit) is None
    finally:
        peer.shutdown()
