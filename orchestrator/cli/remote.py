"""A run watched and stopped from any machine with the archive's credentials, through its archive
(``checkpoint.uri``), with no inbound port on the head: the head publishes a status document every
few seconds, the run store's snapshot every half minute and its logs every five (``fleet/supervisor.py``), and
reads a stop request written there.  ``status``, ``report``, ``dashboard`` and ``logs`` read a
snapshot of it; ``down`` writes the request and waits for the head's answer."""

from __future__ import annotations

import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console

from orchestrator.config.checks import load_cluster_config
from orchestrator.config.schema import ClusterConfig
from orchestrator.runs.durable import ArchiveError, ArchiveMissing, RunArchive

HEAD_ANSWER_S = 60.0  # a head that has not begun stopping this long after the request is taken for gone
POLL_S = 1.0


class RunNotFound(RuntimeError):
    """TARGET names no run this machine has, nor one in its archive."""


def local_run(target: str) -> tuple[Path | None, ClusterConfig | None]:
    """TARGET's run directory where this machine has it, and TARGET's config where it is a cluster YAML."""
    path = Path(target)
    if path.is_dir():
        return path, None
    if not path.is_file():
        raise RunNotFound(f"{target}: no such run directory or cluster YAML")
    config = load_cluster_config(target)
    return (config.run_dir() if (config.run_dir() / "run.sqlite").exists() else None), config


def archive_of(config: ClusterConfig, target: str) -> RunArchive:
    from orchestrator.cli.launch import launches_head, with_archive
    from orchestrator.cli.refusals import NotStarted

    if launches_head(config, None):  # a launched head's archive: checkpoint.uri, else the default bucket
        try:
            config = with_archive(config)
        except NotStarted as e:
            raise RunNotFound(str(e)) from None
    archive = RunArchive.for_config(config)
    if archive is None:
        raise RunNotFound(f"{target}: no run at {config.run_dir()}, and no checkpoint.uri to read one from")
    return archive


@contextmanager
def run_view(target: str, console: Console) -> Iterator[tuple[Path, bool]]:
    """The run directory to read for TARGET, and whether it is the archive's: a run directory; a cluster
    YAML's own when this machine has it; else a snapshot of the run's archive in a temporary directory,
    after a line saying how old the head's last word is."""
    run_dir, config = local_run(target)
    if run_dir is not None:
        yield run_dir, False
        return
    assert config is not None
    archive = archive_of(config, target)
    with tempfile.TemporaryDirectory(prefix="spotswarm-view-") as tmp:
        view = Path(tmp) / config.cluster_name
        try:
            archive.snapshot(view)
        except ArchiveMissing as e:
            raise RunNotFound(f"no run at {config.run_dir()}, and none archived: {e}") from None
        console.print(published_line(archive.status(), archive.uri), soft_wrap=True)
        yield view, True


def published_line(doc: dict | None, uri: str) -> str:
    if doc is None:
        return f"from {uri}: the head has published no status yet (the run store's snapshot follows)"
    age = max(time.time() - float(doc.get("published_at", 0.0)), 0.0)
    return (f"from {uri}: the head ({doc.get('head', '?')}) published {age:.0f} s ago: {doc.get('state', '?')}, "
            f"epoch {doc.get('epoch', '?')}, {doc.get('live', '?')} instances live")


def down_through_archive(config: ClusterConfig, console: Console, answer_s: float = HEAD_ANSWER_S,
                         clock: Callable[[], float] = time.monotonic) -> bool:
    """Ask the run's head to stop cleanly through the archive, and wait for it.  True: it stopped, or no
    head ever published there; False: the archive cannot be read, or the head did not answer within
    ``answer_s`` (the caller then terminates what is tagged with the run)."""
    try:
        archive = archive_of(config, str(config.run_dir()))
        last = archive.status()
    except (ArchiveError, RunNotFound) as e:  # no bucket, no access: no head can be asked this way
        console.print(f"{config.cluster_name}: cannot ask a head through the archive: {e}", soft_wrap=True)
        return False
    if last is None:
        console.print(f"{config.cluster_name}: no head has published to {archive.uri}; nothing to ask",
                      soft_wrap=True)
        return True
    if last.get("state") in ("stopped", "detached"):
        console.print(f"{config.cluster_name}: its head said it {last['state']} "
                      f"{time.time() - float(last.get('published_at', 0.0)):.0f} s ago; nothing to ask", soft_wrap=True)
        return True
    asked = archive.request_stop(by=socket.gethostname())
    console.print(f"{config.cluster_name}: stop requested through {archive.uri}; waiting for the head", soft_wrap=True)
    began = clock()
    stopping_seen = False
    stop_bound = answer_s + 180.0 + config.checkpoint.final_timeout_s  # its final checkpoint, then releases
    while clock() - began < (stop_bound if stopping_seen else answer_s):
        doc = archive.status()
        fresh = doc is not None and float(doc.get("published_at", 0.0)) >= asked
        if fresh and doc.get("state") == "stopped":
            console.print(f"{config.cluster_name}: stopped by its head; every instance released, data kept",
                          soft_wrap=True)
            return True
        if fresh and doc.get("state") == "stopping" and not stopping_seen:
            stopping_seen = True
            console.print(f"{config.cluster_name}: the head is stopping (a final checkpoint, then every instance)",
                          soft_wrap=True)
        time.sleep(POLL_S)
    console.print(f"{config.cluster_name}: no answer from its head within "
                  f"{stop_bound if stopping_seen else answer_s:.0f} s", soft_wrap=True)
    return False


def logs(target: str, instance: str | None, console: Console) -> int:
    """The run's log files (``<run>/logs``, or the head's archived copies): their names, or one's text."""
    run_dir, config = local_run(target)
    if run_dir is not None:
        folder = run_dir / "logs"
        names = sorted(p.name for p in folder.glob("*.log"))
        read: Callable[[str], bytes | None] = lambda name: (folder / name).read_bytes() \
            if (folder / name).is_file() else None  # noqa: E731
    else:
        assert config is not None
        archive = archive_of(config, target)
        names = archive.logs()
        read = archive.read_log
        if instance is None:
            console.print(published_line(archive.status(), archive.uri), soft_wrap=True)
    if instance is None:
        for name in names:
            console.print(name)
        if not names:
            console.print("no log files")
        return 0
    name = instance if instance.endswith(".log") else f"{instance}.log"
    text = read(name)
    if text is None:
        raise RunNotFound(f"no log {name} (there are: {', '.join(names) or 'none'})")
    console.file.write(text.decode(errors="replace"))
    return 0
