"""The run's epoch checkpoints on the head: every ``checkpoint.every_s`` the newest state is pulled from
the peers and written on a thread of its own (never in the tick), kept (recorded, the oldest pruned,
archived), and the newest is served to newcomers, the supervisor being a state donor too."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dht import DHT
from orchestrator.config.schema import ClusterConfig
from orchestrator.runs.checkpoint_io import read_checkpoint, write_checkpoint
from orchestrator.runs.checkpoints import checkpoint_directory, checkpoint_files, prune_checkpoints
from orchestrator.runs.durable import BackgroundArchiver
from orchestrator.runs.store import RunStore
from workers.state import StateSharer, StateUnavailable

logger = logging.getLogger(__name__)

ADVERT_EVERY_S = 20.0  # how often the served checkpoint's epoch is declared again in the DHT


class Checkpointer:
    def __init__(self, config: ClusterConfig, store: RunStore, dht: DHT, state: StateSharer,
                 archiver: BackgroundArchiver | None, clock: Callable[[], float]) -> None:
        self.config = config
        self.store = store
        self.dht = dht
        self.state = state
        self.archiver = archiver
        self.current: tuple[int, Any] | None = None  # (epoch, state) served to newcomers
        self.directory = checkpoint_directory(config, store.dir)
        self._last = clock()
        # a checkpoint's state download (donor after donor) and file write run here, never in the tick
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._job: Future | None = None
        self._last_advert = 0.0

    @property
    def epoch(self) -> int | None:
        """The epoch of the checkpoint served now, if any."""
        return self.current[0] if self.current is not None else None

    def writing(self) -> bool:
        return self._job is not None and not self._job.done()

    def maybe(self, now: float, start: bool = True) -> None:
        """Record a finished checkpoint; with ``start``, begin the next one when ``every_s`` has passed."""
        job = self._job
        if job is not None:
            if job.done():
                self._job = None
                self._record(job)
            return
        if now - self._last < self.config.checkpoint.every_s or not start:
            return
        self._last = now
        have = self.current[0] if self.current else -1
        self._job = self._pool.submit(self._write, have + 1)

    def _write(self, min_epoch: int) -> tuple[int, Any, Path]:
        """The newest state from the peers, written to its file (the checkpoint thread)."""
        epoch, state = self.dht.run_coroutine(lambda n: self.state.download(min_epoch=min_epoch))
        return epoch, state, self.save(epoch, state)

    def save(self, epoch: int, state: Any) -> Path:
        return write_checkpoint(self.directory, epoch, state)

    def _record(self, job: Future) -> None:
        try:
            epoch, state, path = job.result()
        except StateUnavailable as e:
            logger.info("no newer state to checkpoint: %s", e)
            if self.archiver is not None:
                self.archiver.retry()  # what an earlier upload left owed
            return
        except Exception as e:  # a full disk, a peer gone mid-download: the next period tries again
            logger.warning("checkpoint failed: %s: %s", type(e).__name__, e)
            return
        self.keep(epoch, state, path)

    def keep(self, epoch: int, state: Any, path: Path, final: bool = False) -> None:
        """A written checkpoint: served from now on, recorded, the oldest pruned, archived."""
        self.current = (epoch, state)
        self.store.checkpoint(epoch, path)
        self.store.event("checkpoint", detail={"epoch": epoch, "path": str(path), **({"final": True} if final else {})})
        prune_checkpoints(path.parent, self.config.checkpoint.keep)
        if self.archiver is not None:
            self.archiver.submit(path)  # on the upload thread: the tick never waits on S3

    def close(self) -> None:
        """Stop the checkpoint thread (a download in flight ends within its timeouts); keep what finished."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        job = self._job
        if job is not None and job.done() and not job.cancelled():
            self._record(job)

    def newest(self) -> tuple[int, Path] | None:
        """The newest checkpoint the store knows, or a newer file in the checkpoint directory: a run
        restored from its archive may hold a checkpoint its history snapshot was saved too early to
        list (the head died between the two uploads).  Such a file is recorded, so the store agrees."""
        latest = self.store.latest_checkpoint()
        files = checkpoint_files(self.directory)
        if files:
            epoch, newest = files[-1]
            if latest is None or epoch > latest[0]:
                logger.info("checkpoint %s is newer than the run's history lists; using it", newest)
                self.store.checkpoint(epoch, newest)
                return epoch, newest
        return latest

    def load(self) -> int | None:
        """Serve the newest checkpoint on disk (a resumed run); its epoch, or None without one."""
        latest = self.newest()
        if latest is None:
            return None
        epoch, path = latest
        try:
            self.current = read_checkpoint(path)
        except ValueError as e:  # the run goes on without it: the peers still hold their state
            logger.error("%s; not serving it", e)
            self.store.event("checkpoint_refused", detail={"path": str(path), "error": str(e)[:500]})
            return None
        logger.info("serving checkpoint of epoch %d from %s", epoch, path)
        return epoch

    def serve(self) -> tuple[int, Any]:
        """What a newcomer downloads from the supervisor: the checkpoint served now."""
        if self.current is None:
            raise StateUnavailable("no checkpoint yet")
        return self.current

    def refresh_advert(self) -> None:
        """Declare the served checkpoint's epoch in the DHT again, so newcomers find this donor."""
        if self.current is None or time.monotonic() - self._last_advert < ADVERT_EVERY_S:
            return
        self._last_advert = time.monotonic()
        epoch = self.current[0]
        self.dht.spawn(lambda n: self.state.advertise(epoch))  # the tick does not wait on the DHT
