"""Expert servers and their clients against hostile peers, over real loopback sockets.

Attacks: NaN/inf inputs and gradients sent to a server, finite inputs chosen to overflow inside a
batch shared with an honest client, a server that answers with NaN or the wrong shape, and a peer
that declares an expert's uid at its own address to take it over.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import time
from collections import Counter

import msgpack
import pytest
import torch
from torch import nn

from dht import SignatureValidator, ValidationError
from dht.validation import DHTRecord, owner_marker
from experts import (
    AssignedServers,
    BackgroundExpertServer,
    ExpertBackend,
    ExpertCallFailed,
    ExpertClient,
    ExpertServer,
    NonFiniteValues,
    RemoteExpert,
    RemoteMixtureOfExperts,
    TensorSchema,
    get_expert_holders,
    get_experts,
)
from experts.remote import call_backward, call_forward
from p2p import Identity, RemoteError

pytestmark = pytest.mark.timeout(30)

HIDDEN = 4
BIG = 3e38  # finite in float32; doubling it is not


class Scale(nn.Module):
    """``x * w`` with ``w = 2``: an input of BIG overflows for sure, so a test can make a batch non-finite."""

    def __init__(self, hidden_dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((hidden_dim,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def scale_backend(uid: str, lr: float = 0.1, **options) -> ExpertBackend:
    module = Scale(HIDDEN)
    return ExpertBackend(uid, module, [TensorSchema((HIDDEN,))], optimizer=torch.optim.SGD(module.parameters(), lr=lr),
                         **options)


def ffn(uid: str, lr: float = 0.1) -> ExpertBackend:
    return ExpertBackend.from_kind(uid, "ffn", HIDDEN, optimizer=lambda p: torch.optim.SGD(p, lr=lr))


def snapshot(backend: ExpertBackend) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in backend.module.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
        assert torch.isfinite(b[k]).all(), k


class CountingServer(ExpertServer):
    """Counts every expert RPC it receives; ``answer`` may rewrite its forward answers (the
    attacker's own server code)."""

    answer = "honest"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.requests: Counter[str] = Counter()

    async def rpc_forward(self, request, ctx) -> dict:
        self.requests["forward"] += 1
        response = await super().rpc_forward(request, ctx)
        if self.answer == "nan":
            return {"outputs": [torch.full_like(o, math.nan) for o in response["outputs"]]}
        if self.answer == "wide":
            return {"outputs": [torch.zeros(o.shape[0], o.shape[1] + 1) for o in response["outputs"]]}
        return response

    async def rpc_backward(self, request, ctx) -> dict:
        self.requests["backward"] += 1
        return await super().rpc_backward(request, ctx)

    async def rpc_info(self, request, ctx) -> dict:
        self.requests["info"] += 1
        return await super().rpc_info(request, ctx)


class NaNServer(CountingServer):
    answer = "nan"


class WideServer(CountingServer):
    answer = "wide"


@pytest.fixture
def client():
    c = ExpertClient.create()
    yield c
    c.shutdown()


def raw_call(client: ExpertClient, address: str, method: str, request: dict):
    """What an attacker's own code sends: a bare RPC, no client-side checks."""
    return client.p2p.call(address, method, request, timeout=10)


def gather(client: ExpertClient, *coros):
    async def run():
        return await asyncio.gather(*coros, return_exceptions=True)
    return client.run(run(), timeout=20)


# ---- non-finite requests -----------------------------------------------------------------------
def test_nan_gradients_are_refused_and_an_honest_backward_still_trains(client):
    torch.manual_seed(0)
    backend = ffn("ffn.0")
    local = copy.deepcopy(backend.module)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
    x = torch.randn(3, HIDDEN)
    poisoned = torch.randn(3, HIDDEN)
    poisoned[0, :2] = math.nan
    poisoned[2, 3] = math.inf
    attack = {"uid": "ffn.0", "inputs": [x], "grad_outputs": [poisoned]}
    with BackgroundExpertServer([backend], initial_peers=None) as server:
        before = snapshot(backend)
        with pytest.raises(RemoteError) as refused:
            client.run(raw_call(client, server.address, "expert.backward", attack))
        assert refused.value.type_name == "NonFiniteValues"
        assert "grad_output 0 of ffn.0 has 3 non-finite values" in refused.value.message
        assert_same(before, snapshot(backend))
        assert backend.backward_batches == 0 and backend.optimizer_steps == 0

        # the attack again, concurrently with an honest client's backward
        hx, hg = torch.randn(2, HIDDEN), torch.randn(2, HIDDEN)
        bad, good = gather(client, raw_call(client, server.address, "expert.backward", attack),
                           call_backward(client.p2p, server.address, "ffn.0", [hx], [hg], timeout=10))
        assert isinstance(bad, RemoteError) and "grad_output 0 of ffn.0" in bad.message
        lx = hx.clone().requires_grad_()
        local(lx).backward(hg)
        local_opt.step()
        torch.testing.assert_close(good[0], lx.grad)
        assert backend.optimizer_steps == 1 and backend.skipped_steps == 0
        after = snapshot(backend)
        for k, v in local.state_dict().items():
            torch.testing.assert_close(after[k], v, msg=k)
            assert torch.isfinite(after[k]).all() and not torch.equal(after[k], before[k]), k


def test_inf_and_nan_inputs_are_refused_and_an_honest_forward_is_answered_exactly(client):
    torch.manual_seed(1)
    backend = ffn("ffn.0")
    with BackgroundExpertServer([backend], initial_peers=None) as server:
        bad_x = torch.randn(5, HIDDEN)
        bad_x[1, 1] = math.inf
        bad_x[3, 0] = -math.inf
        bad_x[4, 2] = math.nan
        honest_x = torch.randn(2, HIDDEN)
        bad, good = gather(client, raw_call(client, server.address, "expert.forward",
                                            {"uid": "ffn.0", "inputs": [bad_x]}),
                           call_forward(client.p2p, server.address, "ffn.0", [honest_x], timeout=10))
        assert isinstance(bad, RemoteError) and bad.type_name == "NonFiniteValues"
        assert "input 0 of ffn.0 has 3 non-finite values" in bad.message
        with torch.no_grad():
            assert torch.equal(good[0], backend.module(honest_x))
        assert backend.samples_forward == 2  # the refused rows never reached the model

        # through the client library the same refusal is a typed error naming the expert
        expert = RemoteExpert("ffn.0", server.address, client)
        with pytest.raises(NonFiniteValues, match=r"input 0 of ffn\.0 has 1 non-finite values"):
            expert(torch.tensor([[0.0, math.nan, 0.0, 0.0]]))
        # compressed requests are checked after decoding: float16 cannot hold 1e6
        with pytest.raises(NonFiniteValues, match=r"input 0 of ffn\.0 has 1 non-finite values"):
            RemoteExpert("ffn.0", server.address, client, compression="float16")(torch.tensor([[1e6, 0, 0, 0.0]]))
        assert server.server.stats["ffn.0"]["forward_batches"] == 1


def test_finite_inputs_that_overflow_fail_alone_and_the_batch_they_shared_is_still_served(client):
    """Requests pooled into one batch: the one that overflows is refused, the honest one answered and
    learned from, and nothing of the bad one reaches the parameters."""
    backend = scale_backend("scale.0", max_batch_size=5)
    # a batch runs once 5 rows wait (or after 10 s): the two requests below share one batch
    with BackgroundExpertServer([backend], initial_peers=None, batch_timeout=10.0) as server:
        big = torch.full((3, HIDDEN), BIG)
        hx, hg = torch.randn(2, HIDDEN), torch.randn(2, HIDDEN)
        bad, good = gather(client, call_forward(client.p2p, server.address, "scale.0", [big], timeout=10),
                           call_forward(client.p2p, server.address, "scale.0", [hx], timeout=10))
        assert isinstance(bad, NonFiniteValues)
        assert "computed output 0 of scale.0 has 12 non-finite values" in str(bad)
        assert torch.equal(good[0], hx * 2)
        assert server.server.stats["scale.0"]["forward_batches"] == 1

        bad, good = gather(client, call_backward(client.p2p, server.address, "scale.0", [big],
                                                 [torch.ones(3, HIDDEN)], timeout=10),
                           call_backward(client.p2p, server.address, "scale.0", [hx], [hg], timeout=10))
        assert isinstance(bad, NonFiniteValues) and "of scale.0" in str(bad)
        torch.testing.assert_close(good[0], hg * 2)
        assert server.server.stats["scale.0"]["backward_batches"] == 1
        assert backend.optimizer_steps == 1
        torch.testing.assert_close(backend.module.w.detach(), 2 - 0.1 * (hx * hg).sum(0))


def test_a_step_that_would_make_parameters_non_finite_is_skipped_and_logged(caplog):
    caplog.set_level(logging.WARNING, logger="experts.backend")
    # gradients finite in every batch whose sum overflows: the step is skipped
    backend = scale_backend("scale.0", update_period=4)
    x, g = torch.full((1, HIDDEN), 1e19), torch.full((1, HIDDEN), 1e19)  # each batch: 1e38 per parameter
    for _ in range(4):
        backend.backward([x], [g])
    assert backend.optimizer_steps == 0 and backend.skipped_steps == 1
    assert torch.equal(backend.module.w.detach(), torch.full((HIDDEN,), 2.0))
    assert backend.module.w.grad is None  # nothing left to poison the next step
    assert "accumulated gradients are not finite" in caplog.text

    # a finite gradient that the optimizer itself turns into infinity: rolled back
    wild = scale_backend("scale.1", lr=1e38)
    wild.backward([torch.full((1, HIDDEN), 10.0)], [torch.ones(1, HIDDEN)])
    assert wild.optimizer_steps == 0 and wild.skipped_steps == 1
    assert torch.equal(wild.module.w.detach(), torch.full((HIDDEN,), 2.0))
    assert "rolled back" in caplog.text

    # an optional norm bound limits what finite garbage can do in one step
    clipped = scale_backend("scale.2", lr=1.0, max_grad_norm=1.0)
    clipped.backward([torch.full((1, HIDDEN), 1e10)], [torch.ones(1, HIDDEN)])
    assert clipped.optimizer_steps == 1
    torch.testing.assert_close(clipped.module.w.detach(), torch.full((HIDDEN,), 2.0 - 0.5))


# ---- lying servers -----------------------------------------------------------------------------
def test_servers_answering_nan_or_the_wrong_shape_are_excluded_like_dead_ones(start_server, client_dht, client):
    torch.manual_seed(2)
    honest = [ffn("ffn.0.0", lr=0.0), ffn("ffn.0.1", lr=0.0)]
    start_server(honest)
    nan = start_server([ffn("ffn.0.2")], server_cls=NaNServer)
    wide = start_server([ffn("ffn.0.3")], server_cls=WideServer)
    moe = RemoteMixtureOfExperts(HIDDEN, grid_size=(1, 4), uid_prefix="ffn", k_best=4, k_min=1,
                                 forward_timeout=10, backward_timeout=10, dht=client_dht)
    x = torch.randn(3, HIDDEN, requires_grad=True)
    out = moe(x)
    report = moe.last_call
    assert report.answered == {"ffn.0.0", "ffn.0.1"}
    assert "12 non-finite values in output 0" in report.failed["ffn.0.2"]
    assert "the mixture's experts return float32[batch, 4]" in report.failed["ffn.0.3"]
    # exactly the mixture of the honest experts, with a softmax over their scores only
    with torch.no_grad():
        scores = moe.proj(x).split([1, 4], dim=1)
        gate = torch.stack([scores[0][:, 0] + scores[1][:, j] for j in (0, 1)], dim=1)
        expected = sum(w[:, None] * b.module(x) for w, b in zip(torch.softmax(gate, 1).T, honest, strict=True))
    torch.testing.assert_close(out, expected)
    out.pow(2).sum().backward()
    assert torch.isfinite(x.grad).all()
    assert moe.last_call.backward_answered == {"ffn.0.0", "ffn.0.1"}
    assert nan.server.requests["backward"] == 0 and wide.server.requests["backward"] == 0

    with pytest.raises(ExpertCallFailed, match=r"'ffn\.0\.2' at .* sent 8 non-finite values in output 0"):
        RemoteExpert("ffn.0.2", nan.address, client)(torch.randn(2, HIDDEN) / 2)


# ---- uid takeover ------------------------------------------------------------------------------
@pytest.mark.timeout(45)
def test_a_uid_declared_by_an_unassigned_server_is_never_called(start_server, client_dht):
    torch.manual_seed(3)
    honest = start_server([ffn("ffn.0.0"), ffn("ffn.0.1")], update_period=30)
    # the attacker declares ffn.0.1 at its own address, with a later expiration than the honest one
    attacker = start_server([ffn("ffn.0.1")], server_cls=CountingServer, update_period=60)
    x = torch.randn(4, HIDDEN)

    plain = RemoteMixtureOfExperts(HIDDEN, grid_size=(1, 2), uid_prefix="ffn", k_best=2, k_min=1,
                                   forward_timeout=10, dht=client_dht)
    plain(x)
    assert attacker.server.requests["forward"] > 0  # without a policy, the takeover works
    calls_before = sum(attacker.server.requests.values())

    policy = AssignedServers({"ffn.0": {honest.server.p2p.peer_id}})
    guarded = RemoteMixtureOfExperts(HIDDEN, grid_size=(1, 2), uid_prefix="ffn", k_best=2, k_min=1,
                                     forward_timeout=10, backward_timeout=10, dht=client_dht, trusted_servers=policy)
    guarded(x.requires_grad_()).sum().backward()
    assert all(chosen == ["ffn.0.0"] for chosen in guarded.last_call.chosen)  # ffn.0.1 is missing, not hijacked
    assert guarded.last_call.answered == guarded.last_call.backward_answered == {"ffn.0.0"}
    # the attacker's declaration sits beside the honest server's, it cannot replace it: with the policy
    # only the honest holder is left
    holders = client_dht.run_coroutine(lambda node: get_expert_holders(node, ["ffn.0.1"]))["ffn.0.1"]
    assert sorted(holders) == sorted([honest.address, attacker.address])
    found = client_dht.run_coroutine(lambda node: get_experts(node, ["ffn.0.0", "ffn.0.1"], trusted_servers=policy))
    assert found == {"ffn.0.0": honest.address, "ffn.0.1": honest.address}
    assert sum(attacker.server.requests.values()) == calls_before  # the attacker never heard from it


def test_assigned_servers_match_whole_name_parts_and_the_longest_prefix():
    a, b, c = (Identity().peer_id for _ in range(3))
    policy = AssignedServers({"ffn.1": {a}, "ffn.1.2.": {b}, "ffn": {c}})
    assert policy("ffn.1.0", a) and not policy("ffn.1.0", c)
    assert policy("ffn.1.2.5", b) and not policy("ffn.1.2.5", a)  # the longer prefix decides
    assert policy("ffn.10.0", c) and not policy("ffn.10.0", a)  # "ffn.1" is not a prefix of "ffn.10"
    assert not policy("att.0", a) and not policy("att.0", c)  # unassigned uids are trusted nowhere
    assert AssignedServers({"ffn": {f"{a}@127.0.0.1:1"}})("ffn.0", a)  # addresses name their peer id


# ---- DHT records ---------------------------------------------------------------------------------
def test_expert_servers_check_dht_record_signatures_by_default(start_server):
    server = start_server([ffn("ffn.0")]).server
    assert server.dht is not None
    signers = [v for v in server.dht.validator.validators if isinstance(v, SignatureValidator)]
    assert [v.identity.peer_id for v in signers] == [server.p2p.peer_id]
    forged = DHTRecord(msgpack.packb(f"state{owner_marker(server.p2p.identity.public_key)}"), None,
                       msgpack.packb("forged"), time.time() + 60)
    with pytest.raises(ValidationError, match="carries no valid signature"):
        server.dht.validator.check(forged)
