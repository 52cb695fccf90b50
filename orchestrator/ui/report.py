"""``spotswarm report RUN``: a static HTML report with PNG plots of the dashboard's figures, a
folder that can be zipped, mailed or published as it is (no server, no JavaScript)."""

from __future__ import annotations

import html
import logging
from dataclasses import dataclass
from pathlib import Path

from orchestrator.runs import figures
from orchestrator.runs.store import RunStore

logger = logging.getLogger(__name__)


@dataclass
class Report:
    index: Path
    plots: dict[str, Path]  # chart id -> PNG
    points: dict[str, int]  # chart id -> data points plotted


def plot_chart(chart: figures.Chart, span_s: float, path: Path) -> int:
    """One chart as a PNG (matplotlib, Agg: no display needed); returns the points drawn."""
    from matplotlib.figure import Figure

    # fixed margins: matplotlib's layout engines measure every label first, a third of the drawing time
    fig = Figure(figsize=(7, 3.4), dpi=100)
    fig.subplots_adjust(left=0.12, right=0.98, bottom=0.15, top=0.9)
    ax = fig.add_subplot()
    for tr in chart.traces:
        ax.plot([t / 60 for t in tr.t], tr.y, label=tr.name, drawstyle="steps-post" if tr.step else "default",
                marker=None if len(tr.t) > 1 else "o")
    # placed where matplotlib would place it (no ticks on top), which spares it measuring every tick label
    ax.set_title(chart.title, y=1.0)
    ax.set_xlabel("minutes since start")
    ax.set_xlim(0, max(span_s / 60, 1e-3))
    ax.set_ylabel(chart.y_label)
    if all(y >= 0 for tr in chart.traces for y in tr.y):
        ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if len(chart.traces) > 1:
        ax.legend(fontsize="small")
    fig.savefig(path)
    return chart.points


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


ROUND_HEADER = ["epoch", "peers", "wall (s)", "compute (s)", "communication (s)", "communication (%)"]


def _split(wall_s: float, compute_s: float, comm_s: float, comm_percent: float | None) -> list[str]:
    """A round's seconds as the page shows them: hundredths of a second, tenths of a percent."""
    percent = "-" if comm_percent is None else f"{comm_percent:.1f}"
    return [f"{wall_s:.2f}", f"{compute_s:.2f}", f"{comm_s:.2f}", percent]


def rounds_section(rounds: list[figures.RoundRow], totals: figures.RoundTotalsRow) -> str:
    """The newest rounds, newest first, then every round's means summed (what the run spent in rounds)."""
    if not totals.rounds:
        return "<h2>Rounds</h2><p>No trainer reported a round.</p>"
    rows = [[str(r.epoch), str(r.peers), *_split(r.wall_s, r.compute_s, r.comm_s, r.comm_percent)] for r in rounds]
    rows.append([f"all {totals.rounds} rounds", "",
                 *_split(totals.wall_s, totals.compute_s, totals.comm_s, totals.comm_percent)])
    shown = f"the newest {len(rounds)} of {totals.rounds}" if len(rounds) < totals.rounds else f"all {len(rounds)}"
    return (f"<h2>Rounds</h2><p>Each epoch's time, the mean over the trainers that reported it ({shown}), "
            "and the sum over every round.</p>" + _table(ROUND_HEADER, rows))


STYLE = """body{font-family:system-ui,sans-serif;margin:2em;color:#1d2430}
table{border-collapse:collapse;margin:1em 0}td,th{padding:.25em .8em;border-bottom:1px solid #ddd;text-align:left}
img{max-width:100%;border:1px solid #eee;margin:.5em 0}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr))}"""


def write_report(run_dir: Path, out_dir: Path | None = None) -> Report:
    """Write ``index.html`` and one PNG per chart into ``out_dir`` (default ``<run>/report``)."""
    run_dir = Path(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    store = RunStore.open(run_dir)
    try:
        live = figures.is_live(run_dir)
        now = figures.run_now(store, live)
        h = figures.headline(store, now, live)
        charts = figures.charts(store, now)
        instances = figures.instance_rows(store, now)
        costs = figures.cost_breakdown(store.instances(), now)
        rounds, round_totals = figures.round_rows(store), figures.round_totals(store)
    finally:
        store.close()
    plots, points = {}, {}
    for chart in charts:
        plots[chart.id] = out_dir / f"{chart.id}.png"
        points[chart.id] = plot_chart(chart, h.elapsed_s, plots[chart.id])
    images = "".join(f'<img src="{plots[c.id].name}" alt="{html.escape(c.title)}">' for c in charts)
    body = (
        f"<h1>spotswarm run {html.escape(h.cluster)}</h1>"
        f"<p>{'live at' if live else 'finished;'} {h.elapsed_s / 60:.1f} minutes of run time.</p>"
        + _table(["figure", "value"], [list(r) for r in figures.headline_rows(h)])
        + f'<h2>Over time</h2><div class="plots">{images}</div>'
        + rounds_section(rounds, round_totals)
        + "<h2>Cost by node type and zone</h2>"
        + _table(["node type", "zone", "market", "instances", "instance-hours", "dollars", "on demand"],
                 [[g.node_type, g.zone, g.market, str(g.instances), f"{g.instance_hours:.3f}", f"${g.dollars:.4f}",
                   f"${g.on_demand_dollars:.4f}"] for g in costs])
        + "<h2>Instances</h2>"
        + _table(["instance", "node type", "zone", "market", "$/hour", "launched (min)", "lifetime (min)", "cost",
                  "bytes sent / sample", "averaging (% of time)", "how it ended"],
                 [[i.id, i.node_type, i.place, i.market, f"{i.price_per_hour:.3f}", f"{i.launched_s / 60:.1f}",
                   f"{i.lifetime_s / 60:.1f}", f"${i.dollars:.4f}",
                   "-" if i.bytes_per_sample is None else f"{i.bytes_per_sample:.0f}",
                   "-" if i.comm_fraction is None else f"{100 * i.comm_fraction:.0f}", i.ended] for i in instances]))
    index = out_dir / "index.html"
    index.write_text(f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
                     f"<title>spotswarm run {html.escape(h.cluster)}</title><style>{STYLE}</style></head>"
                     f"<body>{body}</body></html>\n")
    logger.info("report written to %s", index)
    return Report(index, plots, points)
