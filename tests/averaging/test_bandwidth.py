"""Measured bandwidth: the kernel's delivery rate read on real sockets, and two averaging peers on
links shaped with tc (each in its own network namespace, joined by a veth pair) that each declare
the rate of their own link, told nothing."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from averaging.bandwidth import BandwidthMeter, ProbeSink
from p2p.errors import RemoteError
from p2p.tcp_info import read_tcp_info

ROOT = Path(__file__).resolve().parent.parent.parent


def test_the_kernel_reports_what_a_connection_carried(wait_for):
    server = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(server.getsockname())
    receiver, _ = server.accept()
    got = bytearray()
    reader = threading.Thread(target=lambda: [got.extend(b) for b in iter(lambda: receiver.recv(1 << 20), b"")])
    reader.start()
    try:
        sender.sendall(b"x" * (4 << 20))
        sender.shutdown(socket.SHUT_WR)
        reader.join(timeout=10)
        assert len(got) == 4 << 20
        # the receiver has every byte, but the sender's kernel may not have processed the last
        # (possibly delayed) ACK yet: about one run in ten here read 4.15 of 4.19 MB acknowledged
        wait_for(lambda: read_tcp_info(sender).bytes_acked >= 4 << 20, 5, "the last ACK")
        sent, received = read_tcp_info(sender), read_tcp_info(receiver)
        assert sent is not None and received is not None
        assert sent.bytes_acked >= 4 << 20  # the SYN and FIN count too
        assert 4 << 20 <= received.bytes_received <= (4 << 20) + 1  # and the FIN
        assert sent.delivery_rate > 0 and sent.rtt_us > 0
    finally:
        for s in (sender, receiver, server):
            s.close()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        assert read_tcp_info(udp) is None  # not TCP: nothing to say
    finally:
        udp.close()


def test_the_estimate_is_the_median_of_recent_rounds_capped():
    meter = BandwidthMeter(default=100.0, ceiling=1000.0, window=3)
    assert meter.estimate == 100.0  # nothing measured yet
    for figure in (40.0, float("nan"), 0.0, -5.0, float("inf")):
        meter.add(figure)  # only the first is a figure
    assert meter.rounds == [40.0]
    meter.add(60.0)
    meter.add(500.0)
    assert meter.estimate == 60.0  # one odd round does not move it
    meter.add(5000.0)
    meter.add(8000.0)  # the oldest rounds leave the window
    assert meter.rounds == [500.0, 5000.0, 8000.0] and meter.estimate == 1000.0  # a CPU-bound link
    with pytest.raises(ValueError, match="default bandwidth"):
        BandwidthMeter(default=0.0)


def test_a_round_figure_adds_up_the_connections_that_share_the_uplink():
    # three receivers each slower than our uplink's share: alone none shows it, together they do
    per_connection = [[8e6, 8.2e6, 7.9e6], [8.1e6, 8e6], [7.8e6, 8e6, 8e6]]
    totals = [(3, 23.9e6), (3, 24.2e6), (2, 16e6), (3, 24e6)]  # one moment with only two flowing
    assert BandwidthMeter.round_figure(per_connection, totals) == 24e6
    # one connection: its median (a sum of one is that connection's sample)
    assert BandwidthMeter.round_figure([[5e6, 9e6, 6e6]], [(1, 5e6), (1, 9e6), (1, 6e6)]) == 6e6
    # a lone burst in the totals never beats a steadier best connection
    assert BandwidthMeter.round_figure([[10e6, 10e6, 10e6]], [(1, 4e6), (1, 4e6), (1, 30e6)]) == 10e6
    assert BandwidthMeter.round_figure([], []) == 0.0


def test_a_round_figure_leaves_out_the_tail_when_only_the_slowest_receiver_still_takes_data():
    # sending to three receivers at once fills our 24 MB/s uplink; then the two fast ones are done
    # and only the slow one (4 MB/s) takes data, for more of the round's moments than the rest
    per_connection = [[8e6] * 4, [8e6] * 4, [8e6] * 4 + [4e6] * 6]
    totals = [(3, 24e6)] * 4 + [(1, 4e6)] * 6
    assert BandwidthMeter.round_figure(per_connection, totals) == 24e6
    # the busiest moments are too few to go by alone: the next busiest ones come in with them
    totals = [(3, 60e6), (2, 16e6), (2, 16e6), (2, 15e6), (1, 4e6)]
    assert BandwidthMeter.round_figure(per_connection, totals) == 16e6


@pytest.mark.timeout(60)
async def test_a_probe_measures_before_any_round_and_a_sink_takes_only_what_it_allows():
    import torch

    from averaging import DecentralizedAverager
    from dht import DHTNode

    a = await DHTNode.create([])
    b = await DHTNode.create([a.address])
    averagers = [DecentralizedAverager([torch.zeros(16)], node, "probe") for node in (a, b)]
    try:
        prober, sink = averagers
        assert prober.bandwidth == 100.0  # the default: no round yet
        figure = await prober.probe_bandwidth([str(b.address)])
        assert figure is not None and figure > 0
        assert prober.meter.rounds == [figure]  # counted as a round's figure would be
        assert prober.bandwidth == min(figure, prober.meter.ceiling) != 100.0

        with pytest.raises(RemoteError, match="at most 8388608 bytes"):  # more than a probe: refused, not kept
            await b.p2p.call_client_stream(a.peer_id, sink.probe_method, [bytes(1 << 20)] * 9, timeout=20)
        with pytest.raises(RemoteError, match="carries bytes, got dict"):
            await b.p2p.call_client_stream(a.peer_id, sink.probe_method, [{"x": 1}], timeout=20)
        assert await b.p2p.call_client_stream(a.peer_id, sink.probe_method, [bytes(10)] * 3, timeout=20) == 30
        # a configured bandwidth is never probed; an unreachable peer measures nothing and raises nothing
        assert await DecentralizedAverager([torch.zeros(16)], a, "fixed", bandwidth=40.0).probe_bandwidth(
            [str(b.address)]) is None
        assert await prober.probe_bandwidth(["/ip4/127.0.0.1/tcp/1"], timeout=2) is None
    finally:
        for averager in averagers:
            await averager.shutdown()
        await b.shutdown()
        await a.shutdown()


@pytest.mark.timeout(30)
async def test_a_stalled_prober_loses_its_slot_and_a_full_sink_says_it_is_busy(until):
    from p2p import P2P, CallKind

    sink_node, caller = await P2P.create(), await P2P.create()
    sink = ProbeSink(slots=1, max_seconds=3.0)
    sink_node.register("probe", sink, CallKind.CLIENT_STREAM)
    try:
        stalled = await caller.open(sink_node.address, "probe", timeout=20)
        await stalled.send(bytes(10))  # and never finishes: it holds the only slot until its time is up
        await until(lambda: sink._slots.locked(), 10, "the stalled probe to hold the slot")
        with pytest.raises(RemoteError, match="busy: already serving 1"):
            await caller.call_client_stream(sink_node.address, "probe", [bytes(10)], timeout=20)
        with pytest.raises(RemoteError, match="takes at most 3 s"):
            await stalled.recv()
        await stalled.aclose()
        assert await caller.call_client_stream(sink_node.address, "probe", [bytes(10)], timeout=20) == 10
    finally:
        await asyncio.gather(caller.shutdown(), sink_node.shutdown())

PEER = """
import asyncio, json, sys, torch
from averaging import DecentralizedAverager
from dht import DHTNode

async def main(host, bootstrap):
    node = await DHTNode.create([bootstrap] if bootstrap != '-' else [], host=host)
    print(json.dumps({"addr": str(node.address)}), flush=True)
    averager = DecentralizedAverager([torch.ones(1 << 21)], node, "bw", target_group_size=2,
                                     min_matchmaking_time=1.0, allreduce_timeout=60.0)
    probed = await averager.probe_bandwidth([bootstrap]) if bootstrap != '-' else None
    probe = {"probed": probed, "declared": averager.bandwidth}
    figures = []
    for _ in range(3):
        result = await averager.step(timeout=90.0)
        figures.append({"group": result.group_size, "declared": averager.bandwidth})
    print(json.dumps({"probe": probe, "rounds": figures, "measured": averager.meter.rounds}), flush=True)
    await asyncio.sleep(1.0)  # the other peer's last round may still read from us
    await averager.shutdown()
    await node.shutdown()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=15)


@pytest.fixture
def two_shaped_links():
    """Namespaces a (10.88.0.1, sending at 20 Mbit/s) and b (10.88.0.2, at 80 Mbit/s), one veth pair."""
    tag = uuid.uuid4().hex[:6]
    names = [f"ssw-bw-a-{tag}", f"ssw-bw-b-{tag}"]
    for name in names:
        sh("ip", "netns", "add", name)
    try:
        sh("ip", "-n", names[0], "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", names[1])
        for i, (name, rate) in enumerate(zip(names, (20, 80), strict=True)):
            sh("ip", "-n", name, "addr", "add", f"10.88.0.{i + 1}/24", "dev", "eth0")
            sh("ip", "-n", name, "link", "set", "eth0", "up")
            sh("ip", "-n", name, "link", "set", "lo", "up")
            sh("ip", "netns", "exec", name, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate",
               f"{rate}mbit", "burst", "64kb", "latency", "500ms")
        yield names
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], check=False, timeout=15)


@pytest.mark.timeout(120)
@pytest.mark.alone  # it measures link rates: nothing else on the CPUs meanwhile
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
                    reason="network namespaces and tc need root and iproute2")
def test_peers_told_nothing_declare_the_rates_of_their_own_links(two_shaped_links):
    """The fast peer starts; the slow one joins it and probes its upload before any round."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = []
    try:
        first = subprocess.Popen(["ip", "netns", "exec", two_shaped_links[1], sys.executable, "-c", PEER,
                                  "10.88.0.2", "-"], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        procs.append(first)
        address = json.loads(first.stdout.readline())["addr"]
        second = subprocess.Popen(["ip", "netns", "exec", two_shaped_links[0], sys.executable, "-c", PEER,
                                   "10.88.0.1", address], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        procs.append(second)
        second.stdout.readline()
        results = [json.loads(p.stdout.readline()) for p in procs]
        for p in procs:
            assert p.wait(timeout=30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stdout.close()
    for result in results:
        assert [r["group"] for r in result["rounds"]] == [2, 2, 2], result
        assert result["rounds"][0]["declared"] != 100.0  # measured from the first round on
    fast_result, slow_result = results
    assert fast_result["probe"] == {"probed": None, "declared": 100.0}  # nobody to probe: the default
    probed = slow_result["probe"]["probed"]
    # probed before its first round: the slow sender declares its link's rate from the start
    assert probed is not None and 0.7 * 20 <= probed <= 1.3 * 20 and slow_result["probe"]["declared"] == probed, \
        results
    slow, fast = slow_result["rounds"][-1]["declared"], fast_result["rounds"][-1]["declared"]
    # the slow link is what its sender measures: the shaper's rate, give or take its bucket's bursts
    assert 0.75 * 20 <= slow <= 1.25 * 20, results
    # the fast sender gets less than its link: its ACKs come back through the slow peer's full queue
    # (an RTT of up to the shaper's 500 ms), so its window, not its link, bounds it.  What the load
    # balancing needs holds: it declares clearly more than the slow one, and no more than its link
    assert 1.5 * slow <= fast <= 1.25 * 80, results
