"""The real multi-node path on one machine: each instance is its own Ray node (``mode: nodes``),
started by its boot script, joined to this test's Ray head; a preemption kills the whole node."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from orchestrator.config.schema import ClusterConfig  # noqa: E402
from orchestrator.fleet.supervisor import SupervisorCore  # noqa: E402
from orchestrator.host.processes import session_pids  # noqa: E402
from orchestrator.instance.actor import worker_actor_name  # noqa: E402
from orchestrator.runs.store import RunStore  # noqa: E402
from orchestrator.sim.nodes import worker_pids  # noqa: E402
from tests.orchestrator.run_checks import (  # noqa: E402
    assert_peers_agree,
    query,
    wait_for_epochs,
    wait_for_first_step,
    wait_for_workers,
    wait_until_preempted,
)

pytestmark = [pytest.mark.timeout(420), pytest.mark.usefixtures("ray_session"), pytest.mark.heavy]


def node_config(tmp_path: Path) -> ClusterConfig:
    trace = tmp_path / "trace.csv"
    # only the first instance is preempted: notice 150 s (15 s here) after launch, killed 60 s later
    trace.write_text("notice_after_s,kill_after_s\n150,210\n,\n,\n,\n,\n")
    return ClusterConfig.model_validate({
        "cluster_name": "n", "runs_dir": str(tmp_path / "runs"),
        "provider": {"type": "local", "mode": "nodes", "zones": ["a"], "time_scale": 10.0,
                     "provisioning_delay_s": 0.0, "trace_file": str(trace)},
        "available_node_types": {"small": {"min_workers": 3, "max_workers": 3, "resources": {"CPU": 1},
                                           "on_demand_price_per_hour": 1.0}},
        "spot": {"notice_period_s": 60.0},
        "training": {"task": "synthetic", "target_batch_size": 64, "min_matchmaking_time_s": 0.5,
                     "averaging_timeout_s": 10.0, "param_digests": True},
        "checkpoint": {"every_s": 600.0},
        "dashboard": {"enabled": False},
    })


def worker_status(instance_id: str) -> dict:
    return ray.get(ray.get_actor(worker_actor_name(instance_id)).status.remote(), timeout=60)


def worker_pid(run_dir: Path, instance_id: str) -> int:
    """The pid of the worker actor's process on an instance's node (its session holds the raylet too)."""
    (pid,) = worker_pids(int((run_dir / "nodes" / f"{instance_id}.pid").read_text()))
    return pid


def process_groups_alive(run_dir: Path) -> list[str]:
    """Instances with any process of their node's session still running (raylet, agents, worker)."""
    return sorted(f.stem for f in (run_dir / "nodes").glob("*.pid") if session_pids(int(f.read_text())))


def test_instances_are_ray_nodes_preemption_replaces_a_node_and_a_restart_adopts(tmp_path, wait_for):
    config = node_config(tmp_path)
    RunStore.create(config).close()
    run_dir = config.run_dir()
    core = SupervisorCore(config, run_dir)
    core.start()
    first = "n-small-0000"
    try:
        wait_for_workers(core, 3, wait_for, 180, "three workers running on their own nodes")
        nodes = {i: worker_status(i)["node_id"] for i in list(core.live)}
        driver_node = ray.get_runtime_context().get_node_id()
        assert len(set(nodes.values())) == len(nodes) >= 3 and driver_node not in nodes.values()  # one node each

        wait_until_preempted(run_dir, first, wait_for, 120, "the first instance's node to be killed")
        wait_for(lambda: first not in process_groups_alive(run_dir), 30, "the killed node's processes to exit")
        replacement = "n-small-0003"
        wait_for_first_step(run_dir, replacement, wait_for, 180)
        others = {i: n for i, n in nodes.items() if i != replacement}
        assert worker_status(replacement)["node_id"] not in others.values()  # a new node, not a survivor
        live = sorted(list(core.live))
        assert live == ["n-small-0001", "n-small-0002", replacement]
        kinds = [k for (k,) in query(run_dir, "SELECT kind FROM events WHERE instance_id = ? ORDER BY time", first)]
        assert kinds.index("notice") < kinds.index("preempted")

        wait_for_epochs(core, 2, wait_for, 120)
        assert_peers_agree(live, "the three live peers")
    except BaseException:
        core.stop()
        raise

    # a supervisor restart: the next one adopts the three live nodes instead of launching more
    core.detach()
    launched_before = query(run_dir, "SELECT COUNT(*) FROM instances")[0][0]
    core = SupervisorCore(config, run_dir)
    try:
        assert sorted(list(core.live)) == live
        core.start()
        wait_for_epochs(core, 2, wait_for, 120, "training to go on under the new supervisor")
        assert query(run_dir, "SELECT COUNT(*) FROM instances")[0][0] == launched_before  # no duplicates
        assert sorted(list(core.live)) == live
        assert sorted(process_groups_alive(run_dir)) == live

        # the worker process dies while its machine runs on: the machine is released and replaced
        victim = live[0]
        os.kill(worker_pid(run_dir, victim), signal.SIGKILL)
        wait_for(lambda: query(run_dir, "SELECT end_reason FROM instances WHERE id = ?", victim) == [("died",)],
                 60, "the instance whose worker died to be recorded as died")
        wait_for(lambda: victim not in process_groups_alive(run_dir), 60, "its machine to be released")
        wait_for(lambda: len(core.live) == 3 and victim not in core.live, 60, "a replacement")
        (replacement,) = set(core.live) - set(live)
        wait_for_first_step(run_dir, replacement, wait_for, 180)
    finally:
        core.stop()
    assert process_groups_alive(run_dir) == []  # released: every node stopped
    assert query(run_dir, "SELECT COUNT(*) FROM instances WHERE ended_at IS NULL") == [(0,)]
