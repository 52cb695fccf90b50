"""The built-in task ``moe-charlm`` against live expert servers: it trains, its mixtures count the
forward passes that met k_min, and a training peer reports them per epoch."""

from __future__ import annotations

import pytest
import torch

from dht import DHT
from experts import BackgroundExpertServer, ExpertBackend
from p2p import Identity
from workers.peer import TrainingPeer, WorkerConfig
from workers.run_keys import run_validators
from workers.task import load_task

pytestmark = pytest.mark.timeout(120)

RUN = "moetask"
OPTIONS = {"dim": 16, "grid": [2, 2], "layers": 1, "context": 8, "batch_size": 4, "k_best": 2, "k_min": 1,
           "heads": 2}


@pytest.fixture
def grid_server():
    """A 2 x 2 grid of ``ffn`` experts on one server that is also the run's first DHT peer."""
    identity = Identity()
    experts = [ExpertBackend.from_kind(f"ffn.{i}.{j}", "ffn", 16, optimizer=lambda p: torch.optim.Adam(p, lr=1e-2))
               for i in range(2) for j in range(2)]
    server = BackgroundExpertServer(experts, initial_peers=[], identity=identity,
                                    dht_options={"validators": run_validators(RUN, identity)})
    yield server
    server.shutdown()


def test_the_model_needs_the_run_s_dht_and_unknown_options_are_named():
    task = load_task("moe-charlm", **OPTIONS)
    with pytest.raises(ValueError, match="needs the run's DHT"):
        task.model()
    with pytest.raises(ValueError, match="task 'moe-charlm'.*layer"):
        load_task("moe-charlm", layer=2)


def test_moe_charlm_trains_through_remote_experts_and_counts_k_min(grid_server):
    dht = DHT([grid_server.address], client_mode=True)
    try:
        task = load_task("moe-charlm", **OPTIONS)
        model = task.model(seed=0, dht=dht)
        assert any(name.endswith("proj.weight") for name, _ in model.named_parameters())  # the gates are dense
        optimizer = task.make_optimizer(model.parameters())
        batches = task.batches(0)
        fixed = next(batches)  # one batch, many steps: its loss must fall
        losses = []
        for _ in range(15):
            loss = task.loss(model, fixed)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert all(torch.isfinite(torch.tensor(losses)))
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
        assert sum(s["backward_batches"] for s in grid_server.server.stats.values()) >= 15  # the experts train
        (moe,) = model.moes
        stats = moe.take_stats()
        assert stats == {"calls": 15, "calls_meeting_k_min": 15, "rows": 15 * 4 * 8, "rows_meeting_k_min": 15 * 4 * 8,
                             "failovers": 0}
        assert moe.take_stats()["calls"] == 0  # taken: reset

        grid_server.remove_experts(["ffn.0.0", "ffn.0.1", "ffn.1.0", "ffn.1.1"])  # every expert gone
        out = model(fixed[0])  # zeros stand in for the mixture: the model still answers
        assert out.shape == (4, 8, 256) and torch.isfinite(out).all()
        assert moe.take_stats() == {"calls": 1, "calls_meeting_k_min": 0, "rows": 32, "rows_meeting_k_min": 0,
                                    "failovers": 0}
    finally:
        dht.shutdown()


def test_a_training_peer_reports_the_k_min_fraction_per_epoch(grid_server):
    config = WorkerConfig(run=RUN, task="moe-charlm", task_options=OPTIONS, initial_peers=[grid_server.address],
                          target_batch_size=8, max_epochs=2, min_matchmaking_time=0.2, averaging_timeout=5)
    peer = TrainingPeer(config)
    try:
        peer.run()
        records = list(peer.history)
        assert [r["epoch"] for r in records] == [1, 2]
        # an epoch holds at least one forward pass: two (8 samples of 4) unless the view, which extrapolates
        # the last report by its rate, saw the target reached a step early on a loaded machine
        assert all(r["kmin_fraction"] == 1.0 and r["moe_calls"] >= 1 for r in records), records
        totals = peer.moe_stats()
        assert totals["calls"] == sum(r["moe_calls"] for r in records) == totals["calls_meeting_k_min"]
    finally:
        peer.prepare_to_leave(deadline=10)  # as `spotswarm worker` ends: its rounds and records wound up first
