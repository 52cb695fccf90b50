"""Settings from a YAML file and flags through one model: the flags follow the model's fields, and
every problem is one line, ``file:line: field: message`` or ``--flag: message``."""

from __future__ import annotations

import argparse
import subprocess
import sys
import typing
from pathlib import Path
from typing import Literal

import pydantic
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.cli.main import build_parser
from orchestrator.config.loader import ConfigError, ModelFlags
from orchestrator.instance.expert_server import FLAGS as SERVER_FLAGS
from orchestrator.instance.worker import FLAGS as WORKER_FLAGS
from workers.peer import WorkerConfig

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent.parent


def subcommand(name: str) -> argparse.ArgumentParser:
    """The parser of one sub-command, its flags loaded (they load when it first parses)."""
    parser = build_parser()
    parser.parse_known_args([name])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize(("command", "flags"), [("worker", WORKER_FLAGS), ("expert-server", SERVER_FLAGS)])
def test_every_field_is_a_flag_of_its_kind(command, flags):
    actions = {a.dest: a for a in subcommand(command)._actions if a.dest not in ("help", "config")}
    assert list(actions) == list(flags.model.model_fields)
    for name, info in flags.model.model_fields.items():
        action, kind = actions[name], info.annotation
        if typing.get_origin(kind) is not Literal and type(None) in typing.get_args(kind):
            (kind,) = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        assert action.option_strings == [flags.flag(name)] and action.default is None
        assert (info.description or "") in action.help
        if kind is bool:
            assert isinstance(action, argparse._StoreTrueAction)
        elif typing.get_origin(kind) is Literal:
            assert action.choices == list(typing.get_args(kind))
        elif typing.get_origin(kind) is list:
            assert action.nargs == ("*" if info.get_default(call_default_factory=True) == [] else "+")
        elif typing.get_origin(kind) is dict:
            assert action.type("{}") == {} and action.metavar == "JSON"
        else:
            assert action.type is kind


def test_the_command_lines_flags_keep_their_spellings():
    worker = build_parser().parse_args(
        ["worker", "--run", "r", "--task", "synthetic", "--mode", "moshpit", "--initial-peers", "a:1", "b:2",
         "--host", "0.0.0.0", "--port", "5", "--client-mode", "--identity", "k.key", "--target-batch-size", "64",
         "--compression", "fp16", "--max-epochs", "3", "--max-seconds", "9.5", "--seed", "2",
         "--report-file", "r.jsonl", "--min-peers", "2", "--moshpit-grid", "2", "3", "--group-size", "4",
         "--averaging-period", "5", "--membership-token", "T"])
    config = WORKER_FLAGS.load(None, vars(worker))
    assert (config.identity_path, config.initial_peers, config.moshpit_grid, config.client_mode) == (
        "k.key", ["a:1", "b:2"], [2, 3], True)
    assert (config.max_seconds, config.group_size, config.membership_token) == (9.5, 4, "T")
    assert WORKER_FLAGS.load(None, vars(build_parser().parse_args(["worker"]))) == WorkerConfig()
    assert WORKER_FLAGS.load(None, {"initial_peers": []}).initial_peers == []  # a bare --initial-peers: none
    server = build_parser().parse_args(["expert-server", "--expert-uids", "ffn.0", "--no-dht", "--identity", "s.key",
                                        "--initial-peers"])
    config = SERVER_FLAGS.load(None, vars(server))
    assert (config.expert_uids, config.no_dht, config.identity, config.initial_peers) == (["ffn.0"], True, "s.key", [])


def test_yaml_errors_have_lines_and_flag_errors_name_the_flag(tmp_path):
    path = tmp_path / "worker.yaml"
    path.write_text("run: test\ngroup_sise: 4\nport: 99999\nmoshpit_grid: [2, x]\nseed: 1\n")
    with pytest.raises(ConfigError) as info:
        WORKER_FLAGS.load(path, {"group_size": 1, "seed": 3, "identity_path": None})
    assert sorted(str(info.value).splitlines()) == [
        "--group-size: Input should be greater than or equal to 2 (got 1)",
        f"{path}:2: group_sise: unknown key; did you mean 'group_size'?",
        f"{path}:3: port: Input should be less than or equal to 65535 (got 99999)",
        f"{path}:4: moshpit_grid.1: Input should be a valid integer, unable to parse string as an integer (got 'x')"]
    with pytest.raises(ConfigError, match=r"^--identity: Input should be a valid string \(got 7\)$"):
        WORKER_FLAGS.load(None, {"identity_path": 7})  # a renamed flag's error says its own spelling
    with pytest.raises(ConfigError, match="^give exactly one of expert_uids and expert_pattern$"):
        SERVER_FLAGS.load(None, {})


def test_flags_override_the_file_and_an_empty_file_is_no_settings(tmp_path):
    path = tmp_path / "server.yaml"
    path.write_text("expert_pattern: 'ffn.[0:2]'\nhidden_dim: 32\n")
    config = SERVER_FLAGS.load(path, {"hidden_dim": 8, "no_dht": None, "config": str(path)})
    assert (config.hidden_dim, config.uids()) == (8, ["ffn.0", "ffn.1"])
    (tmp_path / "empty.yaml").write_text("")
    assert WORKER_FLAGS.load(tmp_path / "empty.yaml", {}) == WorkerConfig()
    (tmp_path / "list.yaml").write_text("- a\n")
    with pytest.raises(ConfigError, match=r"list.yaml:1: expected a mapping of settings$"):
        WORKER_FLAGS.load(tmp_path / "list.yaml", {})


def test_a_field_no_flag_can_carry_is_refused():
    class Odd(pydantic.BaseModel):
        pair: tuple[int, int] = (0, 0)

    with pytest.raises(TypeError, match="no command-line flag"):
        ModelFlags(Odd).add_arguments(argparse.ArgumentParser())


def test_a_mapping_field_is_a_json_object_flag():
    args = build_parser().parse_args(["worker", "--task-options", '{"layers": 1, "context": 8}'])
    assert args.task_options == {"layers": 1, "context": 8}
    for bad in ("[1]", "{layers: 1}"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["worker", "--task-options", bad])


@pytest.mark.parametrize(("argv", "lines"), [
    (["worker", "--config", "{path}", "--max-seconds", "-1"],
     ["{path}:2: group_sise: unknown key; did you mean 'group_size'?",
      "--max-seconds: Input should be greater than 0 (got -1.0)"]),
    (["expert-server", "--hidden-dim", "0", "--expert-uids", "ffn.0"],
     ["--hidden-dim: Input should be greater than 0 (got 0)"]),
])
def test_the_commands_print_every_problem_and_exit_2(tmp_path, argv, lines):
    path = tmp_path / "settings.yaml"
    path.write_text("run: test\ngroup_sise: 4\n")
    argv = [a.replace("{path}", str(path)) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *argv], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert proc.returncode == 2, proc.stderr
    assert sorted(proc.stderr.splitlines()) == sorted([f"spotswarm {argv[0]}: invalid config, nothing started:",
                                                       *(line.replace("{path}", str(path)) for line in lines)])


def test_building_the_parser_does_not_import_the_models():
    code = "import sys; from orchestrator.cli.main import build_parser; build_parser(); print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert proc.stdout.strip() == "False", proc.stderr


_KEYS = sorted(WorkerConfig.model_fields) + ["grup_size", "x"]
_SCALARS = (st.none() | st.booleans() | st.integers(-3, 70000) | st.floats(allow_nan=True)
            | st.sampled_from(["moshpit", "fp16", "127.0.0.1", ""]) | st.text(max_size=12))
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=12)
_FLAGS = st.fixed_dictionaries({}, optional={"group_size": st.integers(-2, 40), "port": st.integers(-5, 70000),
                                             "moshpit_grid": st.lists(st.integers(-1, 4), min_size=1, max_size=3),
                                             "client_mode": st.just(True), "mode": st.sampled_from(["moshpit"])})


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(_KEYS), _VALUES, max_size=8), _FLAGS)
def test_fuzz_any_yaml_and_flags_give_settings_or_a_config_error(tmp_path_factory, data, flags):
    path = tmp_path_factory.mktemp("fuzz") / "w.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    try:
        config = WORKER_FLAGS.load(path, flags)
    except ConfigError as e:
        for line in str(e).splitlines():
            flag = line.split(":")[0]
            assert line.startswith(f"{path}:") or flag in {WORKER_FLAGS.flag(name) for name in flags}, line
    else:
        assert all(getattr(config, name) == value for name, value in flags.items())


def _alias_bomb(levels: int) -> str:
    """Nine of the level below at each level: 9**levels values once the aliases are read as copies."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("reader", ["cluster", "worker"])
def test_aliases_that_explode_or_recurse_are_config_errors_not_hangs(tmp_path, reader):
    from orchestrator.config.checks import load_cluster_config

    def load(text: str) -> None:
        path = tmp_path / "settings.yaml"
        path.write_text(text)
        if reader == "cluster":
            load_cluster_config(path)
        else:
            WORKER_FLAGS.load(str(path), {})

    with pytest.raises(ConfigError, match=r"settings\.yaml: its aliases expand to more than 100,000 values"):
        load(_alias_bomb(9))  # 387 million values: every walk of them would hang
    with pytest.raises(ConfigError, match=r"settings\.yaml: a value refers to itself \(a recursive YAML alias\)"):
        load("run: &r [a, *r]\n")


def test_aliases_within_the_limit_still_load(tmp_path):
    path = tmp_path / "worker.yaml"
    path.write_text("initial_peers: &peers [10.0.0.1:31337, 10.0.0.2:31337]\nmoshpit_grid: [2, 2]\n"
                    "x_unused: *peers\n")
    with pytest.raises(ConfigError, match="x_unused: unknown key"):  # read through the alias, then judged
        WORKER_FLAGS.load(str(path), {})
    path.write_text("initial_peers: &peers [10.0.0.1:31337, 10.0.0.2:31337]\n")
    assert WORKER_FLAGS.load(str(path), {}).initial_peers == ["10.0.0.1:31337", "10.0.0.2:31337"]
