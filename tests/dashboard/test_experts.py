"""The dashboard of a mixture-of-experts run: experts live, replicas per expert, server load and
the k_min fraction, from a run store filled by hand (no Ray)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from orchestrator.config.schema import ClusterConfig
from orchestrator.runs import figures
from orchestrator.runs.store import RunStore
from orchestrator.ui.dashboard import DashboardServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def moe_run(tmp_path):
    config = ClusterConfig.model_validate({
        "cluster_name": "moe", "runs_dir": str(tmp_path / "runs"),
        "available_node_types": {"srv": {"role": "experts", "min_workers": 2, "max_workers": 2},
                                 "trn": {"max_workers": 1}},
        "training": {"task": "moe-charlm"}, "experts": {"grid": [1, 2], "k_best": 2, "k_min": 1}})
    store = RunStore.create(config)
    t = iter(range(1000, 2000, 10))
    store.clock = lambda: float(next(t))
    store.event("supervisor_start")
    store.event("expert_placement", detail={"ffn.0.0": ["moe-srv-0000", "moe-srv-0001"], "ffn.0.1": []})
    store.expert_sample(2, 2, 2, 2.0, None, None, 0, None)
    store.expert_sample(1, 2, 0, 1.0, 40.0, 12.5, 200, 0.995)
    store.close()
    return config.run_dir()


def test_headline_charts_and_api_show_the_experts(moe_run):
    store = RunStore.open(moe_run)
    try:
        h = figures.headline(store, 2000.0, live=False)
        rows = dict(figures.headline_rows(h))
        charts = {c.id: c for c in figures.charts(store, 2000.0)}
    finally:
        store.close()
    assert rows["experts live / grid"] == "1 / 2 (each on >= 0 servers)"
    assert rows["forward passes meeting k_min"] == "99.50%"
    assert {"experts", "expert_load", "kmin"} <= set(charts)
    assert charts["kmin"].traces[0].y == [99.5]  # the first sample had no calls: no point
    assert [tr.y for tr in charts["experts"].traces][:2] == [[2, 1], [2, 2]]
    with DashboardServer(moe_run) as server:
        with urllib.request.urlopen(server.url + "api/experts", timeout=10) as response:
            experts = json.loads(response.read())
        with urllib.request.urlopen(server.url + "metrics", timeout=10) as response:
            metrics = response.read().decode()
    assert experts == [{"uid": "ffn.0.0", "servers": ["moe-srv-0000", "moe-srv-0001"]},
                       {"uid": "ffn.0.1", "servers": []}]
    assert 'spotswarm_experts_live{run="moe"} 1.0' in metrics
    assert 'spotswarm_kmin_fraction{run="moe"} 0.995' in metrics


def test_a_run_without_experts_shows_no_expert_rows(tmp_path):
    config = ClusterConfig.model_validate({"cluster_name": "plain", "runs_dir": str(tmp_path / "runs"),
                                           "available_node_types": {"a": {"max_workers": 1}}})
    store = RunStore.create(config)
    try:
        labels = [label for label, _ in figures.headline_rows(figures.headline(store, store.clock(), live=False))]
        assert not any("expert" in label or "k_min" in label for label in labels)
        assert figures.expert_rows(store) == []
    finally:
        store.close()
