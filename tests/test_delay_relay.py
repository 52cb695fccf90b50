"""The relay that adds latency between emulated regions (``benchmarks/_delay_relay.py``): real bytes
through real sockets, each way ``delay_s`` later."""

from __future__ import annotations

import asyncio
import statistics

import pytest

from benchmarks._delay_relay import DelayRelay
from p2p import P2P, PeerAddress

pytestmark = pytest.mark.timeout(60)
DELAY_S = 0.1  # one way: a round trip 0.2 s longer


async def echo_server() -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


async def test_a_round_trip_through_the_relay_takes_twice_its_delay_and_keeps_every_byte_in_order():
    server = await echo_server()
    relay = DelayRelay(server.sockets[0].getsockname()[:2], DELAY_S)
    reader, writer = await asyncio.open_connection(*await relay.start())
    loop = asyncio.get_running_loop()
    rtts = []
    try:
        for i in range(8):
            sent = loop.time()
            writer.write(bytes([i]))
            assert await reader.readexactly(1) == bytes([i])
            rtts.append(loop.time() - sent)
        payload = bytes(range(256)) * 4096  # 1 MiB in one go: delayed, not cut or reordered
        writer.write(payload)
        assert await reader.readexactly(len(payload)) == payload
    finally:
        writer.close()
        await relay.close()
        server.close()
        await server.wait_closed()
    assert abs(statistics.median(rtts) - 2 * DELAY_S) <= 0.1 * 2 * DELAY_S, rtts
    assert not relay._tasks  # every connection it carried ended with it


async def test_p2p_calls_through_the_relay_pay_its_round_trip():
    server, client = await P2P.create(), await P2P.create()

    async def ping(request, ctx):
        return request

    server.register("ping", ping)
    relay = DelayRelay((server.address.host, server.address.port), DELAY_S)
    host, port = await relay.start()
    via = PeerAddress(host, port, server.peer_id)
    loop = asyncio.get_running_loop()
    try:
        assert await client.call(via, "ping", "hello") == "hello"  # the handshake's round trips first
        rtts = []
        for i in range(5):
            sent = loop.time()
            assert await client.call(via, "ping", i) == i
            rtts.append(loop.time() - sent)
    finally:
        await client.shutdown()
        await server.shutdown()
        await relay.close()
    assert abs(statistics.median(rtts) - 2 * DELAY_S) <= 0.1 * 2 * DELAY_S, rtts
