"""Network namespaces for benchmarks: a Linux bridge in the root namespace plus n namespaces, each
with its own IP address on the bridge's /24 and optional bandwidth shaping (``tc tbf``).

Layout for ``netns_cluster(n, subnet="10.213.0")``::

    root namespace: bridge sswb<tag>, 10.213.0.1/24            (the Ray head binds here)
    ssw-<pid>-<k>:  eth0 = 10.213.0.<10+k>/24, lo up            (k = 1..n, one Ray node each)
                    veth peer sv<tag>-<k> in the root namespace, enslaved to the bridge

Index i = k - 1 everywhere in ``NetnsFleet`` (``namespaces[i]``, ``ips[i]``); run a process inside
namespace i with ``fleet.exec_prefix(i) + [cmd, ...]`` (``ip netns exec``).  Teardown SIGKILLs whatever
still runs inside the namespaces.
Shaping: a tbf qdisc shapes the *egress* of its device, so one qdisc on the inner ``eth0`` caps what
the namespace sends (upload) and one on the outer veth caps what it receives (download); both are
installed.  No delay emulation (no netem here).  Everything runs on this machine: traffic never
leaves the bridge.  Needs root and iproute2 (``ip``, ``tc``); see ``available()``.

Bridged namespace-to-namespace traffic passes the iptables FORWARD chain when br_netfilter is loaded
(``net.bridge.bridge-nf-call-iptables=1``); a FORWARD policy of DROP (Docker hosts) then blocks it,
fixed by ``iptables -I FORWARD -i <bridge> -o <bridge> -j ACCEPT``.  Root-to-namespace traffic is not
affected.  This module does not touch the firewall.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

TIMEOUT_S = 15.0
_seq = itertools.count()


class NetnsError(RuntimeError):
    """A namespace, link or qdisc command failed."""


def _run(args: Sequence[str], check: bool = True, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run one command with a timeout; raise NetnsError on failure when ``check``."""
    try:
        proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsError(f"{' '.join(args)}: {e}") from e
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc


def available(need_tc: bool = False) -> str | None:
    """None if network namespaces can be created here, else the reason why not."""
    if not sys.platform.startswith("linux"):
        return f"not Linux ({sys.platform})"
    if os.geteuid() != 0:
        return "not root"
    tools = ["ip", "tc"] if need_tc else ["ip"]
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)} (iproute2)"
    probe = f"ssw-probe-{os.getpid()}"
    try:
        _run(["ip", "netns", "add", probe])
    except NetnsError as e:
        return f"cannot create a network namespace: {e}"
    try:
        _run(["ip", "netns", "del", probe])
    except NetnsError as e:
        log.warning("could not delete probe namespace %s: %s", probe, e)
    return None


def _tbf(dev: str, mbit: float | None, netns: str | None = None) -> None:
    """Set (``mbit``) or remove (None) a root tbf qdisc on ``dev``."""
    pre = ["ip", "netns", "exec", netns] if netns else []
    if mbit is None:
        _run([*pre, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
        return
    if mbit <= 0:
        raise ValueError(f"bandwidth must be positive, got {mbit} Mbit/s")
    # The bucket must hold at least one timer tick of traffic (HZ >= 250) or the rate undershoots.
    burst = max(64 * 1024, int(mbit * 1e6 / 8 / 250))
    _run([*pre, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
          "rate", f"{mbit}mbit", "burst", str(burst), "latency", "50ms"])  # fmt: skip


@dataclass
class NetnsFleet:
    """A bridge in the root namespace (address ``head_ip``) and namespaces ``namespaces[i]`` with
    addresses ``ips[i]``; ``veths[i]`` is the root-side end of namespace i's link."""

    head_ip: str
    bridge: str
    namespaces: list[str] = field(default_factory=list)
    ips: list[str] = field(default_factory=list)
    veths: list[str] = field(default_factory=list)

    def exec_prefix(self, i: int) -> list[str]:
        """Command prefix that runs a program inside namespace ``i`` (0-based)."""
        return ["ip", "netns", "exec", self.namespaces[i]]

    def set_bandwidth(self, i: int, mbit: float | None) -> None:
        """Cap namespace ``i`` at ``mbit`` Mbit/s in each direction (None: unshaped)."""
        _tbf("eth0", mbit, netns=self.namespaces[i])  # egress of the namespace: upload
        _tbf(self.veths[i], mbit)  # egress of the bridge port towards it: download


def _subnet_users(subnet: str) -> list[str]:
    """Interfaces of the root namespace with an address in ``subnet``.0/24."""
    out = _run(["ip", "-4", "-o", "addr", "show"]).stdout
    users = []
    for line in out.splitlines():
        m = re.search(r"^\d+:\s+(\S+)\s+inet\s+(\d+\.\d+\.\d+)\.\d+/", line)
        if m and m.group(2) == subnet:
            users.append(m.group(1))
    return users


def _cmdline(pid: str) -> str:
    """The start of a process's command line, for log messages."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:100]
    except OSError:
        return "?"


def _teardown(fleet: NetnsFleet, created_bridge: bool) -> None:
    """Best effort: kill what still runs in the namespaces, delete links, namespaces, bridge."""
    for ns in fleet.namespaces:
        pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
        for pid in pids:
            log.warning("killing process %s still running in %s: %s", pid, ns, _cmdline(pid))
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    for veth in fleet.veths:  # deleting one end removes the pair, even if the namespace lingers
        proc = _run(["ip", "link", "del", veth], check=False)
        if proc.returncode != 0 and "Cannot find device" not in proc.stderr:
            log.warning("ip link del %s: %s", veth, proc.stderr.strip())
    for ns in fleet.namespaces:
        proc = _run(["ip", "netns", "del", ns], check=False)
        if proc.returncode != 0:
            log.warning("ip netns del %s: %s", ns, proc.stderr.strip())
    if created_bridge:
        proc = _run(["ip", "link", "del", fleet.bridge], check=False)
        if proc.returncode != 0:
            log.warning("ip link del %s: %s", fleet.bridge, proc.stderr.strip())


@contextlib.contextmanager
def netns_cluster(
    n: int, subnet: str = "10.213.0", bandwidth_mbit: list[float | None] | None = None
) -> Iterator[NetnsFleet]:
    """Create a bridge (``subnet``.1/24) and ``n`` namespaces (``subnet``.11, .12, ...), shaped to
    ``bandwidth_mbit[i]`` Mbit/s each way when given; yield the fleet; always tear it all down."""
    if not 1 <= n <= 244:
        raise ValueError(f"n must be in 1..244, got {n}")
    if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", subnet):
        raise ValueError(f"subnet must be the first three octets, like '10.213.0', got {subnet!r}")
    if bandwidth_mbit is not None and len(bandwidth_mbit) != n:
        raise ValueError(f"bandwidth_mbit has {len(bandwidth_mbit)} entries for {n} namespaces")
    reason = available(need_tc=bandwidth_mbit is not None and any(b is not None for b in bandwidth_mbit))
    if reason:
        raise NetnsError(f"network namespaces unavailable: {reason}")
    if users := _subnet_users(subnet):
        raise NetnsError(f"{subnet}.0/24 is already in use on {', '.join(users)}; pass another subnet")

    pid, seq = os.getpid(), next(_seq)
    tag = f"{pid:x}x{seq:x}" if seq else f"{pid:x}"  # unique per process and fleet
    ns_base = f"ssw-{pid}.{seq}" if seq else f"ssw-{pid}"
    if len(f"sv{tag}-{n}") > 15:  # Linux caps interface names at 15 characters
        raise NetnsError(f"too many fleets in this process for short interface names (tag {tag})")
    fleet = NetnsFleet(head_ip=f"{subnet}.1", bridge=f"sswb{tag}")
    created_bridge = False
    try:
        _run(["ip", "link", "add", fleet.bridge, "type", "bridge"])
        created_bridge = True
        _run(["ip", "addr", "add", f"{fleet.head_ip}/24", "dev", fleet.bridge])
        if others := [u for u in _subnet_users(subnet) if u != fleet.bridge]:  # a concurrent fleet won the race
            raise NetnsError(f"{subnet}.0/24 is already in use on {', '.join(others)}; pass another subnet")
        _run(["ip", "link", "set", fleet.bridge, "up"])
        for k in range(1, n + 1):
            ns, veth, ip = f"{ns_base}-{k}", f"sv{tag}-{k}", f"{subnet}.{10 + k}"
            _run(["ip", "netns", "add", ns])
            fleet.namespaces.append(ns)
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            fleet.veths.append(veth)
            fleet.ips.append(ip)
            _run(["ip", "link", "set", veth, "master", fleet.bridge, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            if bandwidth_mbit is not None and bandwidth_mbit[k - 1] is not None:
                fleet.set_bandwidth(k - 1, bandwidth_mbit[k - 1])
        pairs = ", ".join(f"{ns}={ip}" for ns, ip in zip(fleet.namespaces, fleet.ips, strict=True))
        log.info("netns fleet up: bridge %s %s, %s", fleet.bridge, fleet.head_ip, pairs)
        yield fleet
    finally:
        _teardown(fleet, created_bridge)
        log.info("netns fleet %s torn down", fleet.bridge)


def _self_check() -> str:
    """Create 2 namespaces, send a TCP message from the second to the first, tear down."""
    server = (
        "import socket,sys\n"
        "s=socket.create_server(('0.0.0.0',47001));s.settimeout(10)\n"
        "c,a=s.accept();c.sendall(('pong '+a[0]).encode());c.close()\n"
    )
    client = (
        "import socket,sys,time\n"
        "for _ in range(100):\n"
        "    try: c=socket.create_connection((sys.argv[1],47001),timeout=2); break\n"
        "    except OSError as e: err=e; time.sleep(0.05)\n"
        "else: sys.exit(f'connect failed: {err}')\n"
        "print(c.recv(100).decode())\n"
    )
    with netns_cluster(2) as fleet:
        srv = subprocess.Popen([*fleet.exec_prefix(0), sys.executable, "-c", server])
        try:
            out = _run([*fleet.exec_prefix(1), sys.executable, "-c", client, fleet.ips[0]]).stdout.strip()
        finally:
            with contextlib.suppress(subprocess.TimeoutExpired):
                srv.wait(timeout=TIMEOUT_S)
            if srv.poll() is None:
                srv.kill()
                srv.wait()
        if out != f"pong {fleet.ips[1]}":
            raise NetnsError(f"unexpected reply {out!r}")
        a, b = f"{fleet.namespaces[1]} ({fleet.ips[1]})", f"{fleet.namespaces[0]} ({fleet.ips[0]})"
        return f"netns self-check OK: TCP {a} -> {b}"


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if why := available():
        print(f"netns self-check SKIPPED: {why}")
        sys.exit(0)
    try:
        print(_self_check())
    except NetnsError as e:
        print(
            f"netns self-check FAILED: {e} (hint: br_netfilter + an iptables FORWARD DROP policy drops bridged traffic)"
        )
        sys.exit(1)
