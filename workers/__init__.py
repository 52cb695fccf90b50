"""workers: one training peer — a task, the DeDLOC collaborative optimizer, DiLoCo, Moshpit SGD, state
hand-off to newcomers and graceful leave on a preemption notice — and the expert host, the
expert-server role of a mixture-of-experts run.

Names are imported on first use: the orchestrator reads ``workers.worker_config`` to check a config,
and that must not cost torch's import (seconds) to every command."""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {"CollaborativeOptimizer": ".collaborative", "DiLoCoOptimizer": ".diloco", "ExpertGridSpec": ".expert_host",
          "ExpertHost": ".expert_host",
          "ExpertHostConfig": ".expert_host", "HandOff": ".expert_host", "MoshpitSGD": ".moshpit_sgd",
          "TrainingPeer": ".peer", "Task": ".task", "load_task": ".task", "WorkerConfig": ".worker_config"}

__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value
