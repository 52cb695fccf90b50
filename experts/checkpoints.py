"""Expert checkpoints in a directory: ``<dir>/<uid>.pt`` holds the module, optimizer and step counts.

Files are written to a temporary name and renamed, so a server killed mid-save leaves the previous
checkpoint intact.  Saving and loading run on the runtime thread (see ``ExpertServer``), never while
a batch of the same server is training.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from .backend import ExpertBackend

logger = logging.getLogger(__name__)


def checkpoint_path(directory: str | Path, uid: str) -> Path:
    return Path(directory) / f"{uid}.pt"


def save_experts(backends: Mapping[str, ExpertBackend], directory: str | Path) -> list[Path]:
    """Write every expert's checkpoint; returns the files written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for uid, backend in backends.items():
        path = checkpoint_path(directory, uid)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save(backend.state_dict(), tmp)
        os.replace(tmp, path)
        written.append(path)
    return written


def load_experts(backends: Mapping[str, ExpertBackend], directory: str | Path) -> list[str]:
    """Load the checkpoint of every expert that has one in ``directory``; returns their uids."""
    loaded = []
    for uid, backend in backends.items():
        path = checkpoint_path(directory, uid)
        if not path.exists():
            continue
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state.get("uid") != uid:
            raise ValueError(f"{path} holds expert {state.get('uid')!r}, not {uid!r}")
        backend.load_state_dict(state)
        loaded.append(uid)
    if loaded:
        logger.info("loaded %d expert checkpoints from %s", len(loaded), directory)
    return loaded
