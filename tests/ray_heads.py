"""Ray heads started the way a head machine starts one (``ray start --head``), in sessions of their
own: the tests of a cluster that outlives its command, and the one head that the test modules
using ``ray_session`` share."""

from __future__ import annotations

import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.providers.bootstrap import ray_auth_token

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A port that is free now and that no other process is handed before we bind it: ``bind(0)``
    draws from the kernel's ephemeral range, as Ray's own processes do, so a port found that way
    was once taken by one of the head's processes before ``ray start`` bound it (its client server
    then failed and took the whole head down).  Ports between Ray's worker ports (10002-19999) and
    the ephemeral range are handed to nobody who does not ask for them by number."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    for _ in range(200):
        port = random.randint(20000, ephemeral_low - 1) if ephemeral_low > 20001 else 0
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port between 20000 and {ephemeral_low - 1}")


def ensure_machine_token(env: dict[str, str]) -> None:
    """Make the machine's Ray token where token authentication is on and there is none yet: a local
    ``ray.init`` makes it, ``ray start`` does not."""
    if env.get("RAY_AUTH_MODE", "").lower() == "token" and ray_auth_token() is None:
        ray = Path(sys.executable).with_name("ray")
        subprocess.run([str(ray), "get-auth-token", "--generate"], env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=True, timeout=60)


def kill_session(leader: int) -> None:
    """SIGKILL every process of a session (a machine's power cut: Ray gives workers their own groups)."""
    import psutil

    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == leader:
                proc.send_signal(signal.SIGKILL)
        except (OSError, psutil.Error):
            continue


class RayHead:
    """``ray start --head`` with its own temp dir, in a session of its own: with token authentication
    and a token of its own, or with ``own_token=False`` this process's Ray settings (see
    ``conftest.py``: the machine's token), so that this process connects as to a local ``ray.init``."""

    def __init__(self, name: str, log: Path, num_cpus: int = 1, own_token: bool = True) -> None:
        self.temp = Path(f"/tmp/ssw-{name}-{os.getpid()}")  # short: Ray's socket paths must fit in 107 bytes
        self.env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.env.pop("RAY_ADDRESS", None)
        ray = Path(sys.executable).with_name("ray")
        if own_token:
            self.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
        else:
            ensure_machine_token(self.env)
        self.log = log
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [str(ray), "start", "--head", "--port", str(free_port()), "--num-cpus", str(num_cpus),
                 "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", str(self.temp),
                 "--ray-client-server-port", str(free_port()), "--block"],
                env=self.env, stdout=out, stderr=out, start_new_session=True)
        address_file = self.temp / "ray_current_cluster"
        deadline = time.monotonic() + 60
        while not address_file.exists():
            assert time.monotonic() < deadline and self.process.poll() is None, f"the Ray head did not start: {log}"
            time.sleep(0.1)  # polling for the head to write its address, bounded
        self.address = address_file.read_text().strip()

    def alive(self) -> bool:
        """True while the head runs; an AssertionError with its log's end once it exited (a wait on
        the cluster then fails at once, saying why, instead of at its timeout)."""
        if self.process.poll() is None:
            return True
        raise AssertionError(f"the Ray head exited ({self.process.returncode}):\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        kill_session(self.process.pid)
        self.process.wait(timeout=30)

    def cleanup(self) -> None:
        if self.process.poll() is None:
            self.kill()
        subprocess.run(["rm", "-rf", str(self.temp)], check=False)
