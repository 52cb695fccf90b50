"""Checks the orchestrator tests share, so that the AWS and GCP tests (and the local ones that run
the same flow) say each thing once: a run store's rows, cluster YAML errors and warnings, the
fleet policy driving a real provider with no workers behind it, and a run's end-to-end flow (a
supervised run, a reclaim and its replacement, peers that agree, a clean release).

Ray, the supervisor and the providers are imported where they are used: a module that imports
this one needs only what its own tests use."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from hypothesis import strategies as st

from orchestrator.config.checks import load_cluster_config
from orchestrator.config.schema import ClusterConfig, ConfigError
from orchestrator.runs.store import InstanceRecord
from tests.fakes.workers import FakeWorkers

if TYPE_CHECKING:
    from orchestrator.fleet.policy import FleetPolicy
    from orchestrator.fleet.supervisor import SupervisorCore

ROOT = Path(__file__).resolve().parents[2]


# ---- the run store ---------------------------------------------------------------------------------
def query(run_dir: Path, sql: str, *args: Any) -> list:
    db = sqlite3.connect(run_dir / "run.sqlite")
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def event_time(run_dir: Path, kind: str, instance_id: str) -> float:
    rows = query(run_dir, "SELECT time FROM events WHERE kind = ? AND instance_id = ?", kind, instance_id)
    assert rows, f"no {kind} event for {instance_id}"
    return rows[0][0]


# ---- cluster YAML ----------------------------------------------------------------------------------
# any JSON value, for fuzzing what a section may hold
ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner,
                                                                                      max_size=3),
                        max_leaves=15)


def write(tmp_path: Path, text: str, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load(path: Path) -> tuple[ClusterConfig, list[str]]:
    """The config and the warnings its loading gave (collected, not logged)."""
    warnings: list[str] = []
    return load_cluster_config(path, warnings), warnings


def errors_of(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_cluster_config(path, [])
    return str(info.value).splitlines()


def line_of(text: str, start: str) -> int:
    """The number of the first line of ``text`` that starts (after its indent) with ``start``."""
    return next(i for i, line in enumerate(text.splitlines(), 1) if line.lstrip().startswith(start))


def check_any_node_config(tmp_path_factory: pytest.TempPathFactory, text: str, node_config: dict,
                          head: bool) -> None:
    """``text`` with node type w's node_config replaced (and w made the head, if asked) loads, or is a
    ConfigError: every error line and every warning names the file, one line each."""
    data = yaml.safe_load(text)
    data["available_node_types"]["w"]["node_config"] = node_config
    if head:
        data["head_node_type"] = "w"
    path = tmp_path_factory.mktemp("fuzz") / "c.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    warnings: list[str] = []
    try:
        load_cluster_config(path, warnings)
    except ConfigError as e:
        assert all(line.startswith(f"{path}:") for line in str(e).splitlines())
    assert all(w.startswith(f"{path}:") and "\n" not in w for w in warnings)


def validate_shipped(capsys: pytest.CaptureFixture, name: str, summary: str) -> ClusterConfig:
    """``spotswarm validate`` on a shipped config: exit 0, its one-line summary, not a warning."""
    from orchestrator.cli.main import main

    path = ROOT / "cluster_configs" / name
    assert main(["validate", str(path)]) == 0
    out, err = capsys.readouterr()
    assert (out, err) == (f"{path}: valid ({summary})\n", "")
    return load(path)[0]


def shipped_yaml(tmp_path: Path, name: str, endpoint: str, storage: str | None = None) -> Path:
    """A shipped config as a file of this test's, pointed at a cloud stand-in and at ``tmp_path/runs``;
    its archive at ``storage`` (an S3 archive: at ``endpoint``, moto), else in ``tmp_path/archive``.
    Never without one: a cloud run with no ``checkpoint.uri`` takes the cloud's default bucket."""
    data = yaml.safe_load((ROOT / "cluster_configs" / name).read_text())
    data["provider"]["endpoint_url"] = endpoint
    data["runs_dir"] = str(tmp_path / "runs")
    checkpoint = data.get("checkpoint") or {}
    if checkpoint.get("uri"):  # never the real cloud's storage
        storage = storage or (endpoint if checkpoint["uri"].startswith("s3://") else None)
        if storage:
            checkpoint["endpoint_url"] = storage
        else:
            checkpoint["uri"] = str(tmp_path / "archive")
    return write(tmp_path, yaml.safe_dump(data), name)


# ---- the fleet policy with no workers: tests about the cloud ---------------------------------------
def tick_until(policy: FleetPolicy, until: Callable[[FleetPolicy], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not until(policy):
        assert time.monotonic() < deadline, f"{what}: {policy.status_text}"
        policy.tick()
        time.sleep(0.05)  # the policy's own tick period, shortened; the calls run on its threads


@contextmanager
def fleet_policy(config: ClusterConfig, provider_cls: Callable, live: int = 0) -> Iterator[FleetPolicy]:
    """The fleet policy driving the real provider (``provider_cls``) for a new run of ``config``, ticked
    until ``live`` instances are live; after the test every instance is released."""
    from orchestrator.fleet.policy import FleetPolicy
    from orchestrator.runs.store import RunStore

    policy = FleetPolicy(config, provider_cls(config, time.time), time.time, RunStore.create(config),
                         FakeWorkers(), lambda node_type: {})
    try:
        if live:
            tick_until(policy, lambda p: len(p.live) == live, "policy did not get there")
        yield policy
    finally:
        policy.release_all()
        policy.shutdown()


def refusal_stops_the_run(policy: FleetPolicy, launches: Callable[[], int]) -> str:
    """Ticks until a refusal (the credentials, their permissions) stops the run, which then holds no
    instance and tries no launch (``launches`` counts them); the run's fatal message."""
    # launches already in flight when the refusal came end too (refused, or released as they land)
    tick_until(policy, lambda p: p.fatal is not None and p.launching == 0 and not p.calls.running,
               "the refusal never stopped the run")
    assert policy.live == {} and policy.launching == 0
    asked = launches()
    for _ in range(5):
        policy.tick()
    assert launches() == asked  # nothing more is tried
    return policy.fatal


# ---- a run end to end (Ray) ------------------------------------------------------------------------
@contextmanager
def supervised(config: ClusterConfig) -> Iterator[tuple[SupervisorCore, Path]]:
    """A new run of ``config`` under a started supervisor, and its directory; stopped after, also
    when the test fails."""
    from orchestrator.fleet.supervisor import SupervisorCore
    from orchestrator.runs.store import RunStore

    RunStore.create(config).close()
    run_dir = config.run_dir()
    core = SupervisorCore(config, run_dir)
    core.start()
    try:
        yield core, run_dir
    finally:
        core.stop()


def wait_for_workers(core: SupervisorCore, size: int, wait_for: Callable, timeout: float, what: str) -> None:
    """Until ``size`` instances run a worker that has joined (it has a peer id)."""
    wait_for(lambda: len([i for i in list(core.live.values()) if i.tags.get("peer_id")]) == size, timeout, what)


def wait_for_epochs(core: SupervisorCore, epochs: int, wait_for: Callable, timeout: float,
                    what: str = "training to go on") -> None:
    """Until the run is ``epochs`` global epochs further than now."""
    epoch_now = core.epoch
    wait_for(lambda: core.epoch >= epoch_now + epochs, timeout, what)


def wait_until_preempted(run_dir: Path, instance_id: str, wait_for: Callable, timeout: float, what: str) -> None:
    wait_for(lambda: query(run_dir, "SELECT end_reason FROM instances WHERE id = ?", instance_id) == [("preempted",)],
             timeout, what)


def wait_for_first_step(run_dir: Path, instance_id: str, wait_for: Callable, timeout: float) -> float:
    """Until a (replacement) instance's worker has made its first averaged step; when it did."""
    wait_for(lambda: query(run_dir, "SELECT 1 FROM events WHERE kind = 'first_step' AND instance_id = ?",
                           instance_id), timeout, "the replacement's first averaged step")
    return event_time(run_dir, "first_step", instance_id)


def history(instance_id: str) -> dict[int, str]:
    """A worker's parameter digest after each of its averaged epochs."""
    import ray

    from orchestrator.instance.actor import worker_actor_name

    records = ray.get(ray.get_actor(worker_actor_name(instance_id)).history.remote(), timeout=60)
    return {r["epoch"]: r["params"] for r in records}


def assert_peers_agree(instance_ids: list[str], who: str = "the live peers") -> None:
    """The peers share averaged epochs, and after each they held the same parameters."""
    histories = {i: history(i) for i in instance_ids}
    common = set.intersection(*(set(h) for h in histories.values()))
    assert common, f"{who} share averaged epochs"
    for epoch in sorted(common):
        assert len({h[epoch] for h in histories.values()}) == 1, f"parameters differ after epoch {epoch}"


@dataclasses.dataclass
class Replacement:
    """A reclaimed instance and the one that took its place."""

    victim: str
    machine: Any  # the victim's harness Machine: noticed_at, killed_at, zone, metadata
    left_at: float  # the victim's graceful leave
    instance_id: str  # the replacement
    first_step: float  # the replacement's first averaged step
    api_calls: int  # the cloud API's calls from just before the notice to that first step

    def figures(self, taken_back: str) -> dict[str, float]:
        """The replacement's cost in calls and its timings (``taken_back``: the cloud's word for it)."""
        return {"api_calls_per_replacement": self.api_calls,
                "notice_to_graceful_leave_s": round(self.left_at - self.machine.noticed_at, 2),
                f"{taken_back}_to_replacement_first_step_s": round(self.first_step - self.machine.killed_at, 2),
                "notice_to_replacement_first_step_s": round(self.first_step - self.machine.noticed_at, 2)}


def reclaim_and_replace(core: SupervisorCore, run_dir: Path, harness, api_calls: list, wait_for: Callable,
                        notice_s: float, *, recorded_s: float, replaced_s: float, first_step_s: float) -> Replacement:
    """The cloud takes the fleet's first instance back ``notice_s`` after its notice: it is recorded as
    preempted, its own metadata watcher saw the notice, it left gracefully before the kill, and a new
    instance (running, the victim's machine off) made its first averaged step.  ``api_calls`` is the
    stand-in's list of calls."""
    fleet = set(core.live)
    victim = sorted(fleet)[0]
    calls_before = len(api_calls)
    machine = harness.preempt(victim, notice_s)
    wait_until_preempted(run_dir, victim, wait_for, recorded_s, "the reclaimed instance to be recorded as preempted")
    notice = json.loads(query(run_dir, "SELECT detail FROM events WHERE kind = 'notice' AND instance_id = ?",
                              victim)[0][0])
    assert notice["source"] == "instance"  # its own metadata watcher saw it, not the supervisor
    left_at = event_time(run_dir, "left", victim)
    assert machine.noticed_at < left_at < machine.killed_at  # the graceful leave came before the kill

    found: list[str] = []

    def replaced() -> bool:
        found[:] = sorted(set(core.live) - fleet)
        return bool(found)

    wait_for(replaced, replaced_s, "a replacement instance")
    replacement = found[0]
    first_step = wait_for_first_step(run_dir, replacement, wait_for, first_step_s)
    calls = len(api_calls) - calls_before
    assert replacement in harness.alive() and victim not in harness.alive()
    return Replacement(victim, machine, left_at, replacement, first_step, calls)


def assert_released(run_dir: Path, harness, wait_for: Callable) -> None:
    """After the run: every instance ended in the cloud, so the harness cut its power; none is open in
    the run store, and the harness met no error."""
    wait_for(lambda: harness.alive() == [], 60, "every instance's node to stop")
    assert query(run_dir, "SELECT COUNT(*) FROM instances WHERE ended_at IS NULL") == [(0,)]
    assert harness.errors == []


# ---- a clean stop loses nothing ----------------------------------------------------------------------
LOADED = re.compile(r"loaded state of epoch (\d+) from peers \(parameters ([0-9a-f]+)\)")


def last_stop(run_dir: Path) -> dict:
    """The final checkpoint of the run's last clean stop, as the store recorded it."""
    stops = query(run_dir, "SELECT time FROM events WHERE kind = 'stopping' ORDER BY time DESC LIMIT 1")
    assert stops, "the run was never stopped cleanly"
    found = query(run_dir, "SELECT kind, detail FROM events WHERE kind LIKE 'final_checkpoint%' AND time >= ? "
                           "ORDER BY time", stops[0][0])
    assert [kind for kind, _ in found] == ["final_checkpoint"], found
    return json.loads(found[0][1])


def assert_stop_lost_nothing(run_dir: Path) -> tuple[int, str]:
    """The last clean stop wrote a final checkpoint of the epoch the run stopped at, newer than every
    periodic one, whose parameters are bit-equal to those its peers stopped with (each peer hashed its
    own in its process); the newest checkpoint on record, which ``resume`` starts from.  Its epoch and
    parameter digest."""
    from orchestrator.runs.checkpoint_io import read_checkpoint
    from workers.state import params_digest

    stop = last_stop(run_dir)
    epoch, path = stop["epoch"], Path(stop["path"])
    assert stop["written"] and epoch > 0
    assert epoch == query(run_dir, "SELECT MAX(epoch) FROM progress")[0][0]  # the epoch the run stopped at
    periodic = [json.loads(d)["epoch"] for (d,) in query(run_dir, "SELECT detail FROM events WHERE kind = "
                                                                  "'checkpoint'") if "final" not in json.loads(d)]
    assert all(e <= epoch for e in periodic)
    file_epoch, state = read_checkpoint(path)
    digest = params_digest(state["params"])
    at_stop = [peer for peer in stop["peers"].values() if peer["epoch"] == epoch]
    assert file_epoch == epoch and at_stop, stop
    assert all(peer["params"] == digest and peer["settled"] for peer in at_stop), (digest, stop)
    assert query(run_dir, "SELECT epoch, path FROM checkpoints ORDER BY epoch DESC, time DESC LIMIT 1") == \
        [(epoch, str(path))]
    return epoch, digest


def loaded_states(run_dir: Path, instance_ids: list[str]) -> dict[str, tuple[int, str]]:
    """The state each instance's worker loaded first (epoch, parameter digest), from its log in the run
    directory; instances that loaded none are left out."""
    out = {}
    for instance_id in instance_ids:
        log = run_dir / "logs" / f"{instance_id}.log"
        found = LOADED.search(log.read_text()) if log.exists() else None
        if found:
            out[instance_id] = (int(found.group(1)), found.group(2))
    return out


def instances_since(run_dir: Path, since: float) -> list[str]:
    return [i for (i,) in query(run_dir, "SELECT id FROM instances WHERE launched_at >= ? ORDER BY id", since)]


def assert_resumed_from(run_dir: Path, since: float, epoch: int, digest: str) -> None:
    """The run resumed at ``since`` started from exactly ``epoch`` with these parameters: its
    supervisor served that checkpoint, the first of its workers loaded that very state (bit-equal
    parameters), none loaded an older one, and no epoch before it was recorded again."""
    start = json.loads(query(run_dir, "SELECT detail FROM events WHERE kind = 'supervisor_start' AND time >= ? "
                                      "ORDER BY time LIMIT 1", since)[0][0])
    assert start["resumed_epoch"] == epoch
    loaded = loaded_states(run_dir, instances_since(run_dir, since))
    assert loaded, "no worker of the resumed run loaded a state"
    assert min(loaded.values()) == (epoch, digest), loaded
    (earliest,), = query(run_dir, "SELECT MIN(epoch) FROM progress WHERE time >= ?", since)
    assert earliest is None or earliest >= epoch


def resumed_at(run_dir: Path) -> float:
    """When the run was last resumed (its store's clock)."""
    rows = query(run_dir, "SELECT MAX(time) FROM events WHERE kind = 'resume'")
    assert rows[0][0] is not None, "the run was never resumed"
    return rows[0][0]


# ---- archives ----------------------------------------------------------------------------------
def fill_store(store: Any, archive: Any, epochs: tuple[int, ...] = (1, 2, 3)) -> dict[int, bytes]:
    """A run with an instance, events, progress and checkpoint files, each checkpoint archived."""
    store.launched(InstanceRecord("r-small-0000", "small", "a", "spot", 0.3, 1.0, launched_at=100.0))
    store.update_instance("r-small-0000", notice_at=150.0, ended_at=160.0, end_reason="preempted")
    store.event("supervisor_start", detail={"resumed_epoch": 0})
    contents = {}
    for epoch in epochs:
        store.progress(epoch, 1.0 / epoch, 100.0 * epoch, 2, epoch * 64)
        path = store.dir / "checkpoints" / f"epoch-{epoch:06d}.pt"
        contents[epoch] = bytes([epoch]) * 1000 + f"state of epoch {epoch}".encode()
        path.write_bytes(contents[epoch])
        store.checkpoint(epoch, path)
        archive.save_checkpoint(path)
    return contents


# ---- a run launched from a laptop -----------------------------------------------------------------------
def laptop_yaml(folder: Path, name: str, compute: str, storage: str, **top: Any) -> Path:
    """A shipped cloud config in ``folder`` (a clean "laptop" directory), its endpoints pointed at the
    stand-ins (the cloud's API at ``compute``, the archive's store at ``storage``), ``top`` keys set."""
    data = yaml.safe_load((ROOT / "cluster_configs" / name).read_text())
    data["provider"]["endpoint_url"] = compute
    data["checkpoint"]["endpoint_url"] = storage
    data.update(top)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def spotswarm_command(args: list[str], cwd: Path, out: Path) -> subprocess.Popen:
    """``spotswarm ARGS`` as a process of its own in ``cwd``, its output in ``out``."""
    with open(out, "w") as stdout:
        return subprocess.Popen([sys.executable, "-m", "orchestrator.cli.main", *args], cwd=cwd,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=stdout, stderr=subprocess.STDOUT)


def while_running(process: subprocess.Popen, out: Path, wait_for: Callable) -> Callable:
    """``wait_for`` polling once a second (a poll may read the archive), ended at once with the command's
    output when ``process`` exits first, and with it on a timeout."""
    def wait(condition: Callable[[], Any], timeout: float, what: str) -> Any:
        def check() -> Any:
            if process.poll() is not None:
                raise AssertionError(f"it exited ({process.returncode}) before {what}:\n{out.read_text()[-4000:]}")
            return condition()
        try:
            return wait_for(check, timeout, what, every=1.0)
        except TimeoutError as e:
            raise AssertionError(f"{e}\n{out.read_text()[-4000:]}") from None
    return wait

