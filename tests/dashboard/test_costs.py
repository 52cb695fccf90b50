"""The cost arithmetic: instance-seconds × price per zone and type, partial hours, the on-demand
counterfactual, and cost summed across a crash and a resume."""

from __future__ import annotations

import pytest

from orchestrator.cli.main import main
from orchestrator.runs import figures
from orchestrator.runs.store import InstanceRecord, RunStore

T0 = 1_000_000.0

pytestmark = pytest.mark.timeout(60)


def finished(run_dir):
    store = RunStore.open(run_dir)
    return store, figures.run_now(store, live=False)


def test_instance_seconds_times_price_per_zone_and_type(hand_run):
    store, now = finished(hand_run.dir)
    try:
        groups = {(g.node_type, g.zone, g.market): g for g in figures.cost_breakdown(store.instances(), now)}
    finally:
        store.close()
    assert set(groups) == {("big", "a", "on-demand"), ("big", "a", "spot"), ("small", "a", "spot"),
                           ("small", "b", "spot")}
    small_a = groups["small", "a", "spot"]  # i0 3600 s + i3 1700 s + i5 500 s, all at $0.30/h
    assert small_a.instances == 3
    assert small_a.instance_hours == pytest.approx(5800 / 3600)
    assert small_a.dollars == pytest.approx(5800 / 3600 * 0.3)
    assert small_a.on_demand_dollars == pytest.approx(5800 / 3600 * 1.0)
    small_b = groups["small", "b", "spot"]  # i1 5400 s + i6 900 s at $0.40/h
    assert small_b.dollars == pytest.approx(6300 / 3600 * 0.4)
    assert groups["big", "a", "spot"].dollars == pytest.approx(0.5 * 1.2)
    on_demand = groups["big", "a", "on-demand"]  # the on-demand fallback saves nothing
    assert on_demand.dollars == pytest.approx(3500 / 3600 * 4.0) == pytest.approx(on_demand.on_demand_dollars)
    assert sum(g.dollars for g in groups.values()) == pytest.approx(hand_run.dollars)


def test_partial_hours_are_billed_by_the_second():
    inst = InstanceRecord("x", "small", "a", "spot", 0.3, 1.0, launched_at=T0, ended_at=T0 + 5400)
    assert inst.cost(T0 + 99_999) == pytest.approx(0.45)  # 1.5 h, not 2 h
    assert figures.cost_until([inst], T0 + 1) == pytest.approx(0.3 / 3600)
    assert figures.cost_until([inst], T0 + 2700) == pytest.approx(0.225)  # halfway through its life
    assert figures.cost_until([inst], T0 - 10) == 0.0  # before its launch
    assert figures.cost_until([inst], T0 + 9000) == pytest.approx(0.45)  # after its end: no more
    running = InstanceRecord("y", "small", "b", "spot", 0.4, 1.0, launched_at=T0)
    assert figures.cost_until([running], T0 + 900) == pytest.approx(0.1)  # still up: billed until "now"
    assert figures.cost_until([inst, running], T0 + 900, on_demand=True) == pytest.approx(0.25 + 0.25)


def test_on_demand_counterfactual_and_savings(hand_run):
    store, now = finished(hand_run.dir)
    try:
        h = figures.headline(store, now, live=False)
    finally:
        store.close()
    assert h.on_demand_dollars == pytest.approx(hand_run.on_demand_dollars)
    assert h.savings_dollars == pytest.approx(hand_run.on_demand_dollars - hand_run.dollars)
    assert h.savings_percent == pytest.approx(100 * (1 - hand_run.dollars / hand_run.on_demand_dollars))
    assert h.dollars_per_million_samples == pytest.approx(hand_run.dollars / hand_run.samples * 1e6)
    assert (h.preemptions, h.replacements, h.instances, h.live_instances) == (1, 2, 7, 0)


def test_cost_is_summed_across_a_crash_and_a_resume(hand_run):
    store, now = finished(hand_run.dir)
    try:
        assert now == hand_run.t0 + 7900  # a finished run's "now" is its last record, whatever the wall clock says
        h = figures.headline(store, now, live=False)
        lost = {i.id: i for i in store.instances()}["i5"]
    finally:
        store.close()
    assert h.dollars == pytest.approx(hand_run.dollars)  # both generations of the fleet, each instance once
    # closed at the last thing heard before the crash
    assert (lost.end_reason, lost.ended_at) == ("lost", hand_run.t0 + 6000)


def test_a_crashed_run_that_was_not_resumed_stops_costing_at_its_last_record(hand_run):
    store = RunStore.open(hand_run.dir)
    try:
        store.db.execute("UPDATE instances SET ended_at = NULL, end_reason = NULL WHERE id = 'i6'")
        store.db.execute("DELETE FROM events WHERE time > ?", (hand_run.t0 + 7500,))
        store.db.commit()
        h = figures.headline(store, figures.run_now(store, live=False), live=False)
    finally:
        store.close()
    assert h.dollars == pytest.approx(hand_run.dollars - 400 / 3600 * 0.4)  # i6 counted up to 7500, not to today


def test_charts_end_at_the_headline_figures(hand_run):
    store, now = finished(hand_run.dir)
    try:
        charts = {c.id: c for c in figures.charts(store, now)}
        h = figures.headline(store, now, live=False)
    finally:
        store.close()
    assert all(c.points for c in charts.values())
    spot, on_demand = charts["dollars"].traces
    assert spot.y[-1] == pytest.approx(h.dollars) and on_demand.y[-1] == pytest.approx(h.on_demand_dollars)
    assert spot.y == sorted(spot.y)  # cumulative
    assert charts["savings"].traces[0].y[-1] == pytest.approx(h.savings_dollars)
    preemptions, replacements = charts["preemptions"].traces
    assert (preemptions.y[-1], replacements.y[-1]) == (1, 2)
    per_million = charts["dollars_per_million"].traces[0]
    assert per_million.t[-1] == 7500  # at the last progress row: what was spent by then over what was trained
    assert per_million.y[-1] == pytest.approx((hand_run.dollars - 400 / 3600 * 0.4) / hand_run.samples * 1e6)
    live = {tr.name: tr for tr in charts["instances"].traces}
    assert set(live) == {"big / a", "big / a (on-demand)", "small / a", "small / b"}
    assert max(live["small / b"].y) == 1 and all(tr.y[-1] == 0 for tr in live.values())


def test_status_prints_the_headline_table(hand_run, capsys):
    assert main(["status", str(hand_run.dir)]) == 0
    out = capsys.readouterr().out
    for label in ("dollars spent", "same hours on demand", "saved", "$ per million samples",
                  "preemptions / replacements"):
        assert label in out
    assert f"${hand_run.dollars:.4f}" in out and "1 / 2" in out and "stopped" in out


def test_the_cost_curve_sweep_agrees_with_the_definition(hand_run):
    store = RunStore.open(hand_run.dir)
    try:
        instances = store.instances()
    finally:
        store.close()
    moments = [hand_run.t0 + s for s in range(-100, 8100, 50)]
    for on_demand in (False, True):
        expected = [figures.cost_until(instances, m, on_demand) for m in moments]
        assert figures.cost_curve(instances, moments, on_demand) == pytest.approx(expected, abs=1e-12)


def test_a_long_runs_charts_are_thinned_evenly_in_time_and_its_headline_reads_the_newest_row(tmp_path):
    """A run of weeks has a million progress rows: a chart gets ``CHART_POINTS`` of them, about
    evenly spaced in time, the first and the last among them; the headline's figures are the
    newest row's, as with every row loaded."""
    from orchestrator.config.schema import ClusterConfig

    config = ClusterConfig.model_validate({"cluster_name": "long", "runs_dir": str(tmp_path),
                                           "available_node_types": {"small": {"max_workers": 1}}})
    store = RunStore.create(config)
    rows = 3 * figures.CHART_POINTS + 7
    try:
        store.launched(InstanceRecord("i0", "small", "a", "spot", 0.3, 1.0, T0))
        with store.db:
            store.db.executemany("INSERT INTO progress VALUES (?, ?, ?, ?, ?, ?)",
                                 [(T0 + s, s, 1.0 / (1 + s), float(s), 1, 64 * s) for s in range(rows)])
        now = T0 + rows
        charts = {c.id: c for c in figures.charts(store, now)}
        h = figures.headline(store, now, live=True)
        assert store.progress_rows(points=rows) == store.progress_rows()  # short enough: every row
    finally:
        store.close()
    (throughput,) = charts["throughput"].traces
    assert figures.CHART_POINTS <= len(throughput.t) <= figures.CHART_POINTS + 1
    assert throughput.t[0] == 0 and throughput.t[-1] == rows - 1 and throughput.t == sorted(throughput.t)
    gaps = [b - a for a, b in zip(throughput.t, throughput.t[1:], strict=False)]
    assert max(gaps) <= 2 * min(gaps) + 1  # evenly spaced: no stretch left out
    assert throughput.y == throughput.t  # each point is a row as written (samples/s = its second here)
    assert (h.epoch, h.samples_per_second, h.samples) == (rows - 1, float(rows - 1), 64 * (rows - 1))
    assert h.loss == pytest.approx(1.0 / rows)


def test_an_instances_region_is_recorded_and_a_run_from_before_regions_reads_as_it_was(tmp_path):
    """The region has a table of its own: a run directory whose store has none (from before regions)
    opens with its instances as they were, region unknown; the instance table shows a region beside a
    zone whose name does not say it."""
    import sqlite3

    from orchestrator.config.schema import ClusterConfig

    config = ClusterConfig.model_validate({"cluster_name": "old", "runs_dir": str(tmp_path),
                                           "available_node_types": {"small": {"max_workers": 1}}})
    RunStore.create(config).close()
    db = sqlite3.connect(config.run_dir() / "run.sqlite")
    with db:  # the store as a run from before regions left it: its row inserted by position
        db.execute("DROP TABLE instance_regions")
        db.execute("INSERT INTO instances VALUES ('i0', 'small', 'a', 'spot', 0.3, 1.0, ?, NULL, NULL, NULL, NULL)",
                   (T0,))
    db.close()
    store = RunStore.open(config.run_dir())
    try:
        assert [(r.id, r.zone, r.region) for r in store.instances()] == [("i0", "a", None)]
        store.launched(InstanceRecord("i1", "small", "w-1", "spot", 0.3, 1.0, T0 + 1, region="west"))
        store.launched(InstanceRecord("i2", "small", "us-east-1a", "spot", 0.3, 1.0, T0 + 2, region="us-east-1"))
        rows = figures.instance_rows(store, T0 + 10)
    finally:
        store.close()
    assert [(r.id, r.region, r.place) for r in rows] == [("i0", None, "a"), ("i1", "west", "w-1 (west)"),
                                                         ("i2", "us-east-1", "us-east-1a")]
