"""The AWS provider end to end against moto in server mode: the shipped ``aws-spot.yaml`` (with
the endpoints pointed at moto), instances booted from their user data as Ray nodes joining this
test's head, an interruption notice in an instance's IMDS, a spot reclaim, a replacement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("boto3")

from orchestrator.config.checks import load_cluster_config  # noqa: E402
from orchestrator.config.schema import ClusterConfig  # noqa: E402
from tests.orchestrator.run_checks import (  # noqa: E402
    assert_peers_agree,
    assert_released,
    query,
    reclaim_and_replace,
    supervised,
    wait_for_epochs,
    wait_for_workers,
)

pytestmark = [pytest.mark.timeout(400), pytest.mark.usefixtures("ray_session"), pytest.mark.heavy]

SHIPPED = Path(__file__).resolve().parents[2] / "cluster_configs" / "aws-spot.yaml"
NOTICE_S = 15.0  # EC2 gives two minutes; the harness gives fifteen seconds


def shipped_config(tmp_path: Path, ec2_endpoint: str, s3_endpoint: str) -> ClusterConfig:
    """The shipped example, only pointed at the stand-ins (and at this test's directories)."""
    config = load_cluster_config(SHIPPED, warnings=[])
    provider = config.provider.model_copy(update={"endpoint_url": ec2_endpoint})
    checkpoint = config.checkpoint.model_copy(update={"endpoint_url": s3_endpoint})
    return config.model_copy(update={"provider": provider, "checkpoint": checkpoint,
                                     "runs_dir": str(tmp_path / "runs")})


def test_spot_fleet_on_moto_survives_a_reclaim(tmp_path, aws, aws_proxy, ec2_harness, wait_for, artifacts_dir):
    import boto3

    boto3.client("s3", endpoint_url=aws).create_bucket(Bucket="spotswarm-runs")
    config = shipped_config(tmp_path, aws_proxy.url, aws)
    config = config.model_copy(update={"training": config.training.model_copy(update={"param_digests": True})})
    aws_proxy.throttle_next = 4  # EC2 throttles the run's first calls: retried, and the run never notices
    with supervised(config) as (core, run_dir):
        size = config.available_node_types["worker-spot"].max_workers
        wait_for_workers(core, size, wait_for, 240, f"{size} workers running on their own EC2 instances")
        assert aws_proxy.throttled == 4
        assert sorted(list(core.live)) == ec2_harness.alive()
        zones = {i.zone for i in core.live.values()}
        assert zones <= set(config.provider.zones)
        # the cost uses moto's spot price history (the same price moto reports for every zone)
        moto_price = float(boto3.client("ec2", endpoint_url=aws).describe_spot_price_history(
            InstanceTypes=["m5.large"], AvailabilityZone=sorted(zones)[0])["SpotPriceHistory"][0]["SpotPrice"])
        prices = query(run_dir, "SELECT DISTINCT price_per_hour, market FROM instances")
        assert prices == [(pytest.approx(moto_price), "spot")]
        wait_for(lambda: core.epoch >= 2, 120, "two global epochs")

        replaced = reclaim_and_replace(core, run_dir, ec2_harness, aws_proxy.calls, wait_for, NOTICE_S,
                                       recorded_s=120, replaced_s=120, first_step_s=180)

        wait_for_epochs(core, 2, wait_for, 120)
        assert_peers_agree(sorted(list(core.live)))
        figures = {
            **replaced.figures(taken_back="reclaim"),
            "run_instances_per_replacement": aws_proxy.count("RunInstances", since=replaced.machine.noticed_at),
            "spot_price_per_hour": moto_price,
        }
        (artifacts_dir / "aws_e2e.json").write_text(json.dumps(figures, indent=1))
        print(json.dumps(figures))
    # released: every instance terminated in EC2, so the harness cut its power
    assert_released(run_dir, ec2_harness, wait_for)
