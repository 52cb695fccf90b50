"""A run directory on a small disk of its own, and that disk filled up on demand: the full-disk fault
of a chaos run.  A tmpfs is the small disk (it needs root); its contents are copied back to the real
disk when it is unmounted, so the run's data outlives the fault injection."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

FILLER = ".chaos-fill"
_CHUNK = 1 << 20


def unavailable() -> str | None:
    """Why a small disk cannot be mounted here (None: it can)."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "no mount/umount command"
    return None


def _run(*args: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode != 0:
        raise OSError(f"{' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()}")


@contextlib.contextmanager
def small_disk(path: Path, size_mb: int) -> Iterator[Path]:
    """``path`` (created if missing, kept as it is) on a tmpfs of ``size_mb`` MiB while the block runs;
    afterwards what the block wrote there is on the real disk under the same path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    saved = Path(tempfile.mkdtemp(prefix=".ssw-disk-", dir=path.parent))
    try:
        shutil.copytree(path, saved, dirs_exist_ok=True)  # whatever was there before
        _run("mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755", "tmpfs", str(path))
        try:
            shutil.copytree(saved, path, dirs_exist_ok=True)
            yield path
        finally:
            unfill(path)
            shutil.rmtree(saved)
            shutil.copytree(path, saved, symlinks=True)
            _unmount(path)
            shutil.copytree(saved, path, symlinks=True, dirs_exist_ok=True)
    finally:
        shutil.rmtree(saved, ignore_errors=True)


def _unmount(path: Path) -> None:
    """Unmount, lazily when something still holds a file open there (it keeps its view of the tmpfs)."""
    try:
        _run("umount", str(path))
    except OSError as e:
        logger.warning("%s; unmounting lazily", e)
        _run("umount", "-l", str(path))


def fill(path: Path) -> int:
    """Take every free byte of ``path``'s filesystem (a file of its own); the bytes taken."""
    taken, size = 0, _CHUNK
    with open(Path(path) / FILLER, "ab", buffering=0) as f:
        while size:
            try:
                taken += f.write(b"\0" * size)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                size //= 16  # the last few pages, in smaller pieces
    return taken


def unfill(path: Path) -> None:
    (Path(path) / FILLER).unlink(missing_ok=True)
