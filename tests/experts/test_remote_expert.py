"""RemoteExpert against real servers on loopback: autograd, schema and size errors, training steps."""

from __future__ import annotations

import asyncio
import copy
import threading
from pathlib import Path

import pytest
import torch

from experts import (
    BackgroundExpertServer,
    ExpertBackend,
    ExpertCallFailed,
    ExpertClient,
    ExpertRequestTooLarge,
    ExpertSchemaError,
    RemoteExpert,
    UnknownExpert,
)
from experts.config import load_custom_module
from p2p import P2P, Limits, RemoteError

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def client():
    c = ExpertClient.create()
    yield c
    c.shutdown()


def frozen(uid: str, kind: str, hidden: int, **options) -> ExpertBackend:
    """A backend whose optimizer never changes the weights, so repeated calls stay comparable."""
    return ExpertBackend.from_kind(uid, kind, hidden, optimizer=lambda p: torch.optim.SGD(p, lr=0.0), **options)


@pytest.mark.parametrize("kind,shape", [("ffn", (5, 16)), ("transformer", (3, 7, 16))])
def test_gradients_through_a_remote_expert_match_the_module_run_locally(client, kind, shape):
    torch.manual_seed(0)
    backend = ExpertBackend.from_kind(f"{kind}.0", kind, 16, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                                      update_period=1000)
    local = copy.deepcopy(backend.module)
    with BackgroundExpertServer([backend]) as server:
        expert = RemoteExpert(f"{kind}.0", server.address, client)
        x = torch.randn(*shape, requires_grad=True)
        w = torch.randn(*shape)
        y = expert(x)
        (y * w).sum().backward()

        x_local = x.detach().clone().requires_grad_()
        y_local = local(x_local)
        (y_local * w).sum().backward()
        torch.testing.assert_close(y, y_local, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x.grad, x_local.grad, atol=1e-5, rtol=1e-5)
        # the server accumulated the same parameter gradients (no step yet: update_period=1000)
        for (name, p_remote), p_local in zip(backend.module.named_parameters(), local.parameters(), strict=True):
            torch.testing.assert_close(p_remote.grad, p_local.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_multiple_inputs_with_a_non_float_one(client):
    load_custom_module(HERE / "custom_experts.py")
    torch.manual_seed(1)
    backend = frozen("gs.0", "gated_sum", 8)
    local = copy.deepcopy(backend.module)
    with BackgroundExpertServer([backend]) as server:
        expert = RemoteExpert("gs.0", server.address, client)
        a, b = torch.randn(6, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
        mask = torch.tensor([True, False, True, False, False, True])
        expert(a, b, mask).pow(2).sum().backward()
        a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
        local(a2, b2, mask).pow(2).sum().backward()
    torch.testing.assert_close(a.grad, a2.grad)
    torch.testing.assert_close(b.grad, b2.grad)


def test_compressed_calls_stay_close_and_keep_dtypes(client):
    torch.manual_seed(2)
    backend = frozen("ffn.0", "ffn", 32)
    with BackgroundExpertServer([backend]) as server:
        plain = RemoteExpert("ffn.0", server.address, client)
        half = RemoteExpert("ffn.0", server.address, client, compression="float16")
        x = torch.randn(4, 32, requires_grad=True)
        y = half(x)
        y.sum().backward()
        assert y.dtype == torch.float32 and x.grad.dtype == torch.float32
        torch.testing.assert_close(y, plain(x), atol=2e-2, rtol=2e-2)


def test_the_server_trains_its_expert_every_update_period(client):
    torch.manual_seed(3)
    backend = ExpertBackend.from_kind("ffn.0", "ffn", 8, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                                      update_period=2)
    before = copy.deepcopy(backend.module.state_dict())
    with BackgroundExpertServer([backend]) as server:
        expert = RemoteExpert("ffn.0", server.address, client)
        x = torch.randn(4, 8)  # needs no gradient: the expert still learns
        expert(x).sum().backward()
        assert backend.optimizer_steps == 0
        expert(x).sum().backward()
        assert backend.optimizer_steps == 1
        assert server.server.stats["ffn.0"]["backward_batches"] == 2
    after = backend.module.state_dict()
    assert not torch.equal(before["ffn.weight"], after["ffn.weight"])


def test_wrong_shape_or_dtype_is_refused_naming_the_expert_and_schema(client):
    with BackgroundExpertServer([frozen("ffn.4", "ffn", 16)]) as server:
        expert = RemoteExpert("ffn.4", server.address, client)
        with pytest.raises(ExpertSchemaError) as e:
            expert(torch.randn(3, 15))
        assert "'ffn.4'" in str(e.value) and "float32[batch, 16]" in str(e.value) and "float32[3, 15]" in str(e.value)
        with pytest.raises(ExpertSchemaError, match=r"'ffn\.4' expects inputs \(float32\[batch, 16\]\)"):
            expert(torch.randn(3, 16, dtype=torch.float64))
        with pytest.raises(UnknownExpert, match="no expert 'ffn.5'"):
            RemoteExpert("ffn.5", server.address, client)(torch.randn(3, 16))
        assert expert(torch.randn(3, 16)).shape == (3, 16)  # and it keeps serving
        assert expert.info.args_schema[0].shape == (16,)


def test_requests_over_the_limits_are_refused_and_the_server_keeps_serving(client):
    backend = frozen("ffn.0", "ffn", 64, max_batch_size=16)
    limits = Limits(max_message_bytes=256 << 10, max_frame_bytes=256 << 10)
    with BackgroundExpertServer([backend], limits=limits) as server:
        expert = RemoteExpert("ffn.0", server.address, client, forward_timeout=10)
        with pytest.raises(ExpertRequestTooLarge, match="at most 16 rows per request, got 17"):
            expert(torch.randn(17, 64))
        assert expert(torch.randn(16, 64)).shape == (16, 64)
        # 2048 rows x 64 floats = 512 KiB: over the byte limit, the server drops that connection
        with pytest.raises(ExpertCallFailed, match="PeerUnreachable"):
            expert(torch.randn(2048, 64))
        assert expert(torch.randn(16, 64)).shape == (16, 64)


def test_concurrent_callers_are_batched_and_each_gets_its_own_rows(client):
    torch.manual_seed(4)
    backend = frozen("ffn.0", "ffn", 16)
    local = copy.deepcopy(backend.module)
    with BackgroundExpertServer([backend], batch_timeout=0.5) as server:
        expert = RemoteExpert("ffn.0", server.address, client)
        xs = [torch.randn(i + 1, 16) for i in range(8)]
        results: dict[int, torch.Tensor] = {}
        barrier = threading.Barrier(len(xs))

        def call(i: int) -> None:
            barrier.wait()
            results[i] = expert(xs[i])

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(xs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = server.server.stats["ffn.0"]
    for i, x in enumerate(xs):
        torch.testing.assert_close(results[i], local(x).detach(), atol=1e-5, rtol=1e-5)
    assert stats["samples_forward"] >= sum(x.shape[0] for x in xs)
    assert stats["forward_batches"] < len(xs)  # some requests shared a batch


def test_a_dead_server_is_an_expert_call_failure(client):
    server = BackgroundExpertServer([frozen("ffn.0", "ffn", 8)])
    address = server.address
    server.shutdown()
    expert = RemoteExpert("ffn.0", address, client, forward_timeout=5)
    with pytest.raises(ExpertCallFailed, match="ffn.0"):
        expert(torch.randn(2, 8))


async def test_malformed_requests_are_refused_one_by_one():
    server = BackgroundExpertServer([frozen("ffn.0", "ffn", 4)])
    caller = await P2P.create(client_mode=True)
    try:
        good = {"uid": "ffn.0", "inputs": [torch.ones(2, 4)]}
        for request, error in [(None, "ValueError"), ({"uid": 3}, "ValueError"),
                               ({"uid": "ffn.0"}, "ExpertSchemaError"),
                               ({"uid": "ffn.0", "inputs": [1, "x"]}, "ExpertSchemaError"),
                               ({**good, "c": "zip"}, "ValueError"), ({**good, "c": [1]}, "ValueError"),
                               ({**good, "c": "float16", "inputs": ["x"]}, "ExpertSchemaError"),
                               ({"uid": "ffn.0", "inputs": [torch.ones(2, 4)], "grad_outputs": [torch.ones(3, 4)]},
                                "ExpertSchemaError")]:
            method = "expert.backward" if "grad_outputs" in (request or {}) else "expert.forward"
            with pytest.raises(RemoteError) as e:
                await caller.call(server.address, method, request, timeout=10)
            assert e.value.type_name == error, (request, e.value)
        answer = await caller.call(server.address, "expert.forward", good, timeout=10)
        assert answer["outputs"][0].shape == (2, 4)
    finally:
        await caller.shutdown()
        await asyncio.get_running_loop().run_in_executor(None, server.shutdown)
