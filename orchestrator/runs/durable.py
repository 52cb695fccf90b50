"""Durable run state in S3: a run whose head machine vanishes (an AWS spot head, a lost disk) can be
resumed anywhere from ``checkpoint.uri``.

Layout under ``s3://bucket/prefix``: ``history/run.sqlite`` (a consistent snapshot of the run
store), ``history/config.yaml``, ``checkpoints/<name>`` (the newest ``checkpoint.keep``) and, for a
mixture-of-experts run, ``experts/<uid>.pt`` (each expert's newest state).  The
local run directory stays the working copy; the archive is what survives the machine.  boto3 is an
optional extra (``spotswarm[aws]``), imported only when an archive is used.
"""

from __future__ import annotations

import logging
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
THROTTLING = {"Throttling", "ThrottlingException", "ThrottledException", "SlowDown", "RequestLimitExceeded",
              "TooManyRequests", "TooManyRequestsException", "RequestTimeout", "RequestTimeoutException",
              "ProvisionedThroughputExceededException", "BandwidthLimitExceeded", "InternalError",
              "ServiceUnavailable"}
NO_BUCKET = {"NoSuchBucket"}
DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled",
          "AccountProblem", "InvalidToken", "ExpiredToken"}
_EPOCH_NAME = re.compile(r"epoch-(\d+)\.pt$")


class ArchiveError(RuntimeError):
    """S3 refused or failed for good (missing bucket, access denied, retries spent); names the URI."""


class ArchiveMissing(ArchiveError):
    """The bucket is there but holds no archived run under the prefix."""


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix")`` (the prefix may be empty)."""
    match = re.fullmatch(r"s3://([^/]+)/?(.*)", uri)
    if not match:
        raise ValueError(f"{uri!r} is not an S3 URI (s3://bucket/prefix)")
    return match.group(1), match.group(2).strip("/")


def checkpoint_epoch(name: str) -> int | None:
    """The epoch in a checkpoint file name the supervisor writes (``epoch-000042.pt``)."""
    match = _EPOCH_NAME.search(name)
    return int(match.group(1)) if match else None


def _newest_first(names: list[str]) -> list[str]:
    return sorted(names, key=lambda n: (checkpoint_epoch(n) if checkpoint_epoch(n) is not None else -1, n),
                  reverse=True)


def _error_code(error: BaseException) -> tuple[str, int]:
    """(code, HTTP status) of a botocore ClientError, also when boto3's transfer layer wrapped it."""
    from botocore.exceptions import ClientError

    if not isinstance(error, ClientError) and isinstance(error.__context__, ClientError):
        error = error.__context__  # S3UploadFailedError keeps the ClientError only as its context
    if not isinstance(error, ClientError):
        return "", 0
    return str(error.response.get("Error", {}).get("Code", "")), int(
        error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def is_transient(error: BaseException) -> bool:
    """Worth another try: throttling, 5xx, a dropped or timed-out connection."""
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import HTTPClientError

    if isinstance(error, BotoConnectionError | HTTPClientError):
        return True
    code, status = _error_code(error)
    return code in THROTTLING or status >= 500


def _s3_client(endpoint_url: str | None) -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError as e:
        raise ArchiveError("checkpoint.uri needs boto3: pip install 'spotswarm[aws]'") from e
    # retries are ours (bounded, with jitter, with a clear error at the end), not botocore's as well
    config = Config(retries={"mode": "standard", "total_max_attempts": 1}, connect_timeout=10, read_timeout=60)
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)


class RunArchive:
    """A run's history and newest checkpoints in S3 (or an S3-compatible store at ``endpoint_url``)."""

    def __init__(self, uri: str, endpoint_url: str | None = None, keep: int = 3, client: Any = None,
                 attempts: int = 5, wait: tenacity.wait.wait_base | None = None) -> None:
        self.uri = uri.rstrip("/")
        self.bucket, self.prefix = parse_s3_uri(uri)
        self.keep = keep
        self.client = client if client is not None else _s3_client(endpoint_url)
        self.attempts = attempts
        self.wait = wait if wait is not None else CLOUD_BACKOFF

    @classmethod
    def for_config(cls, config: ClusterConfig) -> RunArchive | None:
        """The run's archive, or None when the config names no ``checkpoint.uri``."""
        checkpoint = config.checkpoint
        if not checkpoint.uri:
            return None
        return cls(checkpoint.uri, endpoint_url=checkpoint.endpoint_url, keep=checkpoint.keep)

    # ---- S3 calls ------------------------------------------------------------------------------
    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """One S3 call, retried through throttling and 5xx; anything else is an ArchiveError."""
        retrying = tenacity.Retrying(retry=tenacity.retry_if_exception(is_transient), wait=self.wait,
                                     stop=tenacity.stop_after_attempt(self.attempts), reraise=True)
        try:
            return retrying(fn, *args, **kwargs)
        except ArchiveError:
            raise
        except Exception as e:
            raise self._explain(what, e) from e

    def _explain(self, what: str, error: Exception) -> ArchiveError:
        code, status = _error_code(error)
        if code in NO_BUCKET:
            return ArchiveError(f"{self.uri}: the bucket {self.bucket!r} does not exist ({what})")
        if code in DENIED or status == 403:
            return ArchiveError(f"{self.uri}: access denied ({what}); check the credentials and the bucket policy")
        if is_transient(error):
            return ArchiveError(f"{self.uri}: S3 still failing after {self.attempts} attempts ({what}): {error}")
        return ArchiveError(f"{self.uri}: {what} failed: {error}")

    def _list(self, folder: str) -> list[str]:
        """Names of the objects directly under ``<prefix>/<folder>/``."""
        base = self.key(folder) + "/"

        def pages() -> list[str]:
            names: list[str] = []
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
                names += [o["Key"][len(base):] for o in page.get("Contents", [])]
            return [n for n in names if n and "/" not in n]

        return self._call(f"listing {base}", pages)

    def _upload(self, path: Path, key: str) -> None:
        self._call(f"uploading {path.name}", self.client.upload_file, str(path), self.bucket, key)

    def _download(self, key: str, path: Path) -> None:
        """Into a side file first: a broken download never looks like a restored file."""
        part = path.with_name(path.name + ".download")
        self._call(f"downloading {key}", self.client.download_file, self.bucket, key, str(part))
        part.replace(path)

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, path: Path) -> None:
        """Upload a checkpoint file, then keep only the newest ``keep`` in the archive."""
        path = Path(path)
        self._upload(path, self.key("checkpoints", path.name))
        stale = _newest_first(self._list("checkpoints"))[self.keep:]
        if stale:
            objects = [{"Key": self.key("checkpoints", n)} for n in stale]
            self._call("pruning old checkpoints", self.client.delete_objects, Bucket=self.bucket,
                       Delete={"Objects": objects, "Quiet": True})

    def checkpoints(self) -> list[str]:
        """Archived checkpoint names, newest first."""
        return _newest_first(self._list("checkpoints"))

    def save_experts(self, directory: Path) -> None:
        """Upload the expert checkpoints of a mixture-of-experts run (``<uid>.pt``, one per expert,
        each replaced by its newer state)."""
        for path in sorted(Path(directory).glob("*.pt")):
            self._upload(path, self.key("experts", path.name))

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
                    self._upload(sources[name], self.key("history", name))

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
            raise ArchiveMissing(f"{self.uri}: no archived run there (no {self.key('history', 'run.sqlite')})")
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        newest = next(iter(self.checkpoints()), None)
        if newest is not None:
            self._download(self.key("checkpoints", newest), run_dir / "checkpoints" / newest)
        experts = [name for name in self._list("experts") if name.endswith(".pt")]
        if experts:
            (run_dir / "checkpoints" / "experts").mkdir(exist_ok=True)
        for name in experts:  # a mixture-of-experts run's experts resume from these
            self._download(self.key("experts", name), run_dir / "checkpoints" / "experts" / name)
        self._download(self.key("history", "config.yaml"), run_dir / "config.yaml")
        staged = run_dir / "run.sqlite.restore"
        self._download(self.key("history", "run.sqlite"), staged)
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
    """Uploads on one background thread, so the supervisor's tick never waits on S3.  What fails is
    logged and stays owed: it goes again with the next ``submit``; the newest checkpoint wins."""

    def __init__(self, archive: RunArchive, run_dir: Path) -> None:
        self.archive = archive
        self.run_dir = Path(run_dir)
        self.failures = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="run-archive")
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._running = False
        self._closed = False
        self._checkpoint: Path | None = None
        self._experts: Path | None = None
        self._history = False

    def submit(self, checkpoint: Path | None = None, experts: Path | None = None) -> None:
        """Owe the history (and ``checkpoint``, and the expert checkpoints in ``experts``, if given)
        to the archive; returns at once."""
        with self._lock:
            if checkpoint is not None:
                self._checkpoint = checkpoint
            if experts is not None:
                self._experts = experts
            self._history = True
            if self._running or self._closed:
                return  # the running upload loop takes it next (or, closed, nobody: the run is stopping)
            self._running = True
            self._idle.clear()
        self._executor.submit(self._drain)

    def retry(self) -> None:
        """Upload again what an earlier upload left owed, if anything."""
        with self._lock:
            owed = self._history or self._checkpoint is not None or self._experts is not None
        if owed:
            self.submit()

    def flush(self, timeout: float) -> bool:
        """Upload the history one last time and wait for that, at most ``timeout`` seconds."""
        self.submit()
        done = self._idle.wait(timeout)
        if not done:
            logger.warning("archiving to %s still running after %.0f s; not waiting longer", self.archive.uri, timeout)
        return done and not self.owed

    @property
    def owed(self) -> bool:
        with self._lock:
            return self._history or self._checkpoint is not None or self._experts is not None

    def close(self) -> None:
        """No more uploads; one still running finishes on its own (bounded by the S3 timeouts)."""
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=False)

    def _drain(self) -> None:
        while True:
            with self._lock:
                checkpoint, experts, history = self._checkpoint, self._experts, self._history
                self._checkpoint, self._experts, self._history = None, None, False
                if checkpoint is None and experts is None and not history:
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
            except Exception as e:  # never the supervisor's problem: it goes again at the next checkpoint
                logger.warning("archiving the run to %s failed (retried at the next checkpoint): %s",
                               self.archive.uri, e)
                with self._lock:
                    self.failures += 1
                    self._checkpoint = self._checkpoint or checkpoint
                    self._experts = self._experts or experts
                    self._history = self._history or history
                    self._running = False
                    self._idle.set()
                return
