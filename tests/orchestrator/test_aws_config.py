"""Cluster YAML for the aws provider: a Ray launcher YAML loads (its unused keys are warnings),
node_config is checked against EC2's RunInstances model, spot is said one way, checkpoint URIs."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.config.checks import load_cluster_config
from orchestrator.config.ray_keys import RAY_LAUNCHER_KEYS
from orchestrator.config.schema import (
    ClusterConfig,
    ConfigError,
    NodeType,
    ProviderConfig,
)
from tests.orchestrator.run_checks import (
    ANY_JSON,
    check_any_node_config,
    errors_of,
    line_of,
    load,
    validate_shipped,
    write,
)

pytestmark = pytest.mark.timeout(300)

AMI = "ami-0123456789abcdef0"
AWS = f"""\
cluster_name: t
provider:
  type: aws
  region: us-east-1
available_node_types:
  w:
    node_config:
      InstanceType: m5.large
      ImageId: {AMI}
    min_workers: 1
    max_workers: 2
"""
NODE_CONFIG_END = f"      ImageId: {AMI}\n"  # where a test adds node_config keys (line 9 ends here)
UNUSED = "Ray's cluster launcher key, not used by spotswarm: "
BOOT = UNUSED + "every instance runs spotswarm's boot script instead (see spotswarm bootstrap-script)"
SSH = UNUSED + "spotswarm does not SSH into instances or sync files to them"
START = UNUSED + ("spotswarm's boot script starts Ray itself, after initialization_commands, setup_commands and "
                  "head_setup_commands or worker_setup_commands")
SIZE = UNUSED + "the fleet follows each node type's min_workers and max_workers and the spot policy"

# Ray's own AWS spot example, as its cluster launcher takes it (plus spotswarm's training section)
RAY_LAUNCHER_YAML = f"""\
cluster_name: ray-spot
max_workers: 4
upscaling_speed: 1.0
idle_timeout_minutes: 5
provider:
  type: aws
  region: us-west-2
  availability_zone: us-west-2a,us-west-2b
  cache_stopped_nodes: False
auth:
  ssh_user: ubuntu
available_node_types:
  ray.head.default:
    resources: {{}}
    node_config:
      InstanceType: m5.large
  ray.worker.default:
    min_workers: 1
    max_workers: 4
    resources: {{CPU: 2}}
    node_config:
      InstanceType: m5.large
      ImageId: {AMI}
      InstanceMarketOptions:
        MarketType: spot
    worker_setup_commands: [echo worker]
head_node_type: ray.head.default
file_mounts: {{}}
initialization_commands: []
setup_commands:
  - pip install spotswarm
head_start_ray_commands:
  - ray stop
worker_start_ray_commands:
  - ray stop
training:
  task: synthetic
"""


def with_provider(tmp_path: Path, lines: str) -> Path:
    """AWS with ``lines`` (indented two spaces) added to the provider section, from line 5 on."""
    return write(tmp_path, AWS.replace("  region: us-east-1\n", "  region: us-east-1\n" + lines))


def with_node_config(tmp_path: Path, lines: str) -> Path:
    """AWS with ``lines`` (indented six spaces) added to node type w's node_config, from line 10 on."""
    return write(tmp_path, AWS.replace(NODE_CONFIG_END, NODE_CONFIG_END + lines))


# ---- a Ray cluster-launcher YAML -------------------------------------------------------------
def test_a_ray_launcher_yaml_loads_with_one_warning_per_unused_key(tmp_path):
    path = write(tmp_path, RAY_LAUNCHER_YAML)
    config, warnings = load(path)
    at = {key: line_of(RAY_LAUNCHER_YAML, key + ":") for key in (
        "max_workers", "upscaling_speed", "idle_timeout_minutes", "cache_stopped_nodes", "auth", "file_mounts",
        "initialization_commands", "setup_commands", "head_start_ray_commands", "worker_start_ray_commands")}
    assert warnings == [
        f"{path}:{at['max_workers']}: max_workers: {SIZE}",
        f"{path}:{at['upscaling_speed']}: upscaling_speed: {SIZE}",
        f"{path}:{at['idle_timeout_minutes']}: idle_timeout_minutes: {SIZE}",
        f"{path}:{at['cache_stopped_nodes']}: provider.cache_stopped_nodes: {UNUSED}spotswarm terminates the "
        "instances it releases",
        f"{path}:{at['auth']}: auth: {SSH}",
        f"{path}:{at['file_mounts']}: file_mounts: {SSH}",
        f"{path}:{at['head_start_ray_commands']}: head_start_ray_commands: {START}",
        f"{path}:{at['worker_start_ray_commands']}: worker_start_ray_commands: {START}",
    ]
    # Ray's boot commands are the boot scripts' (the head's, the fleet's), in Ray's order
    assert (config.initialization_commands, config.setup_commands) == ([], ["pip install spotswarm"])
    assert config.available_node_types["ray.worker.default"].worker_setup_commands == ["echo worker"]  # its own
    # Ray's head type has only node_config and resources: our defaults apply, and it is not launched
    head = config.available_node_types["ray.head.default"]
    assert (head.min_workers, head.max_workers, head.node_config) == (0, 1, {"InstanceType": "m5.large"})
    assert config.max_instances() == 4
    assert config.provider.zones == ["us-west-2a", "us-west-2b"]
    assert config.available_node_types["ray.worker.default"].spot is True


def test_without_a_list_the_warnings_are_logged(tmp_path, caplog):
    path = write(tmp_path, AWS + "auth: {ssh_user: ubuntu}\n")
    with caplog.at_level(logging.WARNING, logger="orchestrator.config.checks"):
        load_cluster_config(path)
    assert [r.getMessage() for r in caplog.records] == [f"{path}:12: auth: {SSH}"]


def test_a_ray_key_close_to_ours_says_which_one_we_read(tmp_path):
    path = with_provider(tmp_path, "  namespace: n\n")
    assert load(path)[1] == [f"{path}:5: provider.namespace: {UNUSED}ignored; did you mean 'namespaces'?"]


def test_rays_gcp_project_id_is_the_gcp_providers_and_ignored_here(tmp_path):
    path = with_provider(tmp_path, "  project_id: p\n")
    assert load(path)[1] == [f"{path}:5: provider.project_id: read by the gcp provider only (the GCP project); "
                             "ignored for provider 'aws'"]


def test_a_key_neither_ray_nor_spotswarm_knows_is_still_an_error(tmp_path):
    path = write(tmp_path, AWS + "file_mounts: {}\ntrainig: {task: synthetic}\n")
    warnings: list[str] = []
    with pytest.raises(ConfigError) as info:
        load_cluster_config(path, warnings)
    assert str(info.value) == f"{path}:13: trainig: unknown key; did you mean 'training'?"
    assert warnings == [f"{path}:12: file_mounts: {SSH}"]  # given even when the file has errors


def test_ray_launcher_keys_cover_rays_schema_and_none_is_ours():
    spec = importlib.util.find_spec("ray")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("ray is not installed")
    schema = json.loads((Path(spec.submodule_search_locations[0]) / "autoscaler" / "ray-schema.json").read_text())
    node_type = schema["properties"]["available_node_types"]["patternProperties"][".*"]["properties"]
    for kind, model, keys in (("", ClusterConfig, schema["properties"]),
                              ("provider", ProviderConfig, schema["properties"]["provider"]["properties"]),
                              ("available_node_types.*", NodeType, node_type)):
        ours = set(model.model_fields)
        assert set(keys) - ours <= set(RAY_LAUNCHER_KEYS[kind]), kind
        assert not ours & set(RAY_LAUNCHER_KEYS[kind]), kind


# ---- zones: provider.zones or Ray's provider.availability_zone -------------------------------
def test_availability_zone_gives_the_zones(tmp_path):
    path = with_provider(tmp_path, "  availability_zone: 'us-east-1a, us-east-1c'\n")
    config = load(path)[0]
    assert (config.provider.zones, config.provider.availability_zone) == (["us-east-1a", "us-east-1c"],
                                                                          "us-east-1a, us-east-1c")
    assert ClusterConfig.model_validate(config.model_dump(mode="json")) == config  # as the run store does


def test_aws_zones_default_to_none_listed_and_local_keeps_its_own(tmp_path):
    assert load(write(tmp_path, AWS))[0].provider.zones == []
    explicit = load(with_provider(tmp_path, "  zones: [b, a]\n"))[0]
    assert explicit.provider.zones == ["b", "a"]
    local = ClusterConfig.model_validate({"cluster_name": "t", "available_node_types": {"a": {}}})
    assert local.provider.zones == ["local-a", "local-b"]


@pytest.mark.parametrize(("provider", "error"), [
    ("availability_zone: us-east-1a,us-east-1b\n  zones: [us-east-1a]",
     ":6: provider.zones: ['us-east-1a'] and provider.availability_zone 'us-east-1a,us-east-1b' name different "
     "zones; give one of them"),
    ("availability_zone: 'us-east-1a,'", ":5: provider.availability_zone: 'us-east-1a,': expected zone names "
                                         "separated by commas, e.g. 'us-east-1a,us-east-1b'"),
])
def test_zones_and_availability_zone_must_agree(tmp_path, provider, error):
    path = with_provider(tmp_path, f"  {provider}\n")
    assert errors_of(path) == [f"{path}{error}"]


def test_the_same_zones_both_ways_are_fine_and_local_refuses_availability_zone(tmp_path):
    both = with_provider(tmp_path, "  availability_zone: a,b\n  zones: [b, a]\n")
    assert load(both)[0].provider.zones == ["b", "a"]
    local = write(tmp_path, "cluster_name: t\nprovider:\n  availability_zone: a\navailable_node_types: {a: {}}\n")
    assert errors_of(local) == [f"{local}:3: provider.availability_zone: Ray's key for a cloud provider's zones; "
                                "the local simulator's zones are provider.zones"]


WEST = f"""\
  west:
    region: us-west-2
    node_config:
      InstanceType: m5.large
      ImageId: {AMI}
"""


def test_a_node_type_in_another_region_may_leave_its_zones_to_the_provider(tmp_path):
    config = load(write(tmp_path, AWS + WEST))[0]
    assert (config.region_of("west"), config.zones_of("west"), config.uses_provider_zones("west")) == (
        "us-west-2", [], False)
    assert (config.region_of("w"), config.uses_provider_zones("w")) == ("us-east-1", True)
    assert config.regions() == ["us-east-1", "us-west-2"]
    given = load(write(tmp_path, AWS + WEST + "    zones: [us-west-2b, us-west-2-lax-1a]\n"))[0]
    assert given.zones_of("west") == ["us-west-2b", "us-west-2-lax-1a"]  # a Local Zone is its region's too


def test_a_node_types_zones_must_be_in_its_region(tmp_path):
    text = AWS + WEST + "    zones: [us-west-2a, us-east-1b]\n"
    path = write(tmp_path, text)
    assert errors_of(path) == [
        f"{path}:{line_of(text, 'zones:')}: available_node_types.west.zones.1: zone 'us-east-1b' of node type 'west' "
        "is not in its region 'us-west-2' (an EC2 zone's name starts with its region's, e.g. us-west-2a)"]


# ---- node_config against EC2 RunInstances ----------------------------------------------------
def test_an_unknown_node_config_key_names_its_line_and_the_parameter_meant(tmp_path):
    path = with_node_config(tmp_path, "      InstanceTyp: m5.xlarge\n      Foo: 1\n")
    assert errors_of(path) == [
        f"{path}:10: available_node_types.w.node_config.InstanceTyp: unknown key for the aws provider (not a "
        "parameter of EC2 RunInstances); did you mean 'InstanceType'?",
        f"{path}:11: available_node_types.w.node_config.Foo: unknown key for the aws provider (not a parameter of "
        "EC2 RunInstances)"]


def test_a_nested_type_error_is_reported_at_its_own_key_with_botocores_message(tmp_path):
    path = with_node_config(tmp_path, "      BlockDeviceMappings:\n        - DeviceName: /dev/sda1\n"
                                      "          Ebs: {VolumeSize: 256GB}\n")
    assert errors_of(path) == [
        f"{path}:12: available_node_types.w.node_config.BlockDeviceMappings.0.Ebs.VolumeSize: Invalid type for "
        "parameter BlockDeviceMappings[0].Ebs.VolumeSize, value: 256GB, type: <class 'str'>, valid types: "
        "<class 'int'>"]


def test_valid_run_instances_parameters_load(tmp_path):
    path = with_node_config(tmp_path, "      BlockDeviceMappings: [{DeviceName: /dev/sda1, Ebs: {VolumeSize: 256}}]\n"
                                      "      SecurityGroupIds: [sg-1]\n      KeyName: k\n"
                                      "      IamInstanceProfile: {Name: spotswarm}\n"
                                      "      TagSpecifications: [{ResourceType: instance, Tags: [{Key: a, Value: b}]}]"
                                      "\n"
                                      "      Placement: {Tenancy: default}\n      SubnetIds: [subnet-1, subnet-2]\n")
    config, warnings = load(path)
    assert warnings == []
    assert config.available_node_types["w"].node_config["SubnetIds"] == ["subnet-1", "subnet-2"]


@pytest.mark.parametrize(("lines", "error"), [
    ("      SubnetId: subnet-1\n      SubnetIds: [subnet-2]\n",
     ":11: available_node_types.w.node_config.SubnetIds: SubnetId and SubnetIds both given: set one (SubnetIds, "
     "Ray's key, lists subnets to choose among; SubnetId is one)"),
    ("      SubnetIds: subnet-2\n", ":10: available_node_types.w.node_config.SubnetIds: must be a non-empty list of "
                                    "subnet ids, e.g. [subnet-0abc] (got 'subnet-2')"),
    ("      MinCount: 1\n", ":10: available_node_types.w.node_config.MinCount: set by spotswarm: one instance per "
                            "launch, the boot script as user data"),
    ("      MaxCount: 3\n", ":10: available_node_types.w.node_config.MaxCount: set by spotswarm: one instance per "
                            "launch, the boot script as user data"),
    ("      UserData: '#!/bin/sh'\n", ":10: available_node_types.w.node_config.UserData: set by spotswarm: one "
                                      "instance per launch, the boot script as user data"),
    ("      Placement:\n        Tenancy: default\n        AvailabilityZone: us-east-1a\n",
     ":12: available_node_types.w.node_config.Placement.AvailabilityZone: zones come from provider.zones or "
     "provider.availability_zone, not node_config"),
])
def test_keys_spotswarm_owns_or_ray_spells_its_way(tmp_path, lines, error):
    path = with_node_config(tmp_path, lines)
    assert errors_of(path) == [f"{path}{error}"]


def test_every_launched_node_type_needs_an_image(tmp_path):
    text = AWS.replace(NODE_CONFIG_END, "") + "  head:\n    node_config: {InstanceType: m5.large}\n    max_workers: 0\n"
    path = write(tmp_path, text)
    assert errors_of(path) == [f"{path}:7: available_node_types.w.node_config: node type 'w' has no ImageId: set "
                               "node_config.ImageId or provider.image (the AMI its instances boot)",
                               f"{path}:12: available_node_types.head.node_config: node type 'head' has no ImageId: "
                               "set node_config.ImageId or provider.image (the AMI its instances boot)"]
    with_head = write(tmp_path, text + "head_node_type: head\n")  # the head is not launched: it needs none
    assert errors_of(with_head) == [f"{with_head}:7: available_node_types.w.node_config: node type 'w' has no "
                                    "ImageId: set node_config.ImageId or provider.image (the AMI its instances boot)"]
    image = text.replace("  region: us-east-1", f"  region: us-east-1\n  image: {AMI}")
    assert load(write(tmp_path, image))[0].provider.image == AMI


# ---- spot: InstanceMarketOptions or spot, said one way ---------------------------------------
SPOT_OPTIONS = "      InstanceMarketOptions: {MarketType: spot, SpotOptions: {SpotInstanceType: one-time}}\n"


def test_instance_market_options_make_a_node_type_spot(tmp_path):
    config, warnings = load(with_node_config(tmp_path, SPOT_OPTIONS))
    assert (config.available_node_types["w"].spot, warnings) == (True, [])


def test_instance_market_options_and_spot_false_contradict(tmp_path):
    path = with_node_config(tmp_path, SPOT_OPTIONS + "    spot: false\n")
    assert errors_of(path) == [f"{path}:11: available_node_types.w.spot: false, but node_config.InstanceMarketOptions "
                               "asks for spot (MarketType spot): remove one of the two (InstanceMarketOptions for "
                               "on-demand, spot: false for spot)"]


def test_instance_market_options_and_spot_true_agree_with_a_warning(tmp_path):
    path = with_node_config(tmp_path, SPOT_OPTIONS + "    spot: true\n")
    config, warnings = load(path)
    assert config.available_node_types["w"].spot is True
    assert warnings == [f"{path}:11: available_node_types.w.spot: true and node_config.InstanceMarketOptions say the "
                        "same (spot); InstanceMarketOptions wins: it is sent to EC2 as given"]


def test_a_spot_head_is_a_warning(tmp_path):
    path = write(tmp_path, AWS + "  head:\n    node_config:\n      InstanceType: m5.large\n"
                                 "      InstanceMarketOptions: {MarketType: spot}\n    max_workers: 0\n"
                                 "head_node_type: head\n")
    assert load(path)[1] == [f"{path}:15: available_node_types.head.node_config.InstanceMarketOptions: the head node "
                             "type asks for spot; the head should be on-demand (spotswarm does not launch it: it is "
                             "where the supervisor runs)"]


def test_other_market_types_and_an_on_demand_fleet_contradict_spot_options(tmp_path):
    block = with_node_config(tmp_path, "      InstanceMarketOptions: {MarketType: capacity-block}\n")
    assert errors_of(block) == [f"{block}:10: available_node_types.w.node_config.InstanceMarketOptions: MarketType "
                                "'capacity-block' is not spot, but the node type is spot (spot: true, the default): "
                                "set spot: false"]
    assert load(write(tmp_path, block.read_text() + "    spot: false\n"))[0].available_node_types["w"].spot is False
    fleet = write(tmp_path, with_node_config(tmp_path, SPOT_OPTIONS).read_text() + "spot: {market: on-demand}\n")
    assert errors_of(fleet) == [f"{fleet}:13: spot.market: 'on-demand' for the whole fleet, but "
                                "available_node_types.w.node_config.InstanceMarketOptions asks for spot: remove one"]


# ---- checkpoint.uri, checkpoint.endpoint_url -------------------------------------------------
@pytest.mark.parametrize("uri", ["s3://spotswarm-runs", "s3://spotswarm-runs/aws-demo", "s3://a.b-c/x/y/",
                                 "s3://abc"])
def test_an_s3_checkpoint_uri_loads(tmp_path, uri):
    path = write(tmp_path, AWS + f"checkpoint:\n  uri: '{uri}'\n  endpoint_url: http://127.0.0.1:5000\n")
    checkpoint = load(path)[0].checkpoint
    assert (checkpoint.uri, checkpoint.endpoint_url) == (uri, "http://127.0.0.1:5000")


BUCKET_RULE = ("is not an S3 bucket name (3 to 63 lowercase letters, digits, dots and hyphens, starting and ending "
               "with a letter or digit)")


GCS_RULE = ("is not a Cloud Storage bucket name (3 to 63 lowercase letters, digits, dots, hyphens and underscores, "
            "starting and ending with a letter or digit)")
SCHEMES = "archives are s3://bucket/prefix, gs://bucket/prefix or an absolute path"


@pytest.mark.parametrize("uri", ["gs://my_bucket/runs/a", "gs://bucket", "/data/archive", "~/archive", "file:///data/x"])
def test_a_gcs_or_local_checkpoint_uri_loads(tmp_path, uri):
    path = write(tmp_path, AWS + f"checkpoint:\n  uri: '{uri}'\n")
    assert load(path)[0].checkpoint.uri == uri


@pytest.mark.parametrize(("key", "value", "message"), [
    ("uri", "S3://bucket", SCHEMES),
    ("uri", "az://container/x", SCHEMES),
    ("uri", "data/checkpoints", "an archive directory must be an absolute path (or s3://bucket/prefix, "
                                "gs://bucket/prefix)"),
    ("uri", "gs://My-Bucket/x", f"'My-Bucket' {GCS_RULE}"),
    ("uri", "gs://", f"'' {GCS_RULE}"),
    ("uri", "s3://My_Bucket/x", f"'My_Bucket' {BUCKET_RULE}"),
    ("uri", "s3://ab", f"'ab' {BUCKET_RULE}"),
    ("uri", "s3://" + "a" * 64, f"'{'a' * 64}' {BUCKET_RULE}"),
    ("uri", "s3://-bucket", f"'-bucket' {BUCKET_RULE}"),
    ("uri", "s3://", f"'' {BUCKET_RULE}"),
    ("endpoint_url", "127.0.0.1:5000", "is not an http:// or https:// URL, e.g. http://127.0.0.1:5000"),
    ("endpoint_url", "ftp://host", "is not an http:// or https:// URL, e.g. http://127.0.0.1:5000"),
    ("endpoint_url", "http://", "is not an http:// or https:// URL, e.g. http://127.0.0.1:5000"),
    ("endpoint_url", "http://[", "is not an http:// or https:// URL, e.g. http://127.0.0.1:5000"),
    ("endpoint_url", "http://h:99999", "is not an http:// or https:// URL, e.g. http://127.0.0.1:5000"),
])
def test_a_bad_checkpoint_location_names_the_key_and_line(tmp_path, key, value, message):
    path = write(tmp_path, AWS + f"checkpoint:\n  {key}: '{value}'\n")
    separator = ": " if key == "uri" else " "
    assert errors_of(path) == [f"{path}:13: checkpoint.{key}: '{value}'{separator}{message}"]


def test_the_provider_endpoint_url_is_a_url_too(tmp_path):
    path = with_provider(tmp_path, "  endpoint_url: localhost:5000\n")
    assert errors_of(path) == [f"{path}:5: provider.endpoint_url: 'localhost:5000' is not an http:// or https:// "
                               "URL, e.g. http://127.0.0.1:5000"]
    good = with_provider(tmp_path, "  endpoint_url: http://[::1]:5000\n")
    assert load(good)[0].provider.endpoint_url == "http://[::1]:5000"


# ---- the provider, the command line ----------------------------------------------------------
def test_aws_needs_boto3(monkeypatch):
    import orchestrator.config.clouds as providers

    assert providers.provider_problem("aws") is None
    monkeypatch.setattr(providers, "_boto3_installed", lambda: False)
    assert providers.provider_problem("aws") == ("provider.type 'aws' needs boto3, which is not installed: "
                                                 "pip install 'spotswarm[aws]'")


def test_validate_the_shipped_aws_config(capsys):
    config = validate_shipped(capsys, "aws-spot.yaml", "provider aws, mode actors, 2 node types, 2..3 instances")
    assert config.provider.zones == ["us-east-1a", "us-east-1b", "us-east-1c"]
    assert config.checkpoint.uri == "s3://spotswarm-runs/aws-demo"
    assert config.available_node_types["worker-spot"].node_config["InstanceMarketOptions"]["MarketType"] == "spot"


def test_validate_prints_warnings_and_exits_0(tmp_path, capsys):
    from orchestrator.cli.main import main

    path = write(tmp_path, AWS + "auth: {ssh_user: ubuntu}\nfile_mounts: {}\n")
    assert main(["validate", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{path}: valid (provider aws, mode actors, 1 node type, 1..2 instances)\n"
    assert err.splitlines() == [f"warning: {path}:12: auth: {SSH}", f"warning: {path}:13: file_mounts: {SSH}"]


# ---- fuzzing: whatever node_config holds, a config or a ConfigError --------------------------
_MEMBERS = st.sampled_from(["InstanceType", "ImageId", "BlockDeviceMappings", "Placement", "InstanceMarketOptions",
                            "SubnetId", "SubnetIds", "TagSpecifications", "MinCount", "NetworkInterfaces",
                            "CpuOptions", "MetadataOptions"])


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(_MEMBERS | st.text(max_size=12), ANY_JSON, max_size=6), st.booleans())
def test_fuzz_any_node_config_gives_a_config_or_a_config_error(tmp_path_factory, node_config, head):
    check_any_node_config(tmp_path_factory, AWS, node_config, head)
