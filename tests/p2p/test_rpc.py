"""RPC over real loopback TCP: every call kind, errors, deadlines, cancellation, limits, shutdown."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import torch

from p2p import (
    P2P,
    CallKind,
    Identity,
    Limits,
    PeerAddress,
    PeerIDMismatch,
    PeerUnreachable,
    RemoteError,
    ResourceExhausted,
    RPCTimeout,
    spawn_peers,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def pair():
    a, b = await spawn_peers(2)
    yield a, b
    await asyncio.gather(a.shutdown(), b.shutdown())


async def echo(request, ctx):
    return request


class Arrivals:
    """Counts the calls that have reached a handler; ``all_in`` is set once ``expected`` have."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.count = 0
        self.all_in = asyncio.Event()

    def arrive(self) -> None:
        self.count += 1
        if self.count == self.expected:
            self.all_in.set()


async def test_unary_roundtrip_of_nested_values(pair):
    a, b = pair
    b.register("echo", echo)
    value = {"int": 7, "float": 1.5, "str": "héllo", "bytes": b"\x00\xff", "list": [1, [2, None]], 3: True}
    assert await a.call(b.address, "echo", value) == value


async def test_server_streaming_client_streaming_and_bidi(pair):
    a, b = pair

    async def count(n, ctx):
        for i in range(n):
            yield torch.full((3,), float(i))

    async def total(requests, ctx):
        return sum([x async for x in requests])

    async def doubler(requests, ctx):
        async for x in requests:
            yield x * 2

    b.register("count", count, CallKind.SERVER_STREAM)
    b.register("total", total, CallKind.CLIENT_STREAM)
    b.register("double", doubler, CallKind.BIDI)

    async with await a.call_stream(b.address, "count", 5) as call:
        got = [t[0].item() async for t in call]
    assert got == [0.0, 1.0, 2.0, 3.0, 4.0]

    assert await a.call_client_stream(b.address, "total", range(100)) == 4950

    async def numbers():
        for i in range(10):
            yield i
    assert await a.call_client_stream(b.address, "total", numbers()) == 45

    async with await a.open(b.address, "double") as call:
        for i in range(3):  # interleave: each answer arrives before the next request is sent
            await call.send(i)
            assert await call.recv() == 2 * i
        await call.done_writing()
        assert [x async for x in call] == []


async def test_a_handler_may_bound_its_work_with_wait_for_from_its_first_line(pair):
    """Handlers start eagerly (their first step runs as the request arrives).  On Python 3.12+ that
    step must run inside the handler's task: 3.12's ``wait_for`` needs a current task, and a
    bandwidth probe's sink, bounded this way, refused every probe there."""
    a, b = pair

    async def added(requests):
        return sum([x async for x in requests])

    async def total(requests, ctx):
        return await asyncio.wait_for(added(requests), 5.0)

    async def bounded(request, ctx):
        return await asyncio.wait_for(asyncio.sleep(0, request + 1), 5.0)

    b.register("total", total, CallKind.CLIENT_STREAM)
    b.register("bounded", bounded)
    assert await a.call_client_stream(b.address, "total", range(10)) == 45
    assert await a.call(b.address, "bounded", 41) == 42


async def test_64mib_tensor_roundtrip_is_bit_exact(pair):
    a, b = pair
    b.register("echo", echo)
    t = torch.randn(16 << 20)  # 64 MiB of float32
    arr = np.random.default_rng(0).integers(0, 255, size=1 << 20, dtype=np.uint8)
    out = await a.call(b.address, "echo", {"t": t, "a": arr}, timeout=60)
    assert out["t"].dtype == torch.float32 and torch.equal(out["t"], t)
    assert np.array_equal(out["a"], arr)


async def test_1000_concurrent_calls_share_one_connection(pair):
    a, b = pair
    started = Arrivals(1000)

    async def wait_for_everyone(i, ctx):
        started.arrive()
        await started.all_in.wait()  # proves all 1000 are in flight at once
        return i * i

    b.register("sq", wait_for_everyone)
    results = await asyncio.gather(*(a.call(b.address, "sq", i) for i in range(1000)))
    assert results == [i * i for i in range(1000)]
    assert a.num_connections == 1 and b.num_connections == 1


async def test_remote_exception_type_and_message_reach_the_caller(pair):
    a, b = pair

    async def fail(request, ctx):
        raise KeyError(f"no such thing: {request}")

    async def unsendable(request, ctx):
        return {1, 2, 3}

    b.register("fail", fail)
    b.register("unsendable", unsendable)
    with pytest.raises(RemoteError) as info:
        await a.call(b.address, "fail", "x")
    assert info.value.type_name == "KeyError" and "no such thing: x" in info.value.message
    with pytest.raises(RemoteError, match="UnknownMethod"):
        await a.call(b.address, "missing")
    with pytest.raises(RemoteError, match="EncodeError"):
        await a.call(b.address, "unsendable")
    b.register("echo", echo)  # the same connection keeps serving after errors
    assert await a.call(b.address, "echo", 1) == 1
    assert a.num_connections == 1


async def test_a_handler_whose_own_call_fails_reports_it_instead_of_going_silent(pair):
    a, b = pair

    async def relay(address, ctx):
        return await b.call(address, "anything", timeout=5)

    b.register("relay", relay)
    probe = await P2P.create()
    dead = str(probe.address)
    await probe.shutdown()
    with pytest.raises(RemoteError) as info:
        await a.call(b.address, "relay", dead, timeout=10)
    assert info.value.type_name == "PeerGone" and "cannot connect" in info.value.message


async def test_deadline_expiry_cancels_the_remote_handler(pair):
    a, b = pair
    cancelled = asyncio.get_running_loop().create_future()

    async def hang(request, ctx):
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set_result(True)
            raise

    b.register("hang", hang)
    with pytest.raises(RPCTimeout):
        await a.call(b.address, "hang", timeout=0.2)
    assert await asyncio.wait_for(cancelled, 5)
    b.register("echo", echo)
    assert await a.call(b.address, "echo", "still works") == "still works"


async def test_cancelling_the_caller_cancels_the_remote_stream(pair):
    a, b = pair
    entered = asyncio.Event()
    finished = asyncio.get_running_loop().create_future()

    async def forever(request, ctx):
        try:
            i = 0
            while True:
                entered.set()
                yield i
                i += 1
        finally:
            finished.set_result(True)

    b.register("forever", forever, CallKind.SERVER_STREAM)

    async def consume():
        async with await a.call_stream(b.address, "forever", None, timeout=30) as call:
            async for _ in call:
                pass

    task = asyncio.create_task(consume())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.wait_for(finished, 5)


async def test_unreachable_peer_and_wrong_identity():
    async with await P2P.create() as a, await P2P.create() as b:
        b.register("echo", echo)
        # a closed port: find one by opening and closing a listener
        probe = await P2P.create()
        dead = probe.address
        await probe.shutdown()
        with pytest.raises(PeerUnreachable, match="cannot connect"):
            await a.call(dead, "echo", 1, timeout=5)
        impostor = PeerAddress(b.address.host, b.address.port, Identity().peer_id)
        with pytest.raises(PeerIDMismatch):
            await a.call(impostor, "echo", 1, timeout=5)
        assert await a.call(b.address, "echo", 2) == 2


async def test_client_mode_peer_calls_out_and_can_be_called_back():
    server = await P2P.create()
    client = await P2P.create(client_mode=True)
    try:
        assert client.address is None

        async def whoami(request, ctx):
            return {"me": str(client.peer_id), "caller": str(ctx.peer_id)}

        async def call_back(request, ctx):
            assert ctx.remote_client_mode
            return await server.call(ctx.peer_id, "whoami", None, timeout=5)

        client.register("whoami", whoami)
        server.register("call_back", call_back)
        answer = await client.call(server.address, "call_back")
        assert answer == {"me": str(client.peer_id), "caller": str(server.peer_id)}
        assert client.num_connections == 1  # the callback used the client's own connection
    finally:
        await asyncio.gather(client.shutdown(), server.shutdown())


async def test_stream_limit_refuses_extra_calls_and_keeps_the_connection():
    server = await P2P.create(limits=Limits(max_streams=4))
    client = await P2P.create()
    release = asyncio.Event()
    inside = Arrivals(4)

    async def block(request, ctx):
        inside.arrive()
        await release.wait()
        return request

    server.register("block", block)
    try:
        held = [asyncio.create_task(client.call(server.address, "block", i)) for i in range(4)]
        await inside.all_in.wait()
        with pytest.raises(ResourceExhausted, match="max_streams"):
            await client.call(server.address, "block", 99)
        release.set()
        assert await asyncio.gather(*held) == [0, 1, 2, 3]
        assert await client.call(server.address, "block", 5) == 5
        assert client.num_connections == 1
    finally:
        await asyncio.gather(client.shutdown(), server.shutdown())


async def test_idle_connections_close_and_reopen_transparently():
    a = await P2P.create(idle_timeout=0.2)
    b = await P2P.create(idle_timeout=0.2)
    try:
        b.register("echo", echo)
        assert await a.call(b.address, "echo", 1) == 1
        (conn,) = list(a._connections)
        await asyncio.wait_for(conn.closed_future, 10)  # closed by either side's idle sweep
        assert await a.call(b.address, "echo", 2) == 2
        assert a.num_connections == 1 and next(iter(a._connections)) is not conn
    finally:
        await asyncio.gather(a.shutdown(), b.shutdown())


async def test_auth_hook_fields_travel_in_the_header_and_can_refuse():
    class TokenAuth:
        def __init__(self, token):
            self.token = token

        def outgoing(self, method, header):
            return {"token": self.token, "ts": 0, "nonce": os.urandom(8), "sig": b"\x00" * 64}

        def check(self, method, header, peer_id):
            if header.get("a", {}).get("token") != "letmein":
                raise PermissionError("bad token")

    server = await P2P.create(auth=TokenAuth("letmein"))
    good = await P2P.create(auth=TokenAuth("letmein"))
    bad = await P2P.create(auth=TokenAuth("wrong"))
    try:
        server.register("echo", echo)
        assert await good.call(server.address, "echo", "ok") == "ok"
        with pytest.raises(RemoteError, match="Unauthorized"):
            await bad.call(server.address, "echo", "no")
    finally:
        await asyncio.gather(server.shutdown(), good.shutdown(), bad.shutdown())


async def test_hundreds_of_peers_in_one_event_loop():
    peers = await spawn_peers(200)
    try:
        for p in peers:
            p.register("id", lambda req, ctx, me=p: _const(str(me.peer_id)))
        ring = await asyncio.gather(*(p.call(peers[(i + 1) % 200].address, "id", timeout=30)
                                      for i, p in enumerate(peers)))
        assert ring == [str(peers[(i + 1) % 200].peer_id) for i in range(200)]
    finally:
        await asyncio.gather(*(p.shutdown() for p in peers))


async def _const(value):
    return value


async def test_clean_shutdown_leaves_no_tasks_or_sockets():
    def open_fds() -> set[tuple[str, str]]:
        """(fd, what it points at): a socket left open shows up as a pair that was not there before.
        (Only new pairs count: an earlier test's object that the garbage collector closes meanwhile
        is not this test's leak.)"""
        out = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
            except OSError:  # closed between listing and reading
                pass
        return out

    before_tasks = asyncio.all_tasks()
    before_fds = open_fds()
    peers = await spawn_peers(5)
    for p in peers:
        p.register("echo", echo)

        async def forever(request, ctx):
            while True:
                yield 1
        p.register("forever", forever, CallKind.SERVER_STREAM)
    await asyncio.gather(*(p.call(q.address, "echo", 1) for p in peers for q in peers if p is not q))
    streams = [await peers[0].call_stream(peers[1].address, "forever", None) for _ in range(3)]
    assert all([await s.recv() == 1 for s in streams])
    await asyncio.gather(*(p.shutdown() for p in peers))
    for s in streams:  # calls that were open see the peer going away, not a hang
        with pytest.raises(PeerUnreachable):
            async for _ in s:
                pass
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == before_tasks
    assert open_fds() - before_fds == set()


async def test_connection_cap_closes_least_recently_used_idle_connections():
    a = await P2P.create(max_connections=2)
    others = await spawn_peers(4)
    try:
        for p in others:
            p.register("echo", echo)
        for i, p in enumerate(others):
            assert await a.call(p.address, "echo", i) == i
            assert sum(not c.closed for c in a._connections) <= 2
        # the evicted peers are still reachable: a fresh connection is opened on demand
        assert await a.call(others[0].address, "echo", "again") == "again"
    finally:
        await asyncio.gather(a.shutdown(), *(p.shutdown() for p in others))


async def test_eviction_never_touches_a_connection_still_in_its_handshake(no_asyncio_errors):
    a = await P2P.create(max_connections=1)
    others = await spawn_peers(6)
    try:
        for p in others:
            p.register("echo", echo)
        # concurrent dials over the cap: only ready, idle connections may be evicted
        results = await asyncio.gather(*(a.call(p.address, "echo", i) for i, p in enumerate(others)))
        assert results == list(range(6))
    finally:
        await asyncio.gather(a.shutdown(), *(p.shutdown() for p in others))


async def test_a_call_right_after_a_local_close_dials_again(pair):
    a, b = pair
    b.register("echo", echo)
    assert await a.call(b.address, "echo", 1) == 1
    (conn,) = list(a._connections)
    conn.abort("test: drop it")  # connection_lost has not run yet when the next call starts
    assert await a.call(b.address, "echo", 2) == 2
    assert await a.call(b.peer_id, "echo", 3) == 3


async def test_a_handler_task_cancelled_before_its_first_step_still_unwinds_the_handler():
    # a handler runs eagerly up to its first wait, then a task continues it; a connection closed in
    # the same read as the call's OPEN cancels that task before its first step: the cancellation must
    # still reach the handler, or its async generators stay mid-iteration until the loop closes
    from p2p.node import _Resumed

    unwound = []

    async def items():
        try:
            await asyncio.Event().wait()
            yield 1
        finally:
            unwound.append("generator")

    async def handler():
        generator = items()
        try:
            async for _ in generator:
                pass
        finally:
            await generator.aclose()
            unwound.append("handler")

    coro = handler()
    first = coro.send(None)  # the eager step: suspended inside the generator
    task = asyncio.get_running_loop().create_task(_Resumed(coro, first))
    task.cancel()  # before the task took a step
    with pytest.raises(asyncio.CancelledError):
        await task
    assert unwound == ["generator", "handler"]


async def test_a_sent_tensor_may_be_changed_as_soon_as_the_send_returns(pair):
    # tensors travel without a copy (the transport holds views of what it could not send yet): a
    # send returns only once the kernel took every byte, so a caller reusing its buffer at once, on
    # a link slower than its sends, never changes what is on the way
    a, b = pair

    async def keep(requests, ctx):
        return [sorted(set(t.tolist())) async for t in requests]

    b.register("keep", keep, CallKind.CLIENT_STREAM)
    b.set_rate_limit(8_000_000)  # the receiver reads at 8 MB/s: the sender's buffers fill
    buffer = torch.empty(32 * 1024)  # 128 KiB, reused for every message

    held_back = []

    async def messages():
        for i in range(128):
            buffer.fill_(i)
            yield buffer
            # the send has returned: nothing of it is left in the event loop's buffer (which would
            # hold views of ``buffer``), so the caller may change its buffer
            held_back.append(a._cached_connection(b.address).transport.get_write_buffer_size())
            buffer.fill_(-1)

    assert await a.call_client_stream(b.address, "keep", messages(), timeout=60) == [[float(i)] for i in range(128)]
    assert held_back == [0] * 128
