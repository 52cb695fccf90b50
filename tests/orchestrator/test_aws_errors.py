"""How the AWS provider meets EC2's errors, against moto in server mode behind a small proxy:
no capacity in a zone (the next zone, then on-demand), throttling (retried), refused credentials
(one clear message, exit 2; at runtime the run stops).  Without Ray: the fleet policy drives the
real provider, and a stand-in for the workers only records what it was asked."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("boto3")

from orchestrator.cli.main import main  # noqa: E402
from orchestrator.config.schema import ClusterConfig  # noqa: E402
from orchestrator.providers.aws import AwsProvider  # noqa: E402
from orchestrator.providers.base import LaunchSpec  # noqa: E402
from tests.orchestrator.run_checks import fleet_policy, refusal_stops_the_run, shipped_yaml  # noqa: E402

pytestmark = pytest.mark.timeout(60)

ZONES = ["us-east-1a", "us-east-1b"]


def aws_config(tmp_path: Path, endpoint: str, **spot: Any) -> ClusterConfig:
    return ClusterConfig.model_validate({
        "cluster_name": "errs", "runs_dir": str(tmp_path / "runs"),
        "provider": {"type": "aws", "region": "us-east-1", "zones": ZONES, "endpoint_url": endpoint},
        "available_node_types": {"w": {"node_config": {"InstanceType": "m5.large", "ImageId": "ami-12c6146b"},
                                       "min_workers": 2, "max_workers": 2, "on_demand_price_per_hour": 0.096}},
        "spot": spot, "dashboard": {"enabled": False},
    })


def test_no_capacity_in_a_zone_launches_in_the_next(tmp_path, aws_proxy):
    aws_proxy.no_capacity = {("us-east-1a", "spot")}
    with fleet_policy(aws_config(tmp_path, aws_proxy.url), AwsProvider, live=2) as policy:
        assert {(i.zone, i.market) for i in policy.live.values()} == {("us-east-1b", "spot")}
        assert ("us-east-1a", "spot") in aws_proxy.refused  # tried first: the cheapest, by moto's prices
        kinds = [k for (_, k, _, _) in policy.store.events()]
        assert "no_capacity" in kinds and policy.fatal is None


def test_no_spot_capacity_anywhere_falls_back_to_on_demand(tmp_path, aws_proxy):
    aws_proxy.no_capacity = {(z, "spot") for z in ZONES}
    with fleet_policy(aws_config(tmp_path, aws_proxy.url), AwsProvider, live=2) as policy:
        assert {i.market for i in policy.live.values()} == {"on-demand"}
        assert sorted(set(aws_proxy.refused)) == [(z, "spot") for z in ZONES]
        ec2 = policy.provider.ec2
        described = [i for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]]
        assert all("InstanceLifecycle" not in d for d in described)  # really on-demand in EC2
        assert [r.price_per_hour for r in policy.store.instances()] == [0.096, 0.096]


def test_throttled_calls_are_retried_with_backoff(tmp_path, aws_proxy):
    provider = AwsProvider(aws_config(tmp_path, aws_proxy.url), time.time)
    aws_proxy.throttle_next = 3
    assert provider.list({"spotswarm-run": "errs"}) == []
    assert aws_proxy.throttled == 3
    assert provider.calls["DescribeInstances"] == 4  # three refused, the fourth answered


def test_refused_credentials_at_runtime_stop_the_run(tmp_path, aws_proxy):
    with fleet_policy(aws_config(tmp_path, aws_proxy.url), AwsProvider) as policy:
        aws_proxy.refuse_auth = True  # the keys were revoked after the run started
        fatal = refusal_stops_the_run(policy, lambda: aws_proxy.count("RunInstances"))
        assert "AuthFailure" in fatal and "credentials" in fatal


def test_launch_parameters(tmp_path, aws):
    """What spotswarm adds to the node config: one instance, IMDSv2 required, the zone, the tags
    (merged with the user's), the boot script as user data, and the market either way."""
    config = aws_config(tmp_path, aws, max_price_per_hour=0.05)
    provider = AwsProvider(config, time.time)
    node_config = {"InstanceType": "m5.large", "ImageId": "ami-1", "MetadataOptions": {"HttpPutResponseHopLimit": 2},
                   "TagSpecifications": [{"ResourceType": "instance", "Tags": [{"Key": "team", "Value": "ml"}]}],
                   "InstanceMarketOptions": {"MarketType": "spot", "SpotOptions": {"SpotInstanceType": "one-time"}}}
    spec = LaunchSpec("errs-w-0007", "w", "us-east-1b", "spot", {"spotswarm-run": "errs"}, node_config=node_config,
                      boot_script="#!/bin/bash\n")
    params = provider.run_params(spec)
    assert (params["MinCount"], params["MaxCount"]) == (1, 1)
    assert params["MetadataOptions"] == {"HttpPutResponseHopLimit": 2, "HttpTokens": "required",
                                         "HttpEndpoint": "enabled"}
    assert params["Placement"] == {"AvailabilityZone": "us-east-1b"}
    assert params["UserData"] == "#!/bin/bash\n"
    tags = {t["Key"]: t["Value"] for t in params["TagSpecifications"][0]["Tags"]}
    assert tags == {"team": "ml", "Name": "spotswarm-errs-w-0007", "spotswarm-run": "errs"}
    assert params["InstanceMarketOptions"] == {"MarketType": "spot", "SpotOptions": {
        "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate", "MaxPrice": "0.0500"}}
    on_demand = provider.run_params(LaunchSpec("errs-w-0008", "w", "us-east-1b", "on-demand", {},
                                               node_config=node_config))
    assert "InstanceMarketOptions" not in on_demand and "UserData" not in on_demand
    provider.shutdown()


def test_bad_credentials_are_one_clear_error_and_exit_2(tmp_path, moto_with_auth, capsys, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOTAREALKEY00000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    assert main(["up", str(shipped_yaml(tmp_path, "aws-spot.yaml", moto_with_auth))]) == 2
    err = capsys.readouterr().err
    assert "nothing started" in err and "AuthFailure" in err and "credentials" in err
    assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # no run directory, no Ray


def test_down_config_terminates_the_runs_instances_with_no_head_left(tmp_path, aws, capsys):
    """The head and its run directory are gone; the YAML alone finds the fleet by tag."""
    path = shipped_yaml(tmp_path, "aws-spot.yaml", aws)
    from orchestrator.config.checks import load_cluster_config

    config = load_cluster_config(path, warnings=[])
    provider = AwsProvider(config, time.time)
    tags = {"spotswarm-run": "aws-demo", "spotswarm-node-type": "worker-spot"}
    for n in range(2):
        provider.launch(LaunchSpec(f"aws-demo-worker-spot-{n:04d}", "worker-spot", "us-east-1a", "spot",
                                   {**tags, "spotswarm-instance": f"aws-demo-worker-spot-{n:04d}"},
                                   node_config=config.available_node_types["worker-spot"].node_config))
    other = provider.ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    assert main(["down", str(path)]) == 0
    assert "terminated 2 instances tagged with the run" in capsys.readouterr().out
    described = [i for r in provider.ec2.describe_instances()["Reservations"] for i in r["Instances"]]
    states = {d["InstanceId"]: d["State"]["Name"] for d in described}
    assert states.pop(other) == "running"  # not the run's: left alone
    assert set(states.values()) == {"terminated"}
    provider.shutdown()


def test_reconciliation_finds_spot_reclaims_and_releases_orphans(tmp_path, aws):
    """Without any notice: EC2's state reason says a spot reclaim; an instance with the run's tag
    that nobody launched or adopted is terminated once it is past the grace period."""
    from moto.backends import get_backend
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.ec2.models.instances import StateReason

    config = aws_config(tmp_path, aws)
    provider = AwsProvider(config, time.time)
    provider.orphan_grace_s = 0.0
    tags = {"spotswarm-run": "errs", "spotswarm-node-type": "w"}
    spot = provider.launch(LaunchSpec("errs-w-0000", "w", "us-east-1a", "spot",
                                      {**tags, "spotswarm-instance": "errs-w-0000"}, node_config={"ImageId": "ami-1"}))
    died = provider.launch(LaunchSpec("errs-w-0001", "w", "us-east-1a", "spot",
                                      {**tags, "spotswarm-instance": "errs-w-0001"}, node_config={"ImageId": "ami-1"}))
    orphan = provider.ec2.run_instances(ImageId="ami-1", MinCount=1, MaxCount=1, TagSpecifications=[{
        "ResourceType": "instance", "Tags": [{"Key": "spotswarm-run", "Value": "errs"}]}])["Instances"][0]["InstanceId"]
    backend = get_backend("ec2")[DEFAULT_ACCOUNT_ID]["us-east-1"]
    backend.terminate_instances([spot.handle, died.handle])
    backend.get_instance(spot.handle).state_reason = StateReason("Server.SpotInstanceTermination: reclaimed",
                                                                 "Server.SpotInstanceTermination")
    assert sorted(provider.poll_terminated(time.time())) == ["errs-w-0000", "errs-w-0001"]
    assert provider.was_preempted("errs-w-0000") and not provider.was_preempted("errs-w-0001")
    state = provider.ec2.describe_instances(InstanceIds=[orphan])["Reservations"][0]["Instances"][0]["State"]
    assert state["Name"] == "terminated"
    provider.shutdown()


def test_a_just_launched_instance_missing_from_the_list_is_not_gone(tmp_path, aws):
    """EC2's list lags a launch: an instance it does not list yet is gone only once it is old."""
    from orchestrator.providers.base import Instance

    provider = AwsProvider(aws_config(tmp_path, aws), time.time)
    provider.instances["errs-w-0009"] = Instance("errs-w-0009", "w", "us-east-1a", "spot", 0.01, time.time(),
                                                 handle="i-0000000000000dead")
    assert provider.poll_terminated(time.time()) == []
    provider.instances["errs-w-0009"].launched_at = time.time() - provider.orphan_grace_s - 1
    assert provider.poll_terminated(time.time()) == ["errs-w-0009"]
    provider.shutdown()


# ---- node types in two regions ----------------------------------------------------------------------
def two_regions(tmp_path: Path, endpoint: str) -> ClusterConfig:
    """w in the provider's region and zones; far in us-west-2 with no zones listed (the provider finds them)."""
    node_config = {"InstanceType": "m5.large", "ImageId": "ami-12c6146b"}
    return ClusterConfig.model_validate({
        "cluster_name": "errs", "runs_dir": str(tmp_path / "runs"),
        "provider": {"type": "aws", "region": "us-east-1", "zones": ZONES, "endpoint_url": endpoint},
        "available_node_types": {
            "w": {"node_config": node_config, "min_workers": 1, "max_workers": 1, "on_demand_price_per_hour": 0.096},
            "far": {"node_config": node_config, "region": "us-west-2", "min_workers": 1, "max_workers": 1,
                    "on_demand_price_per_hour": 0.096}},
        "dashboard": {"enabled": False},
    })


def run_states(endpoint: str, region: str) -> dict[str, tuple[str, str]]:
    """The run's instances as EC2 in ``region`` lists them: EC2 id -> (node type tag, state)."""
    import boto3

    ec2 = boto3.client("ec2", region_name=region, endpoint_url=endpoint)
    try:
        found = [i for r in ec2.describe_instances(Filters=[{"Name": "tag:spotswarm-run", "Values": ["errs"]}])[
            "Reservations"] for i in r["Instances"]]
    finally:
        ec2.close()
    return {d["InstanceId"]: ({t["Key"]: t["Value"] for t in d["Tags"]}["spotswarm-node-type"], d["State"]["Name"])
            for d in found}


def test_node_types_in_two_regions_launch_price_list_and_terminate_each_in_its_own(tmp_path, aws):
    config = two_regions(tmp_path, aws)
    with fleet_policy(config, AwsProvider, live=2) as policy:
        provider = policy.provider
        far_zones = provider.zones_for("far")
        assert far_zones and all(z.startswith("us-west-2") for z in far_zones)  # us-west-2's, found there
        assert provider.zones_for("w") == ZONES
        assert all(provider.price("far", z, "spot") == pytest.approx(1e-05) for z in far_zones)  # us-west-2's history
        placed = {i.node_type: (i.region, i.zone, i.market) for i in policy.live.values()}
        assert placed["w"][0] == "us-east-1" and placed["w"][1] in ZONES
        assert placed["far"][0] == "us-west-2" and placed["far"][1] in far_zones
        assert {r.node_type: r.region for r in policy.store.instances()} == {"w": "us-east-1", "far": "us-west-2"}
        assert [v for v in run_states(aws, "us-east-1").values()] == [("w", "running")]
        assert [v for v in run_states(aws, "us-west-2").values()] == [("far", "running")]
        restarted = AwsProvider(config, time.time)  # a new supervisor finds both
        try:
            assert {i.id: i.region for i in restarted.list({"spotswarm-run": "errs"})} == {
                i.id: i.region for i in policy.live.values()}
        finally:
            restarted.shutdown()
    assert [v for v in run_states(aws, "us-east-1").values()] == [("w", "terminated")]
    assert [v for v in run_states(aws, "us-west-2").values()] == [("far", "terminated")]


def test_reconciliation_and_down_reach_every_region(tmp_path, aws):
    """A spot reclaim in the other region is seen as one; ``down`` terminates the run in both regions."""
    from moto.backends import get_backend
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.ec2.models.instances import StateReason

    from orchestrator.providers.aws import terminate_run

    config = two_regions(tmp_path, aws)
    provider = AwsProvider(config, time.time)
    tags = {"spotswarm-run": "errs"}
    near = provider.launch(LaunchSpec("errs-w-0000", "w", "us-east-1a", "spot",
                                      {**tags, "spotswarm-node-type": "w", "spotswarm-instance": "errs-w-0000"},
                                      node_config={"ImageId": "ami-1"}))
    far = provider.launch(LaunchSpec("errs-far-0001", "far", provider.zones_for("far")[0], "spot",
                                     {**tags, "spotswarm-node-type": "far", "spotswarm-instance": "errs-far-0001"},
                                     node_config={"ImageId": "ami-1"}))
    assert (near.region, far.region) == ("us-east-1", "us-west-2")
    backend = get_backend("ec2")[DEFAULT_ACCOUNT_ID]["us-west-2"]
    backend.terminate_instances([far.handle])
    backend.get_instance(far.handle).state_reason = StateReason("Server.SpotInstanceTermination: reclaimed",
                                                                "Server.SpotInstanceTermination")
    assert provider.poll_terminated(time.time()) == ["errs-far-0001"]
    assert provider.was_preempted("errs-far-0001")
    again = provider.launch(LaunchSpec("errs-far-0002", "far", provider.zones_for("far")[0], "spot",
                                       {**tags, "spotswarm-node-type": "far", "spotswarm-instance": "errs-far-0002"},
                                       node_config={"ImageId": "ami-1"}))
    provider.shutdown()
    assert sorted(terminate_run(config)) == sorted([near.handle, again.handle])
    assert sorted(run_states(aws, "us-east-1").values()) == [("w", "terminated")]
    assert sorted(run_states(aws, "us-west-2").values()) == [("far", "terminated"), ("far", "terminated")]
