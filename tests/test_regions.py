"""Emulated regions (``benchmarks/_regions.py``): a round trip between two regions pays the
configured RTT (within 10%), one within a region does not.  Needs root and network namespaces;
skipped, with the reason, where they are missing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks._netns import available

pytestmark = pytest.mark.timeout(60)
RTT_MS = 80.0

SERVER = """
import socket, sys
s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("up", flush=True)
c, _ = s.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while data := c.recv(65536):
    c.sendall(data)
"""
CLIENT = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(7):
    t = time.perf_counter()
    c.sendall(b"x")
    assert c.recv(16) == b"x"
    times.append(time.perf_counter() - t)
print(sorted(times)[3])
"""


def round_trip(world, server_region: int, client_region: int, port: int) -> float:
    server = subprocess.Popen([*world.exec_prefix(server_region), sys.executable, "-c", SERVER, str(port)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        out = subprocess.run([*world.exec_prefix(client_region), sys.executable, "-c", CLIENT,
                              world.public[server_region], str(port)], capture_output=True, text=True, timeout=30,
                             check=True)
        return float(out.stdout)
    finally:
        server.kill()
        server.wait()


@pytest.mark.skipif(available(need_tc=True) is not None, reason=f"no network namespaces: {available(need_tc=True)}")
def test_a_round_trip_between_regions_pays_the_rtt_and_one_within_a_region_does_not():
    from benchmarks._regions import regions

    with regions([1, 2], rtt_ms=RTT_MS, subnet="10.213.7", public_prefix="10.215") as world:
        between = round_trip(world, 0, 1, world.ports[0][0])
        within = round_trip(world, 1, 1, world.ports[1][0])
    assert abs(between * 1000 - RTT_MS) <= 0.1 * RTT_MS, between
    assert within * 1000 < 0.1 * RTT_MS, within
