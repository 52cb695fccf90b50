"""A Ray head started the way a head machine starts one (``ray start --head --block``), in a session of
its own so that it outlives nothing and is stopped whole: its raylet, its GCS and every worker."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

from orchestrator.host.ports import free_port
from orchestrator.host.processes import kill_session, kill_tree, tree
from orchestrator.host.wait import wait_for

logger = logging.getLogger(__name__)


class RayHead:
    """Started (not waited for) on construction: the caller may do other work while it boots, and
    record its session (``pid``) first, so that a head whose starter dies can still be found.

    Its ports come from ``free_port`` (never ``bind(0)``: see there), its temp dir is the caller's
    (short: Ray's socket paths must fit in 107 bytes), and ``env`` is all of its environment: token
    authentication and health-check settings are the caller's to choose.  ``new_session``: False on a
    head machine, whose boot script's session is the machine (its end ends the head too)."""

    def __init__(self, temp_dir: Path, log_path: Path, env: dict[str, str], num_cpus: int = 1,
                 node_ip: str | None = None, new_session: bool = True) -> None:
        self.temp_dir, self.log_path, self.env = Path(temp_dir), Path(log_path), env
        self.new_session = new_session
        self.address: str | None = None
        ray = Path(sys.executable).with_name("ray")
        command = [str(ray), "start", "--head", f"--port={free_port()}", f"--num-cpus={num_cpus}",
                   "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={self.temp_dir}",
                   f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
                   "--block"]
        if node_ip is not None:
            command.insert(3, f"--node-ip-address={node_ip}")
        with open(self.log_path, "wb") as out:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                            env=env, start_new_session=new_session)

    @property
    def pid(self) -> int:
        """The head's session id (its ``ray start``'s pid)."""
        return self.process.pid

    def wait_ready(self, timeout: float = 60.0) -> str:
        """Its address, once ``ray start`` wrote it (after the runtime started); a RuntimeError with the
        end of its log at once if it exits first, a TimeoutError past ``timeout``."""
        address_file = self.temp_dir / "ray_current_cluster"

        def address() -> str:
            self.alive()
            return address_file.read_text().strip() if address_file.exists() else ""

        self.address = wait_for(address, timeout, f"the Ray head to start (log: {self.log_path})", every=0.1)
        return self.address

    def alive(self) -> bool:
        """True while the head runs; a RuntimeError with its log's end once it exited (a wait on the
        cluster then fails at once, saying why, instead of at its timeout)."""
        if self.process.poll() is None:
            return True
        try:
            log = self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            log = "(no log)"
        raise RuntimeError(f"the Ray head exited ({self.process.returncode}):\n{log}")

    def stop(self, grace_s: float = 0.0) -> None:
        """Every process of its session (or, sharing its caller's, of its tree): SIGTERM and ``grace_s``
        seconds first, or (0) SIGKILL at once, as a head machine's power cut."""
        if self.new_session:
            kill_session(self.pid, grace_s)
        else:  # its tree as it is now: a process whose parent dies first leaves the tree, not the remembered list
            kill_tree(self.pid, tree(self.pid), grace_s=grace_s)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.warning("ray start --head (pid %d) did not exit after its session was killed", self.pid)

    def close(self) -> None:
        """Stopped, and its temp dir removed."""
        self.stop()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
