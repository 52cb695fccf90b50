"""A run on disk: ``runs/<cluster_name>/`` holds the resolved config, ``run.sqlite`` (instances,
events, per-epoch progress, checkpoints, each trainer's cost totals and its per-round time split,
the experts' samples) and ``checkpoints/``.  Everything needed to report on a run, or resume it
after losing every machine, is here."""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from orchestrator.config.schema import ClusterConfig

logger = logging.getLogger(__name__)

# what SQLite says when the disk (or the run directory's filesystem) has no room for a write
_NO_ROOM = {sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR}

SCHEMA = """
CREATE TABLE IF NOT EXISTS instances (
    id TEXT PRIMARY KEY, node_type TEXT NOT NULL, zone TEXT NOT NULL, market TEXT NOT NULL,
    price_per_hour REAL NOT NULL, on_demand_price_per_hour REAL NOT NULL,
    launched_at REAL NOT NULL, notice_at REAL, ended_at REAL, end_reason TEXT, peer_id TEXT
);
-- an instance's region: a table of its own, so that the instances table keeps the columns older run
-- directories have and that rows are inserted by
CREATE TABLE IF NOT EXISTS instance_regions (instance_id TEXT PRIMARY KEY, region TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    time REAL NOT NULL, kind TEXT NOT NULL, instance_id TEXT, detail TEXT
);
CREATE TABLE IF NOT EXISTS progress (
    time REAL NOT NULL, epoch INTEGER NOT NULL, loss REAL, samples_per_second REAL, peers INTEGER,
    samples INTEGER
);
CREATE TABLE IF NOT EXISTS checkpoints (time REAL NOT NULL, epoch INTEGER NOT NULL, path TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS peer_costs (
    instance_id TEXT PRIMARY KEY, time REAL NOT NULL, samples INTEGER NOT NULL, bytes_sent INTEGER NOT NULL,
    comm_s REAL NOT NULL, busy_s REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS rounds (
    epoch INTEGER NOT NULL, instance_id TEXT NOT NULL, time REAL NOT NULL, compute_s REAL NOT NULL,
    comm_s REAL NOT NULL, PRIMARY KEY (epoch, instance_id)
);
CREATE TABLE IF NOT EXISTS experts (
    time REAL NOT NULL, live INTEGER NOT NULL, grid INTEGER NOT NULL, min_replicas INTEGER NOT NULL,
    mean_replicas REAL NOT NULL, requests_per_second REAL, rows_per_batch REAL, calls INTEGER NOT NULL,
    kmin_fraction REAL
);
CREATE INDEX IF NOT EXISTS events_time ON events(time);
CREATE INDEX IF NOT EXISTS events_kind ON events(kind, time);
CREATE INDEX IF NOT EXISTS progress_epoch ON progress(epoch);
CREATE INDEX IF NOT EXISTS progress_time ON progress(time);
CREATE INDEX IF NOT EXISTS progress_samples ON progress(samples);
CREATE INDEX IF NOT EXISTS experts_time ON experts(time);
"""
# the sampled series: a reader asks for the newest row, a window, or a chart's worth, never scans them all
SERIES = ("progress", "experts")


def _check_series(table: str) -> None:
    """Table names go into SQL text: only the sampled series' own."""
    if table not in SERIES:
        raise ValueError(f"not a sampled series: {table!r} (one of {', '.join(SERIES)})")


@dataclass
class InstanceRecord:
    id: str
    node_type: str
    zone: str
    market: str
    price_per_hour: float
    on_demand_price_per_hour: float
    launched_at: float
    notice_at: float | None = None
    ended_at: float | None = None
    end_reason: str | None = None
    peer_id: str | None = None
    region: str | None = None  # None: not recorded (a run from before regions)

    def seconds(self, now: float) -> float:
        """Billed seconds up to ``now`` (also for a moment in the past: cost curves ask for those)."""
        end = now if self.ended_at is None else min(self.ended_at, now)
        return max(end - self.launched_at, 0.0)

    def cost(self, now: float) -> float:
        return self.seconds(now) / 3600 * self.price_per_hour

    def on_demand_cost(self, now: float) -> float:
        return self.seconds(now) / 3600 * self.on_demand_price_per_hour


@dataclass(frozen=True)
class RoundRecord:
    """One epoch of one trainer, as its status reported it."""

    epoch: int
    compute_s: float
    comm_s: float


@dataclass(frozen=True)
class RoundMean:
    """One epoch over the trainers that reported it: their mean compute and communication seconds."""

    epoch: int
    peers: int
    compute_s: float
    comm_s: float
    time: float  # when the store first heard of it

    @property
    def wall_s(self) -> float:
        """The epoch's length: a trainer's time from its previous epoch to this one is all compute or
        communication."""
        return self.compute_s + self.comm_s


@dataclass(frozen=True)
class RoundTotals:
    """The per-epoch means of every epoch reported, summed."""

    rounds: int  # epochs that at least one trainer reported
    compute_s: float
    comm_s: float

    @property
    def wall_s(self) -> float:
        return self.compute_s + self.comm_s


class RunStore:
    def __init__(self, run_dir: Path) -> None:
        self.clock = time.time  # the local simulator swaps in its scaled clock
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "checkpoints").mkdir(exist_ok=True)
        self.db = sqlite3.connect(self.dir / "run.sqlite", timeout=30, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")  # readers (status, dashboard) never block the writer
        self.db.executescript(SCHEMA)
        self.db.commit()
        # writes the disk had no room for yet, in order: (sql, args, a sample row that may be thinned)
        self._pending: list[tuple[str, tuple, bool]] = []
        self._batching = 0  # open batches (nested): writes then go into one transaction, committed at the end
        self._batch_written: list[tuple[str, tuple, bool]] = []  # executed in that transaction, not committed yet
        self._held = False  # the last try found no room: writes wait in ``_pending`` until ``_retry_at``
        self._retry_at = 0.0  # monotonic: when held writes are next tried
        self.instance_writes = 0  # writes to the instances table through this store: what a cache of costs keys on
        self._thinned = 0  # sample rows dropped while the disk had no room (said once per outage)
        self._thin_slack = 0  # held rows past max_pending before the next thinning
        self._write_lock = threading.Lock()

    @classmethod
    def create(cls, config: ClusterConfig, base: Path | None = None) -> RunStore:
        store = cls(config.run_dir(base))
        (store.dir / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
        return store

    @classmethod
    def open(cls, run_dir: Path) -> RunStore:
        if not (Path(run_dir) / "run.sqlite").exists():
            raise FileNotFoundError(f"{run_dir} is not a run directory (no run.sqlite)")
        return cls(run_dir)

    def config(self) -> ClusterConfig:
        return self.read_config(self.dir)

    @staticmethod
    def read_config(run_dir: Path) -> ClusterConfig:
        """The resolved config a run directory was started with (no database needed)."""
        return ClusterConfig.model_validate(yaml.safe_load((Path(run_dir) / "config.yaml").read_text()))

    def close(self) -> None:
        with self._write_lock:
            self._batching = 0  # a batch still open (another thread's) is committed now
            if (self._pending or self._batch_written) and not self._flush():
                logger.warning("run store %s: %d writes still had no room on disk when it closed; they are lost",
                               self.dir, len(self._pending))
        self.db.close()

    # ---- writing -------------------------------------------------------------------------------
    @property
    def pending_writes(self) -> int:
        """Writes held in memory until the disk has room again (0 normally)."""
        return len(self._pending)

    #: how often held writes are tried again while the disk has no room (each try replays them all)
    retry_every_s: float = 1.0
    #: held writes past which sample rows are thinned (about 200 bytes each)
    max_pending: int = 100_000

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Writes inside go into one transaction, committed when the outermost batch ends: a tick that
        records news of a thousand workers pays one commit (one sync of the WAL), not a thousand.
        Reads through this store see them at once; other connections (the dashboard, ``status``)
        when the batch ends.  A full disk holds them back as it holds any write."""
        with self._write_lock:
            self._batching += 1
        try:
            yield
        finally:
            with self._write_lock:
                if self._batching > 0:  # 0: the store was closed meanwhile, and committed then
                    self._batching -= 1
                    if self._batching == 0:
                        self._end_batch()

    def commit(self) -> None:
        """Commit what the open batch wrote so far: before a wait inside it (a final checkpoint), so
        other readers see the run's news and a crash meanwhile loses none of it."""
        with self._write_lock:
            if self._batching and self._batch_written:
                batching, self._batching = self._batching, 0
                try:
                    self._flush()
                finally:
                    self._batching = batching

    def _end_batch(self) -> None:
        if self._held and time.monotonic() < self._retry_at:
            return  # the disk had no room: the batch's writes wait with the others (none is executed)
        if self._pending or self._batch_written:
            self._flush()

    def _write(self, sql: str, args: tuple, sample: bool = False) -> None:
        """Every write goes through here: a full disk holds writes back, in order, instead of losing
        them or failing the caller (the supervisor's tick must go on); a later write retries them.
        ``sample``: a row of a sampled series (progress, experts), which a long outage may thin."""
        with self._write_lock:
            self._pending.append((sql, args, sample))
            if not self._held or time.monotonic() >= self._retry_at:
                self._flush()
            elif len(self._pending) > self.max_pending + self._thin_slack:
                self._thin()

    def _flush(self) -> bool:
        """Write what is held back, in one transaction (committed now, or when the open batch ends);
        False while the disk still has no room."""
        done = 0
        try:
            for sql, args, _sample in self._pending:
                self.db.execute(sql, args)
                done += 1
            if not self._batching:
                self.db.commit()
        except Exception as e:
            self.db.rollback()  # all of the transaction's writes land, or none: the batch's go back in line
            done += len(self._batch_written)
            self._pending[:0], self._batch_written = self._batch_written, []
            if not isinstance(e, sqlite3.OperationalError) or \
                    (getattr(e, "sqlite_errorcode", 0) or 0) & 0xFF not in _NO_ROOM:  # the primary code
                if done < len(self._pending):  # a bad statement is a caller's error, not the disk's
                    del self._pending[done]  # the rest stay
                raise
            if not self._held:  # said once per outage, not once per write
                logger.warning("run store %s: no room on disk (%s); holding writes in memory until there is",
                               self.dir, e)
            self._held = True
            self._retry_at = time.monotonic() + self.retry_every_s
            return False
        if self._batching:
            self._batch_written += self._pending
            self._pending = []
            return True
        if self._held:
            thinned = f" ({self._thinned} progress and expert samples thinned out)" if self._thinned else ""
            logger.warning("run store %s: disk has room again; wrote the %d writes held meanwhile%s",
                           self.dir, len(self._pending) + len(self._batch_written), thinned)
        self._pending.clear()
        self._batch_written = []
        self._held = False
        self._thinned = 0
        self._thin_slack = 0
        return True

    def _thin(self) -> None:
        """Bound the memory a long outage takes: every other held sample row (progress, experts) goes
        — their series keep their shape at half the resolution — while instance, event and checkpoint
        rows, which the costs and the history are read from, are all kept."""
        if self._thinned == 0:
            logger.warning("run store %s: %d writes held in memory; thinning the progress and expert samples "
                           "among them until the disk has room", self.dir, len(self._pending))
        kept, odd = [], False
        for write in self._pending:
            if write[2]:
                odd = not odd
                if not odd:
                    self._thinned += 1
                    continue
            kept.append(write)
        self._pending = kept
        # rows that must stay (accounting) do not make every later write thin again
        self._thin_slack = max(len(kept) - self.max_pending, 0) + self.max_pending // 2

    def event(self, kind: str, instance_id: str | None = None, detail: Any = None, at: float | None = None) -> None:
        text = detail if isinstance(detail, str) or detail is None else json.dumps(detail)
        self._write("INSERT INTO events VALUES (?, ?, ?, ?)", (at or self.clock(), kind, instance_id, text))

    def launched(self, rec: InstanceRecord) -> None:
        self.instance_writes += 1
        self._write("INSERT INTO instances VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                    (rec.id, rec.node_type, rec.zone, rec.market, rec.price_per_hour,
                     rec.on_demand_price_per_hour, rec.launched_at, None, None, None, rec.peer_id))
        if rec.region is not None:
            self._write("INSERT OR REPLACE INTO instance_regions VALUES (?, ?)", (rec.id, rec.region))
        where = {"zone": rec.zone} if rec.region is None else {"zone": rec.zone, "region": rec.region}
        self.event("launch", rec.id, {**where, "node_type": rec.node_type, "market": rec.market,
                                      "price_per_hour": rec.price_per_hour}, at=rec.launched_at)

    def update_instance(self, instance_id: str, **fields: Any) -> None:
        sets = ", ".join(f"{k} = ?" for k in fields)
        self.instance_writes += 1
        self._write(f"UPDATE instances SET {sets} WHERE id = ?", (*fields.values(), instance_id))

    def progress(self, epoch: int, loss: float | None, samples_per_second: float, peers: int, samples: int) -> None:
        self._write("INSERT INTO progress VALUES (?, ?, ?, ?, ?, ?)",
                    (self.clock(), epoch, loss, samples_per_second, peers, samples), sample=True)

    def expert_sample(self, live: int, grid: int, min_replicas: int, mean_replicas: float,
                      requests_per_second: float | None, rows_per_batch: float | None, calls: int,
                      kmin_fraction: float | None) -> None:
        """One sample of a mixture-of-experts run's experts: how many of the grid are live, their
        replicas, the servers' load, and the fraction of the trainers' forward passes that met k_min."""
        self._write("INSERT INTO experts VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (self.clock(), live, grid, min_replicas, mean_replicas, requests_per_second,
                     rows_per_batch, calls, kmin_fraction), sample=True)

    def expert_rows(self, since: float | None = None, until: float | None = None,
                    points: int | None = None) -> list[tuple]:
        """The experts' samples in time order (see ``progress_rows``)."""
        return self._series("experts", since, until, points)

    def peer_costs(self, instance_id: str, samples: int, bytes_sent: int, comm_s: float, busy_s: float) -> None:
        """A trainer's totals so far, as it reported them: samples, bytes it sent, seconds averaging
        or downloading state, seconds since it started training (the newest report replaces the last)."""
        self._write("INSERT OR REPLACE INTO peer_costs VALUES (?, ?, ?, ?, ?, ?)",
                    (instance_id, self.clock(), samples, bytes_sent, comm_s, busy_s))

    def peer_cost_rows(self) -> dict[str, tuple[int, int, float, float]]:
        """instance id -> (samples, bytes sent, communication seconds, training seconds)."""
        rows = self.db.execute("SELECT instance_id, samples, bytes_sent, comm_s, busy_s FROM peer_costs").fetchall()
        return {row[0]: tuple(row[1:]) for row in rows}

    def rounds(self, instance_id: str, rounds: list[RoundRecord]) -> None:
        """Epochs a trainer completed and how each one's time split into compute and communication.
        A round already stored is kept as it is (the same round may arrive again, as after a resume):
        ``time`` is when the store first heard of it."""
        for r in rounds:
            self._write("INSERT OR IGNORE INTO rounds VALUES (?, ?, ?, ?, ?)",
                        (r.epoch, instance_id, self.clock(), r.compute_s, r.comm_s))

    def round_means(self, recent: int) -> list[RoundMean]:
        """The newest ``recent`` epochs that any trainer reported, newest first: per epoch, the mean
        over the trainers that reported it (through the primary key's index, never a scan)."""
        rows = self.db.execute(
            "SELECT epoch, COUNT(*), AVG(compute_s), AVG(comm_s), MIN(time) FROM rounds WHERE epoch IN "
            "(SELECT DISTINCT epoch FROM rounds ORDER BY epoch DESC LIMIT ?) GROUP BY epoch ORDER BY epoch DESC",
            (recent,)).fetchall()
        return [RoundMean(*row) for row in rows]

    def round_totals(self) -> RoundTotals:
        """Every epoch's mean (as ``round_means``) summed over the whole run (a scan of the table:
        the report's, once, not the page's on every refresh)."""
        row = self.db.execute("SELECT COUNT(*), TOTAL(c), TOTAL(m) FROM (SELECT AVG(compute_s) AS c, "
                              "AVG(comm_s) AS m FROM rounds GROUP BY epoch)").fetchone()
        return RoundTotals(int(row[0]), float(row[1]), float(row[2]))

    def checkpoint(self, epoch: int, path: Path) -> None:
        self._write("INSERT INTO checkpoints VALUES (?, ?, ?)", (self.clock(), epoch, str(path)))

    # ---- reading -------------------------------------------------------------------------------
    def instances(self) -> list[InstanceRecord]:
        rows = self.db.execute("SELECT instances.*, r.region FROM instances LEFT JOIN instance_regions AS r "
                               "ON r.instance_id = instances.id ORDER BY instances.launched_at").fetchall()
        return [InstanceRecord(*row) for row in rows]

    def events(self, kind: str | None = None) -> list[tuple]:
        if kind is None:
            return self.db.execute("SELECT * FROM events ORDER BY time").fetchall()
        return self.db.execute("SELECT * FROM events WHERE kind = ? ORDER BY time", (kind,)).fetchall()

    def dollars_spent(self, now: float) -> float:
        """``summarize_costs(store, now).dollars`` summed by SQLite, with no row loaded: what the budget
        asks every tick, as the history of a long run grows."""
        row = self.db.execute("SELECT TOTAL(MAX(MIN(COALESCE(ended_at, ?1), ?1) - launched_at, 0.0) / 3600"
                              " * price_per_hour) FROM instances", (now,)).fetchone()
        return float(row[0])

    def progress_rows(self, since: float | None = None, until: float | None = None,
                      points: int | None = None) -> list[tuple]:
        """Progress rows in time order, those from ``since`` to ``until`` (inclusive) when given.  With
        ``points``, a series longer than that is thinned for a chart: the row at or after each of
        ``points`` moments evenly spaced from its first row to its last, and the last (a screen shows
        no more; a run of weeks has a million rows)."""
        return self._series("progress", since, until, points)

    def last_row(self, table: str) -> tuple | None:
        """The newest row of a sampled series (``progress``, ``experts``), found through its time index."""
        _check_series(table)
        return self.db.execute(f"SELECT * FROM {table} ORDER BY time DESC, rowid DESC LIMIT 1").fetchone()

    def _series(self, table: str, since: float | None, until: float | None, points: int | None) -> list[tuple]:
        _check_series(table)
        bounds = [(f"time {op} ?", value) for op, value in ((">=", since), ("<=", until)) if value is not None]
        where = f"WHERE {' AND '.join(b for b, _ in bounds)}" if bounds else ""
        args = tuple(v for _, v in bounds)
        query = f"SELECT * FROM {table} {where} ORDER BY time, rowid"
        if points is None:
            return self.db.execute(query, args).fetchall()
        head = self.db.execute(f"{query} LIMIT ?", (*args, points + 1)).fetchall()
        if len(head) <= points:
            return head
        last = self.db.execute(f"SELECT time, rowid FROM {table} {where} ORDER BY time DESC, rowid DESC LIMIT 1",
                               args).fetchone()
        step = (last[0] - head[0][0]) / points
        # each moment's row through the time index: ``points`` lookups, never a scan of the series
        return self.db.execute(
            f"WITH RECURSIVE k(j) AS (SELECT 0 UNION ALL SELECT j + 1 FROM k WHERE j + 1 < ?), "
            f"picked(id) AS (SELECT (SELECT rowid FROM {table} WHERE time >= ? + j * ? ORDER BY time, rowid LIMIT 1)"
            f" FROM k) "
            f"SELECT * FROM {table} WHERE rowid IN (SELECT id FROM picked) OR rowid = ? ORDER BY time, rowid",
            (points, head[0][0], step, last[1])).fetchall()

    def last_time(self) -> float | None:
        """The newest moment the store heard about: an event, a progress row or an instance change."""
        row = self.db.execute(
            "SELECT MAX(t) FROM (SELECT MAX(time) AS t FROM events UNION ALL SELECT MAX(time) FROM progress"
            " UNION ALL SELECT MAX(COALESCE(ended_at, notice_at, launched_at)) FROM instances)").fetchone()
        return float(row[0]) if row and row[0] is not None else None

    def close_lost_instances(self, at: float) -> list[str]:
        """Instances still open from a supervisor that died with them (SIGKILL, power loss): they
        end at ``at``, the last moment the store heard from that run, so their cost stops there
        instead of growing for as long as the run stays stopped."""
        ids = [r[0] for r in self.db.execute("SELECT id FROM instances WHERE ended_at IS NULL")]
        for instance_id in ids:
            self.update_instance(instance_id, ended_at=at, end_reason="lost")
            self.event("lost", instance_id, at=at)
        return ids

    def latest_epoch(self) -> int:
        row = self.db.execute("SELECT MAX(epoch) FROM progress").fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def latest_checkpoint(self) -> tuple[int, Path] | None:
        rows = self.db.execute("SELECT epoch, path FROM checkpoints ORDER BY epoch DESC").fetchall()
        for epoch, path in rows:
            if Path(path).exists():
                return int(epoch), Path(path)
        return None


@dataclass
class CostSummary:
    dollars: float
    on_demand_dollars: float
    instance_hours: float
    samples: int
    preemptions: int

    @property
    def savings(self) -> float:
        return self.on_demand_dollars - self.dollars

    @property
    def dollars_per_million_samples(self) -> float | None:
        return self.dollars / self.samples * 1e6 if self.samples else None


def summarize_costs(store: RunStore, now: float | None = None,
                    instances: list[InstanceRecord] | None = None) -> CostSummary:
    """Dollars summed over every instance the run ever had, across every recovery; the on-demand
    counterfactual prices the same instance-seconds at on-demand rates.  ``instances``: the store's,
    when the caller read them already."""
    now = now or store.clock()
    instances = store.instances() if instances is None else instances
    rows = store.db.execute("SELECT MAX(samples) FROM progress").fetchone()
    return CostSummary(
        dollars=sum(i.cost(now) for i in instances),
        on_demand_dollars=sum(i.on_demand_cost(now) for i in instances),
        instance_hours=sum(i.seconds(now) for i in instances) / 3600,
        samples=int(rows[0] or 0),
        preemptions=sum(1 for i in instances if i.end_reason == "preempted"),
    )
