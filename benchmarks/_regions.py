"""Emulated regions on one machine: real bytes through real sockets, with a region's bandwidth and
latency between regions (netem is missing here: ``tc tbf`` shapes the rate, a userspace relay adds
the delay).

Layout for ``regions([2, 2], link_mbit=50, rtt_ms=100)``::

    region r = network namespace r of a ``_netns`` fleet: eth0 10.213.0.<11+r> on the root bridge,
               shaped to link_mbit each way (tbf), and lo shaped to 1 Gbit/s (the region's own network)
    its public address 10.214.<r>.1 is on its own lo: its peers listen on 0.0.0.0 and announce it,
               so peers of one region reach each other over lo, undelayed
    every other region s holds 10.214.<r>.1 on its lo too, where a relay (``_delay_relay.py``) listens
               on each of region r's peer ports and carries the bytes to 10.213.0.<11+r>, over the
               shaped link, rtt_ms / 2 later each way

A call from region s to region r pays one relay (both directions delayed): rtt_ms more per round
trip, at link_mbit.  Peer k of region r has port ``base_port + 100 * r + k``.  Teardown ends the
relays and the namespaces, and whatever still runs in them.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks._netns import NetnsError, NetnsFleet, _run, _tbf, netns_cluster

log = logging.getLogger(__name__)
RELAY = Path(__file__).with_name("_delay_relay.py")
LAN_MBIT = 1000.0  # within a region
READY_S = 20.0


@dataclass
class Regions:
    fleet: NetnsFleet
    public: list[str]  # region r's public address, announced by its peers
    ports: list[list[int]]  # ports[r][k]: peer k of region r listens there
    relays: list[subprocess.Popen] = field(default_factory=list)

    def exec_prefix(self, region: int) -> list[str]:
        """Command prefix that runs a program inside ``region``."""
        return self.fleet.exec_prefix(region)

    def worker_flags(self, region: int, k: int) -> list[str]:
        """A ``spotswarm worker``'s flags for peer k of ``region``: where it listens and what it announces."""
        return ["--host", "0.0.0.0", "--announce-host", self.public[region], "--port", str(self.ports[region][k])]


def _relay_pairs(public: Sequence[str], backbone: Sequence[str], ports: Sequence[Sequence[int]],
                 region: int) -> list[str]:
    """The relays region ``region`` runs: one per peer port of every other region."""
    return [f"{public[s]}:{port}={backbone[s]}:{port}" for s in range(len(public)) if s != region
            for port in ports[s]]


@contextlib.contextmanager
def regions(peers_per_region: Sequence[int], *, link_mbit: float = 50.0, rtt_ms: float = 100.0,
            base_port: int = 47100, subnet: str = "10.213.0", public_prefix: str = "10.214") -> Iterator[Regions]:
    """Build the regions, yield them, always tear them down."""
    n = len(peers_per_region)
    if n < 1 or any(p < 0 or p > 99 for p in peers_per_region):
        raise ValueError(f"peers_per_region must hold 0..99 peers per region, got {list(peers_per_region)}")
    if rtt_ms < 0 or link_mbit <= 0:
        raise ValueError(f"rtt_ms must be >= 0 and link_mbit > 0, got {rtt_ms}, {link_mbit}")
    with netns_cluster(n, subnet=subnet, bandwidth_mbit=[link_mbit] * n) as fleet:
        public = [f"{public_prefix}.{r}.1" for r in range(n)]
        ports = [[base_port + 100 * r + k for k in range(count)] for r, count in enumerate(peers_per_region)]
        world = Regions(fleet, public, ports)
        try:
            for ns in fleet.namespaces:
                for address in public:  # its own (where its peers are) and the others' (where relays are)
                    _run(["ip", "-n", ns, "addr", "add", f"{address}/32", "dev", "lo"])
                _tbf("lo", LAN_MBIT, netns=ns)
            for r in range(n):
                pairs = _relay_pairs(public, fleet.ips, ports, r)
                if not pairs:
                    continue
                relay = subprocess.Popen([*fleet.exec_prefix(r), sys.executable, str(RELAY),
                                          "--delay", str(rtt_ms / 2000), *pairs],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                world.relays.append(relay)
                line = _readline(relay, READY_S)
                if line.strip() != "ready":
                    raise NetnsError(f"the relay of region {r} did not start: {line!r}")
            log.info("regions up: %s, %d Mbit/s and %.0f ms between them", public, link_mbit, rtt_ms)
            yield world
        finally:
            for relay in world.relays:
                with contextlib.suppress(OSError):
                    relay.stdin.close()
            for relay in world.relays:
                try:
                    relay.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    relay.kill()
                    relay.wait()


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    """One line of ``proc``'s stdout, or '' once ``timeout`` passed (it is then killed)."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            proc.kill()
            return ""
    return proc.stdout.readline()
