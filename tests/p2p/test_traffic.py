"""Traffic counters: every message of a call counts once on each side, under the call's method."""

from __future__ import annotations

import asyncio

import pytest
import torch

from p2p import CallKind, spawn_peers

pytestmark = pytest.mark.timeout(60)


async def echo(request, ctx):
    return request


async def count_up(request, ctx):
    for i in range(int(request)):
        yield i


async def test_each_message_counts_once_each_side_under_its_method():
    a, b = await spawn_peers(2)
    try:
        b.register("echo", echo)
        b.register("count", count_up, CallKind.SERVER_STREAM)
        await a.connect(b.address)  # the handshake is not a call: it counts under ""
        a.traffic.reset()
        b.traffic.reset()
        payload = torch.arange(1000, dtype=torch.float32)
        assert torch.equal(await a.call(b.address, "echo", payload), payload)
        got = [item async for item in await a.call_stream(b.address, "count", 3)]
        assert got == [0, 1, 2]
        sent, served = a.traffic.by_method["echo"], b.traffic.by_method["echo"]
        assert (sent.messages_out, sent.messages_in) == (1, 1)  # the request, the answer
        assert (served.messages_in, served.messages_out) == (1, 1)
        assert sent.bytes_out == served.bytes_in > 4000  # the same bytes, seen from both ends
        assert sent.bytes_in == served.bytes_out > 4000
        stream_a, stream_b = a.traffic.by_method["count"], b.traffic.by_method["count"]
        assert (stream_a.messages_out, stream_a.messages_in) == (1, 4)  # three items and the end
        assert stream_a.bytes_in == stream_b.bytes_out
        assert a.traffic.total(["echo", "count"]).messages == 7
        assert a.traffic.total(["nothing"]).bytes == 0
    finally:
        await asyncio.gather(a.shutdown(), b.shutdown())
