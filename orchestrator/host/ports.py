"""A port on this machine that a server we start next may bind."""

from __future__ import annotations

import random
import socket

RAY_WORKER_PORTS_END = 19999  # Ray's worker processes take ports from 10002 up to here


def free_port() -> int:
    """A port that is free now and that no other process is handed before we bind it.

    ``bind(0)`` draws from the kernel's ephemeral range, as Ray's own processes do, so a port found
    that way was once taken by one of a Ray head's processes before ``ray start`` bound it (its client
    server then failed and took the whole head down).  Ports between Ray's worker ports and the
    ephemeral range are handed to nobody who does not ask for them by number.  (Where the ephemeral
    range leaves no such gap, ``bind(0)`` it is.)  Checked on every address: free on any one of them."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    low = RAY_WORKER_PORTS_END + 1
    for _ in range(200):
        port = random.randint(low, ephemeral_low - 1) if ephemeral_low > low + 1 else 0
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port between {low} and {ephemeral_low - 1}")
