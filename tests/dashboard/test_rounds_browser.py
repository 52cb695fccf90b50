"""The dashboard's Rounds table in real headless Chromium, over the hand-filled run store (conftest,
no Ray): each epoch's mean over the trainers that reported it, newest first, as the API gives it;
a run without a single round shows no table."""

from __future__ import annotations

import pytest

pytest.importorskip("playwright.sync_api")

from orchestrator.config.schema import ClusterConfig  # noqa: E402
from orchestrator.runs.store import RunStore  # noqa: E402
from orchestrator.ui.dashboard import DashboardServer  # noqa: E402

pytestmark = [pytest.mark.timeout(120), pytest.mark.heavy]


def round_cells(page) -> list[list[str]]:
    return page.eval_on_selector_all("#rounds tbody tr",
                                     "rows => rows.map(r => Array.from(r.cells).map(c => c.textContent))")


def test_the_rounds_table_shows_each_epochs_split_newest_first(hand_run, open_page, save_screenshot):
    with DashboardServer(hand_run.dir) as server:
        page, errors = open_page(server.url)
        try:
            assert page.is_visible("#rounds-section")
            headers = page.eval_on_selector_all("#rounds thead th", "hs => hs.map(h => h.textContent)")
            assert headers == ["epoch", "peers", "wall (s)", "compute (s)", "communication (s)", "communication (%)"]
            assert round_cells(page) == [[str(e), str(n), f"{wall:.2f}", f"{compute:.2f}", f"{comm:.2f}", f"{pct:.1f}"]
                                         for e, n, wall, compute, comm, pct in hand_run.round_means]
            assert round_cells(page)[1] == ["19", "2", "6.00", "4.00", "2.00", "33.3"]
            save_screenshot(page, "dashboard-rounds.png")
        finally:
            page.close()
    assert not errors, errors


def test_a_run_without_rounds_shows_no_rounds_table(tmp_path, open_page):
    config = ClusterConfig.model_validate({"cluster_name": "norounds", "runs_dir": str(tmp_path / "runs"),
                                           "available_node_types": {"a": {"max_workers": 1}}})
    RunStore.create(config).close()
    with DashboardServer(config.run_dir()) as server:
        page, errors = open_page(server.url)
        try:
            assert page.is_hidden("#rounds-section") and round_cells(page) == []
        finally:
            page.close()
    assert not errors, errors
