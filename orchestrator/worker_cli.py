"""``spotswarm worker``: run one training peer from a YAML config and/or flags.

SIGTERM (what the orchestrator sends on a preemption notice) and SIGINT make the peer leave
gracefully; a second signal exits at once.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import pydantic
import yaml

from p2p import P2PError
from workers.peer import TrainingPeer, WorkerConfig

logger = logging.getLogger("spotswarm.worker")


def load_config(path: str | None, overrides: dict[str, Any]) -> WorkerConfig:
    data: dict[str, Any] = {}
    if path:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a worker config must be a mapping")
        data.update(raw)
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return WorkerConfig.model_validate(data)
    except pydantic.ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ValueError(f"invalid worker config{' in ' + path if path else ''}: {problems}") from None


def run_worker(path: str | None, overrides: dict[str, Any]) -> int:
    try:
        config = load_config(path, overrides)
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
    logger.info("left at epoch %d", peer.epoch)
    return 0
