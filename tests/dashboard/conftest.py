"""A run store filled by hand with a known history (no Ray): two node types in two zones, a
preemption and its replacement, an instance that died, an on-demand fallback, a crash of the
whole run and a resume.  The expected dollars below are worked out by hand from it.

Also what the browser tests share: headless Chromium, opening a page in it, saving screenshots."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.config.schema import ClusterConfig
from orchestrator.runs.store import InstanceRecord, RoundRecord, RunStore

T0 = 1_000_000.0
CONFIG = {
    "cluster_name": "hand", "provider": {"type": "local", "zones": ["a", "b"]},
    "available_node_types": {
        "small": {"max_workers": 2, "on_demand_price_per_hour": 1.0, "spot_price_per_hour": {"a": 0.3, "b": 0.4}},
        "big": {"max_workers": 1, "on_demand_price_per_hour": 4.0, "spot_price_per_hour": {"a": 1.2}},
    },
}
# (id, node type, zone, market, $/h, on-demand $/h, launched, notice, ended, how it ended) — seconds after T0
HISTORY = [
    ("i0", "small", "a", "spot", 0.3, 1.0, 0, 3000, 3600, "preempted"),  # 1 h: $0.30 (on demand $1.00)
    ("i1", "small", "b", "spot", 0.4, 1.0, 0, None, 5400, "released"),  # 1.5 h: $0.60 ($1.50)
    ("i2", "big", "a", "spot", 1.2, 4.0, 60, None, 1860, "died"),  # 0.5 h: $0.60 ($2.00)
    ("i3", "small", "a", "spot", 0.3, 1.0, 3700, None, 5400, "released"),  # 1700 s: $0.141667 ($0.472222)
    ("i4", "big", "a", "on-demand", 4.0, 4.0, 1900, None, 5400, "released"),  # 3500 s: $3.888889 (same)
    # the whole run is SIGKILLed while i5 is up; the store last hears from it at 6000 (a progress row)
    ("i5", "small", "a", "spot", 0.3, 1.0, 5500, None, None, None),  # ends at 6000 on resume: 500 s, $0.041667
    # resumed at 7000 with a fresh instance
    ("i6", "small", "b", "spot", 0.4, 1.0, 7000, None, 7900, "released"),  # 900 s: $0.10 ($0.25)
]
DOLLARS = 0.3 + 0.6 + 0.6 + 1700 / 3600 * 0.3 + 3500 / 3600 * 4.0 + 500 / 3600 * 0.3 + 0.1
ON_DEMAND_DOLLARS = 1.0 + 1.5 + 2.0 + 1700 / 3600 + 3500 / 3600 * 4.0 + 500 / 3600 + 0.25
SAMPLES = 6400  # at the newest epoch
# the trainers' rounds: instance -> (epoch, compute s, comm s)
ROUNDS = {"i1": [(18, 4.0, 1.0), (19, 3.0, 1.0), (20, 6.0, 2.0)], "i5": [(19, 5.0, 3.0), (20, 2.0, 0.0)]}
# per epoch, newest first: (epoch, peers, wall s, compute s, comm s, comm %) — the means over who reported it
ROUND_MEANS = [(20, 2, 5.0, 4.0, 1.0, 20.0), (19, 2, 6.0, 4.0, 2.0, 100 * 2 / 6), (18, 1, 5.0, 4.0, 1.0, 20.0)]


def _at(store: RunStore, t: float) -> None:
    store.clock = lambda: T0 + t


def fill_run(base: Path) -> Path:
    """Write the history above into ``base/hand`` the way the supervisor would; returns the run dir."""
    config = ClusterConfig.model_validate({**CONFIG, "runs_dir": str(base)})
    store = RunStore.create(config)
    try:
        store.event("supervisor_start", at=T0)
        for (iid, node_type, zone, market, price, od, launched, notice, ended, reason) in HISTORY:
            if launched >= 7000:
                continue
            store.launched(InstanceRecord(iid, node_type, zone, market, price, od, T0 + launched))
            if notice is not None:
                store.update_instance(iid, notice_at=T0 + notice)
                store.event("notice", iid, at=T0 + notice)
            if ended is not None:
                store.update_instance(iid, ended_at=T0 + ended, end_reason=reason)
                store.event(reason, iid, at=T0 + ended)
        for t, epoch, loss, sps in [(600, 2, 2.0, 40.0), (1800, 5, 1.5, 55.0), (3000, 10, 1.2, 60.0),
                                    (4500, 16, 1.0, 58.0), (6000, 20, 0.9, 50.0)]:
            _at(store, t)
            store.progress(epoch, loss, sps, 2, epoch * 320)
        store.peer_costs("i1", 6400, 640_000, 30.0, 120.0)  # a trainer's totals: 100 B/sample, 25% averaging
        for iid, rounds in ROUNDS.items():
            store.rounds(iid, [RoundRecord(*r) for r in rounds])
        # the resume: a new supervisor closes what the dead one left open, then carries on
        store.close_lost_instances(store.last_time())
        store.event("supervisor_start", at=T0 + 7000)
        store.launched(InstanceRecord("i6", "small", "b", "spot", 0.4, 1.0, T0 + 7000))
        _at(store, 7500)
        store.progress(20, 0.85, 45.0, 1, SAMPLES)
        store.update_instance("i6", ended_at=T0 + 7900, end_reason="released")
        store.event("released", "i6", at=T0 + 7900)
        store.event("supervisor_stop", at=T0 + 7900)
    finally:
        store.close()
    return config.run_dir()


@dataclass
class HandRun:
    """The filled run and the figures expected of it (tests import nothing from conftest)."""
    dir: Path
    t0: float = T0
    dollars: float = DOLLARS
    on_demand_dollars: float = ON_DEMAND_DOLLARS
    samples: int = SAMPLES
    round_means: tuple = tuple(ROUND_MEANS)


@pytest.fixture
def hand_run(tmp_path: Path) -> HandRun:
    return HandRun(fill_run(tmp_path / "runs"))


# ---- the browser tests -------------------------------------------------------------------------
CHROMIUM = Path("/usr/bin/chromium")
PAGE_LOAD_MS = 30_000


@pytest.fixture(scope="module")
def browser() -> Iterator:
    """Headless Chromium, one for a test module.  A module whose other module fixtures must be set
    up first (a live run) overrides it with ``browser(that_fixture, browser)``: pytest sets up the
    arguments in that order, and tears them down the other way round."""
    playwright_api = pytest.importorskip("playwright.sync_api")
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it, or run "
                    "`apt-get install -y --no-install-recommends chromium`")
    with playwright_api.sync_playwright() as p:
        instance = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"])
        yield instance
        instance.close()


@pytest.fixture
def open_page(browser) -> Callable[[str], tuple]:
    """``open_page(url)``: the page at ``url`` once it has shown what its API answered (its first
    refresh), and the list its console errors and uncaught exceptions go to; the caller closes it."""
    def open_(url: str) -> tuple:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors: list[str] = []
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(url)
        page.wait_for_function("() => Number(document.body.dataset.refreshes || 0) >= 1", timeout=PAGE_LOAD_MS)
        return page, errors
    return open_


@pytest.fixture
def save_screenshot(tmp_path: Path) -> Callable[..., Path]:
    """``save_screenshot(page, name)``: the whole page as a PNG under the test's tmp_path, copied to
    ``$SPOTSWARM_ARTIFACTS`` too when that is set."""
    def save(page, name: str) -> Path:
        path = tmp_path / name
        page.screenshot(path=str(path), full_page=True)
        if os.environ.get("SPOTSWARM_ARTIFACTS"):
            target = Path(os.environ["SPOTSWARM_ARTIFACTS"])
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, target / name)
        return path
    return save
