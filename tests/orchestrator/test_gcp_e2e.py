"""The GCP provider end to end against a loopback fake of the Compute Engine API: the shipped
``gcp-spot.yaml`` (pointed at the fake), instances booted from their startup-script metadata as Ray
nodes joining this test's Ray, a preemption announced by an instance's metadata server, the stop
after the window, a replacement.  GCE's window is 30 s; the harness gives 15 (and the config's
``spot.notice_period_s`` says so, so that the workers plan for it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("google.cloud.compute_v1")

from orchestrator.config.checks import load_cluster_config  # noqa: E402
from orchestrator.config.schema import ClusterConfig  # noqa: E402
from orchestrator.runs.durable import RunArchive  # noqa: E402
from tests.orchestrator.run_checks import (  # noqa: E402
    assert_peers_agree,
    assert_released,
    query,
    reclaim_and_replace,
    supervised,
    wait_for_epochs,
    wait_for_workers,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("ray_session"), pytest.mark.heavy]

SHIPPED = Path(__file__).resolve().parents[2] / "cluster_configs" / "gcp-spot.yaml"
WINDOW_S = 15.0  # GCE stops a preempted VM 30 s after the notice; the harness after fifteen


def shipped_config(tmp_path: Path, endpoint: str, storage: str) -> ClusterConfig:
    """The shipped example pointed at the fake API, the storage emulator (its archive under this test's
    name) and this test's directory; the harness's shorter window; parameter digests for the audit."""
    config = load_cluster_config(SHIPPED, warnings=[])
    return config.model_copy(update={
        "provider": config.provider.model_copy(update={"endpoint_url": endpoint}),
        "checkpoint": config.checkpoint.model_copy(update={
            "endpoint_url": storage, "uri": f"{config.checkpoint.uri}/{tmp_path.name}", "every_s": 5.0}),
        "runs_dir": str(tmp_path / "runs"),
        "spot": config.spot.model_copy(update={"notice_period_s": WINDOW_S}),
        "training": config.training.model_copy(update={"param_digests": True})})


def test_spot_fleet_on_a_fake_gce_survives_a_preemption(tmp_path, gce_api, gce_harness, gcs, wait_for,
                                                        artifacts_dir):
    config = shipped_config(tmp_path, gce_api.url, gcs)
    zones = config.provider.zones
    gce_api.exhausted = {(zones[0], "spot")}  # the cheapest zone has no Spot capacity: the next one
    gce_api.throttle = ["429", "403", "429"]  # and GCE rate-limits the run's first calls: retried
    with supervised(config) as (core, run_dir):
        size = config.available_node_types["worker-spot"].max_workers
        wait_for_workers(core, size, wait_for, 180, f"{size} workers running on their own GCE instances")
        assert gce_api.throttled == 3
        assert sorted(core.live) == gce_harness.alive()
        assert (zones[0], "spot", "ZONE_RESOURCE_POOL_EXHAUSTED") in gce_api.refused
        assert {i.zone for i in core.live.values()} <= set(zones[1:])
        spot_prices = config.available_node_types["worker-spot"].spot_price_per_hour
        prices = query(run_dir, "SELECT DISTINCT price_per_hour, market, zone FROM instances")
        assert prices and all((p, m) == (spot_prices[z], "spot") for p, m, z in prices)  # the config's prices
        wait_for(lambda: core.epoch >= 2, 120, "two global epochs")

        replaced = reclaim_and_replace(core, run_dir, gce_harness, gce_api.calls, wait_for, WINDOW_S,
                                       recorded_s=90, replaced_s=60, first_step_s=120)
        machine = replaced.machine
        # its watcher read instance/preempted, then long-polled it
        assert [wait for _, path, wait in machine.metadata.reads if path == "instance/preempted"][:2] == [False, True]
        assert (machine.zone, replaced.victim) not in gce_api.snapshot()  # the TERMINATED VM was deleted (its disk)

        wait_for_epochs(core, 1, wait_for, 90)
        assert_peers_agree(sorted(list(core.live)))
        figures = {
            "window_s": WINDOW_S,
            **replaced.figures(taken_back="preemption"),
            "api_calls_per_replacement_by_method": {m: gce_api.count(m, since=machine.noticed_at) for m in sorted(
                {m for t, m in gce_api.calls if t >= machine.noticed_at})},
            "inserts_per_replacement": gce_api.count("instances.insert", since=machine.noticed_at),
            "spot_price_per_hour": {z: spot_prices[z] for z in zones},
        }
        (artifacts_dir / "gcp_e2e.json").write_text(json.dumps(figures, indent=1))
        print(json.dumps(figures))
    # released: every instance deleted in GCE, so the harness cut its power
    assert_released(run_dir, gce_harness, wait_for)
    assert gce_api.snapshot() == {}
    # the run outlives this head: a new head restores it from gs:// (the emulator)
    restored = tmp_path / "new-head" / config.cluster_name
    epoch = RunArchive.for_config(config).restore(restored)
    assert epoch is not None and epoch >= 1
    assert query(restored, "SELECT MAX(epoch) FROM progress")[0][0] >= epoch
    assert (restored / "checkpoints" / f"epoch-{epoch:06d}.pt").stat().st_size > 0
