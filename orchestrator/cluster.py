"""What the CLI does: up, resume, status, down, runs.

``up`` and ``resume`` keep the run in the foreground: they start a local Ray session and the
supervisor actor, show a live status, and on Ctrl-C (or SIGTERM, which ``down`` sends, or the end
of ``--duration``) stop cleanly: every instance is released and the run's data is kept, so
``resume`` can continue it later.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from . import figures
from .config import ClusterConfig, load_cluster_config
from .figures import PID_FILE
from .run_store import RunStore


def _start_ray(num_cpus: int = 2) -> None:
    import ray

    for attempt in range(3):  # a fresh ray.init occasionally fails on a busy machine; it is cheap to retry
        try:
            ray.init(include_dashboard=False, num_cpus=num_cpus, log_to_driver=False,
                     configure_logging=False, namespace="spotswarm")
            return
        except Exception:
            if attempt == 2:
                raise
            time.sleep(1.0)


def _status_table(status: dict) -> Table:
    table = Table(title=f"spotswarm run {status['cluster']} — {status['status']}", min_width=60)
    table.add_column("figure")
    table.add_column("value", justify="right")
    loss = status.get("loss")
    sps = status.get("samples_per_second")
    table.add_row("instances live / pending", f"{status['live']} / {status['pending']}")
    table.add_row("global epoch", str(status["epoch"]))
    table.add_row("loss", f"{loss:.4f}" if loss is not None else "-")
    table.add_row("samples/s", f"{sps:,.0f}" if sps else "-")
    table.add_row("preemptions survived", str(status["preemptions"]))
    table.add_row("dollars spent", f"${status['dollars']:.4f}")
    table.add_row("same hours on demand", f"${status['on_demand_dollars']:.4f}")
    return table


def run_foreground(config: ClusterConfig, run_dir: Path, duration: float | None, console: Console) -> dict:
    """Start Ray and the supervisor; show live status until stopped; release everything."""
    import ray

    from .supervisor import Supervisor

    (run_dir / PID_FILE).write_text(str(os.getpid()))
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    _start_ray()
    supervisor = None
    try:
        supervisor = Supervisor.options(name=f"supervisor-{config.cluster_name}").remote(
            config.model_dump(mode="json"), str(run_dir))
        address = ray.get(supervisor.address.remote(), timeout=120)
        console.print(f"run directory: {run_dir}")
        console.print(f"bootstrap peer: {address}")
        dashboard_url = ray.get(supervisor.dashboard.remote(), timeout=60)
        if dashboard_url:
            console.print(f"dashboard: {dashboard_url}")
        started = time.monotonic()
        status = ray.get(supervisor.status.remote(), timeout=60)
        with Live(_status_table(status), console=console, refresh_per_second=2, transient=False) as live:
            while not stop.is_set():
                if duration is not None and time.monotonic() - started >= duration:
                    break
                stop.wait(1.0)
                status = ray.get(supervisor.status.remote(), timeout=60)
                live.update(_status_table(status))
                if status["budget_exhausted"]:
                    break
        console.print("stopping: releasing every instance (the run's data is kept)")
        ray.get(supervisor.stop.remote(), timeout=120)
        return status
    finally:
        if supervisor is not None:
            ray.kill(supervisor)
        ray.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        (run_dir / PID_FILE).unlink(missing_ok=True)


def headline(run_dir: Path) -> figures.Headline:
    """The run's headline figures, live or finished (the same ones the dashboard shows)."""
    store = RunStore.open(run_dir)
    try:
        live = figures.is_live(run_dir)
        return figures.headline(store, figures.run_now(store, live), live)
    finally:
        store.close()


def print_summary(run_dir: Path, console: Console) -> None:
    h = headline(run_dir)
    table = Table(title=f"run {h.cluster}: summary")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for label, value in figures.headline_rows(h):
        table.add_row(label, value)
    console.print(table)


def up(config_path: str, duration: float | None, console: Console) -> int:
    config = load_cluster_config(config_path)  # ConfigError before anything starts
    store = RunStore.create(config)
    store.close()
    run_dir = config.run_dir()
    run_foreground(config, run_dir, duration, console)
    print_summary(run_dir, console)
    return 0


def resume(run_dir: str, duration: float | None, console: Console) -> int:
    path = Path(run_dir)
    store = RunStore.open(path)
    config = store.config()
    latest = store.latest_checkpoint()
    store.event("resume", detail={"checkpoint_epoch": latest[0] if latest else None})
    store.close()
    console.print(f"resuming {config.cluster_name} from checkpoint epoch {latest[0] if latest else 'none'}")
    run_foreground(config, path, duration, console)
    print_summary(path, console)
    return 0


def status(run_dir: str, console: Console) -> int:
    print_summary(Path(run_dir), console)
    return 0


def dashboard(run_dir: str, host: str, port: int, open_browser: bool, console: Console) -> int:
    """Serve the run's dashboard in the foreground until Ctrl-C (or SIGTERM)."""
    from .dashboard import DashboardServer

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with DashboardServer(Path(run_dir), host, port) as server:
            console.print(f"dashboard: {server.url}  (run {run_dir}; Ctrl-C stops it)", soft_wrap=True)
            if open_browser:
                import webbrowser

                webbrowser.open(server.url)
            stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def report(run_dir: str, out: str | None, console: Console) -> int:
    from .report import write_report

    written = write_report(Path(run_dir), Path(out) if out else None)
    console.print(f"report: {written.index} ({len(written.plots)} plots)")
    return 0


def down(run_dir: str, console: Console) -> int:
    pid_file = Path(run_dir) / PID_FILE
    if not pid_file.exists():
        console.print(f"{run_dir}: not running (its data is kept)")
        return 0
    pid = int(pid_file.read_text())
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pid_file.unlink(missing_ok=True)
        console.print(f"{run_dir}: its process is gone; marked stopped")
        return 0
    deadline = time.monotonic() + 180
    while pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    console.print(f"{run_dir}: stopped; every instance released, data kept")
    return 0


def runs(base: str, console: Console) -> int:
    table = Table(title=f"runs in {base}")
    for col in ("run", "state", "epochs", "samples", "preemptions", "dollars"):
        table.add_column(col)
    for d in sorted(Path(base).glob("*/run.sqlite")):
        h = headline(d.parent)
        table.add_row(d.parent.name, "running" if h.live else "stopped", str(h.epoch), f"{h.samples:,}",
                      str(h.preemptions), f"${h.dollars:.4f}")
    console.print(table)
    return 0
