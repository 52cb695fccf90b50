"""The chaos run's slow-link fault on a node in its own network namespace: a real namespace and
veth link, real tc.  The link is given back as it was, its own shaping included."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid

import pytest

from orchestrator.chaos.faults import FaultSkipped, Node, slow_link

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
                                 reason="network namespaces and tc need root and iproute2")]


def sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=15).stdout


@pytest.fixture
def namespace():
    name = f"ssw-link-{uuid.uuid4().hex[:6]}"
    sh("ip", "netns", "add", name)
    try:
        sh("ip", "-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0p")
        sh("ip", "-n", name, "link", "set", "eth0", "up")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, timeout=15)


def root_qdisc(namespace: str) -> dict:
    return json.loads(sh("ip", "netns", "exec", namespace, "tc", "-j", "qdisc", "show", "dev", "eth0", "root"))[0]


def test_an_unshaped_link_is_slowed_then_left_unshaped(namespace):
    link = slow_link(Node("i-1", 0, namespace))
    slowed = root_qdisc(namespace)
    assert slowed["kind"] == "tbf" and slowed["options"]["rate"] == 125_000  # 1 Mbit/s, in bytes per second
    assert namespace in link.detail
    link.restore()
    assert root_qdisc(namespace)["kind"] != "tbf"


def test_a_link_with_its_own_tbf_gets_it_back(namespace):
    sh("ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", "100mbit",
       "burst", "32kbit", "latency", "50ms")
    own = root_qdisc(namespace)["options"]
    link = slow_link(Node("i-1", 0, namespace))
    assert root_qdisc(namespace)["options"]["rate"] == 125_000
    link.restore()
    back = root_qdisc(namespace)
    assert back["kind"] == "tbf"
    assert (back["options"]["rate"], back["options"]["lat"]) == (own["rate"], own["lat"])
    assert back["options"]["burst"] == pytest.approx(own["burst"], rel=0.01)  # tc rounds it to its clock ticks


def test_a_link_shaped_otherwise_is_left_alone(namespace):
    sh("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb")
    with pytest.raises(FaultSkipped, match="htb"):
        slow_link(Node("i-1", 0, namespace))
    assert root_qdisc(namespace)["kind"] == "htb"
