"""What the CLI does: up, resume, status, down, runs.

``up`` and ``resume`` keep the run in the foreground: they start a local Ray session and the
supervisor actor, show a live status, and on Ctrl-C (or SIGTERM, which ``down`` sends, or the end
of ``--duration``) stop cleanly: every instance is released and the run's data is kept, so
``resume`` can continue it later.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from contextlib import closing, suppress
from pathlib import Path

import psutil
from rich.console import Console
from rich.live import Live
from rich.table import Table

from orchestrator.cli import remote
from orchestrator.cli.refusals import NotStarted, ResumeError, refuse_archived_run
from orchestrator.config.checks import load_cluster_config
from orchestrator.config.schema import ClusterConfig
from orchestrator.fleet.ray_session import run_log, start_ray
from orchestrator.fleet.registry import terminate_cloud_run
from orchestrator.host.wait import wait_for
from orchestrator.runs import figures
from orchestrator.runs import pid as run_pid
from orchestrator.runs.logs import RAY_DRIVER_LOG, log_path
from orchestrator.runs.store import RunStore


def _with_absolute_paths(config: ClusterConfig) -> ClusterConfig:
    """Paths as this command sees them: the supervisor's working directory is Ray's, not ours."""
    provider, checkpoint = config.provider, config.checkpoint
    if provider.trace_file:
        provider = provider.model_copy(update={"trace_file": str(Path(provider.trace_file).resolve())})
    if checkpoint.directory:
        checkpoint = checkpoint.model_copy(update={"directory": str(Path(checkpoint.directory).resolve())})
    return config.model_copy(update={"provider": provider, "checkpoint": checkpoint,
                                     "runs_dir": str(Path(config.runs_dir).resolve())})


def _figures_table(title: str, h: figures.Headline) -> Table:
    table = Table(title=title)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for label, value in figures.headline_rows(h):
        table.add_row(label, value)
    return table


def _live_table(store: RunStore, status: dict) -> Table:
    """The run's headline figures (those of ``status`` and the dashboard), under what the
    supervisor is doing, and with the instances it is still waiting for."""
    h = figures.headline(store, figures.run_now(store, live=True), live=True)
    table = _figures_table(f"spotswarm run {h.cluster} — {status['status']}", h)
    table.add_row("instances pending", str(status["pending"]))
    table.min_width = 60  # steady while the values change
    return table


def run_foreground(config: ClusterConfig, run_dir: Path, duration: float | None, console: Console) -> dict:
    """Start Ray and the supervisor; show live status until stopped; release everything."""
    import ray

    from orchestrator.fleet.supervisor import Supervisor

    run_pid.claim(run_dir)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    supervisor = None
    with run_log(log_path(run_dir, RAY_DRIVER_LOG)):  # Ray's console notices: the run's log, not the terminal
        try:
            start_ray(config.ray.address)
            name = f"supervisor-{config.cluster_name}"
            try:
                ray.get_actor(name)
                raise NotStarted(f"run {config.cluster_name} already has a supervisor on this Ray cluster; "
                                 f"stop it first (spotswarm down {run_dir})")
            except ValueError:
                pass  # none yet: ours will be the only one
            # on the head node, detached on a cluster: the run goes on if this command loses its connection
            options: dict = {"name": name, "resources": {"node:__internal_head__": 0.001}}
            if config.ray.address is not None:
                options["lifetime"] = "detached"
            supervisor = Supervisor.options(**options).remote(_with_absolute_paths(config).model_dump(mode="json"),
                                                              str(run_dir.resolve()))
            address = ray.get(supervisor.address.remote(), timeout=120)
            console.print(f"run directory: {run_dir}")
            console.print(f"bootstrap peer: {address}")
            dashboard_url = ray.get(supervisor.dashboard.remote(), timeout=60)
            if dashboard_url:
                console.print(f"dashboard: {dashboard_url}")
            started = time.monotonic()
            status = ray.get(supervisor.status.remote(), timeout=60)
            seen = 0
            with (closing(RunStore.open(run_dir)) as store,
                  Live(_live_table(store, status), console=console, refresh_per_second=2, transient=False) as live):
                while not stop.is_set():
                    if duration is not None and time.monotonic() - started >= duration:
                        break
                    stop.wait(1.0)
                    status = ray.get(supervisor.status.remote(), timeout=60)
                    fresh = status["fleet_events_total"] - seen
                    for line in status["fleet_events"][-fresh:] if fresh > 0 else []:
                        console.print(line)
                    seen = status["fleet_events_total"]
                    live.update(_live_table(store, status))
                    if status["budget_exhausted"] or status.get("fatal"):
                        break
                    if status.get("stop_requested"):
                        by = status["stop_requested"].get("by")
                        console.print(f"a stop was asked for through the archive ({by})")
                        break
            if not console.is_terminal:
                console.line()  # a live table written to a file or pipe ends without a newline
            console.print("stopping: a final checkpoint, then releasing every instance (the run's data is kept)")
            ray.get(supervisor.stop.remote(), timeout=120 + config.checkpoint.final_timeout_s)
            return status
        finally:
            if supervisor is not None:
                ray.kill(supervisor)
            if ray.is_initialized():
                ray.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            run_pid.release(run_dir)


def _following(action: Callable[[threading.Event], int]) -> int:
    """Run ``action`` with an event that Ctrl-C (or SIGTERM) sets instead of interrupting it."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return action(stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def headline(run_dir: Path) -> figures.Headline:
    """The run's headline figures, live or finished (the same ones the dashboard shows)."""
    with closing(RunStore.open(run_dir)) as store:
        live = figures.is_live(run_dir)
        return figures.headline(store, figures.run_now(store, live), live)


def print_summary(run_dir: Path, console: Console) -> None:
    h = headline(run_dir)
    console.print(_figures_table(f"run {h.cluster}: summary", h))


def preflight(config: ClusterConfig, config_path: str = "CONFIG", fresh: bool = False,
              console: Console | None = None) -> None:
    """Before anything starts: a run already up is refused, the cloud is asked one cheap question (so that
    refused credentials are one clear ProviderAuthError here instead of a supervisor that cannot launch
    anything), and the archive must take a write and hold no other run (``refuse_archived_run``)."""
    refuse_if_up(config.run_dir(), config.cluster_name)
    if config.provider.type != "local":
        from orchestrator.fleet.registry import make_provider

        make_provider(config, time.time, config.run_dir()).shutdown()  # it reads zones and prices on creation
    if config.checkpoint.uri:
        from orchestrator.runs.durable import ArchiveError, RunArchive

        try:
            archive = RunArchive.for_config(config)
            assert archive is not None
            archive.check_writable()
        except ArchiveError as e:
            raise NotStarted(f"checkpoint.uri cannot take the run's archive: {e}") from None
        refuse_archived_run(archive, config.cluster_name, config_path, fresh, console or Console())


def refuse_if_up(run_dir: Path, name: str) -> None:
    """A second driver would overwrite the first one's record and run a second supervisor over the same
    instances: refused, naming the commands that watch and stop the run that is up."""
    driver = run_pid.driver(run_dir)
    if driver is not None:
        raise NotStarted(f"run {name} is already up (driven by pid {driver.pid} on this machine): watch it with "
                         f"`spotswarm status {run_dir}`, stop it with `spotswarm down {run_dir}`")


def finish(status: dict, run_dir: Path, console: Console) -> int:
    """The summary, and the exit status: 2 when the run stopped on a problem only a person can fix."""
    print_summary(run_dir, console)
    if status.get("fatal"):
        console.print(f"[bold red]the run stopped:[/] {status['fatal']}")
        return 2
    return 0


def up(config_path: str, duration: float | None, console: Console, address: str | None = None,
       boot_timeout_s: float = 900.0, fresh: bool = False) -> int:
    """Start a run: here (a local Ray session, or the cluster at ``address``), or, for a cloud run that names
    ``head_node_type`` and no address, on a head launched for it (``cli/launch.py``)."""
    config = load_cluster_config(config_path)  # ConfigError before anything starts
    from orchestrator.cli.launch import launch, launches_head

    if launches_head(config, address):
        return _following(lambda stop: launch(config_path, duration, console, "up", boot_timeout_s, stop, fresh))
    config = config.with_ray_address(address)
    preflight(config, config_path, fresh, console)
    RunStore.create(config).close()
    run_dir = config.run_dir()
    status = run_foreground(config, run_dir, duration, console)
    return finish(status, run_dir, console)


def resume_target(target: str, console: Console) -> Path:
    """The run directory ``resume`` continues.  TARGET is a run directory, or a cluster YAML whose
    ``run_dir()`` is used; when that holds no run yet and the YAML has ``checkpoint.uri``, the run
    is restored from S3 first (a new head machine continuing a run whose head vanished)."""
    path = Path(target)
    if path.is_dir():
        if not (path / "run.sqlite").exists():
            raise ResumeError(f"{target} is not a run directory (no run.sqlite)")
        return path
    if not path.is_file():
        raise ResumeError(f"{target}: no such run directory or cluster YAML")
    config = load_cluster_config(target)
    run_dir = config.run_dir()
    if (run_dir / "run.sqlite").exists():
        return run_dir
    if not config.checkpoint.uri:
        raise ResumeError(f"{target}: no run at {run_dir}, and no checkpoint.uri to restore one from")
    epoch = restore_run(config, run_dir)
    console.print(f"restored run {config.cluster_name} from {config.checkpoint.uri} "
                  f"at checkpoint epoch {epoch if epoch is not None else 'none'}")
    return run_dir


def restore_run(config: ClusterConfig, run_dir: Path) -> int | None:
    """Restore ``run_dir`` from the config's S3 archive; returns the restored checkpoint's epoch.
    The store records a ``restored`` event: its open instances belong to the lost head's fleet."""
    from orchestrator.runs.durable import ArchiveMissing, RunArchive

    archive = RunArchive.for_config(config)
    if archive is None:
        raise ResumeError(f"run {config.cluster_name} has no checkpoint.uri to restore from")
    try:
        return archive.restore(run_dir)
    except ArchiveMissing as e:
        raise ResumeError(f"no run at {run_dir}, and none archived: {e}") from None


def resume(target: str, duration: float | None, console: Console, address: str | None = None,
           boot_timeout_s: float = 900.0) -> int:
    """Continue a run from a run directory or a cluster YAML (see ``resume_target``); a cloud run that names
    ``head_node_type``, given by its YAML where this machine has no run, resumes on a new head launched for it."""
    if Path(target).is_file():
        from orchestrator.cli.launch import launch, launches_head

        config = load_cluster_config(target)
        if launches_head(config, address) and not (config.run_dir() / "run.sqlite").exists():
            return _following(lambda stop: launch(target, duration, console, "resume", boot_timeout_s, stop))
    path = resume_target(target, console)
    refuse_if_up(path, path.name)
    with closing(RunStore.open(path)) as store:
        config = store.config().with_ray_address(address)
        latest = store.latest_checkpoint()
        # at the moment the run's clock (simulated on the local provider) resumes from, not before its past
        store.event("resume", detail={"checkpoint_epoch": latest[0] if latest else None},
                    at=max(store.last_time() or 0.0, time.time()))
    console.print(f"resuming {config.cluster_name} from checkpoint epoch {latest[0] if latest else 'none'}")
    run_foreground(config, path, duration, console)
    print_summary(path, console)
    return 0


def status(target: str, console: Console) -> int:
    """A run's figures: from its run directory, or its cluster YAML (on another machine than the head: from
    the run's archive)."""
    with remote.run_view(target, console) as (run_dir, _):
        print_summary(run_dir, console)
    return 0


def dashboard(target: str, host: str, port: int, open_browser: bool, console: Console) -> int:
    """Serve the run's dashboard in the foreground until Ctrl-C (or SIGTERM); from the archive's snapshot
    where this machine has no run directory."""
    from orchestrator.ui.dashboard import DashboardServer

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with remote.run_view(target, console) as (run_dir, _), DashboardServer(run_dir, host, port) as server:
            console.print(f"dashboard: {server.url}  (run {target}; Ctrl-C stops it)", soft_wrap=True)
            if open_browser:
                import webbrowser

                webbrowser.open(server.url)
            stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def report(target: str, out: str | None, console: Console) -> int:
    """A static report of the run (see ``status`` for TARGET); from an archive's snapshot, written to
    ``./<cluster>-report`` unless ``out`` says where."""
    from orchestrator.ui.report import write_report

    with remote.run_view(target, console) as (run_dir, archived):
        default = Path(f"{run_dir.name}-report") if archived else None  # not in the snapshot's temporary folder
        written = write_report(run_dir, Path(out) if out else default)
    console.print(f"report: {written.index} ({len(written.plots)} plots)")
    return 0


def down(target: str, console: Console, address: str | None = None) -> int:
    """Stop a run given its run directory or its cluster YAML.  With a YAML of a cloud run, every
    instance tagged with the run is terminated afterwards as well, even when no head is left to
    ask (the head machine vanished, and with it the run directory)."""
    path = Path(target)
    if not path.is_file():
        return _down_run(target, console, address)
    config = load_cluster_config(target)
    from orchestrator.cli.launch import launches_head

    code = 0
    if (config.run_dir() / "run.sqlite").exists():
        code = _down_run(str(config.run_dir()), console, address)
    elif config.checkpoint.uri or launches_head(config, None):  # the head is elsewhere: asked through the
        # archive (a launched head's default one where checkpoint.uri is left out), with no port of its own
        if not remote.down_through_archive(config, console) and config.provider.type not in ("aws", "gcp"):
            code = 1
    if config.provider.type in ("aws", "gcp"):
        ids = terminate_cloud_run(config)
        console.print(f"{config.cluster_name}: terminated {len(ids)} instance{'s' if len(ids) != 1 else ''} "
                      f"tagged with the run" + (f" ({', '.join(ids)})" if ids else ""))
    elif not (config.run_dir() / "run.sqlite").exists() and not config.checkpoint.uri:
        console.print(f"{target}: no run at {config.run_dir()}; nothing to stop")
    return code


def _down_run(run_dir: str, console: Console, address: str | None = None) -> int:
    """Stop a run: through the ``up`` command that runs it, or, when that command is gone while its
    detached supervisor runs on a Ray cluster, through the supervisor itself."""
    pid_file = Path(run_dir) / run_pid.PID_FILE
    process = run_pid.driver(Path(run_dir))
    if process is not None:
        try:
            process.terminate()  # psutil checks the start time again: never another process
        except psutil.NoSuchProcess:
            process = None
    if process is None:
        if pid_file.exists():
            console.print(f"{pid_file}: no spotswarm process of this run is alive (its pid may belong to "
                          "another process now); removed")
            pid_file.unlink(missing_ok=True)
        return _down_detached(Path(run_dir), console, address)
    with closing(RunStore.open(Path(run_dir))) as store:  # the stop's final checkpoint may take this long too
        timeout = 180 + store.config().checkpoint.final_timeout_s
    with suppress(TimeoutError):  # the run's own command releases everything; bounded
        wait_for(lambda: not pid_file.exists(), timeout, "the run's command to stop", every=0.5)
    console.print(f"{run_dir}: stopped; every instance released, data kept")
    return 0


def _down_detached(run_dir: Path, console: Console, address: str | None) -> int:
    with closing(RunStore.open(run_dir)) as store:
        config = store.config().with_ray_address(address)
    if config.ray.address is None:  # a local session ends with its command: nothing can be running
        console.print(f"{run_dir}: not running (its data is kept)")
        return 0
    import ray

    start_ray(config.ray.address)
    try:
        supervisor = ray.get_actor(f"supervisor-{config.cluster_name}")
    except ValueError:
        ray.shutdown()
        console.print(f"{run_dir}: no supervisor on the cluster at {config.ray.address}; not running (data kept)")
        return 0
    try:
        ray.get(supervisor.stop.remote(), timeout=180 + config.checkpoint.final_timeout_s)
        ray.kill(supervisor)
    finally:
        ray.shutdown()
    console.print(f"{run_dir}: stopped its detached supervisor; every instance released, data kept")
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
