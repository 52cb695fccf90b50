"""A micro-step makes no DHT call: the swarm's progress comes from the tracker's background view,
which publishes our reports and reads the others' on its own."""

from __future__ import annotations

import pytest
import torch

from dht import DHT, SignatureValidator
from p2p import Identity
from workers.collaborative import CollaborativeOptimizer

pytestmark = pytest.mark.timeout(60)


def peer(initial: list[str]) -> tuple[DHT, CollaborativeOptimizer, torch.nn.Linear]:
    identity = Identity()
    dht = DHT(initial, host="127.0.0.1", identity=identity, validators=[SignatureValidator(identity)])
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht, "view",
                                 target_batch_size=10**9, report_interval=0.0, load_state_on_start=False)
    return dht, opt, model


def micro_step(opt: CollaborativeOptimizer, model: torch.nn.Linear, samples: int) -> bool:
    model(torch.ones(2, 8)).sum().backward()
    return opt.step(samples)


def test_micro_steps_call_no_dht_and_the_views_meet(wait_for):
    dht_a, opt_a, model_a = peer([])
    dht_b, opt_b, model_b = peer(dht_a.addresses)
    try:
        # a newcomer's view holds the others from its first step: one that started empty would show it
        # alone, and it would step alone
        assert opt_b.tracker.view().live_peers == 2
        calls = []
        blocking = dht_a.run_coroutine
        dht_a.run_coroutine = lambda *a, **k: calls.append(a) or blocking(*a, **k)  # counts, still works
        for _ in range(200):
            assert not micro_step(opt_a, model_a, 3)
        assert calls == []  # no blocking DHT call from any of the 200 micro-steps
        assert opt_a.local_samples == 600
        micro_step(opt_b, model_b, 5)
        def stored() -> list[int]:
            return sorted(p.samples for p in dht_b.run_coroutine(lambda _n: opt_b.tracker.peers()).values())

        # every report reaches the DHT, the last one too, published in the background
        wait_for(lambda: stored() == [5, 600], 20, "both peers' last reports in the DHT")
        # and each view reads the other's record on its own (samples extrapolated by throughput: at least those)
        for opt in (opt_a, opt_b):
            wait_for(lambda opt=opt: opt.tracker.view().num_peers == 2 and opt.tracker.view().samples >= 605, 20,
                     "each view to count the other peer's samples")
    finally:
        dht_a.run_coroutine = blocking
        for opt, dht in ((opt_b, dht_b), (opt_a, dht_a)):
            opt.prepare_to_leave()
            dht.shutdown()
