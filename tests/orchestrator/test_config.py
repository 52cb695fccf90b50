"""Cluster YAML validation: every mistake is one readable error with its line; nothing starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.config import ConfigError, load_cluster_config

ROOT = Path(__file__).resolve().parent.parent.parent
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


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "cluster_configs").glob("*.yaml")))
def test_shipped_configs_validate(name):
    config = load_cluster_config(ROOT / "cluster_configs" / name)
    assert config.available_node_types


def test_a_typo_in_a_key_names_the_line_and_suggests_the_key(tmp_path):
    path = write(tmp_path, GOOD.replace("  type: local", "  type: local\n  zonez: [a]"))
    with pytest.raises(ConfigError) as info:
        load_cluster_config(path)
    assert str(info.value) == f"{path}:4: provider.zonez: unknown key; did you mean 'zones'?"


def test_a_wrong_type_names_the_field_and_what_was_expected(tmp_path):
    path = write(tmp_path, GOOD.replace("min_workers: 1", "min_workers: plenty"))
    with pytest.raises(ConfigError, match=r":6: available_node_types.small.min_workers: .*integer.*'plenty'"):
        load_cluster_config(path)


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
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "up", str(path)], cwd=tmp_path,
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
