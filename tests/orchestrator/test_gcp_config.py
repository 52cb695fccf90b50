"""Cluster YAML for the gcp provider: a Ray GCP launcher YAML loads (its unused keys are warnings),
node_config is checked against Compute Engine's Instance message, GPU node types need
onHostMaintenance TERMINATE, spot is said one way, the project and zones are given."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("google.cloud.compute_v1")

from orchestrator.config.gcp import instance_fields  # noqa: E402
from tests.orchestrator.run_checks import (  # noqa: E402
    ANY_JSON,
    check_any_node_config,
    errors_of,
    line_of,
    load,
    validate_shipped,
    write,
)

pytestmark = pytest.mark.timeout(120)

IMAGE = "projects/my-project/global/images/family/spotswarm"
GCP = f"""\
cluster_name: t
provider:
  type: gcp
  project_id: my-project
  region: us-central1
  availability_zone: us-central1-a,us-central1-b
available_node_types:
  w:
    node_config:
      machineType: n2-standard-2
      disks: [{{boot: true, autoDelete: true, initializeParams: {{sourceImage: {IMAGE}}}}}]
    min_workers: 1
    max_workers: 2
"""
NODE_CONFIG_END = "      disks: [{boot"  # node_config lines added before it land from line 11 on
UNUSED = "Ray's cluster launcher key, not used by spotswarm: "

# Ray's GCP example (example-full.yaml's shape), as its cluster launcher takes it, plus our training section;
# its head and worker node types boot the same machine
RAY_NODE_CONFIG = """\
    node_config:
      machineType: n1-standard-2
      disks:
        - boot: true
          autoDelete: true
          type: PERSISTENT
          initializeParams:
            diskSizeGb: 50
            sourceImage: projects/deeplearning-platform-release/global/images/family/common-cpu"""
RAY_GCP_YAML = f"""\
cluster_name: ray-gcp
max_workers: 2
upscaling_speed: 1.0
idle_timeout_minutes: 5
provider:
  type: gcp
  region: us-west1
  availability_zone: us-west1-a
  project_id: my-project
  cache_stopped_nodes: false
auth:
  ssh_user: ubuntu
available_node_types:
  ray_head_default:
    resources: {{"CPU": 2}}
{RAY_NODE_CONFIG}
  ray_worker_small:
    min_workers: 0
    max_workers: 2
    resources: {{"CPU": 2}}
{RAY_NODE_CONFIG}
      scheduling:
        - preemptible: true
      serviceAccounts:
        - email: ray-autoscaler-sa-v1@my-project.iam.gserviceaccount.com
          scopes:
            - https://www.googleapis.com/auth/cloud-platform
head_node_type: ray_head_default
file_mounts: {{}}
setup_commands: []
head_start_ray_commands:
  - ray stop
training:
  task: synthetic
"""


def with_node_config(tmp_path: Path, lines: str) -> Path:
    """GCP with ``lines`` (each indented six spaces) added to node type w's node_config, from line 11 on."""
    return write(tmp_path, GCP.replace(NODE_CONFIG_END, lines + NODE_CONFIG_END))


# ---- the shipped file, Ray's file ----------------------------------------------------------------
def test_the_shipped_gcp_config_validates_without_warnings(capsys):
    config = validate_shipped(capsys, "gcp-spot.yaml", "provider gcp, mode actors, 3 node types, 2..2 instances")
    assert config.provider.project == "my-project" and config.provider.project_id == "my-project"
    assert config.provider.zones == ["us-central1-a", "us-central1-b", "us-central1-c"]
    assert config.spot.notice_period_s == 30


def test_a_ray_gcp_launcher_yaml_loads_with_one_warning_per_unused_key(tmp_path):
    path = write(tmp_path, RAY_GCP_YAML)
    config, warnings = load(path)
    at = {key: line_of(RAY_GCP_YAML, key + ":") for key in ("max_workers", "upscaling_speed", "idle_timeout_minutes",
                                                            "cache_stopped_nodes", "auth", "file_mounts",
                                                            "head_start_ray_commands")}
    assert [w.split(": ", 2)[1] for w in warnings] == [
        "max_workers", "upscaling_speed", "idle_timeout_minutes", "provider.cache_stopped_nodes", "auth", "file_mounts",
        "head_start_ray_commands"]
    assert all(w.startswith(f"{path}:{at[w.split(': ')[1].rsplit('.', 1)[-1]]}: ") and UNUSED in w for w in warnings)
    assert config.provider.project == "my-project"  # Ray's project_id is ours
    assert config.provider.zones == ["us-west1-a"]
    assert config.available_node_types["ray_worker_small"].spot is True  # scheduling: [{preemptible: true}]


def test_gcp_credentials_is_rays_and_says_where_credentials_come_from(tmp_path):
    path = write(tmp_path, GCP.replace("  region: us-central1", "  region: us-central1\n  gcp_credentials: {type: x}"))
    assert load(path)[1] == [f"{path}:6: provider.gcp_credentials: {UNUSED}google-auth finds credentials as usual "
                             "(GOOGLE_APPLICATION_CREDENTIALS, gcloud's application-default login, the head's service "
                             "account)"]


# ---- node_config: checked against Compute Engine's Instance --------------------------------------
def test_a_gpu_node_type_without_terminate_names_the_line(tmp_path):
    gpu = "      guestAccelerators: [{acceleratorType: nvidia-tesla-t4, acceleratorCount: 1}]\n"
    path = with_node_config(tmp_path, gpu)
    assert errors_of(path) == [
        f"{path}:11: available_node_types.w.node_config.guestAccelerators: not set (MIGRATE): a node type with GPUs "
        "(guestAccelerators) needs scheduling.onHostMaintenance: TERMINATE; GCE cannot live-migrate GPU VMs and "
        "refuses to create them otherwise"]
    migrate = with_node_config(tmp_path, gpu + "      scheduling:\n        provisioningModel: SPOT\n"
                                               "        onHostMaintenance: MIGRATE\n")
    [error] = errors_of(migrate)
    assert error.startswith(f"{migrate}:14: available_node_types.w.node_config.scheduling.onHostMaintenance: "
                            "MIGRATE: a node type with GPUs")
    fine = with_node_config(tmp_path, gpu + "      scheduling: {onHostMaintenance: TERMINATE}\n")
    assert load(fine)[0].available_node_types["w"].node_config["guestAccelerators"][0]["acceleratorCount"] == 1


@pytest.mark.parametrize(("lines", "line", "error"), [
    ("machinType: n1\n", 11, "machinType: unknown key for the gcp provider (not a field of Compute Engine's "
                             "Instance); did you mean 'machineType'?"),
    ("service_accounts: []\n", 11, "service_accounts: write it 'serviceAccounts' (camelCase, as in Ray's GCP YAML "
                                   "and GCE's REST API)"),
    ("scheduling:\n        provisioningModel: SPOT\n        preemptable: true\n", 13,
     "scheduling.preemptable: unknown key (not a field of Compute Engine's Scheduling); did you mean 'preemptible'?"),
    ("scheduling: {provisioningModel: spot}\n", 11, "scheduling.provisioningModel: 'spot' is not one of FLEX_START, "
                                                    "RESERVATION_BOUND, SPOT, STANDARD; did you mean 'SPOT'?"),
    ("scheduling: {instanceTerminationAction: KILL}\n", 11, "scheduling.instanceTerminationAction: 'KILL' is not one "
                                                            "of DELETE, INSTANCE_TERMINATION_ACTION_UNSPECIFIED, STOP"),
    ("guestAccelerators: [{acceleratorCount: many}]\n", 11,
     "guestAccelerators.acceleratorCount: invalid literal for int() with base 10: 'many'"),
    ("canIpForward: maybe\n", 11, "canIpForward: Expected true or false without quotes"),
    ("name: my-vm\n", 11, "name: set by spotswarm: each instance is named after the run's id for it"),
    ("zone: us-central1-a\n", 11, "zone: zones come from provider.zones or provider.availability_zone, not "
                                  "node_config"),
    ("metadata: {items: [{key: startup-script, value: echo}]}\n", 11,
     "metadata.items.0.key: 'startup-script': set by spotswarm: the boot script that joins the run's Ray cluster"),
    ("labels: {spotswarm-run: x}\n", 11, "labels.spotswarm-run: set by spotswarm: the run's labels"),
    ("labels: {team: ML}\n", 11, "labels.team: 'ML': a GCE label value is up to 63 lowercase letters, digits, '_' "
                                 "or '-'"),
])
def test_a_bad_node_config_names_its_key_and_line(tmp_path, lines, line, error):
    path = with_node_config(tmp_path, "      " + lines)
    assert errors_of(path) == [f"{path}:{line}: available_node_types.w.node_config.{error}"]


def test_zonal_types_are_bare_names(tmp_path):
    path = write(tmp_path, GCP.replace("machineType: n2-standard-2",
                                       "machineType: zones/us-central1-a/machineTypes/n2-standard-2"))
    assert errors_of(path) == [
        f"{path}:10: available_node_types.w.node_config.machineType: 'zones/us-central1-a/machineTypes/n2-standard-2':"
        " give the bare name (e.g. 'n2-standard-2'); spotswarm adds zones/<zone>/machineTypes/ for the zone it "
        "launches in"]


def test_the_checks_come_from_the_instance_message():
    from google.cloud import compute_v1

    fields = instance_fields()
    assert {"machineType", "disks", "networkInterfaces", "guestAccelerators", "serviceAccounts", "metadata",
            "scheduling", "labels"} <= set(fields)
    assert len(fields) == len(compute_v1.Instance.pb().DESCRIPTOR.fields)


# ---- what spans sections: project, zones, image, machine type, spot --------------------------------
def test_project_and_zones_are_needed(tmp_path):
    path = write(tmp_path, GCP.replace("  project_id: my-project\n", "").replace(
        "  availability_zone: us-central1-a,us-central1-b\n", ""))
    assert errors_of(path) == [
        f"{path}:2: provider: the gcp provider needs the project it launches in: provider.project_id (Ray's key) "
        "or provider.project",
        f"{path}:2: provider: the gcp provider needs its zones: provider.availability_zone (Ray's key, e.g. "
        "'us-central1-a,us-central1-b') or provider.zones"]
    both = write(tmp_path, GCP.replace("  project_id: my-project\n", "  project_id: a\n  project: b\n"))
    assert errors_of(both) == [f"{both}:2: provider: project 'b' and project_id 'a' differ; give one of them"]
    elsewhere = write(tmp_path, GCP.replace("us-central1-a,us-central1-b", "us-central1-a,europe-west4-a"))
    assert errors_of(elsewhere) == [f"{elsewhere}:6: provider.availability_zone: zone 'europe-west4-a' is not in "
                                    "provider.region 'us-central1'"]


EAST = f"""\
  e:
    region: us-east1
    node_config:
      machineType: n2-standard-2
      disks: [{{boot: true, autoDelete: true, initializeParams: {{sourceImage: {IMAGE}}}}}]
"""


def test_a_node_type_in_another_region_launches_in_its_zones_there(tmp_path):
    config = load(write(tmp_path, GCP + EAST + "    zones: [us-east1-b, us-east1-c]\n"))[0]
    assert (config.region_of("e"), config.zones_of("e")) == ("us-east1", ["us-east1-b", "us-east1-c"])
    assert (config.region_of("w"), config.zones_of("w")) == ("us-central1", ["us-central1-a", "us-central1-b"])
    assert config.regions() == ["us-central1", "us-east1"]


@pytest.mark.parametrize(("zones", "key", "message"), [
    ("", "  e:", "available_node_types.e.zones: node type 'e' is in region 'us-east1', not provider.region "
                 "'us-central1': list its zones there (e.g. zones: [us-east1-b])"),
    ("    zones: [us-east1-b, us-central1-a]\n", "zones:",
     "available_node_types.e.zones.1: zone 'us-central1-a' of node type 'e' is not in its region 'us-east1' (GCE "
     "zones are <region>-<letter>, e.g. us-east1-b)"),
    ("    zones: [us-east1-bb]\n", "zones:",
     "available_node_types.e.zones.0: zone 'us-east1-bb' of node type 'e' is not in its region 'us-east1' (GCE "
     "zones are <region>-<letter>, e.g. us-east1-b)"),
])
def test_a_node_types_zones_must_be_in_its_region(tmp_path, zones, key, message):
    text = GCP + EAST + zones
    path = write(tmp_path, text)
    assert errors_of(path) == [f"{path}:{line_of(text, key.strip())}: {message}"]


def test_every_launched_node_type_needs_a_machine_type_and_an_image(tmp_path):
    text = GCP.replace("      machineType: n2-standard-2\n", "").replace(
        f"      disks: [{{boot: true, autoDelete: true, initializeParams: {{sourceImage: {IMAGE}}}}}]\n",
        "      disks: [{boot: true, initializeParams: {diskSizeGb: 10}}]\n")
    path = write(tmp_path, text)
    assert errors_of(path) == [
        f"{path}:9: available_node_types.w.node_config: node type 'w' has no machineType (e.g. n1-standard-4)",
        f"{path}:9: available_node_types.w.node_config: node type 'w' has no boot image: a disk with boot: true and "
        "initializeParams.sourceImage, or provider.image"]
    with_image = write(tmp_path, text.replace("  type: gcp\n", f"  type: gcp\n  image: {IMAGE}\n").replace(
        "    node_config:\n", "    node_config:\n      machineType: e2-small\n"))
    assert load(with_image)[0].provider.image == IMAGE


def test_scheduling_and_spot_false_contradict(tmp_path):
    path = write(tmp_path, with_node_config(tmp_path, "      scheduling: {provisioningModel: SPOT}\n").read_text()
                 + "    spot: false\n")
    assert errors_of(path) == [f"{path}:15: available_node_types.w.spot: false, but node_config.scheduling asks for "
                               "spot (provisioningModel SPOT or preemptible): remove one of the two (scheduling for "
                               "on-demand, spot: false for spot)"]


def test_standard_scheduling_with_a_spot_node_type_and_an_on_demand_fleet_contradict(tmp_path):
    standard = with_node_config(tmp_path, "      scheduling: {provisioningModel: STANDARD}\n")
    assert errors_of(standard) == [f"{standard}:11: available_node_types.w.node_config.scheduling: provisioningModel "
                                   "STANDARD is not spot, but the node type is spot (spot: true, the default): set "
                                   "spot: false"]
    fleet = write(tmp_path, with_node_config(tmp_path, "      scheduling: {provisioningModel: SPOT}\n").read_text()
                  + "spot: {market: on-demand}\n")
    assert errors_of(fleet) == [f"{fleet}:15: spot.market: 'on-demand' for the whole fleet, but available_node_types"
                                ".w.node_config.scheduling asks for spot: remove one"]


def test_spot_said_twice_and_a_spot_head_are_warnings(tmp_path):
    path = write(tmp_path, with_node_config(tmp_path, "      scheduling: {provisioningModel: SPOT}\n").read_text()
                 + "    spot: true\nhead_node_type: w\n")
    assert load(path)[1] == [f"{path}:11: available_node_types.w.node_config.scheduling: the head node type asks for "
                             "spot; the head should be on-demand (spotswarm does not launch it: it is where the "
                             "supervisor runs)"]
    twice = write(tmp_path, path.read_text().replace("head_node_type: w\n", ""))
    assert load(twice)[1] == [f"{twice}:15: available_node_types.w.spot: true and node_config.scheduling say the "
                              "same (spot); one is enough"]


def test_a_project_for_another_provider_is_a_warning(tmp_path):
    path = write(tmp_path, "cluster_name: t\nprovider:\n  type: local\n  project_id: p\n"
                           "available_node_types: {a: {}}\n")
    assert load(path)[1] == [f"{path}:4: provider.project_id: read by the gcp provider only (the GCP project); "
                             "ignored for provider 'local'"]


# ---- the provider, the command line ------------------------------------------------------------
def test_gcp_needs_google_cloud_compute(monkeypatch, tmp_path):
    import orchestrator.config.clouds as providers

    assert providers.provider_problem("gcp") is None
    monkeypatch.setattr(providers, "_compute_installed", lambda: False)
    message = ("provider.type 'gcp' needs google-cloud-compute, which is not installed: pip install "
               "'spotswarm[gcp]'")
    assert providers.provider_problem("gcp") == message
    path = write(tmp_path, GCP)
    assert errors_of(path) == [f"{path}:3: {message}"]


# ---- fuzzing: whatever node_config holds, a config or a ConfigError --------------------------
_MEMBERS = st.sampled_from(["machineType", "disks", "networkInterfaces", "guestAccelerators", "serviceAccounts",
                            "metadata", "scheduling", "labels", "name", "zone", "machine_type", "canIpForward"])
_NESTED = st.fixed_dictionaries({}, optional={
    "scheduling": st.lists(st.dictionaries(st.sampled_from(["preemptible", "provisioningModel", "onHostMaintenance"]),
                                           ANY_JSON, max_size=2), max_size=2) | st.dictionaries(
        st.sampled_from(["provisioningModel", "onHostMaintenance", "automaticRestart", "x"]), ANY_JSON, max_size=3),
    "guestAccelerators": st.lists(st.dictionaries(st.sampled_from(["acceleratorType", "acceleratorCount"]), ANY_JSON,
                                                  max_size=2), max_size=2),
    "metadata": st.dictionaries(st.just("items"), st.lists(st.dictionaries(st.sampled_from(["key", "value"]),
                                                                           ANY_JSON, max_size=2), max_size=2))})


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(_MEMBERS | st.text(max_size=12), ANY_JSON, max_size=5), _NESTED, st.booleans())
def test_fuzz_any_node_config_gives_a_config_or_a_config_error(tmp_path_factory, node_config, nested, head):
    check_any_node_config(tmp_path_factory, GCP, {**node_config, **nested}, head)
