"""The per-round time split from a trainer's status answer to the run store (no Ray): the worker
control keeps every round the answers of one tick carried, the supervisor stores each round once,
and the store gives per epoch the mean over the trainers that reported it."""

from __future__ import annotations

import json
import logging
import sqlite3
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest

from orchestrator.config.schema import ClusterConfig
from orchestrator.fleet.supervisor import SupervisorCore, parse_rounds
from orchestrator.fleet.workers import RayWorkers
from orchestrator.runs import figures
from orchestrator.runs.store import RoundMean, RoundRecord, RunStore

pytestmark = pytest.mark.timeout(60)


def new_store(tmp_path: Path) -> RunStore:
    config = ClusterConfig.model_validate({"cluster_name": "rounds", "runs_dir": str(tmp_path / "runs"),
                                           "available_node_types": {"a": {"max_workers": 2}}})
    store = RunStore.create(config)
    store.clock = lambda: 500.0
    return store


def costs(rounds: list[tuple[int, float, float]], busy_s: float = 10.0) -> dict:
    """A trainer's ``costs`` in its status answer, with its newest rounds."""
    return {"samples_total": 640, "bytes_sent": 64_000, "comm_s": 1.0, "busy_s": busy_s,
            "rounds": [{"epoch": e, "time": 1.0e9 + e, "compute_s": c, "comm_s": m} for e, c, m in rounds]}


def test_rounds_read_back_as_the_mean_per_epoch_over_the_trainers_that_reported_it(tmp_path):
    store = new_store(tmp_path)
    try:
        store.rounds("i0", [RoundRecord(1, 2.0, 0.5), RoundRecord(2, 3.0, 1.0), RoundRecord(3, 1.5, 0.5)])
        store.clock = lambda: 600.0
        store.rounds("i1", [RoundRecord(2, 5.0, 3.0), RoundRecord(3, 2.5, 1.5)])
        store.rounds("i0", [RoundRecord(3, 99.0, 99.0)])  # the same round again: the first report stands
        assert store.round_means(2) == [RoundMean(3, 2, 2.0, 1.0, 500.0), RoundMean(2, 2, 4.0, 2.0, 500.0)]
        assert store.round_means(10)[-1] == RoundMean(1, 1, 2.0, 0.5, 500.0)
        totals = store.round_totals()
        assert (totals.rounds, totals.compute_s, totals.comm_s, totals.wall_s) == (3, 8.0, 3.5, 11.5)
        rows = figures.round_rows(store, recent=3)
        assert [(r.epoch, r.peers, r.wall_s, r.compute_s, r.comm_s) for r in rows] == \
            [(3, 2, 3.0, 2.0, 1.0), (2, 2, 6.0, 4.0, 2.0), (1, 1, 2.5, 2.0, 0.5)]
        assert [r.comm_percent for r in rows] == pytest.approx([100 / 3, 100 / 3, 20.0])
    finally:
        store.close()


def test_an_epoch_of_no_length_has_no_percentage_and_an_empty_table_no_totals(tmp_path):
    store = new_store(tmp_path)
    try:
        assert store.round_means(5) == [] and store.round_totals().rounds == 0
        assert figures.round_totals(store).comm_percent is None
        store.rounds("i0", [RoundRecord(7, 0.0, 0.0)])
        (row,) = figures.round_rows(store)
        assert (row.epoch, row.wall_s, row.comm_percent) == (7, 0.0, None)
    finally:
        store.close()


def test_a_run_directory_from_before_the_rounds_table_opens_and_gains_it(tmp_path):
    store = new_store(tmp_path)
    run_dir = store.dir
    store.close()
    db = sqlite3.connect(run_dir / "run.sqlite")
    db.execute("DROP TABLE rounds")  # as a run store written before the table existed
    db.commit()
    db.close()
    store = RunStore.open(run_dir)
    store.clock = lambda: 500.0
    try:
        assert store.round_means(5) == [] and figures.round_rows(store) == []
        store.rounds("i0", [RoundRecord(1, 1.0, 1.0)])
        assert store.round_means(5) == [RoundMean(1, 1, 1.0, 1.0, 500.0)]
    finally:
        store.close()


def test_the_worker_control_keeps_every_round_the_answers_of_one_tick_carried():
    workers = RayWorkers()
    assert workers._rounds_cursor("i0") == -1  # the first call asks for every round the trainer kept
    workers._note_costs("i0", {"costs": costs([(1, 2.0, 1.0), (2, 2.0, 1.0)], busy_s=6.0)})
    assert workers._rounds_cursor("i0") == 2  # the next asks for those after the newest it heard of
    workers._note_costs("i0", {"costs": costs([(2, 2.0, 1.0), (3, 4.0, 0.0)], busy_s=10.0)})  # two calls in flight
    workers._note_costs("i1", {"left": False})  # an expert server or a spare: no costs
    taken = workers.take_costs()
    assert list(taken) == ["i0"] and taken["i0"]["busy_s"] == 10.0  # the newest totals
    assert [r["epoch"] for r in taken["i0"]["rounds"]] == [1, 2, 3]  # each round once
    assert workers.take_costs() == {} and workers._rounds_cursor("i0") == 3


def supervisor_over(store: RunStore, answers: list[dict[str, dict]]) -> SimpleNamespace:
    """``SupervisorCore``'s recording of costs over ``store``, fed by a worker control whose every
    ``take_costs`` hands out the next of ``answers`` (the rest of a supervisor is not needed)."""
    queue = list(answers)
    live = {"i2": SimpleNamespace(id="i2", tags={"peer_id": "swrogue"})}
    core = SimpleNamespace(store=store, _rounds_stored={}, _bans_stored=set(),
                           policy=SimpleNamespace(workers=SimpleNamespace(take_costs=lambda: queue.pop(0)), live=live))
    core._record_rounds = partial(SupervisorCore._record_rounds, core)
    core._record_bans = partial(SupervisorCore._record_bans, core)
    core.record_costs = partial(SupervisorCore._record_costs, core)
    return core


def test_the_supervisor_stores_each_reported_round_once_beside_the_totals(tmp_path, caplog):
    store = new_store(tmp_path)
    writes: list[str] = []
    store.db.set_trace_callback(lambda sql: writes.append(sql) if "INTO rounds" in sql else None)
    try:
        core = supervisor_over(store, [
            {"i0": costs([(1, 2.0, 1.0), (2, 3.0, 1.0)]), "i1": costs([(2, 1.0, 3.0)])},
            {"i0": costs([(1, 2.0, 1.0), (2, 3.0, 1.0), (3, 4.0, 2.0)])},  # repeats its two newest
            {"i1": costs([(3, "x", 1.0), (4, 2.0, float("nan")), (5, 6.0, 2.0)])},  # two that do not parse
        ])
        with caplog.at_level(logging.WARNING, logger="orchestrator.fleet.supervisor"):
            for _ in range(3):
                core.record_costs()
        assert len(writes) == 5  # rounds 1, 2 (i0), 2 (i1), 3 (i0), 5 (i1): a repeat is never written again
        assert store.round_means(10) == [RoundMean(5, 1, 6.0, 2.0, 500.0), RoundMean(3, 1, 4.0, 2.0, 500.0),
                                         RoundMean(2, 2, 2.0, 2.0, 500.0), RoundMean(1, 1, 2.0, 1.0, 500.0)]
        assert sorted(store.peer_cost_rows()) == ["i0", "i1"]  # the totals went in as before
        assert sum("round that does not parse" in r.getMessage() for r in caplog.records) == 2
    finally:
        store.close()


def test_parse_rounds_orders_them_and_skips_what_is_not_a_round():
    assert parse_rounds("i0", None) == [] and parse_rounds("i0", {"epoch": 1}) == []
    assert parse_rounds("i0", [{"epoch": 3, "compute_s": 1, "comm_s": 0.5}, "junk",
                               {"epoch": "2", "compute_s": "0.25", "comm_s": 0}]) == \
        [RoundRecord(2, 0.25, 0.0), RoundRecord(3, 1.0, 0.5)]


def test_each_ban_a_trainer_reports_is_one_member_banned_event_naming_the_rogues_instance(tmp_path):
    store = new_store(tmp_path)
    ban = {"peer": "swrogue", "evidence": "part 3, chunk 0: the average it served is 1e+30 (L2) away", "at": 1.0,
           "group": "ab"}
    try:
        core = supervisor_over(store, [
            {"i0": {**costs([(1, 2.0, 1.0)]), "bans": [ban]}, "i1": {**costs([(1, 2.0, 1.0)]), "bans": [ban]}},
            {"i0": {**costs([(2, 2.0, 1.0)]), "bans": [ban, "junk", {"peer": 5}]}},  # the same ban again
        ])
        core.record_costs()
        core.record_costs()
        events = store.events("member_banned")
        assert len(events) == 2  # one per reporter, never repeated
        assert {e[2] for e in events} == {"i2"}  # the instance whose peer was banned
        details = [json.loads(e[3]) for e in events]
        assert {d["by"] for d in details} == {"i0", "i1"} and all("1e+30" in d["evidence"] for d in details)
    finally:
        store.close()
