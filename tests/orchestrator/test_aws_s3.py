"""Durable run state in S3 (moto in server mode, real HTTP): expert checkpoints, a consistent snapshot
under writes, a missing bucket, throttling, the background uploader, resume's misuse.  The round trip
and resume from a YAML, for every store, are ``test_archive_stores.py``'s."""

from __future__ import annotations

import errno
import logging
import sqlite3
import threading
from pathlib import Path

import pytest
import tenacity

boto3 = pytest.importorskip("boto3")
pytest.importorskip("s3fs")

from orchestrator.cli.main import main  # noqa: E402
from orchestrator.config.schema import ClusterConfig  # noqa: E402
from orchestrator.runs.durable import (  # noqa: E402
    ArchiveError,
    ArchiveMissing,
    BackgroundArchiver,
    RunArchive,
    open_filesystem,
)
from orchestrator.runs.store import RunStore  # noqa: E402
from tests.orchestrator.run_checks import fill_store  # noqa: E402

pytestmark = pytest.mark.timeout(60)

BUCKET = "spotswarm-runs"
URI = f"s3://{BUCKET}/team/r"


def config_data(tmp_path: Path, endpoint: str, **checkpoint) -> dict:
    return {
        "cluster_name": "r", "runs_dir": str(tmp_path / "runs"),
        "provider": {"type": "local", "zones": ["a"]},
        "available_node_types": {"small": {"min_workers": 1, "max_workers": 1}},
        "training": {"task": "synthetic", "target_batch_size": 64},
        "checkpoint": {"uri": URI, "endpoint_url": endpoint, "keep": 2, **checkpoint},
    }


def s3(endpoint: str):
    return boto3.client("s3", endpoint_url=endpoint)


def archived_names(endpoint: str, folder: str) -> list[str]:
    listing = s3(endpoint).list_objects_v2(Bucket=BUCKET, Prefix=f"team/r/{folder}/")
    return sorted(o["Key"].rsplit("/", 1)[1] for o in listing.get("Contents", []))


@pytest.fixture
def bucket(aws: str) -> str:
    s3(aws).create_bucket(Bucket=BUCKET)
    return aws


@pytest.fixture
def config(tmp_path: Path, bucket: str) -> ClusterConfig:
    return ClusterConfig.model_validate(config_data(tmp_path, bucket))


def test_expert_checkpoints_are_archived_in_the_background_and_restored(tmp_path, config, bucket):
    archive = RunArchive.for_config(config)
    store = RunStore.create(config)
    fill_store(store, archive, epochs=(1,))
    experts = store.dir / "checkpoints" / "experts"
    experts.mkdir()
    contents = {f"ffn.0.{j}.pt": bytes([j]) * (100 + j) for j in range(3)}
    for name, data in contents.items():
        (experts / name).write_bytes(data)
    archiver = BackgroundArchiver(archive, store.dir)
    archiver.submit(experts=experts)
    assert archiver.flush(30)  # the history after it, and nothing left owed
    archiver.close()
    store.close()
    assert archived_names(bucket, "experts") == sorted(contents)
    fresh = tmp_path / "elsewhere" / "r"
    assert archive.restore(fresh) == 1
    restored = {p.name: p.read_bytes() for p in (fresh / "checkpoints" / "experts").iterdir()}
    assert restored == contents


def test_a_checkpoint_archived_after_the_last_history_snapshot_is_still_restored(tmp_path, config):
    archive = RunArchive.for_config(config)
    store = RunStore.create(config)
    fill_store(store, archive, epochs=(1,))
    archive.save_history(store)
    later = store.dir / "checkpoints" / "epoch-000002.pt"
    later.write_bytes(b"newer")
    archive.save_checkpoint(later)  # its history upload never happened (the head vanished first)
    store.close()

    fresh = tmp_path / "elsewhere" / "r"
    assert archive.restore(fresh) == 2
    restored = RunStore.open(fresh)
    try:
        assert restored.latest_checkpoint() == (2, fresh / "checkpoints" / "epoch-000002.pt")
    finally:
        restored.close()


def snapshot_rows(tmp_path: Path, endpoint: str, name: str, sql: str) -> list:
    local = tmp_path / name
    s3(endpoint).download_file(BUCKET, "team/r/history/run.sqlite", str(local))
    db = sqlite3.connect(local)
    try:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        return db.execute(sql).fetchall()
    finally:
        db.close()


def test_history_snapshot_is_consistent_while_another_connection_writes(tmp_path, config, bucket):
    archive = RunArchive.for_config(config)
    store = RunStore.create(config)
    store.db.execute("PRAGMA wal_autocheckpoint=0")  # committed rows stay in the WAL, not in run.sqlite
    store.event("committed")
    writer = sqlite3.connect(store.dir / "run.sqlite", timeout=30)
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("INSERT INTO events VALUES (1.0, 'uncommitted', NULL, NULL)")
    archive.save_history(store)  # a reader beside an open write transaction: WAL lets it through
    kinds = [r[0] for r in snapshot_rows(tmp_path, bucket, "a.sqlite", "SELECT kind FROM events")]
    assert kinds == ["committed"]  # the WAL's committed rows, none of the open transaction's
    writer.commit()

    stop = threading.Event()

    def write_pairs() -> None:  # every transaction adds two rows: a consistent snapshot has an even count
        db = sqlite3.connect(store.dir / "run.sqlite", timeout=30)
        while not stop.is_set():
            with db:
                db.execute("INSERT INTO progress VALUES (1.0, 1, NULL, NULL, NULL, NULL)")
                db.execute("INSERT INTO progress VALUES (1.0, 2, NULL, NULL, NULL, NULL)")
        db.close()

    thread = threading.Thread(target=write_pairs)
    thread.start()
    try:
        for i in range(5):
            archive.save_history(store)
            (count,), = snapshot_rows(tmp_path, bucket, f"s{i}.sqlite", "SELECT COUNT(*) FROM progress")
            assert count % 2 == 0
    finally:
        stop.set()
        thread.join()
        writer.close()
        store.close()


def test_a_missing_bucket_is_a_clear_error_naming_the_uri(tmp_path, aws):
    archive = RunArchive("s3://no-such-bucket/runs/r", endpoint_url=aws)
    checkpoint = tmp_path / "epoch-000001.pt"
    checkpoint.write_bytes(b"x")
    with pytest.raises(ArchiveError, match=r"s3://no-such-bucket/runs/r: the bucket 'no-such-bucket' does not exist"):
        archive.save_checkpoint(checkpoint)
    with pytest.raises(ArchiveError, match="does not exist") as raised:
        archive.restore(tmp_path / "r")
    assert not isinstance(raised.value, ArchiveMissing)


class Flaky:
    """A store whose first ``failures`` uploads are throttled (S3's 503 SlowDown, as s3fs raises it)."""

    def __init__(self, fs, failures: int) -> None:
        self.fs, self.failures, self.calls = fs, failures, 0

    def put_file(self, *args, **kwargs):
        self.calls += 1
        if self.calls <= self.failures:
            raise OSError(errno.EBUSY, "SlowDown: please reduce your request rate")
        return self.fs.put_file(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.fs, name)


def test_throttling_is_retried_and_the_retries_are_bounded(tmp_path, bucket):
    checkpoint = tmp_path / "epoch-000001.pt"
    checkpoint.write_bytes(b"x")
    flaky = Flaky(open_filesystem(URI, bucket), failures=2)
    RunArchive(URI, fs=flaky, attempts=3, wait=tenacity.wait_none()).save_checkpoint(checkpoint)
    assert flaky.calls == 3 and archived_names(bucket, "checkpoints") == ["epoch-000001.pt"]

    hopeless = Flaky(open_filesystem(URI, bucket), failures=99)
    with pytest.raises(ArchiveError, match=f"{URI}: S3 still failing after 3 attempts"):
        RunArchive(URI, fs=hopeless, attempts=3, wait=tenacity.wait_none()).save_checkpoint(checkpoint)
    assert hopeless.calls == 3


class FakeArchive:
    """Records uploads; fails the first ``failures`` and can hold an upload until released."""

    uri = URI

    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.uploads: list[str] = []
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()

    def save_checkpoint(self, path: Path) -> None:
        self.entered.set()
        self.release.wait(10)
        if self.failures:
            self.failures -= 1
            raise ArchiveError(f"{URI}: S3 still failing")
        self.uploads.append(path.name)

    def save_history(self, run_dir: Path) -> None:
        self.uploads.append("history")


def test_uploads_run_in_the_background_and_a_failure_is_retried_at_the_next_checkpoint(tmp_path, caplog):
    first, second = tmp_path / "epoch-000001.pt", tmp_path / "epoch-000002.pt"
    first.write_bytes(b"1")
    second.write_bytes(b"2")
    archive = FakeArchive(failures=1)
    archive.release.clear()
    archiver = BackgroundArchiver(archive, tmp_path)  # type: ignore[arg-type]
    try:
        with caplog.at_level(logging.WARNING, logger="orchestrator.runs.durable"):
            archiver.submit(first)  # returns while the upload is held: the tick never waits on S3
            assert archive.entered.wait(10) and archive.uploads == []
            archive.release.set()
            assert not archiver.flush(10)  # the held upload failed: still owed
        assert archiver.failures == 1 and "retried at the next checkpoint" in caplog.text
        archiver.submit(second)  # the next checkpoint: the newest one goes, with the history
        assert archiver.flush(10)
        assert archive.uploads[0] == "epoch-000002.pt" and set(archive.uploads[1:]) == {"history"}  # coalesced
    finally:
        archiver.close()


def write_yaml(tmp_path: Path, endpoint: str, **checkpoint) -> Path:
    import yaml

    path = tmp_path / "cluster.yaml"
    data = config_data(tmp_path, endpoint)
    data["checkpoint"] = {k: v for k, v in {**data["checkpoint"], **checkpoint}.items() if v is not None}
    path.write_text(yaml.safe_dump(data))
    return path


def test_resume_misuse_exits_2_with_a_clear_message(tmp_path, bucket, capsys):
    assert main(["resume", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: no such run directory or cluster YAML" in capsys.readouterr().err

    (tmp_path / "empty").mkdir()
    assert main(["resume", str(tmp_path / "empty")]) == 2
    assert "is not a run directory (no run.sqlite)" in capsys.readouterr().err

    assert main(["resume", str(write_yaml(tmp_path, bucket, uri=None, endpoint_url=None))]) == 2
    assert "no checkpoint.uri to restore one from" in capsys.readouterr().err

    assert main(["resume", str(write_yaml(tmp_path, bucket))]) == 2  # the bucket is there, the run is not
    err = capsys.readouterr().err
    assert "none archived" in err and URI in err and not (tmp_path / "runs" / "r" / "run.sqlite").exists()
