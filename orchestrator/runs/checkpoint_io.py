"""A checkpoint's tensors read and written with torch: written atomically, read as tensors and plain
containers only (``weights_only``), so a file from an object store or a shared disk runs no code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from orchestrator.runs.checkpoints import checkpoint_path


def write_checkpoint(directory: Path, epoch: int, state: Any) -> Path:
    """``state`` written atomically as the checkpoint of ``epoch``; its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(directory, epoch)
    tmp = path.with_suffix(".tmp")
    try:
        torch.save({"epoch": epoch, "state": state}, tmp)
        tmp.replace(path)  # atomic: a crash never leaves a half-written checkpoint behind
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk's partial file would keep it full
        raise
    return path


def read_checkpoint(path: Path) -> tuple[int, Any]:
    """A checkpoint's (epoch, state).  ValueError says why a file is refused."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
        return int(data["epoch"]), data["state"]
    except Exception as e:  # noqa: BLE001 - unpickling refuses in many ways, each a bad file
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"checkpoint {path} cannot be read as tensors and plain values "
                         f"({type(e).__name__}: {first[:300]})") from None
