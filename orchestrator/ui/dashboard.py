"""The cost and throughput dashboard: an aiohttp app over a run directory.

``/`` is the page (plotly.js charts that refresh while the run is up), ``/api/*`` the JSON behind
it, ``/metrics`` the same figures for Prometheus.  ``/chaos`` is a chaos run's report: the faults
its ``chaos.json`` lists, drawn over the run's throughput and loss.  The same app runs inside the supervisor while
a run is up and from ``spotswarm dashboard RUN`` on any run, live or finished: everything is read
from the run store, so the page after the run shows exactly what it showed during it.

``DashboardServer`` runs the app on an event loop of its own thread, so synchronous callers (the
supervisor, the CLI, tests) can start and stop it without owning an event loop.
"""

from __future__ import annotations

import asyncio
import functools
import html
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator.runs import figures
from orchestrator.runs.chaos_report import FAULT_KINDS, PHASES, REPORT
from orchestrator.runs.store import RunStore
from orchestrator.ui import metrics

logger = logging.getLogger(__name__)

STORE_KEY = web.AppKey("store", RunStore)
NOW_KEY = web.AppKey("now", Callable[[], float])
LIVE_KEY = web.AppKey("live", Callable[[], bool])


@functools.cache
def plotly_js() -> bytes:
    """plotly.js as shipped inside the plotly Python package: the page needs no network."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs().encode()


def chart_figures(charts: list[figures.Chart], span_s: float) -> dict[str, dict]:
    """Plotly figures (as JSON-ready dicts) for the charts, all over the run's whole time span;
    the page hands them to Plotly.react."""
    import plotly.graph_objects as go
    import plotly.io as pio

    out = {}
    for chart in charts:
        fig = go.Figure(layout={"title": {"text": chart.title}, "margin": {"l": 60, "r": 20, "t": 50, "b": 45},
                                "xaxis": {"title": {"text": "minutes since start"}, "range": [0, span_s / 60]},
                                "yaxis": {"title": {"text": chart.y_label}, "rangemode": "tozero"},
                                "legend": {"orientation": "h", "y": -0.25}, "height": 320})
        for tr in chart.traces:
            fig.add_trace(go.Scatter(x=[t / 60 for t in tr.t], y=tr.y, name=tr.name,
                                     mode="lines" if len(tr.t) > 1 else "markers",
                                     line={"shape": "hv" if tr.step else "linear"}))
        out[chart.id] = json.loads(pio.to_json(fig, validate=False))
    return out


# ---- the chaos report --------------------------------------------------------------------------
NO_PHASE = "-"
KIND_COLORS = dict(zip(FAULT_KINDS, ("#d62728", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"),
                       strict=True))
OTHER_COLOR = "#7f7f7f"
CHAOS_CHARTS = ("throughput", "loss")


class ChaosReportError(ValueError):
    """A ``chaos.json`` that is there but is not a report this page can read."""


class ChaosFault(BaseModel):
    time: float
    kind: str
    target: str | None = None
    phase: str | None = None
    duration_s: float | None = None  # faults that last: a pause, a bandwidth drop, a full disk
    detail: str = ""
    outcome: str = "injected"  # or "skipped: <why>"

    @property
    def injected(self) -> bool:
        return self.outcome == "injected"


class ChaosViolation(BaseModel):
    time: float | None = None
    invariant: str
    detail: str = ""


class ChaosSummary(BaseModel):
    """Empty until the run ends; figures beyond these are kept as the file has them."""

    model_config = ConfigDict(extra="allow")

    faults: int | None = None  # injected ones
    skipped: int | None = None
    invariant_violations: int | None = None
    error_tracebacks: int | None = None
    max_stall_s: float | None = None
    p99_stall_s: float | None = None
    recovery_s: float | None = None  # from the last fault's end to the fleet's second epoch after it
    retained: Any = None
    by_kind: dict[str, int] = {}
    by_phase: dict[str, int] = {}


class ChaosReport(BaseModel):
    """``<run_dir>/chaos.json`` as the chaos run writes it (replaced atomically, wall-clock seconds:
    the same clock as the run store's rows).  Unknown keys are ignored, so a newer writer that only
    adds keys still reads."""

    version: Literal[1]
    seed: int | None = None
    config: str | None = None
    cluster: str | None = None
    started_at: float
    ended_at: float | None = None
    duration_s: float | None = None
    state: Literal["running", "finished"]
    faults: list[ChaosFault] = []
    violations: list[ChaosViolation] = []
    summary: ChaosSummary = Field(default_factory=ChaosSummary)


def chaos_path(run_dir: Path) -> Path:
    return Path(run_dir) / REPORT


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _got(value: Any) -> str:
    return f" (got {json.dumps(value)})" if value is None or isinstance(value, (str, int, float, bool)) else ""


def load_chaos_report(path: Path) -> ChaosReport | None:
    """The report at ``path``; None when there is none (not a chaos run).  Anything else that keeps
    it from being read is a ``ChaosReportError`` naming the file and the problem."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise ChaosReportError(f"{path}: cannot be read: {e}") from e
    try:
        # NaN/Infinity would pass json.loads but make the API's answer invalid JSON for the browser
        data = json.loads(text, parse_constant=_no_constant)
    except ValueError as e:
        raise ChaosReportError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ChaosReportError(f"{path}: not a chaos report: a JSON {type(data).__name__}, not an object")
    try:
        return ChaosReport.model_validate(data)
    except ValidationError as e:
        problems = [f"{'.'.join(map(str, err['loc']))}: {err['msg']}" + _got(err.get("input")) for err in e.errors()]
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ChaosReportError(f"{path}: not a chaos report: {'; '.join(problems[:3])}{more}") from e


def _ordered(known: tuple[str, ...], seen: set[str]) -> list[str]:
    """Every known name (a zero shows what was never tried), then any others the report has."""
    return [*known, *sorted(seen - set(known))]


def kind_phase_counts(faults: list[ChaosFault]) -> dict:
    """Faults by kind × phase, every kind and phase listed even at zero: the gaps are the
    combinations the run never tried."""
    phases = _ordered(PHASES, {f.phase or NO_PHASE for f in faults})
    kinds = _ordered(FAULT_KINDS, {f.kind for f in faults})
    counts = {k: dict.fromkeys(phases, 0) for k in kinds}
    for f in faults:
        counts[f.kind][f.phase or NO_PHASE] += 1
    return {"phases": phases,
            "rows": [{"kind": k, "counts": list(counts[k].values()), "total": sum(counts[k].values())}
                     for k in kinds],
            "totals": [sum(counts[k][p] for k in kinds) for p in phases], "total": len(faults)}


def _format_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    return value if isinstance(value, str) else json.dumps(value)


def chaos_summary_rows(report: ChaosReport) -> list[tuple[str, str]]:
    """The summary as (label, formatted value) cards; counts the writer left out are counted here."""
    s = report.summary
    skipped = sum(not f.injected for f in report.faults)

    def seconds(v: float | None) -> str:
        return f"{v:.1f} s" if v is not None else "-"
    return [
        ("faults", str(s.faults if s.faults is not None else len(report.faults) - skipped)),
        ("skipped", str(s.skipped if s.skipped is not None else skipped)),
        ("invariant violations", str(s.invariant_violations if s.invariant_violations is not None
                                     else len(report.violations))),
        ("error tracebacks", _format_value(s.error_tracebacks)),
        ("max stall", seconds(s.max_stall_s)),
        ("p99 stall", seconds(s.p99_stall_s)),
        ("recovered after the last fault", seconds(s.recovery_s)),
        ("retained", _format_value(s.retained)),
    ]


def _fault_hover(f: ChaosFault, minute: float) -> str:
    """Plotly reads hover text as a little HTML: the file's own text is escaped so it shows as written."""
    lines = [f"<b>{html.escape(f.kind)}</b> at {minute:.2f} min",
             html.escape(f"{f.target or '-'} · {f.phase or NO_PHASE}")]
    if f.duration_s is not None:
        lines.append(f"lasts {f.duration_s:g} s")
    return "<br>".join([*lines, html.escape(f.detail), html.escape(f.outcome)])


def mark_faults(fig: dict, faults: list[ChaosFault], start: float) -> None:
    """Draw each fault on a plotly figure as a vertical line at its minute, one trace per kind (and
    one per kind for the skipped ones, dotted) so the legend names the kinds; a lasting fault also
    shades the span it lasted.  The lines live on a hidden second y axis from 0 to 1, so they span
    the chart whatever the data's scale."""
    layout = fig.setdefault("layout", {})
    layout["yaxis2"] = {"overlaying": "y", "range": [0, 1], "visible": False, "fixedrange": True}
    shapes = layout.setdefault("shapes", [])
    groups: dict[tuple[str, bool], list[ChaosFault]] = {}
    for f in faults:
        groups.setdefault((f.kind, f.injected), []).append(f)
    kinds = _ordered(FAULT_KINDS, {f.kind for f in faults})
    for (kind, injected), group in sorted(groups.items(), key=lambda g: (kinds.index(g[0][0]), not g[0][1])):
        color = KIND_COLORS.get(kind, OTHER_COLOR)
        top = 0.93 - 0.07 * (kinds.index(kind) % 6)  # labels of different kinds at different heights
        x: list[float | None] = []
        y: list[float | None] = []
        text: list[str] = []
        hover: list[str | None] = []
        for f in group:
            minute = (f.time - start) / 60
            x += [minute, minute, None]
            y += [0.0, top, None]
            text += ["", kind, ""]
            hover += [_fault_hover(f, minute)] * 2 + [None]
            if f.duration_s and injected:
                shapes.append({"type": "rect", "xref": "x", "yref": "paper", "x0": minute,
                               "x1": minute + f.duration_s / 60, "y0": 0, "y1": 1, "fillcolor": color,
                               "opacity": 0.12, "line": {"width": 0}, "layer": "below"})
        fig.setdefault("data", []).append({
            "type": "scatter", "name": kind if injected else f"{kind} (skipped)", "x": x, "y": y, "yaxis": "y2",
            "mode": "lines+text", "text": text, "textposition": "top center", "cliponaxis": False,
            "textfont": {"size": 10, "color": color}, "hovertext": hover, "hoverinfo": "text",
            "line": {"color": color, "width": 1.5, "dash": "dash" if injected else "dot"},
            "showlegend": True})


def chaos_json(store: RunStore, report: ChaosReport, now: float, live: bool) -> dict:
    """What ``/api/chaos`` answers: the report's header, summary, faults and violations, and the
    run's throughput and loss charts with every fault marked, all in time since the run's start
    (the main dashboard's origin, so the same moment has the same minute on both pages)."""
    recorded = store.last_time() is not None
    start = figures.run_start(store) if recorded else report.started_at
    faults = sorted(report.faults, key=lambda f: f.time)
    # a stopped run without a single row has no "now" of its own (it would be today): the report bounds it
    end = max([now if recorded or live else start, report.ended_at or report.started_at,
               *(f.time + (f.duration_s or 0.0) for f in faults)])
    first = min([start, *(f.time for f in faults)])
    charts = chart_figures([c for c in figures.charts(store, now) if c.id in CHAOS_CHARTS], end - start)
    for fig in charts.values():
        mark_faults(fig, faults, start)
        fig["layout"]["xaxis"]["range"] = [(first - start) / 60, (end - start) / 60]
        fig["layout"]["height"] = 380
    return {
        "live": live, "refresh": live or report.state == "running", "path": str(chaos_path(store.dir)),
        "start": start,
        "header": {"cluster": report.cluster or store.config().cluster_name, "seed": report.seed,
                   "config": report.config, "state": report.state, "started_at": report.started_at,
                   "ended_at": report.ended_at, "duration_s": report.duration_s},
        "summary": report.summary.model_dump(),
        "summary_rows": chaos_summary_rows(report),
        "by_kind_phase": kind_phase_counts(faults),
        "faults": [{**f.model_dump(), "t_s": f.time - start} for f in faults],
        "violations": [{**v.model_dump(), "t_s": None if v.time is None else v.time - start}
                       for v in sorted(report.violations, key=lambda v: v.time or 0.0)],
        "charts": charts,
    }


def _state(request: web.Request) -> tuple[RunStore, float, bool]:
    app = request.app
    live = app[LIVE_KEY]()
    return app[STORE_KEY], app[NOW_KEY]() if live else figures.run_now(app[STORE_KEY], live=False), live


def _static_file(name: str, content_type: str) -> web.Response:
    text = resources.files(__package__).joinpath(f"static/{name}").read_text()
    return web.Response(text=text, content_type=content_type)


def _static_page(name: str) -> web.Response:
    return _static_file(name, "text/html")


async def page(request: web.Request) -> web.Response:
    return _static_page("dashboard.html")


async def chaos_page(request: web.Request) -> web.Response:
    return _static_page("chaos.html")


# what both pages load besides plotly.js: the cards, charts, state badge and polling loop, and their style
STATIC_ASSETS = {"common.js": "application/javascript", "common.css": "text/css"}


async def static_asset(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in STATIC_ASSETS:
        raise web.HTTPNotFound()
    return _static_file(name, STATIC_ASSETS[name])


async def plotly_asset(request: web.Request) -> web.Response:
    return web.Response(body=plotly_js(), content_type="application/javascript",
                        headers={"Cache-Control": "max-age=86400"})


async def api_summary(request: web.Request) -> web.Response:
    store, now, live = _state(request)
    h = figures.headline(store, now, live)
    return web.json_response({**h.as_dict(), "rows": figures.headline_rows(h),
                              "chaos_report": chaos_path(store.dir).is_file()})


async def api_series(request: web.Request) -> web.Response:
    store, now, _ = _state(request)
    return web.json_response(figures.series_json(store, now))


async def api_charts(request: web.Request) -> web.Response:
    store, now, _ = _state(request)
    return web.json_response(chart_figures(figures.charts(store, now), now - figures.run_start(store)))


async def api_instances(request: web.Request) -> web.Response:
    store, now, _ = _state(request)
    return web.json_response([asdict(r) for r in figures.instance_rows(store, now)])


async def api_costs(request: web.Request) -> web.Response:
    store, now, _ = _state(request)
    return web.json_response([asdict(g) for g in figures.cost_breakdown(store.instances(), now)])


MAX_ROUNDS = 1000  # the most epochs one ``/api/rounds`` answer lists


async def api_rounds(request: web.Request) -> web.Response:
    """The newest epochs' time split (``?recent=N``, default ``figures.ROUNDS_SHOWN``), newest first."""
    store, _, _ = _state(request)
    try:
        recent = int(request.query.get("recent", figures.ROUNDS_SHOWN))
    except ValueError:
        recent = 0
    if not 1 <= recent <= MAX_ROUNDS:
        return web.json_response({"error": f"recent: a whole number from 1 to {MAX_ROUNDS}"}, status=400)
    return web.json_response([asdict(r) for r in figures.round_rows(store, recent)])


async def api_experts(request: web.Request) -> web.Response:
    store, _, _ = _state(request)
    return web.json_response([asdict(e) for e in figures.expert_rows(store)])


async def api_chaos(request: web.Request) -> web.Response:
    """The chaos report as JSON; a run without one is a 404 and a report that cannot be read a 500,
    both ``{"error": ...}`` naming the file, so the page can say what is wrong instead of failing."""
    store, now, live = _state(request)
    path = chaos_path(store.dir)
    try:
        report = load_chaos_report(path)
    except ChaosReportError as e:
        logger.debug("chaos report unreadable: %s", e)
        return web.json_response({"error": str(e), "live": live}, status=500)
    if report is None:
        return web.json_response({"error": f"no chaos report (not a chaos run): {path}", "live": live}, status=404)
    return web.json_response(chaos_json(store, report, now, live))


async def prometheus(request: web.Request) -> web.Response:
    app = request.app
    body = metrics.render(app[STORE_KEY], lambda: _state(request)[1], app[LIVE_KEY])
    return web.Response(body=body, headers={"Content-Type": metrics.CONTENT_TYPE})


def make_app(run_dir: Path, clock: Callable[[], float] | None = None, live: bool | None = None) -> web.Application:
    """The app over one run directory.  ``clock`` and ``live`` come from the supervisor when it
    serves its own run; otherwise they are read from the run directory on every request."""
    app = web.Application()
    store = RunStore.open(run_dir)
    app[STORE_KEY] = store
    app[LIVE_KEY] = (lambda: live) if live is not None else (lambda: figures.is_live(run_dir))
    app[NOW_KEY] = clock or (lambda: figures.run_now(store, live=True))

    async def close_store(app: web.Application) -> None:
        app[STORE_KEY].close()

    app.on_cleanup.append(close_store)
    app.add_routes([web.get("/", page), web.get("/chaos", chaos_page),
                    web.get("/static/plotly.min.js", plotly_asset), web.get("/static/{name}", static_asset),
                    web.get("/api/summary", api_summary),
                    web.get("/api/series", api_series), web.get("/api/charts", api_charts),
                    web.get("/api/instances", api_instances), web.get("/api/rounds", api_rounds),
                    web.get("/api/costs", api_costs), web.get("/api/experts", api_experts),
                    web.get("/api/chaos", api_chaos), web.get("/metrics", prometheus)])
    return app


class DashboardServer:
    """The app on ``host:port`` (0: any free port), served from an event loop in its own thread."""

    def __init__(self, run_dir: Path, host: str = "127.0.0.1", port: int = 0,
                 clock: Callable[[], float] | None = None, live: bool | None = None) -> None:
        self.run_dir, self.host, self.port = Path(run_dir), host, port
        self.clock, self.live = clock, live
        self.url: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    def start(self, timeout: float = 30.0) -> str:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dashboard", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout)
        except BaseException:
            self.stop()
            raise
        return self.url

    async def _start(self) -> None:
        # the store is opened on the server's own thread: every request reads it from there
        self._runner = web.AppRunner(make_app(self.run_dir, self.clock, self.live), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        host, port = self._runner.addresses[0][:2]
        self.port = port
        self.url = f"http://{host}:{port}/"

    def stop(self, timeout: float = 30.0) -> None:
        """Close the listening socket and every connection, then the loop; idempotent.  All of it
        runs on the server's own loop, so any thread may call this (even one with a loop of its own)."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        if loop.is_running():
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout)
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout)
        loop.close()

    async def _shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in leftover:  # none expected; cancelled and awaited, never destroyed while pending
            task.cancel()
        await asyncio.gather(*leftover, return_exceptions=True)
        await asyncio.get_running_loop().shutdown_asyncgens()

    def __enter__(self) -> DashboardServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
