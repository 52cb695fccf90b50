"""Where a run's processes log: ``<run dir>/logs/<name>.log`` (the supervisor's ``supervisor.log``,
each instance's worker or expert server ``<instance id>.log``), rotated and size-capped.

Ray keeps an actor's stdout and stderr in its own session directory, which goes with the session;
so each of the run's processes also logs into the run directory, where ``spotswarm check`` reads it.
"""

from __future__ import annotations

import logging
import logging.handlers
import sys
import threading
from pathlib import Path
from types import TracebackType

LOG_DIR = "logs"
SUPERVISOR_LOG = "supervisor"
# what Ray prints on the console of the process that drives the run (its notices, its paragraphs for a
# node that died, with the end of the raylet's own log): kept, and not scanned for the run's errors
RAY_DRIVER_LOG = "ray-driver"
MAX_BYTES = 10 * 2**20  # per file; with the backups a process keeps at most 30 MiB of log
BACKUPS = 2
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_uncaught = logging.getLogger("spotswarm.uncaught")


def log_dir(run_dir: Path) -> Path:
    return Path(run_dir) / LOG_DIR


def log_path(run_dir: Path, name: str) -> Path:
    """The log of ``name`` (an instance id, or ``supervisor``) in the run directory."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"a log name is a plain file name, not {name!r}")
    return log_dir(run_dir) / f"{name}.log"


def log_files(run_dir: Path, name: str) -> list[Path]:
    """The log of ``name`` and its rotated predecessors that exist, newest first."""
    first = log_path(run_dir, name)
    return [p for p in (first, *(first.with_name(f"{first.name}.{i}") for i in range(1, BACKUPS + 1)))
            if p.exists()]


def log_to_file(path: Path, catch_uncaught: bool = False) -> logging.Handler:
    """Send this process's log records (root logger) to ``path`` as well, rotated at ``MAX_BYTES``.
    ``catch_uncaught``: exceptions nobody caught (in any thread) are logged there too, with their
    traceback, instead of going only to a stderr that Ray keeps elsewhere.  For a process of its own
    (a worker), not for one that shares its hooks (a test runner)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = _QuietRotatingFileHandler(path, maxBytes=MAX_BYTES, backupCount=BACKUPS, delay=False)
    handler.setFormatter(logging.Formatter(FORMAT))
    logging.getLogger().addHandler(handler)
    if catch_uncaught:
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread
    return handler


class _QuietRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """A record that cannot be written (the disk is full) is dropped: logging's default prints a
    traceback to stderr for each one, which would read as the run's own failure."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        pass


def stop_logging(handler: logging.Handler | None) -> None:
    if handler is None:
        return
    logging.getLogger().removeHandler(handler)
    handler.close()


def _log_uncaught(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    _uncaught.error("uncaught exception", exc_info=(kind, value, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    _uncaught.error("uncaught exception in thread %s", name,
                    exc_info=(args.exc_type, args.exc_value, args.exc_traceback))  # type: ignore[arg-type]
