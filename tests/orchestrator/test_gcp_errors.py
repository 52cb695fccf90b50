"""How the GCP provider meets Compute Engine, against a loopback fake of its v1 REST API reached
by the real google-cloud-compute client: the Instance it inserts, an exhausted zone (the next
zone, then on-demand), quota, rate limits (retried), refused credentials (one clear message,
exit 2; at runtime the run stops), reconciliation and ``down``.  Without Ray: the fleet policy
drives the real provider, and a stand-in for the workers only records what it was asked."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("google.cloud.compute_v1")

from orchestrator.cli.main import main  # noqa: E402
from orchestrator.config.schema import ClusterConfig  # noqa: E402
from orchestrator.providers.base import LaunchSpec, ProviderAuthError  # noqa: E402
from orchestrator.providers.gcp import GcpProvider, instance_name, label_filter, label_value  # noqa: E402
from tests.orchestrator.run_checks import ROOT, fleet_policy, refusal_stops_the_run, shipped_yaml  # noqa: E402

pytestmark = pytest.mark.timeout(60)

ZONES = ["us-central1-a", "us-central1-b"]
IMAGE = "projects/my-project/global/images/family/spotswarm"
TAGS = {"spotswarm-run": "errs", "spotswarm-instance": "errs-w-0007", "spotswarm-node-type": "w"}


def gcp_config(tmp_path: Path, endpoint: str, node_config: dict | None = None, **spot: Any) -> ClusterConfig:
    return ClusterConfig.model_validate({
        "cluster_name": "errs", "runs_dir": str(tmp_path / "runs"),
        "provider": {"type": "gcp", "project_id": "my-project", "region": "us-central1", "zones": ZONES,
                     "endpoint_url": endpoint, "image": IMAGE},
        "available_node_types": {"w": {"node_config": node_config or {"machineType": "n2-standard-2"},
                                       "min_workers": 2, "max_workers": 2, "on_demand_price_per_hour": 0.097,
                                       "spot_price_per_hour": {"us-central1-a": 0.02, "us-central1-b": 0.03}}},
        "spot": spot, "dashboard": {"enabled": False},
    })


def test_insert_body(tmp_path, gce_api):
    """What spotswarm adds to the node config: the name, the zone in the type URLs, the run's labels
    (merged with the user's), the boot script and the exact tags as metadata, the market."""
    node_config = {"machineType": "n1-standard-4", "labels": {"team": "ml"},
                   "guestAccelerators": [{"acceleratorType": "nvidia-tesla-t4", "acceleratorCount": 1}],
                   "disks": [{"boot": True, "autoDelete": True, "initializeParams": {"diskSizeGb": 50,
                                                                                      "diskType": "pd-ssd"}}],
                   "metadata": {"items": [{"key": "enable-oslogin", "value": "TRUE"}]},
                   "scheduling": [{"preemptible": True}, {"onHostMaintenance": "TERMINATE"}]}  # Ray's list form
    provider = GcpProvider(gcp_config(tmp_path, gce_api.url, node_config), time.time)
    spec = LaunchSpec("Errs_W-0007", "w", "us-central1-b", "spot", dict(TAGS, **{"spotswarm-instance": "Errs_W-0007"}),
                      node_config=node_config, boot_script="#!/bin/bash\nexec ray start --block\n")
    body = provider.insert_body(spec)
    assert body["name"] == instance_name("Errs_W-0007") and body["name"].startswith("ss-errs-w-0007-")
    assert body["machineType"] == "zones/us-central1-b/machineTypes/n1-standard-4"
    assert body["guestAccelerators"] == [{"acceleratorType": "projects/my-project/zones/us-central1-b/"
                                          "acceleratorTypes/nvidia-tesla-t4", "acceleratorCount": 1}]
    assert body["disks"] == [{"boot": True, "autoDelete": True, "initializeParams": {
        "diskSizeGb": "50", "diskType": "zones/us-central1-b/diskTypes/pd-ssd", "sourceImage": IMAGE}}]
    assert body["networkInterfaces"][0]["network"] == "global/networks/default"
    assert body["labels"] == {"team": "ml", "spotswarm-run": "errs", "spotswarm-node-type": "w",
                              "spotswarm-instance": label_value("Errs_W-0007")}
    items = {i["key"]: i["value"] for i in body["metadata"]["items"]}
    assert items["startup-script"] == spec.boot_script and items["enable-oslogin"] == "TRUE"
    assert json.loads(items["spotswarm-tags"])["spotswarm-instance"] == "Errs_W-0007"  # exact, unlike the label
    assert body["scheduling"] == {"preemptible": True, "onHostMaintenance": "TERMINATE", "automaticRestart": False,
                                  "provisioningModel": "SPOT", "instanceTerminationAction": "DELETE"}
    on_demand = provider.insert_body(LaunchSpec("errs-w-0008", "w", "us-central1-a", "on-demand", TAGS,
                                                node_config=node_config))
    assert on_demand["scheduling"] == {"onHostMaintenance": "TERMINATE", "provisioningModel": "STANDARD"}
    assert "startup-script" not in {i["key"] for i in on_demand["metadata"]["items"]}
    provider.shutdown()


def test_labels_and_names_follow_gces_rules():
    assert label_value("gcp-demo") == "gcp-demo"
    odd = [label_value(v) for v in ("My.Run", "my-run", "x" * 80, "MY.RUN")]
    assert all(len(v) <= 63 and v == v.lower() for v in odd) and len(set(odd)) == 4  # distinct stay distinct
    assert instance_name("gcp-demo-worker-spot-0001") == "gcp-demo-worker-spot-0001"
    for odd_id in ("9lives-w-0001", "Run_1-w-0001", "r-" + "w" * 70 + "-0001"):
        name = instance_name(odd_id)
        assert len(name) <= 63 and name[0].isalpha() and name == name.lower() and "_" not in name
    assert label_filter({"b": "2", "a": "X"}) == f'(labels.a = "{label_value("X")}") (labels.b = "2")'


def test_launch_list_and_terminate_through_the_real_client(tmp_path, gce_api):
    provider = GcpProvider(gcp_config(tmp_path, gce_api.url), time.time)
    spec = LaunchSpec("errs-w-0001", "w", "us-central1-a", "spot", dict(TAGS, **{"spotswarm-instance": "errs-w-0001"}),
                      node_config={"machineType": "n2-standard-2"}, boot_script="#!/bin/bash\n")
    inst = provider.launch(spec)
    assert (inst.zone, inst.market, inst.price_per_hour, inst.handle) == ("us-central1-a", "spot", 0.02, "errs-w-0001")
    assert provider.calls["instances.insert"] == 1 and provider.calls["zoneOperations.wait"] == 1
    [listed] = provider.list({"spotswarm-run": "errs"})
    assert (listed.id, listed.node_type, listed.market) == ("errs-w-0001", "w", "spot")
    assert provider.list({"spotswarm-run": "other"}) == []
    assert provider.launch(spec).id == "errs-w-0001"  # a retried insert (409 alreadyExists) is the same instance
    provider.terminate(inst)
    provider.terminate(inst)  # gone already: fine
    assert gce_api.snapshot() == {}
    provider.shutdown()


def test_an_exhausted_zone_launches_in_the_next(tmp_path, gce_api):
    gce_api.exhausted = {("us-central1-a", "spot")}
    with fleet_policy(gcp_config(tmp_path, gce_api.url), GcpProvider, live=2) as policy:
        assert {(i.zone, i.market) for i in policy.live.values()} == {("us-central1-b", "spot")}
        assert ("us-central1-a", "spot", "ZONE_RESOURCE_POOL_EXHAUSTED") in gce_api.refused  # the cheapest: first
        events = [(k, json.loads(d or "{}")) for (_, k, _, d) in policy.store.events()]
        refusals = [d for k, d in events if k == "no_capacity"]
        assert refusals and "ZONE_RESOURCE_POOL_EXHAUSTED" in refusals[0]["error"] and policy.fatal is None


def test_no_spot_quota_anywhere_falls_back_to_on_demand(tmp_path, gce_api):
    gce_api.over_quota = {(z, "spot") for z in ZONES}
    with fleet_policy(gcp_config(tmp_path, gce_api.url), GcpProvider, live=2) as policy:
        assert {i.market for i in policy.live.values()} == {"on-demand"}
        assert sorted({(z, m) for z, m, _ in gce_api.refused}) == [(z, "spot") for z in ZONES]
        models = {i["scheduling"]["provisioningModel"] for i in gce_api.snapshot().values()}
        assert models == {"STANDARD"}  # really on-demand in GCE
        assert [r.price_per_hour for r in policy.store.instances()] == [0.097, 0.097]


@pytest.mark.parametrize("answers", [["429", "429", "429"], ["403", "429", "403"]])
def test_rate_limited_calls_are_retried_with_backoff(tmp_path, gce_api, answers):
    provider = GcpProvider(gcp_config(tmp_path, gce_api.url), time.time)
    before = provider.calls["instances.list"]
    gce_api.throttle = list(answers)
    assert provider.list({"spotswarm-run": "errs"}) == []
    assert gce_api.throttled == 3
    assert provider.calls["instances.list"] - before == 3 + len(ZONES)  # three refused, then one per zone
    provider.shutdown()


def test_refused_credentials_at_runtime_stop_the_run(tmp_path, gce_api):
    with fleet_policy(gcp_config(tmp_path, gce_api.url), GcpProvider) as policy:
        gce_api.refuse_auth = 403  # the service account lost its role after the run started
        fatal = refusal_stops_the_run(policy, lambda: gce_api.count("instances.insert"))
        assert "permission" in fatal and "IAM" in fatal


def test_reconciliation_sorts_preempted_from_died_and_releases_orphans(tmp_path, gce_api):
    provider = GcpProvider(gcp_config(tmp_path, gce_api.url), time.time)
    launched = {}
    for i, zone in enumerate(["us-central1-a", "us-central1-a", "us-central1-b"]):
        instance_id = f"errs-w-{i:04d}"
        launched[instance_id] = provider.launch(LaunchSpec(instance_id, "w", zone, "spot",
                                                           dict(TAGS, **{"spotswarm-instance": instance_id}),
                                                           node_config={"machineType": "n2-standard-2"}))
    assert provider.poll_terminated(time.time()) == []
    gce_api.preempt_instance("us-central1-a", "errs-w-0000")  # STOP: TERMINATED, listed
    gce_api.preempt_instance("us-central1-a", "errs-w-0001", delete=True)  # DELETE: gone from the list
    with gce_api.lock:
        del gce_api.instances[("us-central1-b", "errs-w-0002")]  # deleted by a person: died
    assert sorted(provider.poll_terminated(time.time())) == ["errs-w-0000", "errs-w-0001", "errs-w-0002"]
    assert [provider.was_preempted(i) for i in sorted(launched)] == [True, True, False]
    assert gce_api.snapshot() == {}  # the TERMINATED one was deleted (its disk bills on otherwise)
    # an instance with the run's label that nobody launched: deleted once it is older than the grace
    stranger = GcpProvider(gcp_config(tmp_path, gce_api.url), time.time)
    stranger.launch(LaunchSpec("errs-w-0009", "w", "us-central1-b", "spot",
                               dict(TAGS, **{"spotswarm-instance": "errs-w-0009"}),
                               node_config={"machineType": "n2-standard-2"}))
    provider.orphan_grace_s = 0.0
    assert provider.poll_terminated(time.time()) == [] and gce_api.snapshot() == {}
    provider.shutdown()
    stranger.shutdown()


@pytest.mark.parametrize("status", [401, 403])
def test_bad_credentials_are_one_clear_error_and_exit_2(tmp_path, gce_api, capsys, status):
    gce_api.refuse_auth = status
    assert main(["up", str(shipped_yaml(tmp_path, "gcp-spot.yaml", gce_api.url))]) == 2
    err = capsys.readouterr().err
    # a 403 names GCE's answer; on a 401 google-auth first tries new credentials (anonymous ones have none)
    detail = "GCE instances.list: 403 FORBIDDEN" if status == 403 else "could not be had"
    assert "nothing started" in err and "credentials or permissions" in err and detail in err
    assert "docs/gcp.md" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # no run directory, no Ray


def test_down_deletes_every_instance_labelled_with_the_run(tmp_path, gce_api, capsys):
    path = shipped_yaml(tmp_path, "gcp-spot.yaml", gce_api.url)
    from orchestrator.config.checks import load_cluster_config

    config = load_cluster_config(path)
    provider = GcpProvider(config, time.time)
    for i, zone in enumerate(config.provider.zones[:2]):
        instance_id = f"gcp-demo-worker-spot-{i:04d}"
        provider.launch(LaunchSpec(instance_id, "worker-spot", zone, "spot",
                                   {"spotswarm-run": "gcp-demo", "spotswarm-instance": instance_id,
                                    "spotswarm-node-type": "worker-spot"},
                                   node_config=config.available_node_types["worker-spot"].node_config))
    other = gcp_config(tmp_path, gce_api.url)  # another run's instance stays
    GcpProvider(other, time.time).launch(LaunchSpec("errs-w-0000", "w", "us-central1-a", "spot",
                                                    dict(TAGS, **{"spotswarm-instance": "errs-w-0000"}),
                                                    node_config={"machineType": "n2-standard-2"}))
    assert main(["down", str(path)]) == 0
    out = capsys.readouterr().out
    assert "terminated 2 instances tagged with the run" in out
    assert list(gce_api.snapshot()) == [("us-central1-a", "errs-w-0000")]
    provider.shutdown()


def test_a_refused_call_is_an_auth_error_not_a_crash(tmp_path, gce_api):
    gce_api.refuse_auth = 401
    with pytest.raises(ProviderAuthError, match="credentials"):
        GcpProvider(gcp_config(tmp_path, gce_api.url), time.time)


# ---- node types in two regions ----------------------------------------------------------------------
EAST_ZONES = ["us-east1-b", "us-east1-c"]


def two_regions(tmp_path: Path, endpoint: str, **budget: Any) -> ClusterConfig:
    """w in the provider's region and zones; e in us-east1, whose us-east1-b is the cheapest zone of both."""
    node_type = {"node_config": {"machineType": "n2-standard-2"}, "min_workers": 1, "max_workers": 1,
                 "on_demand_price_per_hour": 0.097}
    return ClusterConfig.model_validate({
        "cluster_name": "errs", "runs_dir": str(tmp_path / "runs"),
        "provider": {"type": "gcp", "project_id": "my-project", "region": "us-central1", "zones": ZONES,
                     "endpoint_url": endpoint, "image": IMAGE},
        "available_node_types": {
            "w": {**node_type, "spot_price_per_hour": {"us-central1-a": 0.02, "us-central1-b": 0.03}},
            "e": {**node_type, "region": "us-east1", "zones": EAST_ZONES,
                  "spot_price_per_hour": {"us-east1-b": 0.01, "us-east1-c": 0.04}}},
        "budget": budget, "dashboard": {"enabled": False},
    })


def test_node_types_in_two_regions_launch_list_and_delete_in_their_own_zones(tmp_path, gce_api):
    config = two_regions(tmp_path, gce_api.url)
    with fleet_policy(config, GcpProvider, live=2) as policy:
        placed = {i.node_type: (i.region, i.zone) for i in policy.live.values()}
        assert placed == {"w": ("us-central1", "us-central1-a"), "e": ("us-east1", "us-east1-b")}
        inserted = {zone: body["machineType"] for (zone, _), body in gce_api.snapshot().items()}
        assert inserted["us-east1-b"].endswith("/zones/us-east1-b/machineTypes/n2-standard-2")
        assert set(inserted) == {"us-central1-a", "us-east1-b"}
        restarted = GcpProvider(config, time.time)  # a new supervisor lists every node type's zones
        try:
            assert {i.id: (i.region, i.zone) for i in restarted.list({"spotswarm-run": "errs"})} == {
                i.id: (i.region, i.zone) for i in policy.live.values()}
            assert restarted.list_zones == ZONES + EAST_ZONES
        finally:
            restarted.shutdown()
        far = next(i for i in policy.live.values() if i.node_type == "e")
        gce_api.preempt_instance("us-east1-b", far.handle, delete=True)
        assert policy.provider.poll_terminated(time.time()) == [far.id]
        assert policy.provider.was_preempted(far.id)  # us-east1-b's preempted operation says so
    assert gce_api.snapshot() == {}  # released in its own zone


def test_an_exhausted_zone_moves_the_launch_to_the_other_region(tmp_path, gce_api):
    """The budget has room for one: us-east1-b first (the cheapest); exhausted, e's next zone (0.04)
    costs more than w's us-central1-a (0.02), so the instance is bought in the other region."""
    gce_api.exhausted = {("us-east1-b", "spot")}
    config = two_regions(tmp_path, gce_api.url, max_dollars_per_hour=0.025)
    with fleet_policy(config, GcpProvider, live=1) as policy:
        assert ("us-east1-b", "spot", "ZONE_RESOURCE_POOL_EXHAUSTED") in gce_api.refused
        assert [(i.node_type, i.region, i.zone) for i in policy.live.values()] == [
            ("w", "us-central1", "us-central1-a")]
        assert [zone for zone, _ in gce_api.snapshot()] == ["us-central1-a"]


# ---- the default archive bucket: its name is predictable, so its owner is checked -------------------------
def default_archive_yaml(tmp_path: Path, endpoint: str, gcs: str) -> Path:
    """The shipped gcp-spot.yaml with no ``checkpoint.uri`` (as in Ray's YAMLs): the default bucket,
    ``spotswarm-my-project``, on the Cloud Storage emulator."""
    data = yaml.safe_load((ROOT / "cluster_configs" / "gcp-spot.yaml").read_text())
    data["provider"]["endpoint_url"] = endpoint
    data["runs_dir"] = str(tmp_path / "runs")
    data["checkpoint"] = {k: v for k, v in data["checkpoint"].items() if k != "uri"} | {"endpoint_url": gcs}
    path = tmp_path / "gcp-spot.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_default_bucket_is_taken_only_where_the_runs_project_owns_it(tmp_path, gce_api, gcs):
    from orchestrator.cli.launch import check_default_bucket_owned, with_archive
    from orchestrator.cli.refusals import NotStarted
    from orchestrator.config.checks import load_cluster_config
    from orchestrator.runs.durable import RunArchive

    config = with_archive(load_cluster_config(default_archive_yaml(tmp_path, gce_api.url, gcs)))
    archive = RunArchive.for_config(config)
    assert archive is not None and archive.uri == "gs://spotswarm-my-project/gcp-demo"
    archive.ensure_bucket()
    provider = GcpProvider(config, time.time)
    try:
        check_default_bucket_owned(config, provider, archive)  # the emulator's buckets are project 1234's
        gce_api.project_number = "5678"  # the same name, made first by another project
        with pytest.raises(NotStarted, match=r"spotswarm-my-project belongs to project number 1234, not to "
                                             r"my-project \(5678\)"):
            check_default_bucket_owned(config, provider, archive)
    finally:
        provider.shutdown()
    assert gce_api.count("projects.get") == 2


def test_up_with_a_default_bucket_of_another_project_starts_nothing(tmp_path, gce_api, gcs, capsys):
    gce_api.project_number = "5678"
    assert main(["up", str(default_archive_yaml(tmp_path, gce_api.url, gcs))]) == 2
    err = capsys.readouterr().err
    assert "belongs to project number 1234, not to my-project (5678): set checkpoint.uri" in err
    assert "Traceback" not in err and gce_api.snapshot() == {} and gce_api.count("instances.insert") == 0
