"""What ``up`` and ``resume`` refuse with: one message, exit 2, nothing created or launched."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from orchestrator.runs.durable import RunArchive


class NotStarted(RuntimeError):
    """``up`` or ``resume`` refused before anything was created or launched."""


class ResumeError(NotStarted):
    """``resume``'s TARGET names no run this machine has or can restore; nothing was started."""


def refuse_archived_run(archive: RunArchive, name: str, config_path: str, fresh: bool, console: Console) -> None:
    """A new run over an archive that holds one would mix their checkpoints (the older run's later epochs
    would outlive the new run's and be what a resume restores): refused, naming ``resume`` and ``--fresh``;
    with ``fresh``, the archived run is deleted first."""
    if not archive.has_history():
        return
    if not fresh:
        raise NotStarted(f"{archive.uri} already holds an archived run of {name}: `spotswarm resume {config_path}` "
                         f"continues it; `spotswarm up {config_path} --fresh` deletes it and starts over")
    archive.clear()
    console.print(f"deleted the archived run at {archive.uri} (--fresh)", soft_wrap=True)
