"""The faults a chaos run injects into a local ``nodes``-mode run, one function each, and where each
one lands (the phase its target was in).  Targets are found the way an operator would: the run's
node records (``<run_dir>/nodes/<id>.json``), the processes of each node's session, and the worker
and supervisor actors by name."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from orchestrator.chaos import disk as chaos_disk
from orchestrator.host.processes import signal_session
from orchestrator.instance.actor import worker_actor_name
from orchestrator.sim.nodes import node_alive, worker_pids

logger = logging.getLogger(__name__)

SLOW_LINK_BYTES_PER_S = 125_000  # 1 Mbit/s
ASK_TIMEOUT_S = 2.0  # a target that does not answer this fast is asked no more (a paused one never would)


@dataclass
class Fault:
    """One injected fault, as the report shows it."""

    time: float  # wall-clock seconds (the run store's clock: chaos runs use time_scale 1)
    kind: str
    target: str
    phase: str
    duration_s: float | None = None  # faults that last: a pause, a slow link, a full disk
    detail: str = ""
    outcome: str = "injected"  # or "skipped: <why>"


@dataclass(frozen=True)
class Node:
    """A live instance of the run: its id, its node's session leader, its network namespace."""

    instance_id: str
    leader: int
    namespace: str | None


def live_nodes(run_dir: Path) -> list[Node]:
    """The run's instances whose node still runs, from the simulated cloud's own inventory."""
    nodes = []
    for path in sorted((Path(run_dir) / "nodes").glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):  # being replaced right now
            continue
        if node_alive(record["leader"]):
            nodes.append(Node(record["id"], record["leader"], record.get("namespace")))
    return nodes


def worker_status(instance_id: str) -> dict | None:
    """The worker's status (phase, epoch, pid), or None when it does not answer in time."""
    try:
        actor = ray.get_actor(worker_actor_name(instance_id))
        return ray.get(actor.status.remote(), timeout=ASK_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - gone, booting or paused: not a target now
        return None


def worker_pid(node: Node) -> int | None:
    pids = worker_pids(node.leader)
    return pids[0] if len(pids) == 1 else None


def kill_worker(node: Node) -> str:
    pid = worker_pid(node)
    if pid is None:
        raise FaultSkipped("no single worker process on the node")
    os.kill(pid, signal.SIGKILL)
    return f"SIGKILL of the worker process {pid}"


def kill_whole_node(node: Node) -> str:
    signal_session(node.leader, signal.SIGKILL)
    return f"SIGKILL of every process of the node's session {node.leader}"


def pause_worker(node: Node) -> tuple[str, int]:
    pid = worker_pid(node)
    if pid is None:
        raise FaultSkipped("no single worker process on the node")
    os.kill(pid, signal.SIGSTOP)
    return f"SIGSTOP of the worker process {pid}", pid


def resume_worker(pid: int) -> None:
    with suppress(ProcessLookupError):  # killed meanwhile by another fault
        os.kill(pid, signal.SIGCONT)


def _tc(namespace: str, *args: str) -> str:
    proc = subprocess.run(["ip", "netns", "exec", namespace, "tc", *args], capture_output=True, text=True,
                          timeout=15, check=False)
    if proc.returncode != 0:
        raise FaultSkipped(f"tc in {namespace}: {proc.stderr.strip()}")
    return proc.stdout


# a link without shaping of its own: the fault's tbf is simply deleted after it
_UNSHAPED = frozenset({"noqueue", "pfifo_fast", "pfifo", "fq_codel", "fq", "mq"})


def _root_qdisc(namespace: str) -> dict:
    try:
        found = json.loads(_tc(namespace, "-j", "qdisc", "show", "dev", "eth0", "root") or "[]")
    except ValueError:
        found = []
    return found[0] if found and isinstance(found[0], dict) else {}


@dataclass
class SlowLink:
    """A slowed link and how to give it back as it was."""

    node: Node
    detail: str
    shaped_before: dict | None = None  # the namespace link's own tbf (its options), put back afterwards

    def restore(self) -> None:
        node = self.node
        try:
            if not node.namespace:
                _call_worker(node.instance_id, "throttle", None)
            elif self.shaped_before is None:
                _tc(node.namespace, "qdisc", "del", "dev", "eth0", "root")
            else:
                o = self.shaped_before
                _tc(node.namespace, "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", f"{o['rate'] * 8}bit",
                    "burst", f"{o['burst']}b", "latency", f"{o['lat']}us")
        except FaultSkipped as e:  # the node died meanwhile: nothing left to restore
            logger.info("link of %s not restored: %s", node.instance_id, e)


def slow_link(node: Node) -> SlowLink:
    """1 Mbit/s: tc on the namespace's link where the node has one, else the peer's own throttle.
    A namespace link shaped by other means than a tbf is left alone (skipped): replacing its root
    qdisc would lose that shaping for good."""
    if not node.namespace:
        _call_worker(node.instance_id, "throttle", SLOW_LINK_BYTES_PER_S)
        return SlowLink(node, "the peer's own throttle at 1 Mbit/s (send and receive): no network namespace")
    before = _root_qdisc(node.namespace)
    kind = before.get("kind", "noqueue")
    options = before.get("options") or {}
    if kind not in _UNSHAPED and not (kind == "tbf" and {"rate", "burst", "lat"} <= set(options)):
        raise FaultSkipped(f"eth0 of namespace {node.namespace} is shaped by a {kind} qdisc, which this fault "
                           "would replace")
    _tc(node.namespace, "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", "1mbit", "burst", "32kbit",
        "latency", "400ms")
    return SlowLink(node, f"tc tbf 1 Mbit/s on eth0 of namespace {node.namespace} (upload)",
                    options if kind == "tbf" else None)


def jump_clock(node: Node, seconds: float) -> str:
    _call_worker(node.instance_id, "jump_clock", seconds)
    return f"the peer's wall clock stepped {seconds:+.0f} s"


def _call_worker(instance_id: str, method: str, *args: Any) -> None:
    try:
        actor = ray.get_actor(worker_actor_name(instance_id))
        ray.get(getattr(actor, method).remote(*args), timeout=10)
    except Exception as e:  # noqa: BLE001 - the worker died or hangs: the fault did not land
        raise FaultSkipped(f"the worker did not take it: {type(e).__name__}: {str(e)[:200]}") from None


def fill_disk(run_dir: Path) -> str:
    taken = chaos_disk.fill(run_dir)
    return f"the run directory's disk filled ({taken / 2**20:.0f} MiB taken)"


def free_disk(run_dir: Path) -> None:
    chaos_disk.unfill(run_dir)


class FaultSkipped(Exception):
    """The fault could not be injected now (no target, nothing to act on); the report says why."""
