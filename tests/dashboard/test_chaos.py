"""The chaos report's API on a real loopback server: a hand-written ``chaos.json`` beside the
hand-filled run store (conftest), its faults counted by kind and phase and drawn on the charts at
their minutes; a run without a report and a report that cannot be read answer JSON errors."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from orchestrator.ui.dashboard import DashboardServer

pytestmark = pytest.mark.timeout(60)

T0 = 1_000_000.0  # the hand run's first record (conftest)

# (seconds after T0, kind, target, phase, duration, outcome)
FAULTS = [
    (1200, "worker_kill", "hand-small-0001", "all-reduce", None, "injected"),
    (2400, "worker_pause", "hand-small-0002", "idle", 30.0, "injected"),
    (3000, "worker_kill", "hand-small-0003", "matchmaking", None, "injected"),
    (3600, "bandwidth_drop", "hand-big-0000", "all-reduce", 120.0, "injected"),
    (4200, "disk_full", "head", "checkpoint write", 60.0, "injected"),
    (4800, "node_kill", "hand-small-0004", "idle", None, "skipped: no node in its own namespace"),
    (5400, "clock_jump", "hand-small-0005", "state download", None, "injected"),
]


def chaos_report(violations: list[dict] | None = None, state: str = "finished") -> dict:
    faults = [{"time": T0 + t, "kind": kind, "target": target, "phase": phase, "duration_s": duration,
               "detail": f"{kind} of {target}", "outcome": outcome}
              for t, kind, target, phase, duration, outcome in FAULTS]
    violations = violations or []
    return {
        "version": 1, "seed": 7, "config": "cluster_configs/local-chaos.yaml", "cluster": "hand",
        "started_at": T0 - 5, "ended_at": T0 + 7900, "duration_s": 7905.0, "state": state,
        "faults": faults, "violations": violations,
        "summary": {"faults": 6, "skipped": 1, "invariant_violations": len(violations), "error_tracebacks": 0,
                    "max_stall_s": 12.34, "p99_stall_s": 10.1, "recovery_s": 4.25, "retained": None,
                    "by_kind": {"worker_kill": 2}, "by_phase": {"idle": 2}, "epochs": 20},
    }


def write_report(run_dir: Path, report: dict) -> Path:
    path = run_dir / "chaos.json"
    path.write_text(json.dumps(report))
    return path


def get_json(url: str) -> tuple[int, dict]:
    """The status and JSON body of a GET, error statuses included."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        assert e.headers["Content-Type"].startswith("application/json")
        return e.code, json.loads(e.read())


def fault_lines(fig: dict) -> dict[str, list[float]]:
    """The minutes at which each fault trace draws its vertical lines (one per fault)."""
    return {tr["name"]: sorted({x for x in tr["x"] if x is not None}) for tr in fig["data"]
            if tr.get("yaxis") == "y2"}


def test_chaos_api_counts_lists_and_marks_every_fault(hand_run):
    write_report(hand_run.dir, chaos_report(
        [{"time": T0 + 5000, "invariant": "equal_params", "detail": "peers disagree after epoch 17"}]))
    with DashboardServer(hand_run.dir) as server:
        status, report = get_json(server.url + "api/chaos")
        page = urllib.request.urlopen(server.url + "chaos", timeout=10)
        html = page.read().decode()
        summary = get_json(server.url + "api/summary")[1]
    assert status == 200
    assert page.headers["Content-Type"].startswith("text/html") and 'src="static/plotly.min.js"' in html
    assert 'src="static/common.js"' in html
    assert summary["chaos_report"] is True  # the main page links the report
    assert report["start"] == T0 and report["live"] is False and report["refresh"] is False
    assert report["header"] == {"cluster": "hand", "seed": 7, "config": "cluster_configs/local-chaos.yaml",
                                "state": "finished", "started_at": T0 - 5, "ended_at": T0 + 7900,
                                "duration_s": 7905.0}
    assert report["path"] == str(hand_run.dir / "chaos.json")

    table = report["by_kind_phase"]
    assert table["phases"] == ["matchmaking", "all-reduce", "state download", "checkpoint write", "idle"]
    counts = {r["kind"]: dict(zip(table["phases"], r["counts"], strict=True)) for r in table["rows"]}
    assert list(counts) == ["worker_kill", "node_kill", "supervisor_kill", "worker_pause", "bandwidth_drop",
                            "disk_full", "clock_jump"]  # every kind, tried or not
    assert counts["worker_kill"] == {"matchmaking": 1, "all-reduce": 1, "state download": 0,
                                     "checkpoint write": 0, "idle": 0}
    assert counts["disk_full"]["checkpoint write"] == 1 and counts["node_kill"]["idle"] == 1
    assert sum(counts["supervisor_kill"].values()) == 0
    assert {r["kind"]: r["total"] for r in table["rows"]}["worker_kill"] == 2
    assert table["totals"] == [1, 2, 1, 1, 2] and table["total"] == 7

    assert [(f["kind"], f["t_s"]) for f in report["faults"]] == [(k, t) for t, k, *_ in FAULTS]
    assert report["faults"][1]["duration_s"] == 30.0 and report["faults"][5]["outcome"].startswith("skipped")
    assert report["violations"] == [{"time": T0 + 5000, "invariant": "equal_params",
                                     "detail": "peers disagree after epoch 17", "t_s": 5000}]
    rows = dict(report["summary_rows"])
    assert rows == {"faults": "6", "skipped": "1", "invariant violations": "1", "error tracebacks": "0",
                    "max stall": "12.3 s", "p99 stall": "10.1 s", "recovered after the last fault": "4.2 s",
                    "retained": "-"}
    assert report["summary"]["by_kind"] == {"worker_kill": 2} and report["summary"]["epochs"] == 20  # kept as is

    assert set(report["charts"]) == {"throughput", "loss"}
    for fig in report["charts"].values():
        data = [tr for tr in fig["data"] if tr.get("yaxis") != "y2"]
        assert len(data) == 1 and len(data[0]["x"]) > 1  # the run's own series, from its progress rows
        assert fault_lines(fig) == {"worker_kill": [20.0, 50.0], "worker_pause": [40.0], "bandwidth_drop": [60.0],
                                    "disk_full": [70.0], "node_kill (skipped)": [80.0], "clock_jump": [90.0]}
        labels = {tr["name"]: [t for t in tr["text"] if t] for tr in fig["data"] if tr.get("yaxis") == "y2"}
        assert labels["worker_kill"] == ["worker_kill", "worker_kill"]  # each line labelled by its kind
        bands = sorted((s["x0"], s["x1"]) for s in fig["layout"]["shapes"])
        assert bands == [(40.0, 40.5), (60.0, 62.0), (70.0, 71.0)]  # the faults that last, as long as they last
        assert fig["layout"]["xaxis"]["range"] == [0.0, pytest.approx(7900 / 60)]
        assert fig["layout"]["xaxis"]["title"]["text"] == "minutes since start"


def test_a_running_chaos_report_keeps_the_page_refreshing(hand_run):
    write_report(hand_run.dir, {**chaos_report(state="running"), "summary": {}})  # summed up at the end
    with DashboardServer(hand_run.dir) as server:
        status, report = get_json(server.url + "api/chaos")
    assert status == 200 and report["live"] is False and report["refresh"] is True
    rows = dict(report["summary_rows"])  # counted from the faults and violations meanwhile
    assert (rows["faults"], rows["skipped"], rows["invariant violations"], rows["max stall"]) == ("6", "1", "0", "-")


def test_a_run_without_a_chaos_report_answers_404(hand_run):
    with DashboardServer(hand_run.dir) as server:
        status, body = get_json(server.url + "api/chaos")
        summary = get_json(server.url + "api/summary")[1]
        page_status = urllib.request.urlopen(server.url + "chaos", timeout=10).status
    assert status == 404
    assert body == {"error": f"no chaos report (not a chaos run): {hand_run.dir / 'chaos.json'}", "live": False}
    assert summary["chaos_report"] is False  # no link on the main page
    assert page_status == 200  # the page itself loads and shows the error


@pytest.mark.parametrize(("content", "problem"), [
    ("{\"version\": 1, \"faults\": [", "not valid JSON"),
    ("[1, 2]", "a JSON list, not an object"),
    (json.dumps({**chaos_report(), "version": 2}), "version"),
    (json.dumps({**chaos_report(), "faults": [{"kind": "worker_kill"}]}), "faults.0.time"),
    (json.dumps(chaos_report()).replace("12.34", "NaN"), "NaN"),
    (b"\xff\xfe not text", "cannot be read"),
])
def test_a_malformed_chaos_report_is_an_error_naming_the_file(hand_run, content, problem):
    path = hand_run.dir / "chaos.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with DashboardServer(hand_run.dir) as server:
        status, body = get_json(server.url + "api/chaos")
        assert get_json(server.url + "api/summary")[0] == 200  # the rest of the dashboard is unaffected
        path.write_text(json.dumps(chaos_report()))  # fixed in place: the next request reads it
        assert get_json(server.url + "api/chaos")[0] == 200
    assert status == 500
    assert body["error"].startswith(f"{path}: ") and problem in body["error"], body
