"""Durable run state in object storage: a run whose head machine vanishes (a spot head, a lost disk)
can be resumed anywhere from ``checkpoint.uri``.

Layout under ``checkpoint.uri`` (``s3://bucket/prefix``, ``gs://bucket/prefix`` or a directory):
``history/run.sqlite`` (a consistent snapshot of the run store), ``history/config.yaml``,
``checkpoints/<name>`` (the newest ``checkpoint.keep``) and, for a mixture-of-experts run,
``experts/<uid>.pt`` (each expert's newest state), ``logs/<name>.log``, ``live/status.json`` (what
the head publishes every few seconds), ``control/stop.json`` (a stop asked for from elsewhere) and,
for a head that ``spotswarm up`` launched, ``launch/launch.json`` (the config and the command) and
``launch/authority.key`` (the run's membership key), which its boot takes from here.
The local run directory stays the working copy; the archive is what survives the machine, and what
another machine watches and stops the run through.  Every store goes through one interface, fsspec: s3fs for
S3 (the extra ``spotswarm[aws]``), gcsfs for Cloud Storage (``spotswarm[gcp]``), imported only when
an archive of theirs is used.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import tenacity

from orchestrator.providers.base import CLOUD_BACKOFF
from orchestrator.runs.store import RunStore

if TYPE_CHECKING:
    from orchestrator.config.schema import ClusterConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

HISTORY_FILES = ("config.yaml", "run.sqlite")  # run.sqlite last: its presence marks a complete archive
STATUS_DOC = "live/status.json"  # what the head publishes every few seconds
STOP_DOC = "control/stop.json"  # a stop asked for from another machine
LAUNCH_DOC = "launch/launch.json"  # what a launched head runs: the config, up or resume, the duration
KEY_DOC = "launch/authority.key"  # the run's authority key, for a launched head
# where a store's own client has retried already, these still get ours: a connection dropped or timed out
# (s3fs: SlowDown and 503 are EBUSY, 500 EREMOTEIO)
TRANSIENT_ERRNOS = {errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EBUSY,
                    errno.EAGAIN, errno.EREMOTEIO}
STORES = {"s3": ("s3fs", "aws", "S3"), "gs": ("gcsfs", "gcp", "Cloud Storage")}
_EPOCH_NAME = re.compile(r"epoch-(\d+)\.pt$")


class ArchiveError(RuntimeError):
    """The store refused or failed for good (missing bucket, access denied, retries spent); names the URI."""


class ArchiveMissing(ArchiveError):
    """The bucket is there but holds no archived run under the prefix."""


def split_uri(uri: str) -> tuple[str, str, str]:
    """``s3://bucket/some/prefix`` -> ``("s3", "bucket", "some/prefix")``; a local path -> ``("file", "",
    its absolute path)``."""
    match = re.fullmatch(r"([a-z0-9]+)://([^/]*)/?(.*)", uri)
    if match is None:
        return "file", "", str(Path(uri).expanduser().resolve())
    scheme, bucket, prefix = match.groups()
    if scheme == "file":
        return "file", "", str(Path("/" + "/".join(p for p in (bucket, prefix) if p)).resolve())
    if scheme not in STORES or not bucket:
        raise ValueError(f"{uri!r} is not an archive URI: s3://bucket[/prefix], gs://bucket[/prefix] or a path")
    return scheme, bucket, prefix.strip("/")


def _json_doc(raw: bytes | None) -> dict | None:
    try:
        doc = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def checkpoint_epoch(name: str) -> int | None:
    """The epoch in a checkpoint file name the supervisor writes (``epoch-000042.pt``)."""
    match = _EPOCH_NAME.search(name)
    return int(match.group(1)) if match else None


def _newest_first(names: list[str]) -> list[str]:
    return sorted(names, key=lambda n: (checkpoint_epoch(n) if checkpoint_epoch(n) is not None else -1, n),
                  reverse=True)


def is_transient(error: BaseException) -> bool:
    """Worth another try: a connection dropped, refused or timed out, a store asking to slow down."""
    if isinstance(error, ConnectionError | TimeoutError):
        return True
    return isinstance(error, OSError) and error.errno in TRANSIENT_ERRNOS


def open_filesystem(uri: str, endpoint_url: str | None = None) -> Any:
    """The fsspec filesystem of ``uri``'s store.  ``endpoint_url``: an S3-compatible endpoint (moto,
    MinIO), or for ``gs://`` a Cloud Storage emulator, spoken to without credentials."""
    scheme, _, _ = split_uri(uri)
    if scheme == "file":
        from fsspec.implementations.local import LocalFileSystem

        return LocalFileSystem(auto_mkdir=True)
    module, extra, _ = STORES[scheme]
    try:
        __import__(module)
    except ImportError as e:
        raise ArchiveError(f"checkpoint.uri {uri} needs {module}: pip install 'spotswarm[{extra}]'") from e
    if scheme == "s3":
        import s3fs

        # listings are read fresh each time: another head may have written since
        return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False,
                                 client_kwargs={"endpoint_url": endpoint_url} if endpoint_url else {},
                                 config_kwargs={"connect_timeout": 10, "read_timeout": 60})
    # gcsfs's JSON-API filesystem: the archive is flat objects, and its newer default also asks a gRPC
    # control plane about each bucket's layout first (a minute per call where none answers: an emulator)
    from gcsfs.core import GCSFileSystem

    emulator = endpoint_url or os.environ.get("STORAGE_EMULATOR_HOST")
    options: dict[str, Any] = {"endpoint_url": emulator, "token": "anon"} if emulator else {}
    return GCSFileSystem(skip_instance_cache=True, cache_timeout=0, **options)


class RunArchive:
    """A run's history and newest checkpoints in S3, Cloud Storage or a directory."""

    def __init__(self, uri: str, endpoint_url: str | None = None, keep: int = 3, fs: Any = None,
                 attempts: int = 5, wait: tenacity.wait.wait_base | None = None) -> None:
        self.uri = uri.rstrip("/")
        self.scheme, self.bucket, prefix = split_uri(self.uri)
        self.root = "/".join(p for p in (self.bucket, prefix) if p) if self.scheme != "file" else prefix
        self.store = STORES[self.scheme][2] if self.scheme in STORES else "the archive directory"
        self.keep = keep
        self.fs = fs if fs is not None else open_filesystem(self.uri, endpoint_url)
        self.attempts = attempts
        self.wait = wait if wait is not None else CLOUD_BACKOFF
        self._log_marks: dict[str, tuple[int, int]] = {}  # log file -> (size, mtime) last uploaded

    @classmethod
    def for_config(cls, config: ClusterConfig) -> RunArchive | None:
        """The run's archive, or None when the config names no ``checkpoint.uri``."""
        checkpoint = config.checkpoint
        if not checkpoint.uri:
            return None
        return cls(checkpoint.uri, endpoint_url=checkpoint.endpoint_url, keep=checkpoint.keep)

    # ---- store calls ---------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return "/".join(p for p in (self.root, *parts) if p)

    def _call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """One store call, retried through transient failures; anything else is an ArchiveError."""
        retrying = tenacity.Retrying(retry=tenacity.retry_if_exception(is_transient), wait=self.wait,
                                     stop=tenacity.stop_after_attempt(self.attempts), reraise=True)
        try:
            return retrying(fn, *args, **kwargs)
        except ArchiveError:
            raise
        except Exception as e:
            raise self._explain(what, e) from e

    def _explain(self, what: str, error: Exception) -> ArchiveError:
        if isinstance(error, FileNotFoundError) and self.bucket and not self._bucket_exists():
            return ArchiveError(f"{self.uri}: the bucket {self.bucket!r} does not exist ({what})")
        if isinstance(error, PermissionError):
            return ArchiveError(f"{self.uri}: access denied ({what}); check the credentials and the bucket's "
                                "permissions")
        if is_transient(error):
            return ArchiveError(f"{self.uri}: {self.store} still failing after {self.attempts} attempts ({what}): "
                                f"{error}")
        return ArchiveError(f"{self.uri}: {what} failed: {type(error).__name__}: {error}")

    def clear(self) -> None:
        """Delete the archived run under the prefix: its history, checkpoints, experts, logs and documents."""
        for folder in ("history", "checkpoints", "experts", "logs", "live", "control", "launch"):
            if self._call(f"looking for {folder}/", self.fs.exists, self.path(folder)):
                self._call(f"deleting {folder}/", self.fs.rm, self.path(folder), recursive=True)

    def gcs_project_number(self) -> str:
        """The number of the Google Cloud project that owns this ``gs://`` archive's bucket."""
        if self.scheme != "gs":
            raise ValueError(f"{self.uri} is not a Cloud Storage archive")
        found = self._call(f"reading the bucket {self.bucket}'s metadata", self.fs.call, "GET", "b/{}", self.bucket,
                           json_out=True)
        return str(found.get("projectNumber", ""))

    def ensure_bucket(self, region: str | None = None) -> bool:
        """Create the bucket where there is none (in ``region``, for S3); whether it was created."""
        if self.scheme == "file" or self._bucket_exists():
            return False
        # S3 takes a location constraint for every region but us-east-1, where one is refused
        options = {"region_name": region} if self.scheme == "s3" and region and region != "us-east-1" else {}
        self._call(f"creating the bucket {self.bucket}", self.fs.mkdir, self.bucket, create_parents=True, **options)
        return True

    def _bucket_exists(self) -> bool:
        try:
            return bool(self.fs.exists(self.bucket))
        except Exception:  # noqa: BLE001 - a store that cannot say: the original error stands
            return True

    def _list(self, folder: str) -> list[str]:
        """Names of the objects directly under ``<root>/<folder>/``."""
        base = self.path(folder)

        def names() -> list[str]:
            try:
                found = self.fs.ls(base, detail=True)
            except FileNotFoundError:  # no such folder yet (a missing bucket is told apart by _explain)
                if self.bucket and not self._bucket_exists():
                    raise
                return []
            return [Path(e["name"]).name for e in found if e.get("type") == "file"]

        return self._call(f"listing {base}/", names)

    def _upload(self, path: Path, target: str) -> None:
        self._call(f"uploading {path.name}", self.fs.put_file, str(path), target)

    def _download(self, source: str, path: Path) -> None:
        """Into a side file first: a broken download never looks like a restored file."""
        part = path.with_name(path.name + ".download")
        self._call(f"downloading {source}", self.fs.get_file, source, str(part))
        part.replace(path)

    def write_bytes(self, name: str, data: bytes) -> None:
        """A small document (``name``: a path under the archive's root)."""
        self._call(f"writing {name}", self.fs.pipe_file, self.path(name), data)

    def read_bytes(self, name: str) -> bytes | None:
        """A small document, or None where there is none."""
        def read() -> bytes | None:
            try:
                return self.fs.cat_file(self.path(name))
            except FileNotFoundError:
                if self.bucket and not self._bucket_exists():
                    raise
                return None

        return self._call(f"reading {name}", read)

    # ---- a run watched and stopped through its archive -------------------------------------------
    def status(self) -> dict | None:
        """The status document the head publishes every few seconds (None: none yet, or unreadable)."""
        return _json_doc(self.read_bytes(STATUS_DOC))

    def request_stop(self, by: str) -> float:
        """Ask the run's head to stop cleanly; returns when the request was made (wall clock)."""
        at = time.time()
        self.write_bytes(STOP_DOC, json.dumps({"at": at, "by": by}).encode())
        return at

    def stop_request(self) -> dict | None:
        return _json_doc(self.read_bytes(STOP_DOC))

    # ---- a head launched from elsewhere -----------------------------------------------------------
    def write_launch(self, launch: dict, authority_key: bytes) -> None:
        """What a head launched by ``spotswarm up`` takes at boot: the key first, so that a launch document
        is never there without its key."""
        self.write_bytes(KEY_DOC, authority_key)
        self.write_bytes(LAUNCH_DOC, json.dumps(launch).encode())

    def launch(self) -> dict:
        """The launch document; ArchiveMissing where there is none."""
        doc = _json_doc(self.read_bytes(LAUNCH_DOC))
        if doc is None:
            raise ArchiveMissing(f"{self.uri}: no launch there (no {self.path(LAUNCH_DOC)})")
        return doc

    def authority_key(self) -> bytes | None:
        return self.read_bytes(KEY_DOC)

    def save_logs(self, directory: Path) -> None:
        """Upload the run's log files that changed since their last upload (``logs/<name>``)."""
        for path in sorted(Path(directory).glob("*.log")):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            if self._log_marks.get(path.name) != (stat.st_size, stat.st_mtime_ns):
                self._upload(path, self.path("logs", path.name))
                self._log_marks[path.name] = (stat.st_size, stat.st_mtime_ns)

    def logs(self) -> list[str]:
        return sorted(self._list("logs"))

    def read_log(self, name: str) -> bytes | None:
        return self.read_bytes(f"logs/{name}")

    def snapshot(self, run_dir: Path) -> None:
        """The archived history (run store and config) into ``run_dir``, to read: no checkpoint, nothing
        relocated; raises ArchiveMissing where nothing was archived."""
        if not self.has_history():
            raise ArchiveMissing(f"{self.uri}: no archived run there (no {self.path('history', 'run.sqlite')})")
        run_dir.mkdir(parents=True, exist_ok=True)
        for name in HISTORY_FILES:
            self._download(self.path("history", name), run_dir / name)

    def check_writable(self) -> None:
        """Write and delete a probe object: an archive that is missing or read-only fails here, with its
        reason, before anything is launched."""
        probe = f"probe-{os.getpid()}-{time.time_ns()}"
        self.write_bytes(probe, b"spotswarm")
        self._call(f"deleting {probe}", self.fs.rm_file, self.path(probe))

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, path: Path) -> None:
        """Upload a checkpoint file, then keep only the newest ``keep`` in the archive."""
        path = Path(path)
        self._upload(path, self.path("checkpoints", path.name))
        stale = _newest_first(self._list("checkpoints"))[self.keep:]
        if stale:
            self._call("pruning old checkpoints", self.fs.rm, [self.path("checkpoints", n) for n in stale])

    def checkpoints(self) -> list[str]:
        """Archived checkpoint names, newest first."""
        return _newest_first(self._list("checkpoints"))

    def save_experts(self, directory: Path) -> None:
        """Upload the expert checkpoints of a mixture-of-experts run (``<uid>.pt``, one per expert,
        each replaced by its newer state)."""
        for path in sorted(Path(directory).glob("*.pt")):
            self._upload(path, self.path("experts", path.name))

    # ---- history -------------------------------------------------------------------------------
    def save_history(self, store: RunStore | Path) -> None:
        """Upload a consistent snapshot of the run store and its config.  The snapshot comes from
        a connection of its own through SQLite's backup API (one step: one read transaction), so
        it never races the supervisor's writes nor copies a live WAL database byte for byte."""
        run_dir = store.dir if isinstance(store, RunStore) else Path(store)
        if not (run_dir / "run.sqlite").exists():
            raise FileNotFoundError(f"{run_dir} holds no run.sqlite to archive")
        with tempfile.TemporaryDirectory(prefix="spotswarm-archive-") as tmp:
            snapshot = Path(tmp) / "run.sqlite"
            _snapshot(run_dir / "run.sqlite", snapshot)
            sources = {"config.yaml": run_dir / "config.yaml", "run.sqlite": snapshot}
            for name in HISTORY_FILES:
                if sources[name].exists():
                    self._upload(sources[name], self.path("history", name))

    def has_history(self) -> bool:
        return "run.sqlite" in self._list("history")

    # ---- restore -------------------------------------------------------------------------------
    def restore(self, run_dir: Path) -> int | None:
        """Download the history and the newest checkpoint into ``run_dir`` (which must hold no run
        yet), point the store's checkpoint records at the new directory, and record a ``restored``
        event (the Ray head changed: the old fleet's records are stale).  Returns the restored
        checkpoint's epoch, None when the archive has no checkpoint.  ``run.sqlite`` appears last:
        a restore cut short never leaves a run that would resume without its checkpoint."""
        run_dir = Path(run_dir).resolve()  # the store's paths are read by a supervisor with another cwd
        if (run_dir / "run.sqlite").exists():
            raise FileExistsError(f"{run_dir} already holds a run; not overwriting it from {self.uri}")
        if not self.has_history():
            raise ArchiveMissing(f"{self.uri}: no archived run there (no {self.path('history', 'run.sqlite')})")
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        newest = next(iter(self.checkpoints()), None)
        if newest is not None:
            self._download(self.path("checkpoints", newest), run_dir / "checkpoints" / newest)
        experts = [name for name in self._list("experts") if name.endswith(".pt")]
        if experts:
            (run_dir / "checkpoints" / "experts").mkdir(exist_ok=True)
        for name in experts:  # a mixture-of-experts run's experts resume from these
            self._download(self.path("experts", name), run_dir / "checkpoints" / "experts" / name)
        self._download(self.path("history", "config.yaml"), run_dir / "config.yaml")
        staged = run_dir / "run.sqlite.restore"
        self._download(self.path("history", "run.sqlite"), staged)
        db = sqlite3.connect(staged)
        try:
            epoch = _relocate_checkpoints(db, run_dir / "checkpoints", newest)
        finally:
            db.close()
        for stale in ("run.sqlite-wal", "run.sqlite-shm"):  # a leftover WAL would be replayed onto the restore
            (run_dir / stale).unlink(missing_ok=True)
        staged.replace(run_dir / "run.sqlite")
        store = RunStore(run_dir)
        try:
            store.event("restored", detail={"from": self.uri, "epoch": epoch})
        finally:
            store.close()
        logger.info("restored %s from %s (checkpoint epoch %s)", run_dir, self.uri, epoch)
        return epoch


def _snapshot(source: Path, target: Path) -> None:
    src = sqlite3.connect(source, timeout=30)  # a connection of its own, never the writer's
    dst = sqlite3.connect(target)
    try:
        src.backup(dst)  # all pages in one step: one read transaction, one consistent moment
    finally:
        dst.close()
        src.close()


def _relocate_checkpoints(db: sqlite3.Connection, folder: Path, restored: str | None) -> int | None:
    """Point every checkpoint record at the restored run's ``folder`` (only the newest file is
    there; ``latest_checkpoint`` skips the others).  Returns the restored file's epoch, registering
    it when the history snapshot predates it."""
    epoch = None
    for rowid, row_epoch, path in db.execute("SELECT rowid, epoch, path FROM checkpoints").fetchall():
        name = Path(path).name
        db.execute("UPDATE checkpoints SET path = ? WHERE rowid = ?", (str(folder / name), rowid))
        if name == restored:
            epoch = max(int(row_epoch), epoch if epoch is not None else -1)
    if restored is not None and epoch is None:
        epoch = checkpoint_epoch(restored)
        if epoch is None:
            logger.warning("restored checkpoint %s names no epoch; not registered", restored)
        else:
            db.execute("INSERT INTO checkpoints VALUES (?, ?, ?)", (time.time(), epoch, str(folder / restored)))
    db.commit()
    return epoch


class BackgroundArchiver:
    """Uploads on one background thread, so the supervisor's tick never waits on the store.  What fails is
    logged and stays owed: it goes again with the next ``submit``; the newest checkpoint wins.  After
    each pass it reads the archive's stop request (``down CONFIG`` from another machine): one made
    after ``since`` (wall clock) is kept in ``stop_request``."""

    def __init__(self, archive: RunArchive, run_dir: Path, since: float | None = None) -> None:
        self.archive = archive
        self.run_dir = Path(run_dir)
        self.since = since
        self.failures = 0
        self.stop_request: dict | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="run-archive")
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._running = False
        self._closed = False
        self._checkpoint: Path | None = None
        self._experts: Path | None = None
        self._history = False
        self._status: bytes | None = None
        self._logs: Path | None = None

    def submit(self, checkpoint: Path | None = None, experts: Path | None = None, *, history: bool = True,
               status: bytes | None = None, logs: Path | None = None) -> None:
        """Owe the archive the history (unless ``history`` is False), and whatever else is given: a
        checkpoint, the expert checkpoints in ``experts``, the status document, the logs in ``logs``;
        returns at once."""
        with self._lock:
            if checkpoint is not None:
                self._checkpoint = checkpoint
            if experts is not None:
                self._experts = experts
            if status is not None:
                self._status = status
            if logs is not None:
                self._logs = logs
            self._history = self._history or history
            if self._running or self._closed:
                return  # the running upload loop takes it next (or, closed, nobody: the run is stopping)
            self._running = True
            self._idle.clear()
        self._executor.submit(self._drain)

    def retry(self) -> None:
        """Upload again what an earlier upload left owed, if anything."""
        if self.owed:
            self.submit(history=False)

    def flush(self, timeout: float, status: bytes | None = None) -> bool:
        """Upload the history (and ``status``) one last time and wait for that, at most ``timeout`` seconds."""
        self.submit(status=status)
        done = self._idle.wait(timeout)
        if not done:
            logger.warning("archiving to %s still running after %.0f s; not waiting longer", self.archive.uri, timeout)
        return done and not self.owed

    @property
    def owed(self) -> bool:
        with self._lock:
            return self._history or any(x is not None for x in (self._checkpoint, self._experts, self._status,
                                                                  self._logs))

    def close(self) -> None:
        """No more uploads; one still running finishes on its own (bounded by the store's timeouts)."""
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=False)

    def _take(self) -> tuple:
        with self._lock:
            taken = (self._checkpoint, self._experts, self._history, self._status, self._logs)
            self._checkpoint, self._experts, self._history, self._status, self._logs = None, None, False, None, None
            return taken

    def _drain(self) -> None:
        while True:
            checkpoint, experts, history, status, logs = taken = self._take()
            if not any(taken):
                with self._lock:
                    self._running = False
                    self._idle.set()
                return
            try:
                if checkpoint is not None and checkpoint.exists():  # gone: a newer one replaced it locally
                    self.archive.save_checkpoint(checkpoint)
                if experts is not None:
                    self.archive.save_experts(experts)
                if history:
                    self.archive.save_history(self.run_dir)
                if logs is not None:
                    self.archive.save_logs(logs)
                if status is not None:
                    self.archive.write_bytes(STATUS_DOC, status)
                if self.since is not None:
                    self._read_stop_request()
            except Exception as e:  # never the supervisor's problem: it goes again at the next checkpoint
                logger.warning("archiving the run to %s failed (retried at the next checkpoint): %s",
                               self.archive.uri, e)
                with self._lock:
                    self.failures += 1
                    self._checkpoint = self._checkpoint or checkpoint
                    self._experts = self._experts or experts
                    self._history = self._history or history
                    self._status = self._status or status
                    self._logs = self._logs or logs
                    self._running = False
                    self._idle.set()
                return

    def _read_stop_request(self) -> None:
        request = self.archive.stop_request()
        if request is not None and self.since is not None and request.get("at", 0.0) >= self.since:
            if self.stop_request is None:
                logger.warning("a stop was requested through the archive (%s)", request.get("by", "?"))
            self.stop_request = request
