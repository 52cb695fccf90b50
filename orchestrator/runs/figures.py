"""The figures of a run, computed from its store alone: headline numbers, time series, the
instance table, the per-round table and the cost breakdown.  The dashboard, its JSON API,
``/metrics``, the static report, ``spotswarm status`` and the live table of ``spotswarm up`` all
read them from here, so they always agree.

Times are the run's own clock (simulated seconds with the local provider); series are in seconds
since the run's first record.  Cost is per-second billing: instance-seconds × the instance's
price, summed over every instance the run ever had, across every recovery.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from orchestrator.runs import pid as run_pid
from orchestrator.runs.store import InstanceRecord, RunStore, summarize_costs

LOSSES = ("preempted", "died")  # ends that the supervisor replaces


def is_live(run_dir: Path) -> bool:
    """Whether a ``spotswarm up``/``resume`` process is driving this run right now."""
    return run_pid.driver(run_dir) is not None


def store_clock(store: RunStore) -> Callable[[], float] | None:
    """The live run's clock, rebuilt from what its supervisor recorded when it started (the local
    simulator's clock runs faster than the wall clock, so ``time.time()`` would be wrong)."""
    row = store.db.execute(
        "SELECT detail FROM events WHERE kind = 'supervisor_start' ORDER BY time DESC LIMIT 1").fetchone()
    try:
        clock = json.loads(row[0])["clock"]
        scale, wall0, origin = float(clock["scale"]), float(clock["wall0"]), float(clock["origin"])
    except (TypeError, KeyError, ValueError):
        return None
    return lambda: origin + (time.time() - wall0) * scale


def run_now(store: RunStore, live: bool) -> float:
    """"Now" on the run's clock: the live clock while the run is up, else the last thing recorded
    (a stopped run's figures do not move)."""
    last = store.last_time() or time.time()
    clock = store_clock(store) if live else None
    return max(clock(), last) if clock is not None else last


def run_start(store: RunStore) -> float:
    """The run's first record: its first event or its first launch, whichever came first."""
    row = store.db.execute("SELECT (SELECT MIN(time) FROM events), (SELECT MIN(launched_at) FROM instances)").fetchone()
    first = [t for t in row if t is not None]
    return min(first) if first else 0.0


# ---- cost arithmetic ---------------------------------------------------------------------------
def cost_until(instances: list[InstanceRecord], t: float, on_demand: bool = False) -> float:
    """Dollars spent by time ``t``: each instance's seconds up to ``t`` × its hourly price / 3600."""
    return sum(i.on_demand_cost(t) if on_demand else i.cost(t) for i in instances)


def cost_curve(instances: list[InstanceRecord], moments: list[float], on_demand: bool = False) -> list[float]:
    """``cost_until`` at each of the sorted ``moments`` in one sweep (a long run has thousands of
    instances and moments): cost grows at the summed hourly price of the instances up."""
    changes = sorted([(i.launched_at, p) for i, p in _prices(instances, on_demand)]
                     + [(i.ended_at, -p) for i, p in _prices(instances, on_demand) if i.ended_at is not None])
    out: list[float] = []
    total, rate, last, k = 0.0, 0.0, None, 0
    for m in moments:
        while k < len(changes) and changes[k][0] <= m:
            t, delta = changes[k]
            total += rate * (t - last) / 3600 if last is not None else 0.0
            last, rate, k = t, rate + delta, k + 1
        out.append(total + (rate * (m - last) / 3600 if last is not None else 0.0))
    return out


def _prices(instances: list[InstanceRecord], on_demand: bool) -> list[tuple[InstanceRecord, float]]:
    return [(i, i.on_demand_price_per_hour if on_demand else i.price_per_hour) for i in instances]


@dataclass
class CostGroup:
    node_type: str
    zone: str
    market: str
    instances: int
    instance_hours: float
    dollars: float
    on_demand_dollars: float


def cost_breakdown(instances: list[InstanceRecord], now: float) -> list[CostGroup]:
    """Cost per node type, zone and market: instance-seconds × price, partial hours prorated."""
    groups: dict[tuple[str, str, str], CostGroup] = {}
    for i in instances:
        key = (i.node_type, i.zone, i.market)
        g = groups.setdefault(key, CostGroup(*key, 0, 0.0, 0.0, 0.0))
        g.instances += 1
        g.instance_hours += i.seconds(now) / 3600
        g.dollars += i.cost(now)
        g.on_demand_dollars += i.on_demand_cost(now)
    return [groups[k] for k in sorted(groups)]


def _lost_at(i: InstanceRecord) -> float | None:
    """When the supervisor learnt it had to replace ``i``: at its notice (it replaces the instance
    while it is leaving) or, without one, when it died."""
    if i.notice_at is not None:
        return i.notice_at
    return i.ended_at if i.end_reason in LOSSES else None


def replacements(instances: list[InstanceRecord]) -> list[InstanceRecord]:
    """Launches that replaced a preempted or dead instance: each loss is matched with the next
    launch after it (a resumed run's fresh fleet after a clean stop is not a replacement)."""
    losses = [(t, 0, i) for i in instances if (t := _lost_at(i)) is not None]
    timeline = sorted(losses + [(i.launched_at, 1, i) for i in instances], key=lambda e: (e[0], e[1]))
    unreplaced, out = 0, []
    for _, kind, inst in timeline:
        if kind == 0:
            unreplaced += 1
        elif unreplaced:
            unreplaced -= 1
            out.append(inst)
    return out


# ---- headline ----------------------------------------------------------------------------------
@dataclass
class Headline:
    cluster: str
    live: bool
    now: float
    elapsed_s: float
    epoch: int
    loss: float | None
    samples_per_second: float | None
    samples: int
    live_instances: int
    instances: int
    preemptions: int
    replacements: int
    instance_hours: float
    dollars: float
    on_demand_dollars: float
    savings_dollars: float
    savings_percent: float | None
    dollars_per_million_samples: float | None
    dollars_per_hour: float  # what the instances alive now cost per hour
    # mixture-of-experts runs only (None otherwise): the newest sample of the experts
    experts_live: int | None = None
    experts_grid: int | None = None
    experts_min_replicas: int | None = None
    kmin_fraction: float | None = None  # of the trainers' forward passes, since the run (or resume) began
    # what samples_per_second is: the newest figure of a live run, or the mean over the last minute
    # (of the run's clock) before a stopped run's stop
    samples_per_second_over: str = "now"
    checkpoint_epoch: int | None = None  # the newest checkpoint's
    # a stopped run whose final checkpoint was missed: how many epochs older the last checkpoint is
    checkpoint_epochs_behind: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


STOPPED_WINDOW_S = 60.0  # a stopped run's samples/s: the mean over this much of its clock before the stop


def samples_per_second_before_stop(rows: list[tuple], window_s: float = STOPPED_WINDOW_S) -> float | None:
    """The mean of the samples/s figures recorded in the last ``window_s`` before the last progress
    row (at least that row): what the fleet did at the end, not one figure taken at random."""
    if not rows:
        return None
    end = rows[-1][0]
    recent = [r[3] for r in rows if r[0] >= end - window_s and r[3] is not None]
    return sum(recent) / len(recent) if recent else None


def checkpoint_state(store: RunStore) -> tuple[int | None, int | None]:
    """The newest checkpoint's epoch, and, when the last stop's final checkpoint was missed (no
    checkpoint came after it), how many epochs older than the stop that checkpoint is."""
    row = store.db.execute("SELECT epoch, time FROM checkpoints ORDER BY epoch DESC, time DESC LIMIT 1").fetchone()
    epoch, at = (int(row[0]), float(row[1])) if row else (None, float("-inf"))
    missed = store.events("final_checkpoint_missed")
    if not missed or missed[-1][0] < at:
        return epoch, None
    try:
        behind = int(json.loads(missed[-1][3])["epochs_behind"])
    except (TypeError, KeyError, ValueError):
        return epoch, None
    return epoch, behind


def headline(store: RunStore, now: float, live: bool) -> Headline:
    instances = store.instances()
    costs = summarize_costs(store, now, instances)
    last = store.last_row("progress")  # the newest row, and for a stopped run the minute before it: never all
    tail = store.progress_rows(since=last[0] - STOPPED_WINDOW_S) if last is not None and not live else []
    alive = [i for i in instances if i.ended_at is None] if live else []  # a stopped run has none up
    checkpoint_epoch, behind = checkpoint_state(store)
    return Headline(
        cluster=store.config().cluster_name, live=live, now=now, elapsed_s=now - run_start(store),
        epoch=store.latest_epoch(), loss=last[2] if last else None,
        samples_per_second=(last[3] if last else None) if live else samples_per_second_before_stop(tail),
        samples_per_second_over="now" if live else "last minute before the stop",
        checkpoint_epoch=checkpoint_epoch, checkpoint_epochs_behind=None if live else behind,
        samples=costs.samples,
        live_instances=len(alive), instances=len(instances), preemptions=costs.preemptions,
        replacements=len(replacements(instances)), instance_hours=costs.instance_hours, dollars=costs.dollars,
        on_demand_dollars=costs.on_demand_dollars, savings_dollars=costs.savings,
        savings_percent=100 * costs.savings / costs.on_demand_dollars if costs.on_demand_dollars else None,
        dollars_per_million_samples=costs.dollars_per_million_samples,
        dollars_per_hour=sum(i.price_per_hour for i in alive),
        **_experts_headline(store),
    )


def _experts_headline(store: RunStore) -> dict:
    last = store.last_row("experts")
    if last is None:
        return {}
    _, live, grid, min_replicas, _, _, _, _, kmin = last
    return {"experts_live": live, "experts_grid": grid, "experts_min_replicas": min_replicas, "kmin_fraction": kmin}


def _samples_per_second_label(h: Headline) -> str:
    return "samples/s" if h.samples_per_second_over == "now" else f"samples/s ({h.samples_per_second_over})"


def _checkpoint_text(h: Headline) -> str:
    if h.checkpoint_epoch is None:
        return "none" if not h.checkpoint_epochs_behind else f"none ({h.checkpoint_epochs_behind} epochs lost " \
                                                                "at the stop: final checkpoint missed)"
    if h.checkpoint_epochs_behind:
        return (f"epoch {h.checkpoint_epoch} ({h.checkpoint_epochs_behind} epochs older than the stop: "
                "final checkpoint missed)")
    return f"epoch {h.checkpoint_epoch}"


HEADLINE_ROWS: list[tuple[str | Callable[[Headline], str], Callable[[Headline], str | None]]] = [
    ("state", lambda h: "running" if h.live else "stopped"),
    ("run time (s)", lambda h: f"{h.elapsed_s:,.0f}"),
    ("global epoch", lambda h: str(h.epoch)),
    ("last checkpoint", _checkpoint_text),
    ("loss", lambda h: f"{h.loss:.4f}" if h.loss is not None else "-"),
    (_samples_per_second_label, lambda h: f"{h.samples_per_second:,.0f}" if h.samples_per_second else "-"),
    ("samples trained", lambda h: f"{h.samples:,}"),
    ("instances live / used", lambda h: f"{h.live_instances} / {h.instances}"),
    ("preemptions / replacements", lambda h: f"{h.preemptions} / {h.replacements}"),
    ("instance-hours", lambda h: f"{h.instance_hours:.3f}"),
    ("dollars spent", lambda h: f"${h.dollars:.4f}"),
    ("same hours on demand", lambda h: f"${h.on_demand_dollars:.4f}"),
    ("saved", lambda h: f"${h.savings_dollars:.4f}"
     + (f" ({h.savings_percent:.0f}%)" if h.savings_percent is not None else "")),
    ("$ per million samples", lambda h: f"${h.dollars_per_million_samples:.4f}"
     if h.dollars_per_million_samples is not None else "-"),
    ("burn rate ($/h)", lambda h: f"${h.dollars_per_hour:.3f}"),
    ("experts live / grid", lambda h: f"{h.experts_live} / {h.experts_grid} (each on >= {h.experts_min_replicas} "
     "servers)" if h.experts_grid is not None else None),
    ("forward passes meeting k_min", lambda h: f"{100 * h.kmin_fraction:.2f}%"
     if h.kmin_fraction is not None else None),
]
"""The headline as (label, formatted value) rows: one wording for the terminal, the page and the report
(a row whose value is None does not apply to this run)."""


def headline_rows(h: Headline) -> list[tuple[str, str]]:
    return [(label if isinstance(label, str) else label(h), value) for label, fmt in HEADLINE_ROWS
            if (value := fmt(h)) is not None]


# ---- instance table ----------------------------------------------------------------------------
@dataclass
class InstanceRow:
    id: str
    node_type: str
    zone: str
    market: str
    price_per_hour: float
    launched_s: float  # seconds since the run's start
    lifetime_s: float
    dollars: float
    ended: str  # preempted, died, released, budget, lost, or running
    noticed: bool
    bytes_per_sample: float | None = None  # a trainer's: every byte it sent over the samples it trained
    comm_fraction: float | None = None  # of its training time, the part spent averaging or loading state
    region: str | None = None  # None: not recorded (a run from before regions)

    @property
    def place(self) -> str:
        """The zone as a person reads it: with its region where the zone's name does not say it (the
        local simulator's labels), as a cloud's zone names do (us-east-1a, us-central1-b)."""
        return self.zone if not self.region or self.zone.startswith(self.region) else f"{self.zone} ({self.region})"


def instance_rows(store: RunStore, now: float) -> list[InstanceRow]:
    start = run_start(store)
    costs = store.peer_cost_rows()
    rows = []
    for i in store.instances():
        samples, sent, comm, busy = costs.get(i.id, (0, 0, 0.0, 0.0))
        rows.append(InstanceRow(i.id, i.node_type, i.zone, i.market, i.price_per_hour, i.launched_at - start,
                                i.seconds(now), i.cost(now), i.end_reason or "running", i.notice_at is not None,
                                sent / samples if samples else None, comm / busy if busy > 0 else None, i.region))
    return rows


# ---- rounds ------------------------------------------------------------------------------------
#: epochs the page's and the report's per-round table show, newest first
ROUNDS_SHOWN = 20


@dataclass
class RoundRow:
    """One epoch (a DiLoCo outer round): the mean over the trainers that reported it."""

    epoch: int
    peers: int  # trainers that reported it
    wall_s: float  # compute + communication: a trainer's time from its previous epoch to this one
    compute_s: float
    comm_s: float
    comm_percent: float | None  # of wall_s; None for an epoch of no measurable length


def _percent(part: float, whole: float) -> float | None:
    return 100 * part / whole if whole > 0 else None


def round_rows(store: RunStore, recent: int = ROUNDS_SHOWN) -> list[RoundRow]:
    """The newest ``recent`` epochs the trainers reported, newest first: how long each took and how
    that time split into compute and communication."""
    return [RoundRow(m.epoch, m.peers, m.wall_s, m.compute_s, m.comm_s, _percent(m.comm_s, m.wall_s))
            for m in store.round_means(recent)]


@dataclass
class RoundTotalsRow:
    """Every epoch's means, summed: the run's time in rounds and its split."""

    rounds: int
    wall_s: float
    compute_s: float
    comm_s: float
    comm_percent: float | None


def round_totals(store: RunStore) -> RoundTotalsRow:
    t = store.round_totals()
    return RoundTotalsRow(t.rounds, t.wall_s, t.compute_s, t.comm_s, _percent(t.comm_s, t.wall_s))


# ---- experts -----------------------------------------------------------------------------------
@dataclass
class ExpertRow:
    uid: str
    servers: list[str]  # the instances holding it, as the newest placement says


def expert_rows(store: RunStore) -> list[ExpertRow]:
    """Every expert of a mixture-of-experts run and where it lives now (empty for other runs)."""
    placements = store.events("expert_placement")
    if not placements:
        return []
    newest = json.loads(placements[-1][3])
    return [ExpertRow(uid, list(servers)) for uid, servers in newest.items()]


# ---- time series -------------------------------------------------------------------------------
@dataclass
class Trace:
    name: str
    t: list[float] = field(default_factory=list)  # seconds since the run's start
    y: list[float] = field(default_factory=list)
    step: bool = False  # a count that jumps (draw as steps), not a measurement (draw as a line)


@dataclass
class Chart:
    id: str
    title: str
    y_label: str
    traces: list[Trace]

    @property
    def points(self) -> int:
        return sum(len(tr.t) for tr in self.traces)


def _steps(name: str, changes: list[tuple[float, int]], start: float, now: float) -> Trace:
    """A count from 0 that changes by each ``(time, delta)``, held until ``now``."""
    trace, count = Trace(name, [0.0], [0.0], step=True), 0
    for t, delta in sorted(changes):
        count += delta
        trace.t.append(t - start)
        trace.y.append(float(count))
    trace.t.append(now - start)
    trace.y.append(float(count))
    return trace


def _live_by_group(instances: list[InstanceRecord], start: float, now: float) -> list[Trace]:
    changes: dict[str, list[tuple[float, int]]] = {}
    for i in instances:
        name = f"{i.node_type} / {i.zone}" + ("" if i.market == "spot" else f" ({i.market})")
        changes.setdefault(name, []).append((i.launched_at, 1))
        if i.ended_at is not None:
            changes[name].append((i.ended_at, -1))
    return [_steps(name, changes[name], start, now) for name in sorted(changes)]


#: rows of a sampled series (progress, experts) a chart draws at most: a longer series is thinned to
#: rows evenly spaced in time (``RunStore.progress_rows``), since a chart is a few hundred pixels wide
CHART_POINTS = 2000


def charts(store: RunStore, now: float) -> list[Chart]:
    """Every chart of the dashboard and the report, as plain series (no plotting library here)."""
    start = run_start(store)
    instances = store.instances()
    progress = store.progress_rows(until=now, points=CHART_POINTS)
    # cost is piecewise linear between launches and ends: evaluating at those moments is exact
    moments = sorted({start, now, *(t for i in instances for t in (i.launched_at, i.ended_at)
                                    if t is not None and start <= t <= now)})
    spot = cost_curve(instances, moments)
    on_demand = cost_curve(instances, moments, on_demand=True)
    rel = [t - start for t in moments]
    trained = [(r[0], r[5]) for r in progress if r[5]]
    per_million = Trace("spot fleet", [t - start for t, _ in trained],
                        [c / n * 1e6 for c, (_, n) in zip(cost_curve(instances, [t for t, _ in trained]), trained,
                                                          strict=True)])
    return [
        Chart("throughput", "Global samples/s", "samples/s",
              [Trace("samples/s", [r[0] - start for r in progress], [r[3] or 0.0 for r in progress])]),
        Chart("loss", "Loss", "loss",
              [Trace("loss", [r[0] - start for r in progress if r[2] is not None],
                     [r[2] for r in progress if r[2] is not None])]),
        Chart("instances", "Live instances by node type and zone", "instances",
              _live_by_group(instances, start, now)),
        Chart("preemptions", "Preemptions and replacements", "count (cumulative)", [
            _steps("preemptions", [(i.ended_at, 1) for i in instances
                                   if i.end_reason == "preempted" and i.ended_at is not None], start, now),
            _steps("replacements", [(i.launched_at, 1) for i in replacements(instances)], start, now)]),
        Chart("dollars", "Cumulative dollars", "$", [Trace("spot fleet", rel, spot),
                                                     Trace("same instance-hours on demand", rel, on_demand)]),
        Chart("dollars_per_million", "Dollars per million samples", "$ / 1M samples", [per_million]),
        Chart("savings", "Savings against on-demand", "$ saved",
              [Trace("saved", rel, [od - s for od, s in zip(on_demand, spot, strict=True)])]),
        *_expert_charts(store, start, now),
    ]


def _expert_charts(store: RunStore, start: float, now: float) -> list[Chart]:
    """A mixture-of-experts run's experts: how many of the grid are live and on how many servers,
    the servers' load, and how many of the trainers' forward passes met k_min."""
    rows = store.expert_rows(until=now, points=CHART_POINTS)
    if not rows:
        return []
    t = [r[0] - start for r in rows]

    def trace(name: str, column: int, scale: float = 1.0) -> Trace:
        kept = [(x, r[column]) for x, r in zip(t, rows, strict=True) if r[column] is not None]
        return Trace(name, [x for x, _ in kept], [v * scale for _, v in kept])
    return [
        Chart("experts", "Experts live and their replicas", "experts / servers",
              [trace("experts live", 1), trace("grid", 2), trace("fewest replicas", 3), trace("mean replicas", 4)]),
        Chart("expert_load", "Expert servers' load", "requests/s, rows/batch",
              [trace("requests/s (all servers)", 5), trace("rows per batch", 6)]),
        Chart("kmin", "Forward passes meeting k_min", "%", [trace("meeting k_min", 8, 100.0)]),
    ]


def series_json(store: RunStore, now: float) -> dict:
    return {"start": run_start(store), "now": now, "charts": [asdict(c) for c in charts(store, now)]}
