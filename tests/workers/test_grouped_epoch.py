"""DeDLOC beyond one group: nine peers with group_size 3 end their epoch with the exact global mean
of their gradients, weighted by samples, and the same parameters bit for bit."""

from __future__ import annotations

import threading

import pytest
import torch

from dht import DHT
from tests.workers.local_dhts import signed_dhts
from workers.collaborative import CollaborativeOptimizer

pytestmark = pytest.mark.timeout(90)
PEERS, GROUP, SIZE = 9, 3, 257


def grouped_epoch(swarm_size: int, wait_for) -> tuple[list[CollaborativeOptimizer], list, list[torch.Tensor]]:
    """Nine peers, each with its own gradient, micro-step until their first global epoch."""
    dhts: list[DHT] = []
    opts: list[CollaborativeOptimizer] = []
    params = [torch.nn.Parameter(torch.zeros(SIZE)) for _ in range(PEERS)]
    gradients = [torch.randn(SIZE, generator=torch.Generator().manual_seed(i)) * (i + 1) for i in range(PEERS)]
    try:
        signed_dhts(PEERS, into=dhts)
        for param, dht in zip(params, dhts, strict=True):
            opts.append(CollaborativeOptimizer(torch.optim.SGD([param], lr=1.0), dht, "grouped",
                                               target_batch_size=PEERS * 40, max_group_size=GROUP,
                                               min_matchmaking_time=0.5, averaging_timeout=30,
                                               load_state_on_start=False, swarm_size=swarm_size))
        # every view holds all nine before anyone steps: a peer whose view misses some plans other groups
        # than theirs (it then averages with fewer, or loads the state of those that stepped)
        # (and every plan: with a tree of keys, the roster reads the other leaves a few per refresh)
        def all_seen() -> bool:
            for opt in opts:
                opt.keep_alive()  # waiting peers keep their records fresh, as a worker waiting for min_peers does
            return all(opt.tracker.view().live_peers == PEERS and len(opt.tracker.members(0)) == PEERS
                       for opt in opts)

        wait_for(all_seen, 30, "every view and plan to hold nine peers")
        stepped = threading.Barrier(PEERS + 1)

        def train(i: int) -> None:
            try:
                for _ in range(20_000):  # bounded: a peer that never steps fails the assertions below
                    params[i].grad = gradients[i].clone()
                    if opts[i].step(4 + i) or opts[i].epoch > 0:
                        return
            finally:
                stepped.wait()

        threads = [threading.Thread(target=train, args=(i,), daemon=True) for i in range(PEERS)]
        for t in threads:
            t.start()
        stepped.wait(timeout=80)
        return opts, params, gradients
    finally:
        for opt in reversed(opts):
            opt.prepare_to_leave()
        for dht in dhts:
            dht.shutdown()


@pytest.mark.parametrize("swarm_size", [16, 64], ids=["one-key", "tree-of-keys"])
def test_nine_peers_in_groups_of_three_step_on_the_exact_weighted_mean(swarm_size, wait_for):
    opts, params, gradients = grouped_epoch(swarm_size, wait_for)
    assert [opt.epoch for opt in opts] == [1] * PEERS
    reports = [opt.history[-1] for opt in opts]
    assert all(r.group_size == PEERS for r in reports)  # planned over all nine, in groups of three
    samples = torch.tensor([float(r.samples) for r in reports], dtype=torch.float64)
    means = []  # each peer's mean gradient per micro-step, as it computed it in float32
    for i, (g, r) in enumerate(zip(gradients, reports, strict=True)):
        steps, total = r.samples // (4 + i), torch.zeros(SIZE)
        for _ in range(steps):
            total += g
        means.append(total / steps)
    expected = -(torch.stack(means).double() * samples[:, None]).sum(0) / samples.sum()
    for p in params:
        assert torch.equal(p.detach(), params[0].detach())  # bit-identical on every peer
    torch.testing.assert_close(params[0].detach().double(), expected, rtol=1e-5, atol=1e-5)
