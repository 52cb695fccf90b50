"""The cost and throughput dashboard: an aiohttp app over a run directory.

``/`` is the page (plotly.js charts that refresh while the run is up), ``/api/*`` the JSON behind
it, ``/metrics`` the same figures for Prometheus.  The same app runs inside the supervisor while
a run is up and from ``spotswarm dashboard RUN`` on any run, live or finished: everything is read
from the run store, so the page after the run shows exactly what it showed during it.

``DashboardServer`` runs the app on an event loop of its own thread, so synchronous callers (the
supervisor, the CLI, tests) can start and stop it without owning an event loop.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import asdict
from importlib import resources
from pathlib import Path

from aiohttp import web

from . import figures, metrics
from .run_store import RunStore

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


def _state(request: web.Request) -> tuple[RunStore, float, bool]:
    app = request.app
    live = app[LIVE_KEY]()
    return app[STORE_KEY], app[NOW_KEY]() if live else figures.run_now(app[STORE_KEY], live=False), live


async def page(request: web.Request) -> web.Response:
    html = resources.files("orchestrator").joinpath("static/dashboard.html").read_text()
    return web.Response(text=html, content_type="text/html")


async def plotly_asset(request: web.Request) -> web.Response:
    return web.Response(body=plotly_js(), content_type="application/javascript",
                        headers={"Cache-Control": "max-age=86400"})


async def api_summary(request: web.Request) -> web.Response:
    store, now, live = _state(request)
    h = figures.headline(store, now, live)
    return web.json_response({**h.as_dict(), "rows": figures.headline_rows(h)})


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


async def api_experts(request: web.Request) -> web.Response:
    store, _, _ = _state(request)
    return web.json_response([asdict(e) for e in figures.expert_rows(store)])


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
    app.add_routes([web.get("/", page), web.get("/static/plotly.min.js", plotly_asset),
                    web.get("/api/summary", api_summary), web.get("/api/series", api_series),
                    web.get("/api/charts", api_charts), web.get("/api/instances", api_instances),
                    web.get("/api/costs", api_costs), web.get("/api/experts", api_experts),
                    web.get("/metrics", prometheus)])
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
