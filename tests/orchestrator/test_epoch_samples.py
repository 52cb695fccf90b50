"""What a global epoch stands for in the run's records: the collaborative global batch, or a
DiLoCo round's samples as every trainer sizes it (inner steps x the task's batch x the trainers the
run keeps up), so that samples trained and dollars per million samples are right in both modes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray")

from orchestrator.config.schema import ClusterConfig  # noqa: E402
from orchestrator.fleet.supervisor import epoch_samples  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_an_epoch_is_the_global_batch_or_a_diloco_round():
    wan = ClusterConfig.model_validate(yaml.safe_load((ROOT / "cluster_configs/local-wan.yaml").read_text()))
    assert wan.training.averaging == "diloco"  # given as training.mode
    assert epoch_samples(wan) == 50 * 16 * 2  # charlm's batch is 16; two trainer types of min_workers 1
    local = ClusterConfig.model_validate(yaml.safe_load((ROOT / "cluster_configs/local.yaml").read_text()))
    assert epoch_samples(local) == local.training.target_batch_size == 256
    small = wan.model_copy(update={"training": wan.training.model_copy(update={"task_options": {"batch_size": 4}})})
    assert epoch_samples(small) == 50 * 4 * 2
