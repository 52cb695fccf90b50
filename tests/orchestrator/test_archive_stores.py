"""One archive interface for every store (fsspec): S3 (moto in server mode, s3fs), Cloud Storage
(gcp-storage-emulator, gcsfs), both over real HTTP, and a local directory hold and restore a run alike.
S3's own cases (throttling, the background uploader, resume's misuse) are ``test_aws_s3.py``'s."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from orchestrator.cli import cluster
from orchestrator.cli.main import main
from orchestrator.config.schema import ClusterConfig
from orchestrator.runs.durable import ArchiveError, ArchiveMissing, RunArchive
from orchestrator.runs.store import RunStore
from tests.orchestrator.run_checks import fill_store

BUCKET = "spotswarm-runs"  # the one the ``gcs`` fixture's emulator holds


def config_data(tmp_path: Path, uri: str, endpoint: str | None) -> dict:
    checkpoint = {"uri": uri, "keep": 2, **({"endpoint_url": endpoint} if endpoint else {})}
    return {
        "cluster_name": "r", "runs_dir": str(tmp_path / "runs"),
        "provider": {"type": "local", "zones": ["a"]},
        "available_node_types": {"small": {"min_workers": 1, "max_workers": 1}},
        "training": {"task": "synthetic", "target_batch_size": 64},
        "checkpoint": checkpoint,
    }


@pytest.fixture(params=["s3", "gs", "directory"])
def where(request, tmp_path: Path) -> tuple[str, str | None]:
    """(checkpoint.uri, checkpoint.endpoint_url) of a fresh archive."""
    if request.param == "s3":
        boto3 = pytest.importorskip("boto3")
        pytest.importorskip("s3fs")
        moto = request.getfixturevalue("aws")
        boto3.client("s3", endpoint_url=moto).create_bucket(Bucket=BUCKET)
        return f"s3://{BUCKET}/{tmp_path.name}/r", moto
    if request.param == "gs":
        return f"gs://{BUCKET}/{tmp_path.name}/r", request.getfixturevalue("gcs")
    return str(tmp_path / "archive" / "r"), None


def test_an_archived_run_is_restored_with_its_rows_and_newest_checkpoint_only_keep_kept(tmp_path, where):
    uri, endpoint = where
    config = ClusterConfig.model_validate(config_data(tmp_path, uri, endpoint))
    archive = RunArchive.for_config(config)
    store = RunStore.create(config)
    contents = fill_store(store, archive)
    archive.save_history(store)
    before = {"instances": store.instances(), "events": store.events(), "progress": store.progress_rows()}
    store.close()

    assert archive.checkpoints() == ["epoch-000003.pt", "epoch-000002.pt"]  # keep: 2
    fresh = tmp_path / "elsewhere" / "r"
    assert archive.restore(fresh) == 3
    restored = RunStore.open(fresh)
    try:
        assert restored.instances() == before["instances"]
        assert restored.progress_rows() == before["progress"]
        events = restored.events()
        assert events[:-1] == before["events"]
        assert events[-1][1] == "restored" and json.loads(events[-1][3]) == {"from": uri, "epoch": 3}
        paths = restored.db.execute("SELECT epoch, path FROM checkpoints ORDER BY epoch").fetchall()
        assert paths == [(e, str(fresh / "checkpoints" / f"epoch-{e:06d}.pt")) for e in (1, 2, 3)]
        assert restored.latest_checkpoint() == (3, fresh / "checkpoints" / "epoch-000003.pt")
        assert restored.config() == config
    finally:
        restored.close()
    assert (fresh / "checkpoints" / "epoch-000003.pt").read_bytes() == contents[3]
    assert sorted(p.name for p in (fresh / "checkpoints").iterdir()) == ["epoch-000003.pt"]
    with pytest.raises(FileExistsError):  # never over a run that is there
        archive.restore(fresh)


def test_small_documents_are_written_read_and_missing_ones_are_none(tmp_path, where):
    archive = RunArchive(*where)
    assert archive.read_bytes("status.json") is None
    archive.write_bytes("status.json", b'{"epoch": 7}')
    archive.write_bytes("status.json", b'{"epoch": 8}')
    assert archive.read_bytes("status.json") == b'{"epoch": 8}'
    archive.check_writable()


def test_a_missing_gcs_bucket_is_a_clear_error_naming_the_uri(tmp_path, gcs):
    archive = RunArchive("gs://no-such-bucket/runs/r", endpoint_url=gcs)
    checkpoint = tmp_path / "epoch-000001.pt"
    checkpoint.write_bytes(b"x")
    expected = "gs://no-such-bucket/runs/r: the bucket 'no-such-bucket' does not exist"
    with pytest.raises(ArchiveError, match=expected):
        archive.save_checkpoint(checkpoint)
    with pytest.raises(ArchiveError, match=expected):
        archive.check_writable()
    with pytest.raises(ArchiveError, match="does not exist") as raised:
        archive.restore(tmp_path / "r")
    assert not isinstance(raised.value, ArchiveMissing)


def test_resume_from_a_yaml_restores_a_vanished_run_once(tmp_path, where):
    uri, endpoint = where
    data = config_data(tmp_path, uri, endpoint)
    config = ClusterConfig.model_validate(data)
    archive = RunArchive.for_config(config)
    store = RunStore.create(config)
    contents = fill_store(store, archive)
    archive.save_history(store)
    store.close()
    for path in sorted(config.run_dir().rglob("*"), reverse=True):  # the head machine vanished
        path.rmdir() if path.is_dir() else path.unlink()

    yaml_path = tmp_path / "cluster.yaml"
    yaml_path.write_text(yaml.safe_dump(data))
    out = io.StringIO()
    run_dir = cluster.resume_target(str(yaml_path), Console(file=out, width=200))
    assert run_dir == config.run_dir()
    assert f"restored run r from {uri} at checkpoint epoch 3" in out.getvalue()
    assert (run_dir / "checkpoints" / "epoch-000003.pt").read_bytes() == contents[3]
    assert cluster.resume_target(str(yaml_path), Console(file=out)) == run_dir  # local now: no second restore
    assert cluster.resume_target(str(run_dir), Console(file=out)) == run_dir  # a run directory, as before
    store = RunStore.open(run_dir)
    try:
        assert [json.loads(e[3]) for e in store.events("restored")] == [{"from": uri, "epoch": 3}]
        assert store.latest_checkpoint() == (3, run_dir / "checkpoints" / "epoch-000003.pt")
    finally:
        store.close()


def test_resume_from_an_empty_gcs_prefix_exits_2_and_creates_nothing(tmp_path, gcs, capsys):
    uri = f"gs://{BUCKET}/{tmp_path.name}/nothing"
    yaml_path = tmp_path / "cluster.yaml"
    yaml_path.write_text(yaml.safe_dump(config_data(tmp_path, uri, gcs)))
    assert main(["resume", str(yaml_path)]) == 2
    err = capsys.readouterr().err
    assert "none archived" in err and uri in err and not (tmp_path / "runs" / "r" / "run.sqlite").exists()


def test_an_archive_uri_of_a_store_without_its_library_names_the_extra(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_gcsfs(name, *args, **kwargs):
        if name == "gcsfs":
            raise ImportError("No module named 'gcsfs'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_gcsfs)
    with pytest.raises(ArchiveError, match=r"needs gcsfs: pip install 'spotswarm\[gcp\]'"):
        RunArchive("gs://bucket/x")


def test_a_missing_bucket_is_created_once_and_a_whole_archived_run_cleared(tmp_path, where):
    uri, endpoint = where
    if not uri.startswith(("s3://", "gs://")):
        pytest.skip("a directory has no bucket")
    scheme, rest = uri.split("://")
    archive = RunArchive(f"{scheme}://spotswarm-new-{tmp_path.name.lower().replace('_', '-')[:20]}/r",
                         endpoint_url=endpoint)
    assert archive.ensure_bucket("us-east-1") is True  # a launched run's default bucket
    assert archive.ensure_bucket("us-east-1") is False
    archive.check_writable()
    archive.write_launch({"command": "up"}, b"key")
    archive.request_stop(by="me")
    archive.clear()
    assert archive.stop_request() is None and archive.authority_key() is None
