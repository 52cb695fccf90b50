"""A run watched and stopped from another machine through its archive (``orchestrator/cli/remote.py``):
the head's publications (status document, store snapshot, logs), ``status``/``report``/``logs`` from a
machine with only the cluster YAML, and ``down`` asking the head through the archive.  The archive is a
directory here (the same interface as s3:// and gs://); the head is the real archiver, or, for the
stop's protocol alone, a thread that answers as a head does."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from orchestrator.cli import remote
from orchestrator.cli.main import main
from orchestrator.config.schema import ClusterConfig
from orchestrator.runs.durable import STATUS_DOC, BackgroundArchiver, RunArchive
from orchestrator.runs.store import RunStore
from tests.orchestrator.run_checks import fill_store

pytestmark = pytest.mark.timeout(60)


def config_data(runs_dir: Path, archive: Path) -> dict:
    return {
        "cluster_name": "r", "runs_dir": str(runs_dir),
        "provider": {"type": "local", "zones": ["a"]},
        "available_node_types": {"small": {"min_workers": 1, "max_workers": 1}},
        "training": {"task": "synthetic", "target_batch_size": 64},
        "checkpoint": {"uri": str(archive), "keep": 2},
    }


def head_and_laptop(tmp_path: Path) -> tuple[ClusterConfig, Path]:
    """The head's config (its run directory under head/) and the laptop's YAML: the same run and archive,
    another runs_dir, where no run directory exists."""
    archive = tmp_path / "archive" / "r"
    config = ClusterConfig.model_validate(config_data(tmp_path / "head" / "runs", archive))
    laptop = tmp_path / "laptop" / "cluster.yaml"
    laptop.parent.mkdir(parents=True)
    laptop.write_text(yaml.safe_dump(config_data(tmp_path / "laptop" / "runs", archive)))
    return config, laptop


def publish_a_run(config: ClusterConfig) -> BackgroundArchiver:
    """A head's run, published as its supervisor does: store snapshot, logs, status document."""
    store = RunStore.create(config)
    archive = RunArchive.for_config(config)
    fill_store(store, archive)
    (store.dir / "logs").mkdir(exist_ok=True)
    (store.dir / "logs" / "r-small-0000.log").write_text("epoch 3 done\n")
    archiver = BackgroundArchiver(archive, store.dir, since=time.time())
    store.close()
    status = {"cluster": "r", "state": "running", "published_at": time.time(), "epoch": 3, "live": 1, "head": "h1"}
    archiver.submit(status=json.dumps(status).encode(), logs=store.dir / "logs")
    assert archiver.flush(10)
    return archiver


def test_the_head_publishes_status_snapshot_and_logs_and_hears_only_new_stop_requests(tmp_path):
    config, _ = head_and_laptop(tmp_path)
    archive = RunArchive.for_config(config)
    archive.request_stop(by="earlier")  # before this head started: not for it
    time.sleep(0.01)
    archiver = publish_a_run(config)
    try:
        assert archive.status()["state"] == "running" and archive.has_history()
        assert archive.logs() == ["r-small-0000.log"] and archive.read_log("r-small-0000.log") == b"epoch 3 done\n"
        assert archiver.stop_request is None
        archive.request_stop(by="laptop")
        archiver.submit(history=False, status=b'{"state": "running"}')
        assert archiver.flush(10)
        assert archiver.stop_request["by"] == "laptop"
    finally:
        archiver.close()


def test_status_report_and_logs_from_a_machine_with_only_the_yaml(tmp_path, monkeypatch, capsys):
    config, laptop = head_and_laptop(tmp_path)
    publish_a_run(config).close()
    monkeypatch.chdir(laptop.parent)

    assert main(["status", str(laptop)]) == 0
    out = capsys.readouterr().out
    assert f"from {config.checkpoint.uri}: the head (h1) published" in out and "running, epoch 3" in out
    assert "run r: summary" in out
    assert not (tmp_path / "laptop" / "runs").exists()  # nothing of the run written here

    assert main(["logs", str(laptop)]) == 0
    assert "r-small-0000.log" in capsys.readouterr().out
    assert main(["logs", str(laptop), "r-small-0000"]) == 0
    assert capsys.readouterr().out.endswith("epoch 3 done\n")
    assert main(["logs", str(laptop), "nobody"]) == 2
    assert "no log nobody.log (there are: r-small-0000.log)" in capsys.readouterr().err

    assert main(["report", str(laptop)]) == 0
    assert (laptop.parent / "r-report" / "index.html").is_file()


def test_status_of_a_yaml_whose_run_was_never_archived_is_one_message(tmp_path, capsys):
    _, laptop = head_and_laptop(tmp_path)
    assert main(["status", str(laptop)]) == 2
    err = capsys.readouterr().err
    assert "none archived" in err and "Traceback" not in err


def answering_head(archive: RunArchive, answer: bool) -> threading.Thread:
    """A head that reads the stop request as the archiver does, then publishes stopping and stopped."""
    def run() -> None:
        deadline = time.monotonic() + 20
        while archive.stop_request() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if not answer:
            return
        for state in ("stopping", "stopped"):
            doc = {"cluster": "r", "state": state, "published_at": time.time(), "epoch": 3, "live": 0}
            archive.write_bytes(STATUS_DOC, json.dumps(doc).encode())
            time.sleep(0.2)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_down_from_another_machine_asks_the_head_through_the_archive(tmp_path, capsys):
    config, laptop = head_and_laptop(tmp_path)
    publish_a_run(config).close()
    head = answering_head(RunArchive.for_config(config), answer=True)
    assert main(["down", str(laptop)]) == 0
    head.join(5)
    out = capsys.readouterr().out
    assert "stop requested through" in out
    assert "r: stopped by its head; every instance released, data kept" in out
    assert main(["down", str(laptop)]) == 0  # asked again: the head said it stopped
    assert "its head said it stopped" in capsys.readouterr().out


def test_a_head_that_never_answers_is_given_up_on(tmp_path):
    config, _ = head_and_laptop(tmp_path)
    publish_a_run(config).close()
    head = answering_head(RunArchive.for_config(config), answer=False)
    out = Console(record=True, width=200)
    assert remote.down_through_archive(config, out, answer_s=1.0) is False
    head.join(5)
    assert "no answer from its head within 1 s" in out.export_text()


def test_token_issue_from_the_yaml_alone_signs_with_the_authority_key_in_the_archive(tmp_path, capsys):
    from orchestrator.cli.launch import new_authority_key
    from p2p import Identity
    from p2p.membership import Authority, Certificate

    config, laptop = head_and_laptop(tmp_path)
    archive = RunArchive.for_config(config)
    key = new_authority_key()
    archive.write_launch({"command": "up", "config_yaml": laptop.read_text(), "head": "head-1"}, key)
    (tmp_path / "k").write_bytes(key)
    authority = Authority.from_file(tmp_path / "k", "r", create=False)
    member_key = tmp_path / "volunteer.key"
    assert main(["token", "issue", str(laptop), "--identity-out", str(member_key), "--ttl", "1h"]) == 0
    out, err = capsys.readouterr()
    cert = Certificate.from_token(out.strip())
    assert (cert.run, cert.authority, cert.roles) == ("r", authority.public_key, ("volunteer",))
    cert.check(run="r", authority=authority.public_key, peer_id=Identity.from_file(member_key).peer_id,
               now=time.time())  # signed by the run's key, for the volunteer's new identity
    assert f"--identity {member_key}" in err and not (tmp_path / "laptop" / "runs").exists()


def test_token_issue_for_a_run_with_no_key_anywhere_says_so(tmp_path, capsys):
    _, laptop = head_and_laptop(tmp_path)
    assert main(["token", "issue", str(laptop)]) == 2
    assert "has no authority.key, nor has the run's archive" in capsys.readouterr().err
