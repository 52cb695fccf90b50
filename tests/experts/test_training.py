"""Training through a DMoE layer while one of three expert servers is SIGKILLed and restarted."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from experts import ExpertBackend, RemoteMixtureOfExperts

pytestmark = [pytest.mark.timeout(120), pytest.mark.heavy]

HIDDEN = 16
VICTIM = {"ffn.2.0", "ffn.2.1"}


def make_task(seed: int):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(8, 1, generator=g), torch.randn(8, 1, generator=g)
    a, b = a / a.norm(), b / b.norm()

    def batch(n: int = 32):
        x = torch.randn(n, 8, generator=g)
        return x, torch.sin(2 * (x @ a)) + 0.5 * (x @ b)
    return batch


def test_loss_falls_while_a_server_is_killed_and_restarted(start_server, client_dht, dht_boot, server_process):
    torch.manual_seed(0)
    victim_flags = ("--expert-cls", "ffn", "--hidden-dim", str(HIDDEN), "--expert-uids", *sorted(VICTIM),
                    "--lr", "3e-3", "--seed", "1", "--num-threads", "1", "--initial-peers", *dht_boot.addresses)
    victim = server_process(*victim_flags)  # the third server: a process of its own, started first (slowest)
    for i in (0, 1):  # two servers in this process, two experts each, on grid (3, 2)
        start_server([ExpertBackend.from_kind(f"ffn.{i}.{j}", "ffn", HIDDEN,
                                              optimizer=lambda p: torch.optim.Adam(p, lr=3e-3)) for j in (0, 1)])
    victim.address  # noqa: B018 - up and declared

    moe = RemoteMixtureOfExperts(HIDDEN, (3, 2), "ffn", k_best=4, k_min=1, forward_timeout=10,
                                 timeout_after_k_min=2, backward_k_min=1, backward_timeout=10, dht=client_dht)
    model = nn.Sequential(nn.Linear(8, HIDDEN), moe, nn.Linear(HIDDEN, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = make_task(seed=5)

    losses: list[float] = []
    restarted = None
    failed_while_dead = answered_after_restart = 0
    ready_at = None
    step = 0
    while step < 240 or ready_at is None or step < ready_at + 30:
        assert step < 2000, "the restarted server never came back"
        if step == 60:
            assert victim.kill() == -9  # SIGKILL: no withdrawal, its records stay in the DHT
            restarted = server_process(*victim_flags)  # comes up while training goes on
        if restarted is not None and ready_at is None and any("listening at" in line for line in restarted.lines):
            ready_at = step
        x, y = batch()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        report = moe.last_call
        if step >= 60 and ready_at is None and VICTIM & set(report.failed):
            failed_while_dead += 1
        if ready_at is not None and step > ready_at and VICTIM & report.backward_answered:
            answered_after_restart += 1
        step += 1

    first, last = sum(losses[:10]) / 10, sum(losses[-30:]) / 30
    assert last < 0.3 * first, f"loss went from {first:.3f} to {last:.3f}"
    assert failed_while_dead > 0  # the dead server was chosen and skipped, and training went on
    assert answered_after_restart > 0  # the restarted server was found again and trained
