"""Cluster YAML validation: every mistake is one readable error with its line; nothing starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.config.checks import load_cluster_config
from orchestrator.config.schema import ClusterConfig, ConfigError
from tests.orchestrator.run_checks import errors_of, line_of, write

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent.parent
CONFIGS = sorted((ROOT / "cluster_configs").glob("*.yaml"))
GOOD = """\
cluster_name: t
provider:
  type: local
available_node_types:
  small:
    min_workers: 1
    max_workers: 2
training:
  task: synthetic
"""


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": ""})


def shipped_provider(path: Path) -> str:
    return yaml.safe_load(path.read_text()).get("provider", {}).get("type", "local")


RUNNABLE = ("local", "aws", "gcp")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load_without_warnings(path):
    assert shipped_provider(path) in RUNNABLE  # every shipped file runs in this build
    warnings: list[str] = []
    assert load_cluster_config(path, warnings).available_node_types
    assert warnings == []


def test_a_typo_in_a_key_names_the_line_and_suggests_the_key(tmp_path):
    path = write(tmp_path, GOOD.replace("  type: local", "  type: local\n  zonez: [a]"))
    with pytest.raises(ConfigError) as info:
        load_cluster_config(path)
    assert str(info.value) == f"{path}:4: provider.zonez: unknown key; did you mean 'zones'?"


def test_a_wrong_type_names_the_field_and_what_was_expected(tmp_path):
    path = write(tmp_path, GOOD.replace("min_workers: 1", "min_workers: plenty"))
    with pytest.raises(ConfigError, match=r":6: available_node_types.small.min_workers: .*integer.*'plenty'"):
        load_cluster_config(path)


def test_overlap_outside_diloco_is_an_error_naming_the_mode_and_in_diloco_reaches_the_workers(tmp_path):
    path = write(tmp_path, GOOD.replace("task: synthetic", "task: synthetic\n  overlap: true"))
    with pytest.raises(ConfigError, match=r"training.overlap: .*the mode is 'collaborative' \(use mode diloco"):
        load_cluster_config(path)
    path = write(tmp_path, GOOD.replace("task: synthetic", "task: synthetic\n  mode: diloco\n  overlap: true"))
    assert load_cluster_config(path).worker_config([]).overlap is True


def test_the_byzantine_level_reaches_the_workers_and_a_bad_one_is_named(tmp_path):
    path = write(tmp_path, GOOD.replace("task: synthetic", "task: synthetic\n  byzantine: verify"))
    assert load_cluster_config(path).worker_config([]).byzantine == "verify"
    assert load_cluster_config(write(tmp_path, GOOD)).worker_config([]).byzantine == "off"
    with pytest.raises(ConfigError, match=r"training.byzantine: Input should be 'off', 'clip' or 'verify'"):
        load_cluster_config(write(tmp_path, GOOD.replace("task: synthetic", "task: synthetic\n  byzantine: paranoid")))


def test_a_missing_field_and_a_bad_value_are_both_reported(tmp_path):
    path = write(tmp_path, GOOD.replace("cluster_name: t\n", "").replace("task: synthetic",
                                                                          "target_batch_size: 0"))
    with pytest.raises(ConfigError) as info:
        load_cluster_config(path)
    text = str(info.value)
    assert "cluster_name: required field is missing" in text
    assert ":8: training.target_batch_size: Input should be greater than 0" in text


def test_invalid_yaml_and_contradictions(tmp_path):
    with pytest.raises(ConfigError, match=r":2: not valid YAML"):
        load_cluster_config(write(tmp_path, "cluster_name: [\nprovider: {"))
    with pytest.raises(ConfigError, match="min_workers \\(3\\) exceeds max_workers \\(2\\)"):
        load_cluster_config(write(tmp_path, GOOD.replace("min_workers: 1", "min_workers: 3")))


def test_up_with_an_invalid_config_starts_nothing(tmp_path):
    path = write(tmp_path, GOOD.replace("task: synthetic", "taks: synthetic"))
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "up", str(path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert proc.returncode == 2
    assert "training.taks: unknown key; did you mean 'task'?" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=300))
def test_fuzz_any_text_gives_a_config_or_a_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "c.yaml"
    path.write_text(text)
    try:
        load_cluster_config(path)
    except ConfigError as e:
        assert str(path) in str(e)


# ---- provider.mode, provider.namespaces ------------------------------------------------------
def test_nodes_mode_and_namespaces_are_accepted_for_the_local_provider(tmp_path):
    path = write(tmp_path, GOOD.replace("  type: local", "  type: local\n  mode: nodes\n  namespaces: [ss0, ss-1.a_b]"))
    config = load_cluster_config(path)
    assert (config.provider.mode, config.provider.namespaces) == ("nodes", ["ss0", "ss-1.a_b"])
    assert config.listen_host() == "0.0.0.0"


def test_nodes_mode_with_a_cloud_provider_names_provider_mode(tmp_path):
    path = write(tmp_path, GOOD.replace("  type: local", "  type: gcp\n  mode: nodes"))
    errors = errors_of(path)
    assert errors == [f"{path}:4: provider.mode: 'nodes' is for the local provider only (provider.type is 'gcp'); "
                      "cloud instances are separate machines already"]
    aws = write(tmp_path, GOOD.replace("  type: local", "  type: aws\n  mode: nodes"))
    assert errors_of(aws) == [f"{aws}:4: provider.mode: 'nodes' is for the local provider only (provider.type is "
                              "'aws'); cloud instances are separate machines already"]
    with pytest.raises(Exception, match="provider.mode|'nodes' is for the local provider only"):
        ClusterConfig.model_validate({"cluster_name": "t", "provider": {"type": "gcp", "mode": "nodes"},
                                      "available_node_types": {"a": {}}})


@pytest.mark.parametrize(("provider", "message"), [
    ("mode: actors\n  namespaces: [ns0]", "only provider.type 'local' with provider.mode 'nodes' runs instances in "
                                          "network namespaces (here type 'local', mode 'actors')"),
    ("namespaces: [ns0]", "only provider.type 'local' with provider.mode 'nodes' runs instances in network "
                          "namespaces (here type 'local', mode 'actors')"),
    ("mode: nodes\n  namespaces: ['bad name']", "'bad name' is not a network namespace name (letters, digits, '_', "
                                                "'.', '-')"),
    ("mode: nodes\n  namespaces: ['']", "'' is not a network namespace name"),
    ("mode: nodes\n  namespaces: ['..']", "'..' is not a network namespace name"),
    ("mode: nodes\n  namespaces: [\"ns0\\n\"]", "'ns0\\n' is not a network namespace name"),
    ("mode: nodes\n  namespaces: [a, b, a]", "listed more than once: 'a'"),
])
def test_bad_namespaces_name_the_field_and_line(tmp_path, provider, message):
    path = write(tmp_path, GOOD.replace("  type: local", "  type: local\n  " + provider))
    [error] = errors_of(path)
    line = 4 + provider.count("\n")
    assert error.startswith(f"{path}:{line}: provider.namespaces: {message}")


def test_mode_defaults_to_actors_and_round_trips_for_every_provider():
    for kind in ("local", "aws", "gcp"):
        config = ClusterConfig.model_validate({"cluster_name": "t", "provider": {"type": kind},
                                               "available_node_types": {"a": {}}})
        again = ClusterConfig.model_validate(config.model_dump(mode="json"))  # as the run store does
        assert again.provider.mode == "actors" and again == config


# ---- ray, network ----------------------------------------------------------------------------
@pytest.mark.parametrize("address", ["auto", "10.0.0.5:6379", "head.example.com:6379", "localhost:1",
                                     "[::1]:65535", "[fe80::1]:6379"])
def test_ray_address_accepts_auto_and_host_port(tmp_path, address):
    path = write(tmp_path, GOOD + f"ray:\n  address: '{address}'\n")
    assert load_cluster_config(path).ray.address == address


@pytest.mark.parametrize(("address", "message"), [
    ("10.0.0.5", "'10.0.0.5': expected 'auto' or HOST:PORT, e.g. 10.0.0.5:6379"),
    ("10.0.0.5:0", "'10.0.0.5:0': port '0' is not a number from 1 to 65535"),
    ("10.0.0.5:65536", "port '65536' is not a number from 1 to 65535"),
    ("10.0.0.5:http", "port 'http' is not a number from 1 to 65535"),
    (":6379", "expected 'auto' or HOST:PORT"),
    ("::1:6379", "an IPv6 host goes in brackets, e.g. [::1]:6379"),
    ("[nope]:6379", "'nope' in brackets is not an IPv6 address"),
    ("ray://head:10001", "'ray://head:10001': a URL (a Ray Client address?); expected 'auto' or HOST:PORT"),
    ("-h:6379", "'-h' is neither an IP address nor a hostname"),
    ("300.1.1.1:6379", "'300.1.1.1' is not a valid IP address"),
    ("AUTO", "expected 'auto' or HOST:PORT"),
    ("h:\u0663", "is not a number from 1 to 65535"),
])
def test_a_bad_ray_address_names_the_field_and_line(tmp_path, address, message):
    path = write(tmp_path, GOOD + f"ray:\n  address: '{address}'\n")
    [error] = errors_of(path)
    assert error.startswith(f"{path}:11: ray.address: ") and message in error


def test_listen_host_default_follows_the_provider_and_mode(tmp_path):
    local = load_cluster_config(write(tmp_path, GOOD))
    assert (local.network.listen_host, local.network.announce_host, local.listen_host()) == (None, None, "127.0.0.1")
    assert local.model_copy(update={"provider": local.provider.model_copy(update={"mode": "nodes"})}
                            ).listen_host() == "0.0.0.0"
    cloud = ClusterConfig.model_validate({"cluster_name": "t", "provider": {"type": "aws"},
                                          "available_node_types": {"a": {}}})
    assert cloud.listen_host() == "0.0.0.0"
    given_host = load_cluster_config(write(tmp_path, GOOD + "network: {listen_host: 10.1.2.3, announce_host: "
                                                             "node-1.internal}\n"))
    assert (given_host.listen_host(), given_host.network.announce_host) == ("10.1.2.3", "node-1.internal")


@pytest.mark.parametrize(("network", "message"), [
    ("listen_host: 10.0.0.256", "network.listen_host: '10.0.0.256' is not a valid IP address"),
    ("listen_host: 'under_score.example'", "network.listen_host: 'under_score.example' is neither an IP address nor "
                                           "a hostname"),
    ("listen_host: ''", "network.listen_host: '' is neither an IP address nor a hostname"),
    ("announce_host: 'a b'", "network.announce_host: 'a b' is neither an IP address nor a hostname"),
    ("announce_host: 0.0.0.0", "network.announce_host: '0.0.0.0' is a wildcard to listen on; announce an address "
                               "other peers can reach"),
    ("announce_host: '::'", "network.announce_host: '::' is a wildcard"),
    ("announce_host: \"host\\n\"", "network.announce_host: 'host\\n' is neither an IP address nor a hostname"),
    ("listen_hots: 0.0.0.0", "network.listen_hots: unknown key; did you mean 'listen_host'?"),
])
def test_a_bad_network_host_names_the_field_and_line(tmp_path, network, message):
    path = write(tmp_path, GOOD + f"network:\n  {network}\n")
    [error] = errors_of(path)
    assert error.startswith(f"{path}:11: {message}")


def test_ipv6_hosts_are_accepted(tmp_path):
    config = load_cluster_config(write(tmp_path, GOOD + "network: {listen_host: '::', announce_host: 'fd00::5'}\n"))
    assert (config.listen_host(), config.network.announce_host) == ("::", "fd00::5")


def test_the_dashboard_default_port_is_not_rays(tmp_path):
    assert load_cluster_config(write(tmp_path, GOOD)).dashboard.port == 8270


# ---- provider-specific node_config -----------------------------------------------------------
def test_local_node_config_accepts_only_an_instance_type_label(tmp_path):
    path = write(tmp_path, GOOD.replace("    min_workers: 1", "    node_config: {InstanceType: sim.small}\n"
                                                                "    min_workers: 1"))
    assert load_cluster_config(path).available_node_types["small"].node_config == {"InstanceType": "sim.small"}


@pytest.mark.parametrize(("node_config", "message"), [
    ("{InstanceTyp: sim.small}", "node_config.InstanceTyp: unknown key for the local provider; did you mean "
                                 "'InstanceType'?"),
    ("{instance_type: sim.small}", "node_config.instance_type: unknown key for the local provider; did you mean "
                                   "'InstanceType'?"),
    ("{ImageId: ami-1}", "node_config.ImageId: unknown key for the local provider (it reads only InstanceType)"),
    ("{InstanceType: 4}", "node_config.InstanceType: must be a string, a label for node type 'small' (got 4)"),
])
def test_a_bad_local_node_config_key_names_the_key_and_line(tmp_path, node_config, message):
    path = write(tmp_path, GOOD.replace("    min_workers: 1", f"    node_config: {node_config}\n    min_workers: 1"))
    [error] = errors_of(path)
    assert error == f"{path}:6: available_node_types.small.{message}"


def test_node_config_is_the_cloud_providers_business():
    from orchestrator.config.clouds import node_config_problems, provider_problem

    assert node_config_problems("aws", "gpu", {"InstanceType": "g5.xlarge", "SubnetId": "s-1"}) == []
    assert node_config_problems("gcp", "t4", {"machineType": "n1-standard-4"}) == []
    assert provider_problem("local") is None
    assert provider_problem("aws") is None  # boto3 is installed here
    assert provider_problem("gcp") is None  # google-cloud-compute is installed here
    assert provider_problem("azure") == "provider.type 'azure' is not a provider (this build runs 'local', 'aws' " \
                                        "and 'gcp')"


# ---- training.group_size ---------------------------------------------------------------------
def test_group_size_reaches_the_workers(tmp_path):
    config = load_cluster_config(write(tmp_path, GOOD.replace("  task: synthetic",
                                                              "  task: synthetic\n  group_size: 4")))
    assert config.worker_config(["127.0.0.1:1"]).group_size == 4
    default = load_cluster_config(write(tmp_path, GOOD))
    assert default.worker_config([]).group_size == 16


# ---- available_node_types.<type>.bandwidth ------------------------------------------------------
def test_a_node_types_bandwidth_reaches_its_workers_and_unset_means_measured(tmp_path):
    text = GOOD.replace("    max_workers: 2\n", "    max_workers: 2\n    bandwidth: 50\n  big:\n    max_workers: 1\n")
    config = load_cluster_config(write(tmp_path, text))
    assert config.worker_config(["127.0.0.1:1"], node_type="small").bandwidth == 50.0
    assert config.worker_config(["127.0.0.1:1"], node_type="big").bandwidth is None  # each measures its own
    assert config.worker_config([]).bandwidth is None
    assert config.expert_host_config([], node_type="small")["bandwidth"] == 50.0  # an experts type's too


@pytest.mark.parametrize("value", ["0", "-5", "fast", ".inf"])
def test_a_bad_bandwidth_names_the_node_type_and_the_field(tmp_path, value):
    path = write(tmp_path, GOOD.replace("    max_workers: 2\n", f"    max_workers: 2\n    bandwidth: {value}\n"))
    errors = errors_of(path)
    assert any("available_node_types.small.bandwidth" in e for e in errors), errors


# ---- regions: a node type's region and zones ---------------------------------------------------------
REGIONS = """\
cluster_name: t
provider:
  type: local
  region: east
  zones: [east-a, east-b]
available_node_types:
  near:
    max_workers: 1
  far:
    region: west
    zones: [west-a, west-b]
    spot_price_per_hour: {west-a: 0.1}
"""


def test_a_node_type_in_another_region_launches_in_its_own_zones_and_the_others_in_the_providers(tmp_path):
    config = load_cluster_config(write(tmp_path, REGIONS), [])
    assert [(config.region_of(n), config.zones_of(n), config.uses_provider_zones(n)) for n in ("near", "far")] == [
        ("east", ["east-a", "east-b"], True), ("west", ["west-a", "west-b"], False)]
    assert config.regions() == ["east", "west"]
    assert ClusterConfig.model_validate(config.model_dump(mode="json")) == config  # as the run store reads it back


@pytest.mark.parametrize(("old", "new", "key", "message"), [
    ("    zones: [west-a, west-b]\n    spot_price_per_hour: {west-a: 0.1}\n", "", "far:",
     "available_node_types.far.zones: node type 'far' is in region 'west', not provider.region 'east': list its "
     "zones there (e.g. zones: [west-a])"),
    ("zones: [west-a, west-b]", "zones: []", "zones: []",
     "available_node_types.far.zones: names no zone: list at least one, or leave zones out for the provider's"),
    ("zones: [west-a, west-b]", "zones: [west-a, west-a]", "zones: [west-a, west-a]",
     "available_node_types.far.zones: listed more than once: 'west-a'"),
    ("{west-a: 0.1}", "{west-c: 0.1}", "spot_price_per_hour",
     "available_node_types.far.spot_price_per_hour.west-c: zone 'west-c' is not among the zones of node type "
     "'far' (west-a, west-b)"),
])
def test_a_node_types_region_and_zones_are_checked_at_their_key(tmp_path, old, new, key, message):
    text = REGIONS.replace(old, new)
    path = write(tmp_path, text)
    assert errors_of(path) == [f"{path}:{line_of(text, key)}: {message}"]


def test_a_node_type_naming_the_providers_region_keeps_the_providers_zones(tmp_path):
    text = REGIONS.replace("    region: west\n    zones: [west-a, west-b]\n    spot_price_per_hour: {west-a: 0.1}\n",
                           "    region: east\n")
    config = load_cluster_config(write(tmp_path, text), [])
    assert (config.zones_of("far"), config.uses_provider_zones("far"), config.regions()) == (
        ["east-a", "east-b"], True, ["east"])


def test_group_size_is_a_worker_flag():
    from orchestrator.cli.main import build_parser
    from orchestrator.instance.worker import FLAGS

    args = build_parser().parse_args(["worker", "--group-size", "5"])
    assert FLAGS.load(None, vars(args)).group_size == 5
    with pytest.raises(ConfigError, match="^--group-size: Input should be greater than or equal to 2"):
        FLAGS.load(None, {"group_size": 1})


def test_a_collaborative_fleet_larger_than_a_group_averages_in_groups_of_that_size(tmp_path):
    path = write(tmp_path, GOOD.replace("max_workers: 2", "max_workers: 5").replace(
        "  task: synthetic", "  task: synthetic\n  group_size: 4"))
    config = load_cluster_config(path)  # no error: the group size is a group's, not the run's
    assert config.max_trainers() == 5 and config.worker_config(["127.0.0.1:1"]).group_size == 4


# ---- the command line: validate, bootstrap-script, --address ---------------------------------
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_validate_every_shipped_config(path, capsys):
    from orchestrator.cli.main import main

    code = main(["validate", str(path)])  # in-process: the command's own process is tested below
    out, err = capsys.readouterr()
    kind = shipped_provider(path)
    config = load_cluster_config(path)
    types = config.available_node_types
    fleet = [t for name, t in types.items() if name != config.head_node_type]  # the head is not launched
    low, high = sum(t.min_workers for t in fleet), sum(t.max_workers for t in fleet)
    noun = "node type" if len(types) == 1 else "node types"
    assert (code, err) == (0, "")
    assert out == (f"{path}: valid (provider {kind}, mode {config.provider.mode}, {len(types)} {noun}, "
                           f"{low}..{high} instances)\n")


def test_validate_reports_every_error_and_starts_nothing(tmp_path):
    path = write(tmp_path, GOOD.replace("  type: local", "  type: local\n  zonez: [a]").replace(
        "task: synthetic", "taks: synthetic"))
    proc = cli("validate", str(path), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"{path}:4: provider.zonez: unknown key; did you mean 'zones'?",
                                        f"{path}:10: training.taks: unknown key; did you mean 'task'?"]
    assert proc.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.yaml"]  # no run directory


def test_validate_imports_neither_ray_nor_torch(tmp_path):
    """Checking a config answers in well under a second: torch's import alone is ~2 s here."""
    path = write(tmp_path, GOOD)
    code = ("import sys; from orchestrator.cli.main import main; rc = main(['validate', sys.argv[1]]); "
            "print('rc', rc, 'ray' in sys.modules, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, str(path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert proc.stdout.splitlines()[-1] == "rc 0 False False", proc.stderr


def test_a_worker_with_an_invalid_config_says_so_before_importing_torch(tmp_path):
    code = ("import sys; from orchestrator.cli.main import main; rc = main(['worker', '--max-seconds', '-1']); "
            "print('rc', rc, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert proc.stdout.splitlines()[-1] == "rc 2 False", proc.stderr
    assert "--max-seconds: Input should be greater than 0" in proc.stderr


def test_bootstrap_script_of_an_unknown_node_type_lists_the_known_ones(capsys):
    from orchestrator.cli.main import main

    assert main(["bootstrap-script", str(ROOT / "cluster_configs" / "local-large.yaml"), "gpu"]) == 2
    err = capsys.readouterr().err
    assert "no node type 'gpu' in available_node_types (known: cpu-large, cpu-small)" in err


def test_bootstrap_script_of_an_invalid_config_says_why(tmp_path, capsys):
    from orchestrator.cli.main import main

    path = write(tmp_path, GOOD.replace("min_workers: 1", "min_workers: plenty"))
    assert main(["bootstrap-script", str(path), "small"]) == 2
    assert "available_node_types.small.min_workers" in capsys.readouterr().err
    unknown = write(tmp_path, GOOD.replace("  type: local", "  type: azure"))  # a provider no build runs
    assert main(["bootstrap-script", str(unknown), "small"]) == 2
    assert f"{unknown}:3: provider.type: Input should be 'local', 'aws' or 'gcp'" in capsys.readouterr().err


def test_bootstrap_script_prints_placeholders_unless_told(capsys):
    pytest.importorskip("orchestrator.providers.bootstrap")
    from orchestrator.cli.main import main

    local = str(ROOT / "cluster_configs" / "local.yaml")
    assert main(["bootstrap-script", local, "cpu-small"]) == 0
    script = capsys.readouterr().out
    assert script.startswith("#!") and "<HEAD_ADDRESS>" in script and "<INSTANCE_ID>" in script
    assert main(["bootstrap-script", local, "cpu-small", "--head", "10.0.0.5:6379", "--instance-id", "i-7"]) == 0
    script = capsys.readouterr().out
    assert "10.0.0.5:6379" in script and "i-7" in script and "<HEAD_ADDRESS>" not in script


@pytest.mark.parametrize(("argv", "message"), [
    (["up", "c.yaml", "--address", "10.0.0.5"], "argument --address: '10.0.0.5': expected 'auto' or HOST:PORT"),
    (["resume", "runs/x", "--address", "h:0"], "argument --address: 'h:0': port '0' is not a number"),
    (["bootstrap-script", "c.yaml", "t", "--head", "auto"], "argument --head: 'auto' finds a cluster from inside it"),
])
def test_a_bad_address_flag_is_a_usage_error(capsys, argv, message):
    from orchestrator.cli.main import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_address_flag_is_parsed_and_overrides_ray_address(tmp_path):
    from orchestrator.cli.main import build_parser

    assert build_parser().parse_args(["up", "c.yaml", "--address", "auto"]).address == "auto"
    assert build_parser().parse_args(["resume", "runs/x"]).address is None
    config = load_cluster_config(write(tmp_path, GOOD + "ray: {address: 'head:6379'}\n"))
    assert config.with_ray_address(None) is config
    joined = config.with_ray_address("10.0.0.5:6379")
    assert (joined.ray.address, config.ray.address) == ("10.0.0.5:6379", "head:6379")
    with pytest.raises(ConfigError, match="--address: 'nope': expected 'auto' or HOST:PORT"):
        config.with_ray_address("nope")


# ---- fuzzing: whatever the YAML, a config or a ConfigError -----------------------------------
_KEYS = sorted({"cluster_name", "runs_dir", "provider", "type", "mode", "namespaces", "available_node_types",
                "small", "node_config", "InstanceType", "resources", "min_workers", "max_workers", "training",
                "group_size", "averaging", "grid", "ray", "address", "network", "listen_host", "announce_host",
                "dashboard", "port", "spot", "budget", "checkpoint", "preemption", "zones", "head_node_type"})
_SCALARS = (st.none() | st.booleans() | st.integers(-3, 70000) | st.floats(allow_nan=True)
            | st.sampled_from(["local", "aws", "gcp", "nodes", "actors", "auto", "0.0.0.0", "h:6379", "small",
                               "collaborative", "moshpit", "[::1]:1", ""]) | st.text(max_size=12))
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=8), inner, max_size=5),
                       max_leaves=25)
_DOCS = st.dictionaries(st.sampled_from(_KEYS), _VALUES, max_size=8)


@settings(max_examples=300, deadline=None)
@given(_DOCS)
def test_fuzz_any_mapping_gives_a_config_or_a_config_error(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fuzz") / "c.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    try:
        config = load_cluster_config(path)
    except ConfigError as e:
        assert all(line.startswith(f"{path}") for line in str(e).splitlines())
    else:
        assert config.available_node_types


@pytest.mark.parametrize("text", ["a: &x [*x]\n", "cluster_name: &n\n  k: *n\n",
                                  "? [a, b]\n: 1\n", "1: 2\n", "\x00", "- a\n- b\n", "",
                                  "provider: {type: aws}\nmax: 1\n"])
def test_odd_yaml_gives_a_config_error(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=str(path)):
        load_cluster_config(path)


# ---- provider.warm_image ---------------------------------------------------------------------
def test_warm_image_is_on_by_default_and_may_be_turned_off_in_local_actors_mode(tmp_path):
    assert load_cluster_config(write(tmp_path, GOOD)).provider.warm_image is None  # the provider: on
    off = write(tmp_path, GOOD.replace("  type: local", "  type: local\n  warm_image: false"))
    assert load_cluster_config(off).provider.warm_image is False


@pytest.mark.parametrize(("provider", "here"), [
    ("type: local\n  mode: nodes\n  warm_image: true", "type 'local', mode 'nodes'"),
    ("type: gcp\n  warm_image: false", "type 'gcp', mode 'actors'"),
])
def test_warm_image_elsewhere_names_the_field_and_line(tmp_path, provider, here):
    path = write(tmp_path, GOOD.replace("  type: local", "  " + provider))
    errors = [e for e in errors_of(path) if "provider.warm_image" in e]
    assert errors == [f"{path}:{3 + provider.count(chr(10))}: provider.warm_image: only provider.type 'local' with "
                      f"provider.mode 'actors' forks workers from a warm image (here {here}); the others boot every "
                      "worker on its own"]
