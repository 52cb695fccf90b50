"""The paths a GPU takes — averaging tensors staged through host buffers, a peer training on its
device, an expert and a mixture of experts whose callers' tensors are on the device (answers
travel through host memory and come back there), a caller and a server on one GPU in one process —
run on every device this machine has: the CPU always, CUDA where torch sees a GPU (skipped
elsewhere, so the same assertions hold in both places)."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from averaging import DecentralizedAverager
from dht import DHTNode
from experts import BackgroundExpertServer, ExpertBackend, ExpertClient, RemoteExpert, RemoteMixtureOfExperts
from tests.averaging.means import assert_exact_mean_everywhere, exact_mean
from tests.workers.two_peers import assert_in_step, two_peers_training

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no GPU here")
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]


def _tensors(i: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return [(torch.randn(*shape, generator=g) * (i + 1)).to(device) for shape in ((300, 50), (7,), (1000,))]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("device", DEVICES)
async def test_tensors_on_the_device_average_to_the_exact_mean_through_host_buffers(device):
    first = await DHTNode.create()
    nodes = [first, *[await DHTNode.create([str(first.address)]) for _ in range(2)]]
    inputs = [_tensors(i, device) for i in range(3)]
    expected = exact_mean(inputs)
    averagers = [DecentralizedAverager(t, n, "dev", target_group_size=3, min_matchmaking_time=10.0, chunk_size=4096)
                 for t, n in zip(inputs, nodes, strict=True)]
    try:
        results = await asyncio.gather(*(a.step(timeout=30) for a in averagers))
        assert all(r.group_size == 3 and not r.failed_peers for r in results)
        # staged in page-locked memory when the tensors are a GPU's: their copies skip a bounce buffer
        assert all(a.flat.flat.device.type == "cpu" and a.flat.flat.is_pinned() == (device == "cuda")
                   for a in averagers)
        assert_exact_mean_everywhere(averagers, expected)
    finally:
        for a in averagers:
            await a.shutdown()
        for node in reversed(nodes):
            await node.shutdown()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("device", DEVICES)
def test_two_peers_train_on_the_device_and_share_every_epoch(device, wait_for):
    common = dict(task="synthetic", target_batch_size=128, min_peers=2, param_digests=True, device=device,
                  run=f"on-{device}", min_matchmaking_time=0.5, averaging_timeout=5.0)
    with two_peers_training(**common) as peers:
        wait_for(lambda: min(p.epoch for p in peers) >= 4, 60, "epoch 4 on both peers")
        for p in peers:
            assert {t.device.type for t in p.model.parameters()} == {device}
            state = [v for s in p.optimizer.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
            assert state and {v.device.type for v in state if v.dim() > 0} == {device}  # the optimizer's too
        leaving_at = min(p.epoch for p in peers)
    assert_in_step(peers, after=1, before=leaving_at, at_least=2)


# All four pairs in one process: a GPU caller's backward must not hold the GPU's autograd thread
# for the call's round trip, or a GPU server's backward in the same process waits for it.
@pytest.mark.timeout(60)
@pytest.mark.parametrize("caller,server", [("cpu", "cpu"), pytest.param("cuda", "cpu", marks=GPU),
                                           pytest.param("cpu", "cuda", marks=GPU),
                                           pytest.param("cuda", "cuda", marks=GPU)])
def test_an_expert_answers_a_caller_on_any_device_as_the_module_would(caller, server):
    torch.manual_seed(0)
    backend = ExpertBackend.from_kind("ffn.0", "ffn", 16, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                                      update_period=1000, device=server)
    local = copy.deepcopy(backend.module).cpu()
    client = ExpertClient.create()
    try:
        with BackgroundExpertServer([backend]) as served:
            x = torch.randn(5, 16, device=caller, requires_grad=True)
            w = torch.randn(5, 16, device=caller)
            y = RemoteExpert("ffn.0", served.address, client)(x)
            (y * w).sum().backward()
            assert y.device.type == caller and x.grad.device.type == caller  # answers come back where x is
            x_local = x.detach().cpu().requires_grad_()
            y_local = local(x_local)
            (y_local * w.cpu()).sum().backward()
            torch.testing.assert_close(y.cpu(), y_local, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(x.grad.cpu(), x_local.grad, atol=1e-4, rtol=1e-4)
            for (name, p_remote), p_local in zip(backend.module.named_parameters(), local.parameters(), strict=True):
                assert p_remote.grad.device.type == server
                torch.testing.assert_close(p_remote.grad.cpu(), p_local.grad, atol=1e-4, rtol=1e-4, msg=name)
    finally:
        client.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("device", DEVICES)
def test_a_mixture_on_the_device_gives_what_it_gives_on_the_cpu(device, start_server, client_dht):
    torch.manual_seed(0)
    hidden = 8
    start_server([ExpertBackend.from_kind(f"ffn.{i}", "ffn", hidden, optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
                                          device=device) for i in range(3)])  # caller and servers on it
    moe = RemoteMixtureOfExperts(hidden, (3,), "ffn", k_best=3, k_min=3, forward_timeout=20, dht=client_dht)
    gating = copy.deepcopy(moe.proj)
    x_cpu = torch.randn(6, hidden, requires_grad=True)
    w = torch.randn(6, hidden)
    out_cpu = moe(x_cpu)
    (out_cpu * w).sum().backward()
    cpu_grad = moe.proj.weight.grad

    moe.proj = gating.to(device)  # the same layer and weights, on the device
    x = x_cpu.detach().to(device).requires_grad_()
    out = moe(x)
    (out * w.to(device)).sum().backward()
    assert out.device.type == device and x.grad.device.type == device and moe.proj.weight.grad.device.type == device
    torch.testing.assert_close(out.cpu(), out_cpu, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(x.grad.cpu(), x_cpu.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(moe.proj.weight.grad.cpu(), cpu_grad, atol=1e-4, rtol=1e-4)
