"""The dashboard's HTTP side on loopback: the JSON API, ``/metrics`` parsed with
prometheus-client's own parser, and a clean start and stop."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.runs import figures
from orchestrator.runs.store import RunStore
from orchestrator.ui.dashboard import DashboardServer

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent.parent


def get(url: str) -> tuple[str, bytes]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.headers["Content-Type"], response.read()


def samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def test_metrics_carry_the_dashboard_figures(hand_run):
    with DashboardServer(hand_run.dir) as server:
        content_type, body = get(server.url + "metrics")
        summary = json.loads(get(server.url + "api/summary")[1])
    assert content_type.startswith("text/plain")
    m = samples(body.decode())

    def value(name: str) -> float:
        (s,) = m[name]
        assert s.labels["run"] == "hand"
        return s.value

    assert value("spotswarm_run_live") == 0
    assert value("spotswarm_epoch") == 20
    assert value("spotswarm_loss") == pytest.approx(0.85)
    assert value("spotswarm_samples_per_second") == pytest.approx(45.0)
    assert value("spotswarm_samples_total") == hand_run.samples
    assert value("spotswarm_preemptions_total") == 1
    assert value("spotswarm_replacements_total") == 2
    assert value("spotswarm_instances_launched_total") == 7
    assert value("spotswarm_savings_dollars") == pytest.approx(hand_run.on_demand_dollars - hand_run.dollars)
    assert value("spotswarm_dollars_per_million_samples") == pytest.approx(hand_run.dollars / hand_run.samples * 1e6)
    cost = {(s.labels["node_type"], s.labels["zone"], s.labels["market"]): s.value
            for s in m["spotswarm_cost_dollars_total"]}
    assert cost[("small", "a", "spot")] == pytest.approx(5800 / 3600 * 0.3)
    assert sum(cost.values()) == pytest.approx(hand_run.dollars)
    assert sum(s.value for s in m["spotswarm_on_demand_cost_dollars_total"]) == pytest.approx(
        hand_run.on_demand_dollars)
    assert sum(s.value for s in m["spotswarm_instance_seconds_total"]) == pytest.approx(5800 + 6300 + 1800 + 3500)
    assert all(s.value == 0 for s in m["spotswarm_live_instances"])  # finished: nothing is up
    epoch, _, _, compute, comm, _ = hand_run.round_means[0]  # the last round, over the trainers that reported it
    assert value("spotswarm_round_epoch") == epoch
    assert value("spotswarm_round_compute_seconds") == pytest.approx(compute)
    assert value("spotswarm_round_comm_seconds") == pytest.approx(comm)
    # the page's numbers are the same numbers
    assert summary["dollars"] == pytest.approx(hand_run.dollars)
    assert summary["preemptions"] == 1 and summary["replacements"] == 2 and summary["live"] is False


def test_json_api_page_and_offline_plotly(hand_run):
    with DashboardServer(hand_run.dir) as server:
        instances = json.loads(get(server.url + "api/instances")[1])
        series = json.loads(get(server.url + "api/series")[1])
        charts = json.loads(get(server.url + "api/charts")[1])
        costs = json.loads(get(server.url + "api/costs")[1])
        page_type, page = get(server.url)
        js_type, js = get(server.url + "static/plotly.min.js")
        common_type, common = get(server.url + "static/common.js")
        css_type, css = get(server.url + "static/common.css")
        with pytest.raises(urllib.error.HTTPError, match="404"):
            get(server.url + "static/dashboard.html")  # only the assets are served from static/
    assert [i["id"] for i in instances] == ["i0", "i1", "i2", "i4", "i3", "i5", "i6"]  # by launch time
    assert {i["id"]: i["ended"] for i in instances}["i0"] == "preempted"
    assert {i["id"]: i["lifetime_s"] for i in instances}["i3"] == pytest.approx(1700)
    costs_of = {i["id"]: (i["bytes_per_sample"], i["comm_fraction"]) for i in instances}
    assert costs_of["i1"] == (100.0, 0.25) and costs_of["i0"] == (None, None)  # only trainers that reported
    ids = [c["id"] for c in series["charts"]]
    assert ids == ["throughput", "loss", "instances", "preemptions", "dollars", "dollars_per_million", "savings"]
    assert set(charts) == set(ids) and all(fig["data"] for fig in charts.values())
    assert all(any(tr["x"] for tr in fig["data"]) for fig in charts.values())
    assert sum(c["dollars"] for c in costs) == pytest.approx(hand_run.dollars)
    assert page_type.startswith("text/html") and b'src="static/plotly.min.js"' in page
    assert js_type.startswith("application/javascript") and len(js) > 1_000_000  # shipped inside plotly
    assert b'src="static/common.js"' in page  # the script the dashboard and the chaos page share
    assert common_type.startswith("application/javascript") and b"function renderCharts(" in common
    assert b'href="static/common.css"' in page and css_type.startswith("text/css") and b".card" in css


def test_rounds_api_lists_each_epochs_mean_over_the_trainers_newest_first(hand_run):
    with DashboardServer(hand_run.dir) as server:
        rounds = json.loads(get(server.url + "api/rounds")[1])
        newest = json.loads(get(server.url + "api/rounds?recent=1")[1])
        with pytest.raises(urllib.error.HTTPError, match="400"):
            get(server.url + "api/rounds?recent=0")
        with pytest.raises(urllib.error.HTTPError, match="400"):
            get(server.url + "api/rounds?recent=many")
    assert [(r["epoch"], r["peers"], r["wall_s"], r["compute_s"], r["comm_s"]) for r in rounds] == \
        [m[:5] for m in hand_run.round_means]
    assert [r["comm_percent"] for r in rounds] == pytest.approx([m[5] for m in hand_run.round_means])
    assert newest == rounds[:1]


def test_metrics_leave_the_round_gauges_out_before_any_round(tmp_path):
    from orchestrator.config.schema import ClusterConfig

    config = ClusterConfig.model_validate({"cluster_name": "norounds", "runs_dir": str(tmp_path / "runs"),
                                           "available_node_types": {"a": {"max_workers": 1}}})
    RunStore.create(config).close()
    with DashboardServer(config.run_dir()) as server:
        m = samples(get(server.url + "metrics")[1].decode())
        rounds = json.loads(get(server.url + "api/rounds")[1])
    assert rounds == [] and not any(name.startswith("spotswarm_round_") for name in m)


def test_a_live_run_reads_the_clock_it_is_given(hand_run):
    store = RunStore.open(hand_run.dir)
    try:
        store.db.execute("UPDATE instances SET ended_at = NULL, end_reason = NULL WHERE id = 'i6'")
        store.db.commit()
    finally:
        store.close()
    now = hand_run.t0 + 7000 + 3600  # i6 has been up an hour
    with DashboardServer(hand_run.dir, clock=lambda: now, live=True) as server:
        m = samples(get(server.url + "metrics")[1].decode())
        summary = json.loads(get(server.url + "api/summary")[1])
    assert m["spotswarm_run_live"][0].value == 1
    live = {(s.labels["node_type"], s.labels["zone"]): s.value for s in m["spotswarm_live_instances"]}
    assert live[("small", "b")] == 1 and sum(live.values()) == 1
    assert summary["live"] is True and summary["dollars_per_hour"] == pytest.approx(0.4)
    assert summary["dollars"] == pytest.approx(hand_run.dollars - 0.1 + 0.4)


def test_start_and_stop_are_clean(hand_run):
    threads = set(threading.enumerate())
    server = DashboardServer(hand_run.dir)
    url = server.start()
    get(url + "api/summary")
    with pytest.raises(OSError):  # the port is taken: a second server says so instead of hiding it
        DashboardServer(hand_run.dir, port=server.port).start()
    server.stop()
    server.stop()  # idempotent
    with pytest.raises(urllib.error.URLError):
        get(url + "api/summary")
    with socket.socket() as s:  # the port is free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", server.port))
    assert set(threading.enumerate()) <= threads  # no thread left behind


def test_a_directory_that_is_not_a_run_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError):
        DashboardServer(tmp_path).start()
    assert figures.is_live(tmp_path) is False


def test_dashboard_command_serves_until_interrupted_and_exits_cleanly(hand_run):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "orchestrator.cli.main", "dashboard", str(hand_run.dir), "--port", "0"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()  # blocks until the server is up and has printed its address
        url = re.search(r"http://\S+/", line).group(0)
        assert json.loads(get(url + "api/summary")[1])["cluster"] == "hand"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert "Traceback" not in err and "Error" not in err, err


def test_a_stopped_runs_throughput_is_its_last_minute_labelled_so(tmp_path, capsys):
    """A stopped run shows no live figure: samples/s is the mean over the last minute of the run's clock
    before the stop, labelled so, alike in `status`, the page's API and the report."""
    from orchestrator.cli.main import main
    from orchestrator.config.schema import ClusterConfig
    from orchestrator.ui.report import write_report

    config = ClusterConfig.model_validate({"cluster_name": "last", "runs_dir": str(tmp_path / "runs"),
                                           "available_node_types": {"a": {"max_workers": 1}}})
    store = RunStore.create(config)
    try:
        for t, epoch, sps in [(0.0, 1, 900.0), (100.0, 2, 10.0), (130.0, 3, 20.0), (150.0, 4, 30.0)]:
            store.clock = lambda t=t: 1000.0 + t
            store.progress(epoch, 1.0, sps, 1, epoch * 64)
        store.event("supervisor_stop", at=1160.0)
        live = dict(figures.headline_rows(figures.headline(store, 1150.0, live=True)))
    finally:
        store.close()
    label = "samples/s (last minute before the stop)"
    assert live["samples/s"] == "30"  # a live run: its newest figure
    assert main(["status", str(config.run_dir())]) == 0
    assert any(line.split("│")[1:3] and label in line and line.split("│")[2].strip() == "20"
               for line in capsys.readouterr().out.splitlines())  # (10 + 20 + 30) / 3
    with DashboardServer(config.run_dir()) as server:
        summary = json.loads(get(server.url + "api/summary")[1])
    assert [label, "20"] in summary["rows"] and summary["samples_per_second"] == pytest.approx(20.0)
    assert summary["samples_per_second_over"] == "last minute before the stop"
    assert f"<td>{label}</td><td>20</td>" in write_report(config.run_dir(), tmp_path / "report").index.read_text()
