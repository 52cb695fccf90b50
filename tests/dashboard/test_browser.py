"""The dashboard page in real headless Chromium, on a run store filled by a short real local run
(Ray, simulated spot instances training, a preemption and its replacement): served live by the
supervisor, then from the finished run's store as ``spotswarm dashboard RUN`` does."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("playwright.sync_api")


from orchestrator.config.schema import ClusterConfig  # noqa: E402
from orchestrator.fleet.supervisor import SupervisorCore  # noqa: E402
from orchestrator.runs.store import RunStore  # noqa: E402
from orchestrator.ui.dashboard import DashboardServer  # noqa: E402

pytestmark = [pytest.mark.timeout(180), pytest.mark.heavy]

CHARTS = 7


def store_rows(run_dir: Path, sql: str) -> list:
    store = RunStore.open(run_dir)
    try:
        return store.db.execute(sql).fetchall()
    finally:
        store.close()


@pytest.fixture(scope="module")
def live_run(ray_session, tmp_path_factory, wait_for) -> Iterator[tuple[SupervisorCore, str, Callable[[], None]]]:
    """A real run with its supervisor serving the dashboard; the first instance is preempted."""
    base = tmp_path_factory.mktemp("run")
    trace = base / "trace.csv"
    trace.write_text("notice_after_s,kill_after_s\n20,60\n,\n,\n")
    config = ClusterConfig.model_validate({
        "cluster_name": "browser", "runs_dir": str(base / "runs"),
        "provider": {"type": "local", "zones": ["a", "b"], "time_scale": 20.0, "provisioning_delay_s": 10.0,
                     "trace_file": str(trace)},
        "available_node_types": {"small": {"min_workers": 2, "max_workers": 2, "on_demand_price_per_hour": 1.0,
                                           "spot_price_per_hour": {"a": 0.3, "b": 0.35}}},
        "spot": {"notice_period_s": 40.0},
        "training": {"task": "synthetic", "target_batch_size": 64, "min_matchmaking_time_s": 0.5,
                     "averaging_timeout_s": 10.0},
        "checkpoint": {"every_s": 600.0},
        "dashboard": {"port": 0},
    })
    RunStore.create(config).close()
    run_dir = config.run_dir()
    core = SupervisorCore(config, run_dir)
    url = core.serve_dashboard()
    assert url is not None, "the supervisor did not serve its dashboard"
    core.start()
    stopped: list[bool] = []

    def stop() -> None:  # the second test stops the run; the fixture stops it if that did not happen
        if not stopped:
            stopped.append(True)
            core.stop()

    try:
        wait_for(lambda: store_rows(run_dir, "SELECT COUNT(*) FROM instances WHERE end_reason = 'preempted'")
                 == [(1,)], 60, "a preemption")
        wait_for(lambda: store_rows(run_dir, "SELECT COUNT(*) FROM instances")[0][0] >= 3, 30, "its replacement")
        wait_for(lambda: store_rows(run_dir, "SELECT COUNT(*) FROM progress WHERE samples > 0")[0][0] >= 2, 60,
                 "training progress")
        yield core, url, stop
    finally:
        stop()


@pytest.fixture(scope="module")
def browser(live_run, browser):
    """Chromium (conftest) started once the run is up, and closed before it is stopped."""
    return browser


def chart_points(page) -> dict[str, int]:
    return page.evaluate("""() => Object.fromEntries(Array.from(document.querySelectorAll('.chart')).map(
        d => [d.id, (d.data || []).reduce((n, t) => n + (t.x ? t.x.length : 0), 0)]))""")


def table_ids(page) -> list[str]:
    return page.eval_on_selector_all("#instances tbody tr", "rows => rows.map(r => r.cells[0].textContent)")


def card(page, label: str) -> str:
    """The value shown on a headline card."""
    return page.evaluate("""label => Array.from(document.querySelectorAll('#headline .card'))
        .find(c => c.children[0].textContent === label).children[1].textContent""", label)


def round_cells(page) -> list[list[str]]:
    return page.eval_on_selector_all("#rounds tbody tr",
                                     "rows => rows.map(r => Array.from(r.cells).map(c => c.textContent))")


def refreshes(page) -> int:
    return int(page.evaluate("() => document.body.dataset.refreshes || 0"))


def test_live_page_in_chromium(live_run, open_page, save_screenshot, wait_for):
    core, url, _ = live_run
    page, errors = open_page(url)
    try:
        wait_for(lambda: refreshes(page) >= 2, 30, "the page to refresh itself")
        assert page.text_content("#state") == "live"
        assert page.evaluate("() => document.body.dataset.polling") == "on"
        points = chart_points(page)
        assert len(points) == CHARTS and all(n > 0 for n in points.values()), points
        ids = lambda: sorted(r[0] for r in store_rows(core.store.dir, "SELECT id FROM instances"))  # noqa: E731
        wait_for(lambda: sorted(table_ids(page)) == ids(), 30, "the table to list every instance")
        assert "preempted" in page.text_content("#instances")
        # the trainers' rounds reach the page through their status answers and the store
        wait_for(lambda: page.is_visible("#rounds-section") and round_cells(page), 30, "the rounds table")
        shown = round_cells(page)  # one reading: the page redraws the table on every refresh
        for _, peers, wall, compute, comm, _ in shown:
            assert int(peers) >= 1 and float(wall) == pytest.approx(float(compute) + float(comm), abs=0.011)
        epochs = [int(r[0]) for r in shown]
        assert epochs == sorted(epochs, reverse=True)  # newest first
        shot = save_screenshot(page, "dashboard-live.png")
        assert shot.stat().st_size > 20_000
    finally:
        page.close()
    assert not errors, errors


def test_finished_run_page_in_chromium(live_run, open_page, save_screenshot):
    core, _, stop = live_run
    stop()
    run_dir = core.store.dir
    every_instance = [r[0] for r in store_rows(run_dir, "SELECT id FROM instances ORDER BY launched_at")]
    with DashboardServer(run_dir) as server:  # what `spotswarm dashboard RUN` serves
        page, errors = open_page(server.url)  # once it has loaded its figures
        try:
            assert page.text_content("#state") == "finished"
            points = chart_points(page)
            assert len(points) == CHARTS and all(n > 0 for n in points.values()), points
            assert table_ids(page) == every_instance
            preemptions, replacements = map(int, card(page, "preemptions / replacements").split(" / "))
            assert preemptions == 1 and replacements >= 1
            assert card(page, "dollars spent").startswith("$") and card(page, "saved").endswith("%)")
            ended = page.eval_on_selector_all("#instances tbody tr", "rows => rows.map(r => r.cells[10].textContent)")
            per_sample = page.eval_on_selector_all("#instances tbody tr",
                                                   "rows => rows.map(r => r.cells[8].textContent)")
            assert all(c == "-" or c.isdigit() for c in per_sample), per_sample  # bytes sent per sample, if reported
            assert "preempted" in ended and "running" not in ended  # every instance released at the stop
            rounds = page.evaluate("() => fetch('api/rounds').then(r => r.json())")
            assert rounds and round_cells(page) == [
                [str(r["epoch"]), str(r["peers"]), f"{r['wall_s']:.2f}", f"{r['compute_s']:.2f}", f"{r['comm_s']:.2f}",
                 "-" if r["comm_percent"] is None else f"{r['comm_percent']:.1f}"] for r in rounds]
            assert page.evaluate("() => document.body.dataset.polling") == "off"  # nothing left to refresh
            save_screenshot(page, "dashboard-finished.png")
        finally:
            page.close()
    assert not errors, errors
