"""Faults from outside: a peer process killed mid-stream, and garbage on the server's socket."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p import P2P, PeerGone, PeerUnreachable

HERE = Path(__file__).parent


@pytest.mark.timeout(60)
async def test_remote_dying_mid_stream_raises_peer_unreachable():
    proc = subprocess.Popen([sys.executable, str(HERE / "peer_process.py")], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(HERE.parent.parent)})
    client = await P2P.create(client_mode=True)
    try:
        addr = (await asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline)).strip()
        assert await client.call(addr, "echo", "alive", timeout=20) == "alive"
        got = 0
        with pytest.raises(PeerUnreachable):
            async with await client.call_stream(addr, "chunks", 1 << 16, timeout=30) as call:
                async for chunk in call:
                    got += 1
                    assert chunk.numel() == 1 << 16
                    if got == 10:
                        proc.send_signal(signal.SIGKILL)  # the stream is live and the server dies
        assert got >= 10
        with pytest.raises(PeerUnreachable):
            await client.call(addr, "echo", 1, timeout=5)
    finally:
        proc.kill()
        proc.wait()
        await client.shutdown()


async def test_a_peer_that_shut_down_is_gone_not_slow():
    """Nothing listens at its address: the caller learns at once that waiting is pointless."""
    probe = await P2P.create()
    addr = str(probe.address)
    await probe.shutdown()
    client = await P2P.create(client_mode=True)
    try:
        with pytest.raises(PeerGone, match=f"cannot connect to {addr}"):
            await client.call(addr, "echo", 1, timeout=5)
    finally:
        await client.shutdown()


async def _garbage_then_legit_call(data: bytes) -> None:
    server = await P2P.create()
    client = await P2P.create()

    async def echo(request, ctx):
        return request

    server.register("echo", echo)
    loop = asyncio.get_running_loop()
    try:
        assert await client.call(server.address, "echo", 1) == 1  # a connection that must survive
        raw = socket.create_connection((server.address.host, server.address.port))
        raw.setblocking(False)
        await loop.sock_sendall(raw, data)
        raw.shutdown(socket.SHUT_WR)
        while await asyncio.wait_for(loop.sock_recv(raw, 65536), 10):
            pass  # the server closes the bad connection; we read until EOF
        raw.close()
        assert await client.call(server.address, "echo", "after") == "after"
        assert client.num_connections == 1
    finally:
        await asyncio.gather(client.shutdown(), server.shutdown())


@pytest.mark.timeout(120)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(
    st.binary(min_size=1, max_size=4096),
    st.just(b"\xff" * 64),  # absurd header length
    st.just((10).to_bytes(4, "little") + (0).to_bytes(4, "little") + b"\x81\xa1t\x03"),  # truncated header
))
def test_fuzz_garbage_on_a_socket_closes_only_that_connection(data):
    asyncio.run(_garbage_then_legit_call(data))
