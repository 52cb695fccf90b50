"""The local simulator's slow links between regions (``provider.links``, ``orchestrator/sim/relay.py``):
real p2p nodes in two emulated regions pay the configured round trip and rate through the relay, and
none within a region; the relay refuses what it cannot carry and carries on; the simulator owns the
relay's process; the config says what is wrong with a links setting."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import numpy as np
import pydantic
import pytest

from orchestrator.config.schema import ClusterConfig
from orchestrator.runs.logs import log_path
from orchestrator.sim.relay import LinkSpec, RegionRelay, RelayProcess, region_hosts, worker_networks
from p2p import P2P, Authority, Identity, Membership, PeerUnreachable
from p2p.route import RelayRoute
from tests.orchestrator.run_checks import errors_of, load, write
from workers.worker_config import WorkerConfig

pytestmark = pytest.mark.timeout(120)

HOSTS = {"east": "127.77.1.1", "west": "127.77.2.1"}
LINK = LinkSpec(mbit=20, rtt_ms=100)  # 2.5 MB/s each way
RUN = "links"


@pytest.fixture
async def relay():
    relay = RegionRelay({host: region for region, host in HOSTS.items()}, LINK)
    await relay.start()
    yield relay
    await relay.close()
    assert not relay._tasks  # every connection it carried ended with it


@pytest.fixture
def authority() -> Authority:
    return Authority(Identity(), RUN)


async def peer(relay: RegionRelay, region: str, authority: Authority | None = None) -> P2P:
    """A p2p node of ``region``: listening on its address, dialing the other region through the relay."""
    route = RelayRoute.make((relay.host, relay.port), HOSTS[region], [h for r, h in HOSTS.items() if r != region])
    identity = Identity()
    membership = None
    if authority is not None:
        membership = Membership(RUN, authority.public_key, authority.issue(identity.peer_id, ttl=600))
    node = await P2P.create(HOSTS[region], 0, identity=identity, route=route, membership=membership)

    async def echo(request, ctx):
        return [request, ctx.remote_address[0], str(ctx.peer_id)]

    async def size(request, ctx):
        return int(request.nbytes)

    node.register("echo", echo)
    node.register("size", size)
    return node


async def round_trips(caller: P2P, callee: P2P, n: int = 6) -> list[float]:
    loop = asyncio.get_running_loop()
    out = []
    for i in range(n):
        sent = loop.time()
        assert (await caller.call(callee.address, "echo", i))[0] == i
        out.append(loop.time() - sent)
    return out


@pytest.mark.alone  # bounds calls in real time
async def test_a_call_between_regions_pays_the_rtt_and_one_within_a_region_does_not(relay, authority):
    east, west, west2 = [await peer(relay, r, authority) for r in ("east", "west", "west")]
    try:
        # the handshake (membership, the pinned peer id) crosses the relay unchanged; the callee sees
        # the caller's region's address and its peer id
        value, seen_host, seen_id = await east.call(west.address, "echo", "hello")
        assert (value, seen_host, seen_id) == ("hello", HOSTS["east"], str(east.peer_id))
        between = await round_trips(east, west)
        await west2.call(west.address, "echo", "hello")
        within = await round_trips(west2, west)
    finally:
        for node in (east, west, west2):
            await node.shutdown()
    assert LINK.rtt_s <= min(between) <= 1.1 * LINK.rtt_s, between
    assert min(within) < 0.02, within  # plain loopback: no added delay
    assert relay.links[("east", "west")].connections == 1
    assert set(relay.links) == {("east", "west"), ("west", "east")}  # west to west never went through it


@pytest.mark.alone  # bounds calls in real time
async def test_a_transfer_between_regions_takes_its_size_over_the_rate_shared_by_the_pairs_connections(relay):
    east, east2, west = [await peer(relay, r) for r in ("east", "east", "west")]
    size = 3_000_000
    try:
        await east.call(west.address, "echo", 0)
        await east2.call(west.address, "echo", 0)
        started = time.monotonic()
        got = await east.call(west.address, "size", np.ones(size, dtype=np.uint8), timeout=30)
        alone = time.monotonic() - started
        started = time.monotonic()  # two connections of the same pair at once share its rate
        both = await asyncio.gather(*(node.call(west.address, "size", np.ones(size // 2, dtype=np.uint8),
                                                timeout=30) for node in (east, east2)))
        shared = time.monotonic() - started
    finally:
        for node in (east, east2, west):
            await node.shutdown()
    nominal = size / LINK.rate  # 1.2 s
    assert got == size and both == [size // 2] * 2
    burst = max(64 * 1024, LINK.rate * 0.05)  # what the bucket may have banked while the link was idle
    for elapsed in (alone, shared):
        assert (size - burst) / LINK.rate + LINK.rtt_s <= elapsed <= 1.5 * nominal + 1.0, (alone, shared)
    assert relay.links[("east", "west")].bytes >= 2 * size


@pytest.mark.parametrize("source, line, reason", [
    (HOSTS["east"], b"GET / HTTP/1.1\n", "malformed header: not a relay header"),
    (HOSTS["east"], b"SWRELAY1 127.77.2.1\n", "malformed header: destination must be HOST:PORT"),
    (HOSTS["east"], b"SWRELAY1 127.77.9.1:80\n", "is in no region"),
    (HOSTS["east"], b"SWRELAY1 127.77.1.1:80\n", "the dialer's own region"),
    ("127.0.0.1", b"SWRELAY1 127.77.2.1:80\n", "127.0.0.1 is in no region"),
])
async def test_the_relay_refuses_what_it_cannot_carry_with_a_reason_and_carries_on(relay, caplog, source, line,
                                                                                   reason):
    caplog.set_level(logging.WARNING, "orchestrator.sim.relay")
    reader, writer = await asyncio.open_connection(relay.host, relay.port, local_addr=(source, 0))
    writer.write(line)
    answer = await asyncio.wait_for(reader.read(), 10)  # the reason, then the end of the connection
    writer.close()
    assert answer.startswith(b"error ") and reason.encode() in answer, answer
    assert any("refused a connection" in r.message and reason in r.message for r in caplog.records)
    east, west = await peer(relay, "east"), await peer(relay, "west")
    try:
        assert (await east.call(west.address, "echo", "still there"))[0] == "still there"
    finally:
        await east.shutdown()
        await west.shutdown()
    assert relay.refused == 1


async def test_a_destination_that_is_down_is_a_peer_unreachable_naming_the_relays_reason(relay):
    east = await peer(relay, "east")
    gone = await peer(relay, "west")
    address = gone.address
    await gone.shutdown()
    try:
        with pytest.raises(PeerUnreachable, match=r"relay .* refused: cannot connect to 127\.77\.2\.1"):
            await east.call(address, "echo", 1, timeout=10)
    finally:
        await east.shutdown()


async def test_the_relay_process_carries_reports_each_pair_and_ends_with_nothing_left(tmp_path):
    log = tmp_path / "relay.log"
    process = RelayProcess(HOSTS, LINK, log_file=log)
    address = process.start()
    proc = process.proc
    assert proc is not None
    try:
        fake = RegionRelay({}, LINK, *address)  # only for the routes' address
        east, west = await peer(fake, "east"), await peer(fake, "west")
        try:
            assert (await east.call(west.address, "echo", "x"))[0] == "x"
            assert (await west.call(east.address, "echo", "y"))[0] == "y"
        finally:
            await east.shutdown()
            await west.shutdown()
    finally:
        status = process.stop()
    assert status == 0 and proc.poll() == 0
    text = log.read_text()
    # one connection, used both ways (p2p keeps one per pair of peers, whichever dialed)
    for pair in ("east -> west", "west -> east"):
        assert re.search(rf"relay carried {pair}: [1-9][0-9,]* bytes over 1 connection$", text, re.M), text
    assert "stopped" in text


def test_a_relay_given_a_lifetime_ends_by_itself(tmp_path):
    process = RelayProcess(HOSTS, LINK, log_file=tmp_path / "relay.log", lifetime_s=0.5)
    process.start()
    proc = process.proc
    assert proc is not None
    try:
        assert proc.wait(timeout=30) == 0
    finally:
        process.stop()
    assert "stopped" in (tmp_path / "relay.log").read_text()


def wan_config(tmp_path) -> ClusterConfig:
    """A local run with one node type in each region (warm image off: no Ray needed)."""
    text = """\
cluster_name: wan
provider:
  type: local
  region: east
  warm_image: false
  links: {mbit: 50, rtt_ms: 100}
available_node_types:
  east-type: {region: east, max_workers: 1}
  west-type: {region: west, zones: [west-a], max_workers: 1}
"""
    config, warnings = load(write(tmp_path, text))
    assert warnings == []
    return config


def test_the_simulator_starts_the_relay_gives_each_region_its_address_and_stops_it(tmp_path):
    from orchestrator.sim.actors import LocalSpotProvider

    provider = LocalSpotProvider(wan_config(tmp_path), clock=time.time, run_dir=tmp_path)
    relay = provider.relay
    assert relay is not None and relay.proc is not None
    proc = relay.proc
    try:
        east, west = provider.networks["east-type"], provider.networks["west-type"]
        assert (east["host"], east["announce_host"], west["host"]) == ("127.77.1.1", "127.77.1.1", "127.77.2.1")
        route = RelayRoute.parse(WorkerConfig(host=east["host"], route=east["route"]).route)
        assert route == RelayRoute.make(relay.address, "127.77.1.1", ["127.77.2.1"])
    finally:
        provider.shutdown()
    assert provider.relay is None and proc.poll() == 0
    assert "relay refused 0 connections; stopped" in log_path(tmp_path, "relay").read_text()


def test_region_addresses_follow_the_sorted_region_names_and_routes_name_the_others():
    hosts = region_hosts(["west", "east", "west", "north"])
    assert hosts == {"east": "127.77.1.1", "north": "127.77.2.1", "west": "127.77.3.1"}
    networks = worker_networks(hosts, {"a": "west", "b": "east"}, ("127.77.0.1", 4000))
    assert networks["a"] == {"host": "127.77.3.1", "announce_host": "127.77.3.1",
                             "route": "relay=127.77.0.1:4000 source=127.77.3.1 remote=127.77.1.1,127.77.2.1"}
    with pytest.raises(pydantic.ValidationError, match="route"):
        WorkerConfig(route="relay=nowhere")


LINKED = """\
cluster_name: t
provider:
  type: local
  links: {mbit: 50, rtt_ms: 100}
available_node_types:
  a: {max_workers: 1}
  b: {region: far, zones: [far-a], max_workers: 1}
"""


@pytest.mark.parametrize("change, error", [
    (("  type: local", "  type: aws\n  region: us-east-1"), "provider.links: the local simulator's"),
    (("  type: local", "  type: local\n  mode: nodes"), "provider.links: emulated for provider.mode "
                                                         "'actors' only"),
    (("mbit: 50", "mbit: 0"), "provider.links.mbit: Input should be greater than 0"),
    (("rtt_ms: 100", "rtt_ms: -5"), "provider.links.rtt_ms: Input should be greater than or equal to 0"),
    ((", rtt_ms: 100", ""), "provider.links.rtt_ms: required field is missing"),
    (("rtt_ms: 100", "rtt_ms: 100, jitter: 3"), "provider.links.jitter: unknown key"),
    (("available_node_types:", "network: {listen_host: 0.0.0.0}\navailable_node_types:"),
     "network.listen_host: '0.0.0.0', but provider.links gives each region's workers a loopback address"),
])
def test_a_wrong_links_setting_is_an_error_naming_the_key(tmp_path, change, error):
    errors = errors_of(write(tmp_path, LINKED.replace(*change)))
    assert any(error in line for line in errors), errors


def test_links_between_one_region_only_are_a_warning(tmp_path):
    config, warnings = load(write(tmp_path, LINKED.replace("region: far, zones: [far-a], ", "")))
    assert config.provider.links is not None
    assert len(warnings) == 1 and "provider.links: every node type is in region 'local'" in warnings[0]
