"""ExpertHost: experts assigned at run time from a replica, a checkpoint or fresh, and replicas
that average their parameters."""

from __future__ import annotations

import pydantic
import pytest
import torch

from experts import ExpertClient, RemoteExpert, UnknownExpert, get_experts, load_state_bytes, params_checksum
from experts.handoff import state_bytes
from orchestrator.host.wait import wait_for
from workers.expert_host import ExpertGridSpec, ExpertHost, ExpertHostConfig, fresh_expert, grid_uids

pytestmark = pytest.mark.timeout(60)

SPEC = ExpertGridSpec(grid=[2, 4], hidden_dim=16)


def host(every: float = 0.0, initial_peers: list[str] | None = None) -> ExpertHost:
    return ExpertHost(ExpertHostConfig(run="moe", initial_peers=initial_peers or [], experts=SPEC, device="cpu",
                                       replica_average_every_s=every, averaging_timeout=5.0))


@pytest.fixture
def client():
    c = ExpertClient.create()
    yield c
    c.shutdown()


def trained(uid: str) -> torch.nn.Module:
    """A fresh expert after two local training steps: its parameters differ from a fresh one's."""
    backend = fresh_expert(SPEC, uid)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(4, 16, generator=gen)
        backend.backward([x], [torch.randn(4, 16, generator=gen)])
    return backend


def params(state_bytes_: bytes, uid: str) -> dict[str, torch.Tensor]:
    return load_state_bytes(state_bytes_, uid)["module"]


def test_grid_and_fresh_experts_are_the_same_everywhere():
    assert grid_uids(SPEC) == [f"ffn.{i}.{j}" for i in range(2) for j in range(4)]
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b = fresh_expert(SPEC, "ffn.1.2"), fresh_expert(SPEC, "ffn.1.2")
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's random stream is untouched
    assert params_checksum(a.module) == params_checksum(b.module) != params_checksum(fresh_expert(SPEC, "ffn.1.3")
                                                                                      .module)
    with pytest.raises(pydantic.ValidationError, match="at least 1"):
        ExpertGridSpec(grid=[2, 0])
    with pytest.raises(pydantic.ValidationError, match="prefix"):
        ExpertGridSpec(uid_prefix="ffn.1")
    with pytest.raises(pydantic.ValidationError, match="unknown expert kind 'mlp'"):
        ExpertGridSpec(kind="mlp")


def test_assign_loads_from_a_replica_else_a_checkpoint_else_fresh(client):
    a = host()
    b = host(initial_peers=[a.address])
    try:
        fresh = {uid: params_checksum(fresh_expert(SPEC, uid).module) for uid in ("ffn.0.0", "ffn.0.1")}
        handoffs = a.assign(["ffn.0.0", "ffn.0.1"])
        assert [(h.uid, h.source, h.donor, h.params_checksum) for h in handoffs] == [
            ("ffn.0.0", "fresh", None, fresh["ffn.0.0"]), ("ffn.0.1", "fresh", None, fresh["ffn.0.1"])]
        x = torch.randn(6, 16, requires_grad=True)
        RemoteExpert("ffn.0.0", a.address, client)(x).pow(2).sum().backward()  # one training step on A
        on_a = a.params_checksums()["ffn.0.0"]
        assert on_a != fresh["ffn.0.0"]

        (replica,) = b.assign(["ffn.0.0"], donors={"ffn.0.0": [a.address]})
        assert (replica.source, replica.donor, replica.params_checksum, replica.error) == (
            "replica", a.address, on_a, None)
        assert b.params_checksums()["ffn.0.0"] == on_a
        (new,) = b.assign(["ffn.0.1"])
        assert (new.source, new.params_checksum) == ("fresh", a.params_checksums()["ffn.0.1"])

        checkpoint = trained("ffn.1.0")
        (restored,) = b.assign(["ffn.1.0"], donors={"ffn.1.0": [a.address]},  # A does not host it
                               checkpoints={"ffn.1.0": state_bytes(checkpoint)})
        assert (restored.source, restored.donor) == ("checkpoint", None)
        assert restored.params_checksum == params_checksum(checkpoint.module)
        assert "UnknownExpert" in restored.error and a.address in restored.error
        assert b.assign(["ffn.0.0", "ffn.1.0"]) == []  # hosted already: skipped
        with pytest.raises(ValueError, match=r"'ffn\.2\.0' is not in this run's grid ffn\.\[0:2\]\.\[0:4\]"):
            b.assign(["ffn.1.1", "ffn.2.0"])
        assert b.hosted() == ["ffn.0.0", "ffn.0.1", "ffn.1.0"]

        saved = b.states(["ffn.1.0", "ffn.1.3"])
        assert list(saved) == ["ffn.1.0"]
        for name, tensor in checkpoint.module.state_dict().items():
            assert torch.equal(params(saved["ffn.1.0"], "ffn.1.0")[name], tensor)

        def lookup(uid: str) -> str | None:
            return a._face.run(get_experts(a.server.dht, [uid], latest=True))[uid]
        assert lookup("ffn.1.0") == b.address  # declared at once
        b.unassign(["ffn.1.0", "ffn.1.3"])
        assert lookup("ffn.1.0") is None and b.hosted() == ["ffn.0.0", "ffn.0.1"]
        with pytest.raises(UnknownExpert):
            RemoteExpert("ffn.1.0", b.address, client)(torch.randn(2, 16))

        stats = a.stats()
        assert (stats["requests_forward"], stats["requests_backward"], stats["samples_forward"]) == (1, 1, 6)
        assert stats["forward_batches"] == 1 and stats["rows_per_batch"] == 6.0
        assert stats["experts"]["ffn.0.0"]["optimizer_steps"] == 1 and stats["replica_rounds"] == 0
    finally:
        b.shutdown()
        a.shutdown()


def test_replicas_average_their_parameters_to_the_mean_and_end_bit_identical(client):
    a = host(every=0.5)
    b = host(every=0.5, initial_peers=[a.address])
    uid = "ffn.1.3"
    try:
        checkpoint = trained(uid)
        a.assign([uid], checkpoints={uid: state_bytes(checkpoint)})
        b.assign([uid])
        snapshots = [checkpoint.module.state_dict(), fresh_expert(SPEC, uid).module.state_dict()]
        assert params_checksum(checkpoint.module) != params_checksum(fresh_expert(SPEC, uid).module)
        wait_for(lambda: a.stats()["replica_averaged"] >= 1 and b.stats()["replica_averaged"] >= 1, 30,
                 "a replica averaging round on both hosts")
        on_a, on_b = params(a.states()[uid], uid), params(b.states()[uid], uid)
        for name, _ in checkpoint.module.named_parameters():
            mean = (snapshots[0][name].double() + snapshots[1][name].double()) / 2
            torch.testing.assert_close(on_a[name].double(), mean, rtol=1e-6, atol=1e-7, msg=name)
            assert torch.equal(on_a[name], on_b[name]), name  # the reducers' bits, on both replicas
        assert a.params_checksums() == b.params_checksums()
        assert a.stats()["replica_rounds"] >= 1
    finally:
        b.shutdown()
        a.shutdown()
