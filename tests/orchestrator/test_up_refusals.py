"""What ``up`` and ``resume`` refuse before anything is created or launched: a run that is already up,
and an archive (``checkpoint.uri``) that cannot take a write.  One message each, exit 2."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from orchestrator.cli.main import main
from orchestrator.config.schema import ClusterConfig
from orchestrator.runs import pid as run_pid
from orchestrator.runs.store import RunStore


def local_yaml(tmp_path: Path, **checkpoint) -> Path:
    data = {
        "cluster_name": "r", "runs_dir": str(tmp_path / "runs"),
        "provider": {"type": "local", "zones": ["a"]},
        "available_node_types": {"small": {"min_workers": 1, "max_workers": 1}},
        "training": {"task": "synthetic", "target_batch_size": 64},
        **({"checkpoint": checkpoint} if checkpoint else {}),
    }
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_second_up_or_a_resume_of_a_run_that_is_up_is_refused_and_touches_nothing(tmp_path, capsys):
    path = local_yaml(tmp_path)
    config = ClusterConfig.model_validate(yaml.safe_load(path.read_text()))
    RunStore.create(config).close()
    run_dir = config.run_dir()
    run_pid.claim(run_dir)  # this process drives the run
    recorded = {name: (run_dir / name).read_bytes() for name in ("config.yaml", run_pid.PID_FILE)}
    try:
        assert main(["up", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"run r is already up (driven by pid {os.getpid()} on this machine)" in err
        assert f"spotswarm down {run_dir}" in err and "nothing started" in err and "Traceback" not in err
        assert main(["resume", str(run_dir)]) == 2
        assert "is already up" in capsys.readouterr().err
        assert {name: (run_dir / name).read_bytes() for name in recorded} == recorded
    finally:
        run_pid.release(run_dir)


def test_up_with_an_archive_in_a_missing_bucket_exits_2_before_creating_the_run(tmp_path, gcs, capsys):
    path = local_yaml(tmp_path, uri="gs://no-such-bucket/r", endpoint_url=gcs)
    assert main(["up", str(path)]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.uri cannot take the run's archive: gs://no-such-bucket/r: the bucket 'no-such-bucket' " \
           "does not exist" in err and "nothing started" in err
    assert not (tmp_path / "runs").exists()


def test_up_with_an_archive_directory_that_cannot_be_written_exits_2(tmp_path, capsys):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the archive's directory should be")
    assert main(["up", str(local_yaml(tmp_path, uri=str(blocker / "r")))]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint.uri cannot take the run's archive: {blocker / 'r'}" in err
    assert not (tmp_path / "runs").exists()


@pytest.fixture(autouse=True)
def _no_ray_started():
    """Nothing here may start Ray: every case is refused before."""
    yield
    import sys

    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized()


def test_up_over_an_archive_holding_a_run_is_refused_naming_resume_and_fresh(tmp_path, capsys):
    import shutil

    from orchestrator.runs.durable import RunArchive

    archive_dir = tmp_path / "archive" / "r"
    path = local_yaml(tmp_path, uri=str(archive_dir))
    config = ClusterConfig.model_validate(yaml.safe_load(path.read_text()))
    archive = RunArchive(str(archive_dir))
    store = RunStore.create(config)
    try:
        archive.save_history(store)
        archive.request_stop(by="someone")
    finally:
        store.close()
    shutil.rmtree(tmp_path / "runs")  # the run lives on in its archive only
    assert main(["up", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{archive_dir} already holds an archived run of r: `spotswarm resume {path}` continues it; " \
           f"`spotswarm up {path} --fresh` deletes it and starts over; nothing started" in err
    assert archive.has_history() and not (tmp_path / "runs").exists()
    archive.clear()  # what --fresh does first
    assert not archive.has_history() and archive.stop_request() is None and archive.status() is None
