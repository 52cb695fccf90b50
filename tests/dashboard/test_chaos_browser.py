"""The chaos report page in real headless Chromium, over the hand-filled run store (conftest, no
Ray) and a hand-written ``chaos.json``: both charts drawn with the faults on them, the tables
filled, the main dashboard linking the report only when there is one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("playwright.sync_api")

from orchestrator.ui.dashboard import DashboardServer  # noqa: E402

pytestmark = [pytest.mark.timeout(120), pytest.mark.heavy]

T0 = 1_000_000.0  # the hand run's first record (conftest)
FAULTS = [  # (seconds after T0, kind, phase, duration)
    (1200, "worker_kill", "all-reduce", None),
    (2400, "worker_pause", "idle", 30.0),
    (3600, "bandwidth_drop", "matchmaking", 120.0),
    (4200, "disk_full", "checkpoint write", 60.0),
    (5400, "supervisor_kill", "state download", None),
]
LOAD_MS = 30_000


def write_chaos(run_dir: Path) -> None:
    run_dir.joinpath("chaos.json").write_text(json.dumps({
        "version": 1, "seed": 7, "config": "cluster_configs/local-chaos.yaml", "cluster": "hand",
        "started_at": T0, "ended_at": T0 + 7900, "duration_s": 7900.0, "state": "finished",
        "faults": [{"time": T0 + t, "kind": kind, "target": "hand-small-0001", "phase": phase, "duration_s": d,
                    "detail": f"{kind} by hand", "outcome": "injected"} for t, kind, phase, d in FAULTS],
        "violations": [],
        "summary": {"faults": len(FAULTS), "skipped": 0, "invariant_violations": 0, "error_tracebacks": 0,
                    "max_stall_s": 12.3, "p99_stall_s": 10.1, "retained": None, "by_kind": {}, "by_phase": {}},
    }))


def card(page, label: str) -> str:
    return page.evaluate("""label => Array.from(document.querySelectorAll('#summary .card'))
        .find(c => c.children[0].textContent === label).children[1].textContent""", label)


def test_chaos_page_of_a_finished_run(hand_run, open_page, save_screenshot):
    write_chaos(hand_run.dir)
    with DashboardServer(hand_run.dir) as server:
        page, errors = open_page(server.url + "chaos")
        try:
            for chart in ("chart-throughput", "chart-loss"):
                page.wait_for_selector(f"#{chart} .main-svg", state="attached", timeout=LOAD_MS)
                fault_traces = page.evaluate("""id => document.getElementById(id).data
                    .filter(t => t.yaxis === 'y2').map(t => t.name)""", chart)
                assert sorted(fault_traces) == sorted(kind for _, kind, _, _ in FAULTS)
                labels = page.eval_on_selector_all(f"#{chart} .textpoint text", "ts => ts.map(t => t.textContent)")
                assert sorted(labels) == sorted(kind for _, kind, _, _ in FAULTS)  # each line labelled, drawn
            rows = page.eval_on_selector_all("#faults tbody tr", "rs => rs.map(r => [r.cells[0].textContent, "
                                             "r.cells[1].textContent])")
            assert rows == [[f"{t / 60:.2f}", kind] for t, kind, _, _ in FAULTS]  # minutes since the start
            assert card(page, "invariant violations") == "0"
            assert card(page, "faults") == str(len(FAULTS)) and card(page, "max stall") == "12.3 s"
            assert page.is_visible("#no-violations") and not page.is_visible("#violations")
            assert len(page.query_selector_all("#by-kind-phase tbody tr")) == 7  # every kind
            assert page.text_content("#by-kind-phase tfoot").endswith(str(len(FAULTS)))
            assert page.text_content("#state") == "finished"
            assert page.evaluate("() => document.body.dataset.polling") == "off"  # a finished run: no polling
            assert page.is_hidden("#message")
            save_screenshot(page, "chaos-finished.png")
        finally:
            page.close()
        main, main_errors = open_page(server.url)
        try:
            assert main.is_visible("#chaos-link")
            main.click("#chaos-link")
            main.wait_for_url("**/chaos")
            main.wait_for_selector("#chart-loss .main-svg", state="attached", timeout=LOAD_MS)
        finally:
            main.close()
    assert not errors and not main_errors, errors + main_errors


def test_chaos_page_of_a_run_without_a_report(hand_run, open_page):
    with DashboardServer(hand_run.dir) as server:
        page, errors = open_page(server.url + "chaos")
        try:
            message = page.text_content("#message")
            assert page.is_visible("#message") and page.is_hidden("#report")
            assert message == f"no chaos report (not a chaos run): {hand_run.dir / 'chaos.json'}"
            assert page.evaluate("() => document.body.dataset.polling") == "off"
        finally:
            page.close()
        main, main_errors = open_page(server.url)
        try:
            assert main.is_hidden("#chaos-link")  # not a chaos run: no link
        finally:
            main.close()
    # the 404 itself is the only thing Chromium reports
    assert all("404" in e for e in errors) and not main_errors, errors + main_errors
