"""The training device: auto is a GPU where torch sees one, else the CPU; cuda where there is none is
a clear error before anything starts.  (This suite runs where no GPU is; the cuda paths themselves
run on GPU machines only.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orchestrator.config.loader import ConfigError
from orchestrator.config.schema import ClusterConfig
from p2p.devices import host_buffer, pick_device

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts what happens without a GPU")


def test_auto_follows_what_torch_sees_and_bad_names_are_refused():
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pick_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="must be auto, cpu or cuda, got 'tpu'"):
        pick_device("tpu")
    buf = host_buffer(10, torch.device("cpu"))
    assert buf.dtype == torch.float32 and buf.numel() == 10 and not buf.is_pinned()


@NO_GPU
def test_cuda_without_a_gpu_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="device cuda: torch .* sees no CUDA device here; use auto or cpu"):
        pick_device("cuda")


@NO_GPU
@pytest.mark.parametrize("command", ["worker", "expert-server"])
def test_the_commands_refuse_cuda_without_a_gpu_before_starting(command):
    extra = ["--no-dht", "--expert-uids", "ffn.0"] if command == "expert-server" else []
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", command, "--device", "cuda", *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 2, proc.stderr
    assert f"spotswarm {command}: device cuda:" in proc.stderr and "sees no CUDA device" in proc.stderr
    assert "Traceback" not in proc.stderr


def _cluster(tmp_path: Path, training: str, resources: str) -> ClusterConfig:
    from orchestrator.config.checks import load_cluster_config

    path = tmp_path / "c.yaml"
    path.write_text(f"cluster_name: dev\nprovider: {{type: local}}\nhead_node_type: head\n"
                    f"available_node_types:\n  head: {{max_workers: 0}}\n"
                    f"  gpu: {{min_workers: 1, max_workers: 2, resources: {resources}}}\n"
                    f"training: {training}\n")
    return load_cluster_config(path)


def test_workers_take_their_nodes_gpu_unless_told_to_train_on_the_cpu(tmp_path):
    config = _cluster(tmp_path, "{device: auto}", "{GPU: 1}")
    assert config.worker_gpus() == {"gpu": 1}  # Ray shows a worker actor the GPU only if it asks for it
    assert config.worker_config([]).device == "auto"
    assert _cluster(tmp_path, "{device: cpu}", "{GPU: 1}").worker_gpus() == {}
    assert _cluster(tmp_path, "{device: auto}", "{}").worker_gpus() == {}
    with pytest.raises(ConfigError, match=r"c\.yaml:\d+: training\.device: cuda, but node type\(s\) gpu have no GPU"):
        _cluster(tmp_path, "{device: cuda}", "{}")
