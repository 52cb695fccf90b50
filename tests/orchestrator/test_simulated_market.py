"""The local simulator's preemption draws: launch k's lifetime is a function of the run's seed and k
alone, whatever order concurrent launches complete in, and fresh for a resumed run's new launches."""

from __future__ import annotations

import statistics

import pytest

pytest.importorskip("ray")

from orchestrator.config.schema import ClusterConfig  # noqa: E402
from orchestrator.providers.base import LaunchSpec  # noqa: E402
from orchestrator.sim.actors import SimulatedMarket  # noqa: E402

MEAN = 600.0
NOTICE = 30.0


def market(seed: int = 5, distribution: str = "exponential") -> SimulatedMarket:
    config = ClusterConfig.model_validate({
        "cluster_name": "sim", "provider": {"type": "local", "seed": seed},
        "spot": {"notice_period_s": NOTICE},
        "available_node_types": {"small": {"min_workers": 1, "max_workers": 1, "preemption": {
            "distribution": distribution, "mean_lifetime_s": MEAN, "weibull_shape": 1.5}}},
    })
    return SimulatedMarket(config, clock=lambda: 0.0)


def lifetimes(m: SimulatedMarket, sequences, now: float = 1000.0) -> dict[int, float]:
    for k in sequences:
        m.schedule(LaunchSpec(f"sim-small-{k:04d}", "small", "a", "spot", tags={}, sequence=k), now)
    return {k: m.schedules[f"sim-small-{k:04d}"].kill_at - now for k in sequences}


@pytest.mark.parametrize("distribution", ["exponential", "weibull"])
def test_a_launch_gets_its_lifetime_from_the_seed_and_its_number_alone(distribution):
    in_order = lifetimes(market(distribution=distribution), range(6))
    shuffled = lifetimes(market(distribution=distribution), [3, 0, 5, 1, 4, 2])  # launches completing out of order
    assert shuffled == in_order
    assert lifetimes(market(seed=6, distribution=distribution), range(6)) != in_order  # another seed, other draws
    resumed = lifetimes(market(distribution=distribution), range(6, 12))  # a resumed run's launch numbers go on
    assert set(resumed.values()).isdisjoint(in_order.values())
    m = market(distribution=distribution)
    lifetimes(m, [0])
    assert m.schedules["sim-small-0000"].notice_at == pytest.approx(1000.0 + max(in_order[0] - NOTICE, 0.0))


def test_the_draws_have_the_configured_mean():
    drawn = list(lifetimes(market(), range(4000)).values())
    assert statistics.fmean(drawn) == pytest.approx(MEAN, rel=0.08)
    assert statistics.median(drawn) == pytest.approx(MEAN * 0.693, rel=0.1)  # exponential: mean x ln 2


def test_a_preemption_on_cue_replaces_the_drawn_one_and_is_noticed_once():
    m = market(distribution="none")
    m.schedule(LaunchSpec("sim-small-0000", "small", "a", "spot", tags={}, sequence=0), 1000.0)
    assert m.due_notices(["sim-small-0000"], 5000.0) == []  # no drawn lifetime: never preempted
    m.preempt("sim-small-0000", 2000.0)
    assert m.due_notices(["sim-small-0000"], 1999.0) == []
    (notice,) = m.due_notices(["sim-small-0000"], 2000.0)
    assert (notice.instance_id, notice.notice_at, notice.terminate_at) == ("sim-small-0000", 2000.0, 2000.0 + NOTICE)
    assert m.due_notices(["sim-small-0000"], 2001.0) == []  # noticed once
    assert not m.due_kill("sim-small-0000", 2000.0 + NOTICE - 1) and m.due_kill("sim-small-0000", 2000.0 + NOTICE)
