"""``spotswarm worker``: run one training peer, its settings from ``FLAGS`` (a YAML file and/or flags).

SIGTERM (what the orchestrator sends on a preemption notice) and SIGINT make the peer leave
gracefully; a second signal exits at once.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import Any

from orchestrator.config.loader import ModelFlags
from p2p import P2PError
from p2p.devices import pick_device
from workers.worker_config import WorkerConfig

logger = logging.getLogger("spotswarm.worker")

FLAGS = ModelFlags(WorkerConfig, spellings={"identity_path": "--identity"})  # as the command line always said


def run(config: WorkerConfig) -> int:
    from workers.peer import TrainingPeer  # torch's import (seconds) only once the settings are valid

    try:
        pick_device(config.device)  # a GPU asked for and missing: said before anything starts
    except ValueError as e:
        print(f"spotswarm worker: {e}", file=sys.stderr)
        return 2
    try:
        peer = TrainingPeer(config)
    except P2PError as e:
        print(f"spotswarm worker: cannot join the run: {e}", file=sys.stderr)
        return 1
    print(f"worker {peer.dht.peer_id} listening at {peer.address or '(client mode)'}", flush=True)
    leaving = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        if leaving.is_set():
            raise SystemExit(1)
        leaving.set()
        logger.info("received %s: leaving gracefully", signal.Signals(signum).name)
        peer._stop.set()  # the loop stops after its current step; leaving happens below

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        peer.run()
    finally:
        peer.prepare_to_leave(deadline=config.averaging_timeout)
    traffic = sorted(peer.dht.node.p2p.traffic.by_method.items(), key=lambda kv: -kv[1].bytes_out)
    logger.info("left at epoch %d; sent %s", peer.epoch,
                ", ".join(f"{method or 'handshakes'} {t.bytes_out / 1e6:.2f} MB" for method, t in traffic[:6]))
    return 0
