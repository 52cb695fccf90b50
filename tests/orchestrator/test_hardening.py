"""Files a run trusts that someone else may have written or outlived: a checkpoint is read as tensors
only, and the run's pid file never leads to another process that got the same pid."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from orchestrator.chaos import disk as chaos_disk
from orchestrator.runs import figures
from orchestrator.runs import pid as run_pid
from orchestrator.runs.checkpoint_io import read_checkpoint

pytestmark = pytest.mark.timeout(60)


class _Planted:
    """Unpickled by a full ``torch.load``, it would create a file: code run by reading a checkpoint."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_is_read_as_tensors_and_a_planted_object_is_refused(tmp_path):
    good = tmp_path / "epoch-000004.pt"
    state = {"params": [torch.arange(3.0)], "optimizer": {"state": {}, "param_groups": [{"lr": 0.1}]},
             "scheduler": None}
    torch.save({"epoch": 4, "state": state}, good)
    epoch, loaded = read_checkpoint(good)
    assert epoch == 4 and torch.equal(loaded["params"][0], torch.arange(3.0))
    assert loaded["optimizer"]["param_groups"] == [{"lr": 0.1}]

    marker = tmp_path / "code-ran"
    bad = tmp_path / "epoch-000005.pt"
    torch.save({"epoch": 5, "state": {"params": [], "x": _Planted(str(marker))}}, bad)
    with pytest.raises(ValueError, match=r"epoch-000005\.pt cannot be read as tensors and plain values"):
        read_checkpoint(bad)
    assert not marker.exists()  # refused before anything in it ran

    for junk in (b"", b"not a checkpoint", b"PK\x03\x04" + os.urandom(64)):
        bad.write_bytes(junk)
        with pytest.raises(ValueError, match="cannot be read as tensors"):
            read_checkpoint(bad)


def test_the_run_pid_file_names_its_driver_only_while_that_very_process_runs(tmp_path):
    assert run_pid.driver(tmp_path) is None and not figures.is_live(tmp_path)
    run_pid.claim(tmp_path)
    assert run_pid.driver(tmp_path).pid == os.getpid() and figures.is_live(tmp_path)

    # the same pid with another start time: the pid was reused, the run's driver is gone
    pid_file = tmp_path / run_pid.PID_FILE
    pid_file.write_text(f"{os.getpid()} {psutil.Process().create_time() - 100.0!r}")
    assert run_pid.driver(tmp_path) is None and not figures.is_live(tmp_path)
    pid_file.write_text(str(os.getpid()))  # no start time recorded: cannot be told from a stranger
    assert run_pid.driver(tmp_path) is None

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pid_file.write_text(f"{child.pid} {psutil.Process(child.pid).create_time()!r}")
        assert run_pid.driver(tmp_path).pid == child.pid
    finally:
        child.kill()
        child.wait()
    assert run_pid.driver(tmp_path) is None  # ended: not live, whatever the file says
    run_pid.release(tmp_path)
    assert not pid_file.exists()


def test_down_never_signals_a_process_that_got_the_runs_pid(tmp_path, capsys):
    from orchestrator.cli.main import main
    from orchestrator.config.checks import load_cluster_config
    from orchestrator.runs.store import RunStore

    config = load_cluster_config(Path(__file__).resolve().parents[2] / "cluster_configs" / "local.yaml")
    store = RunStore.create(config, base=tmp_path)
    store.close()
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:  # the run's driver died; the system gave its pid to this process, started later
        started = psutil.Process(stranger.pid).create_time()
        (store.dir / run_pid.PID_FILE).write_text(f"{stranger.pid} {started - 30.0!r}")
        assert main(["down", str(store.dir)]) == 0
        assert stranger.poll() is None  # not signalled
        assert "not running" in " ".join(capsys.readouterr().out.split())  # the console wraps lines
        assert not (store.dir / run_pid.PID_FILE).exists()  # the stale file is gone
    finally:
        stranger.kill()
        stranger.wait()


def one_machine_config(tmp_path, name: str):
    from orchestrator.config.schema import ClusterConfig

    return ClusterConfig.model_validate({"cluster_name": name, "runs_dir": str(tmp_path / "runs"),
                                         "available_node_types": {"small": {"min_workers": 1, "max_workers": 1}}})


def assert_written_in_order(run_dir) -> None:
    """The held writes of the full-disk tests landed, all of them and in their order."""
    from orchestrator.runs.store import RunStore

    store = RunStore.open(run_dir)
    try:
        kinds = [k for (k,) in store.db.execute("SELECT kind FROM events ORDER BY rowid")]
        assert kinds == ["before", "launch", "after"]
        assert [row[1] for row in store.progress_rows()] == list(range(1, 200))
        (instance,) = store.instances()
        assert (instance.ended_at, instance.end_reason) == (200.0, "preempted")
    finally:
        store.close()


@pytest.mark.skipif(chaos_disk.unavailable() is not None, reason=str(chaos_disk.unavailable()))
def test_a_full_disk_holds_the_run_stores_writes_back_in_order_and_loses_none(tmp_path):
    from orchestrator.runs.store import InstanceRecord, RunStore

    config = one_machine_config(tmp_path, "full")
    run_dir = config.run_dir()
    with chaos_disk.small_disk(run_dir, 8):
        store = RunStore.create(config)
        store.retry_every_s = 0.0  # every write tries the held ones again (by default once a second)
        store.event("before")
        assert chaos_disk.fill(run_dir) > 0
        # the writes a supervisor's tick makes while the disk is full: none raises, none is lost
        store.launched(InstanceRecord("i-1", "small", "a", "spot", 0.1, 1.0, 100.0))
        for epoch in range(1, 200):
            store.progress(epoch, 1.0 / epoch, 10.0, 1, epoch * 64)
        store.update_instance("i-1", ended_at=200.0, end_reason="preempted")
        assert store.pending_writes > 0, "the disk was not full"
        chaos_disk.unfill(run_dir)
        store.event("after")  # the next write lands the held ones first
        assert store.pending_writes == 0
        store.close()
    assert_written_in_order(run_dir)  # back on the real disk, as it was written
    with pytest.raises(sqlite3.OperationalError):  # a bad statement is still the caller's error
        RunStore.open(run_dir).update_instance("i-1", no_such_column=1)


@pytest.mark.skipif(chaos_disk.unavailable() is not None, reason=str(chaos_disk.unavailable()))
def test_a_batch_that_meets_a_full_disk_is_held_back_whole_and_lands_in_order(tmp_path):
    """A tick's writes go into one transaction; a commit with no room rolls it back, and every write
    of the batch waits with the held ones instead of being lost."""
    from orchestrator.runs.store import InstanceRecord, RunStore

    config = one_machine_config(tmp_path, "batch")
    run_dir = config.run_dir()
    with chaos_disk.small_disk(run_dir, 8):
        store = RunStore.create(config)
        store.retry_every_s = 0.0
        store.event("before")
        with store.batch():
            store.launched(InstanceRecord("i-1", "small", "a", "spot", 0.1, 1.0, 100.0))
            assert [r.id for r in store.instances()] == ["i-1"]  # this store reads its own batch at once
            assert chaos_disk.fill(run_dir) > 0
            for epoch in range(1, 200):
                store.progress(epoch, 1.0 / epoch, 10.0, 1, epoch * 64)
            store.update_instance("i-1", ended_at=200.0, end_reason="preempted")
        assert store.pending_writes > 0, "the disk was not full"
        assert store.instances() == []  # rolled back, held in memory
        chaos_disk.unfill(run_dir)
        store.event("after")  # the next write lands the held ones first
        assert store.pending_writes == 0
        store.close()
    assert_written_in_order(run_dir)


@pytest.mark.skipif(chaos_disk.unavailable() is not None, reason=str(chaos_disk.unavailable()))
def test_a_long_full_disk_outage_costs_bounded_memory_and_time_and_keeps_every_accounting_row(tmp_path):
    """Held writes are tried again once per ``retry_every_s``, not on every write (each try replays
    them all); past ``max_pending`` every other progress sample goes, never an instance or event row."""
    from orchestrator.runs.store import InstanceRecord, RunStore

    config = one_machine_config(tmp_path, "long")
    run_dir = config.run_dir()
    with chaos_disk.small_disk(run_dir, 8):
        store = RunStore.create(config)
        store.retry_every_s, store.max_pending = 3600.0, 100
        assert chaos_disk.fill(run_dir) > 0
        executed = []
        store.db.set_trace_callback(executed.append)
        store.launched(InstanceRecord("i-1", "small", "a", "spot", 0.1, 1.0, 100.0))
        for epoch in range(1, 1001):
            store.progress(epoch, None, 10.0, 1, epoch * 64)
            if epoch % 100 == 0:
                store.event("tick", detail={"epoch": epoch})
        store.update_instance("i-1", ended_at=2000.0, end_reason="preempted")
        store.db.set_trace_callback(None)
        assert len(executed) < 20, "held writes were replayed on every write"
        assert store.pending_writes <= 2 * store.max_pending
        chaos_disk.unfill(run_dir)
        store.close()  # closing tries once more: everything held lands
    store = RunStore.open(run_dir)
    try:
        kinds = [k for (k,) in store.db.execute("SELECT kind FROM events ORDER BY rowid")]
        assert kinds == ["launch"] + ["tick"] * 10  # every event, in order
        (instance,) = store.instances()
        assert (instance.ended_at, instance.end_reason) == (2000.0, "preempted")
        epochs = [row[1] for row in store.progress_rows()]
        assert 50 <= len(epochs) < 1000 and epochs == sorted(epochs) and epochs[-1] >= 990
    finally:
        store.close()


def test_a_bad_write_is_the_callers_error_and_does_not_block_the_writes_after_it(tmp_path):
    from orchestrator.runs.store import RunStore

    config = one_machine_config(tmp_path, "bad")
    store = RunStore.create(config)
    try:
        with pytest.raises(Exception, match="bind|type"):
            store.progress(1, object(), 10.0, 1, 64)  # type: ignore[arg-type]  # not a number
        store.progress(2, 0.5, 10.0, 1, 128)
        assert store.pending_writes == 0
        assert [row[1] for row in store.progress_rows()] == [2]
    finally:
        store.close()
