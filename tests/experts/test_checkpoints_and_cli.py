"""Expert checkpoints in a directory, and the expert-server settings (YAML and flags)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from experts import BackgroundExpertServer, ExpertBackend, ExpertClient, RemoteExpert, load_experts, save_experts
from experts.config import ExpertServerConfig, build_backends
from orchestrator.cli.main import build_parser
from orchestrator.instance.expert_server import config_from_args

pytestmark = pytest.mark.timeout(60)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def test_checkpoints_round_trip_module_optimizer_and_counters(tmp_path):
    torch.manual_seed(0)
    a = ExpertBackend.from_kind("ffn.0", "ffn", 8, optimizer=sgd)
    x = torch.randn(4, 8)
    a.backward([x], [torch.ones(4, 8)])
    save_experts({"ffn.0": a}, tmp_path)
    b = ExpertBackend.from_kind("ffn.0", "ffn", 8, optimizer=sgd)
    c = ExpertBackend.from_kind("ffn.1", "ffn", 8, optimizer=sgd)
    assert load_experts({"ffn.0": b, "ffn.1": c}, tmp_path) == ["ffn.0"]
    assert b.optimizer_steps == a.optimizer_steps == 1
    for pa, pb in zip(a.module.parameters(), b.module.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert b.optimizer.state_dict()["state"].keys() == a.optimizer.state_dict()["state"].keys()
    torch.testing.assert_close(a.forward([x])[0], b.forward([x])[0])
    with pytest.raises(ValueError, match="holds expert 'ffn.0'"):
        (tmp_path / "ffn.0.pt").rename(tmp_path / "ffn.1.pt")
        load_experts({"ffn.1": c}, tmp_path)


def test_a_server_saves_on_shutdown_and_a_new_one_resumes_from_the_directory(tmp_path):
    torch.manual_seed(1)
    with ExpertClient.create() as client:
        first = ExpertBackend.from_kind("ffn.0", "ffn", 8, optimizer=sgd)
        with BackgroundExpertServer([first], checkpoint_dir=tmp_path) as server:
            RemoteExpert("ffn.0", server.address, client)(torch.randn(3, 8)).sum().backward()
        trained = {k: v.clone() for k, v in first.module.state_dict().items()}
        assert (tmp_path / "ffn.0.pt").exists()
        second = ExpertBackend.from_kind("ffn.0", "ffn", 8, optimizer=sgd)
        with BackgroundExpertServer([second], checkpoint_dir=tmp_path):
            assert second.optimizer_steps == 1
            for k, v in second.module.state_dict().items():
                assert torch.equal(v, trained[k]), k


def test_settings_come_from_yaml_with_flags_overriding(tmp_path):
    yaml_file = tmp_path / "server.yaml"
    yaml_file.write_text("expert_cls: ffn\nhidden_dim: 32\nexpert_pattern: 'ffn.[0:2].[0:3]'\nlr: 0.01\n")
    args = build_parser().parse_args(["expert-server", "--config", str(yaml_file), "--hidden-dim", "8",
                                      "--optimizer", "sgd", "--initial-peers", "a@127.0.0.1:1"])
    config = config_from_args(args)
    assert (config.hidden_dim, config.lr, config.optimizer, config.initial_peers) == (8, 0.01, "sgd", ["a@127.0.0.1:1"])
    backends = build_backends(config)
    assert [b.uid for b in backends] == ["ffn.0.0", "ffn.0.1", "ffn.0.2", "ffn.1.0", "ffn.1.1", "ffn.1.2"]
    assert isinstance(backends[0].optimizer, torch.optim.SGD) and backends[0].args_schema[0].shape == (8,)


def test_bad_settings_name_the_field():
    with pytest.raises(ValidationError, match="hidden_dim"):
        ExpertServerConfig(expert_uids=["ffn.0"], hidden_dim=0)
    with pytest.raises(ValidationError, match="exactly one of expert_uids and expert_pattern"):
        ExpertServerConfig()
    with pytest.raises(ValidationError, match="prefix.i0.i1"):
        ExpertServerConfig(expert_uids=["ffn"])
    with pytest.raises(ValidationError, match="unknown_field"):
        ExpertServerConfig(expert_uids=["ffn.0"], unknown_field=1)
