"""The dialing side of emulated regions (``p2p/route.py``): the relay header, a route's text, which
hosts it sends through the relay, and a dial the relay refuses.  The relay itself and real calls
across it: ``tests/orchestrator/test_links.py``."""

from __future__ import annotations

import asyncio

import pytest

from p2p import P2P, PeerGone, PeerUnreachable
from p2p.route import MAX_HEADER_BYTES, RelayRoute, parse_relay_header, relay_header

pytestmark = pytest.mark.timeout(30)


def test_a_header_names_its_destination_and_parses_back():
    line = relay_header("127.77.2.1", 4242)
    assert line == b"SWRELAY1 127.77.2.1:4242\n"
    assert parse_relay_header(line) == ("127.77.2.1", 4242)


@pytest.mark.parametrize("line, error", [
    (b"SWRELAY1 127.77.2.1:4242", "not a relay header"),
    (b"HELLO 127.77.2.1:4242\n", "not a relay header"),
    (b"SWRELAY1 127.77.2.1\n", "HOST:PORT"),
    (b"SWRELAY1 127.77.2.1:0\n", "HOST:PORT"),
    (b"SWRELAY1 :80\n", "HOST:PORT"),
    (b"SWRELAY1 a b:80\n", "HOST:PORT"),
    (b"SWRELAY1 \xff:80\n", "not ASCII"),
    (b"SWRELAY1 " + b"a" * MAX_HEADER_BYTES + b":80\n", "longer than"),
])
def test_a_malformed_header_is_a_value_error_saying_what_is_wrong(line, error):
    with pytest.raises(ValueError, match=error):
        parse_relay_header(line)


def test_a_route_relays_only_the_other_regions_hosts_and_round_trips_as_text():
    route = RelayRoute.make(("127.77.0.1", 4000), "127.77.1.1", ["127.77.3.1", "127.77.2.1"])
    assert route.relayed("127.77.2.1") and route.relayed("127.77.3.1")
    assert not route.relayed("127.77.1.1") and not route.relayed("127.0.0.1")  # its own region, the head
    assert str(route) == "relay=127.77.0.1:4000 source=127.77.1.1 remote=127.77.2.1,127.77.3.1"
    assert RelayRoute.parse(str(route)) == route


@pytest.mark.parametrize("text, error", [
    ("relay=127.77.0.1:4000 source=127.77.1.1", "lacks remote"),
    ("relay=127.77.0.1 source=127.77.1.1 remote=", "HOST:PORT"),
    ("relay=127.77.0.1:4000 source=127.77.1.1 remote=127.77.1.1", "own address"),
    ("via=127.77.0.1:4000", "a route is"),
])
def test_a_bad_route_is_a_value_error(text, error):
    with pytest.raises(ValueError, match=error):
        RelayRoute.parse(text)


async def test_a_dial_the_relay_refuses_is_a_peer_unreachable_with_its_reason():
    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        writer.write(b"error no such region\n")
        writer.close()

    fake_relay = await asyncio.start_server(refuse, "127.0.0.1", 0)
    target = await P2P.create("127.0.0.1", 0)
    route = RelayRoute.make(fake_relay.sockets[0].getsockname()[:2], "127.77.1.1", ["127.0.0.1"])
    caller = await P2P.create("127.77.1.1", 0, route=route)
    try:
        with pytest.raises(PeerUnreachable, match="refused: no such region") as refused:
            await caller.call(target.address, "anything", timeout=5)
        assert not isinstance(refused.value, PeerGone)  # the relay's word, not proof the peer is down
    finally:
        await caller.shutdown()
        await target.shutdown()
        fake_relay.close()
        await fake_relay.wait_closed()


async def test_without_a_route_a_peer_dials_directly():
    a, b = await P2P.create(), await P2P.create()

    async def echo(request, ctx):
        return request

    b.register("echo", echo)
    try:
        assert a.route is None and a.pool.route is None
        assert await a.call(b.address, "echo", 7) == 7
    finally:
        await a.shutdown()
        await b.shutdown()
