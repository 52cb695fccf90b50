"""Chaos runs: a local ``nodes``-mode run (every instance its own Ray node) with a fault injector,
and the run's invariants checked while it runs and after it stops.

At moments drawn from the seed the injector kills a worker, a whole node, or the supervisor (then
resumes the run, as ``spotswarm resume`` would), pauses a worker (SIGSTOP, a straggler for 2-20
steps), drops one peer's link to 1 Mbit/s, fills the run directory's disk, or steps one peer's
clock.  Each fault is recorded with the phase its target was in.  Meanwhile every few seconds: the
store is readable and adds up, every checkpoint loads, peers that completed the same epoch hold
the same parameters, no stall past the bound; after the stop: every instance closed, nothing of
the run still running, no ERROR line or traceback in its logs.  The report is ``chaos.json`` in
the run directory, which the dashboard's chaos page shows.
"""

from __future__ import annotations

import heapq
import logging
import os
import random
import shutil
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import ray

from orchestrator.chaos import disk as chaos_disk
from orchestrator.chaos import faults as chaos_faults
from orchestrator.chaos.faults import Fault, FaultSkipped, Node
from orchestrator.chaos.report import ChaosReport, save_report, summarize
from orchestrator.config.schema import ClusterConfig
from orchestrator.fleet.ray_session import run_log
from orchestrator.runs.chaos_report import FAULT_KINDS, RUN_PHASES, WORKER_PHASES
from orchestrator.runs.checkpoints import checkpoint_directory
from orchestrator.runs.invariants import (
    CheckpointWatch,
    ParamsAgreement,
    Violation,
    check_run,
    check_store,
    stall_violation,
    store_unreadable,
    supervisor_downtimes,
)
from orchestrator.runs.logs import RAY_DRIVER_LOG, log_path
from orchestrator.runs.store import RunStore

logger = logging.getLogger(__name__)



class ChaosError(RuntimeError):
    """The chaos run cannot start as asked (wrong provider, run directory in the way)."""


@dataclass
class ChaosSettings:
    duration_s: float  # the fault window, from the fleet's first epoch on
    seed: int = 0
    every_s: float = 15.0  # mean time between faults
    kinds: tuple[str, ...] = FAULT_KINDS
    stall_bound_s: float = 60.0
    check_every_s: float = 5.0
    calm_s: float | None = None  # no new fault this long before the end (default: max(every_s, 10))
    disk_mb: int = 256
    aim_s: float = 10.0  # how long a fault may wait for its target to be in the phase drawn for it (0: never)
    boot_timeout_s: float = 180.0

    def __post_init__(self) -> None:
        unknown = sorted(set(self.kinds) - set(FAULT_KINDS))
        if unknown:
            raise ChaosError(f"unknown fault kind(s) {', '.join(unknown)}; known: {', '.join(FAULT_KINDS)}")
        if not self.duration_s > 0 or not self.every_s > 0:
            raise ChaosError("duration and the time between faults must be positive")


def plan(settings: ChaosSettings) -> list[tuple[float, str]]:
    """(seconds into the window, kind) for every fault: a jittered grid, the kinds in shuffled rounds,
    so that a window of at least ``len(kinds)`` faults holds every kind."""
    rng = random.Random(settings.seed)
    calm = settings.calm_s if settings.calm_s is not None else max(settings.every_s, 10.0)
    count = max(int((settings.duration_s - calm) // settings.every_s), 0) if settings.kinds else 0
    out, cycle = [], []
    for i in range(count):
        if not cycle:
            cycle = list(settings.kinds)
            rng.shuffle(cycle)
        out.append(((i + rng.uniform(0.25, 0.75)) * settings.every_s, cycle.pop()))
    return out


@dataclass(order=True)
class _Due:
    at: float  # monotonic
    seq: int
    action: Callable[[], None] = field(compare=False)


class ChaosRun:
    """One chaos run; ``run()`` blocks until it is over and returns its report."""

    def __init__(self, config: ClusterConfig, settings: ChaosSettings, config_path: str = "",
                 stop: threading.Event | None = None) -> None:
        if config.provider.type != "local" or config.provider.mode != "nodes":
            raise ChaosError("a chaos run needs the local provider in nodes mode (provider.type local, mode nodes): "
                             "its faults act on each instance's own Ray node")
        if config.provider.time_scale != 1.0:
            raise ChaosError("a chaos run needs provider.time_scale 1: faults and stalls are timed in real seconds")
        if not config.training.param_digests and config.training.averaging == "collaborative":
            config = config.model_copy(update={"training": config.training.model_copy(
                update={"param_digests": True})})  # the equal-parameters invariant reads them
        self.config = config
        self.settings = settings
        self.run_dir = config.run_dir()
        self.stop_event = stop or threading.Event()
        self.report = ChaosReport(settings.seed, config_path, config.cluster_name, time.time(), settings.duration_s)
        self.rng = random.Random(settings.seed + 1)  # targets and durations; the plan has its own stream
        self._due: list[_Due] = []
        self._seq = 0
        self._supervisor: Any = None
        self._supervisor_pid: int | None = None
        self._supervisor_pids: list[int] = []
        self._busy: dict[str, str] = {}  # instance id or "disk" -> the lasting fault on it
        self._params = ParamsAgreement()
        self._checkpoints = CheckpointWatch(checkpoint_directory(config, self.run_dir))
        self._step_s = 0.5  # until measured
        self._disk_why = chaos_disk.unavailable() if "disk_full" in settings.kinds else None

    # ---- the whole run -------------------------------------------------------------------------
    def run(self) -> ChaosReport:
        if self.run_dir.exists() and any(self.run_dir.iterdir()):
            raise ChaosError(f"{self.run_dir} already holds a run; a chaos run starts a fresh one "
                             "(remove it, or change cluster_name)")
        disk = nullcontext() if self._disk_why or "disk_full" not in self.settings.kinds else \
            chaos_disk.small_disk(self.run_dir, self.settings.disk_mb)
        sockets_before = _own_sockets()
        with disk:
            RunStore.create(self.config).close()
            with run_log(log_path(self.run_dir, RAY_DRIVER_LOG)):  # Ray's console notices, not the terminal's
                try:
                    self._supervise()
                finally:
                    self._end()
        self._final_checks(sockets_before)
        return self.report

    def _supervise(self) -> None:
        from orchestrator.fleet.ray_session import start_ray

        start_ray(None, num_cpus=2, namespace=f"spotswarm-chaos-{self.config.cluster_name}")
        self._start_supervisor(resumed=False)
        self._wait_for_training()
        begin = time.monotonic()
        for offset, kind in plan(self.settings):
            self._at(begin + offset, lambda k=kind: self._inject(k))
        end = begin + self.settings.duration_s
        next_check = time.monotonic()
        while not self.stop_event.is_set() and not (time.monotonic() >= end and self._recovered()):
            self._run_due()
            if time.monotonic() >= next_check:
                self._check_while_running()
                self._save_report()
                next_check = time.monotonic() + self.settings.check_every_s
            wait = min([end, next_check] + ([self._due[0].at] if self._due else [])) - time.monotonic()
            self.stop_event.wait(max(min(wait, 0.5), 0.0))

    def _recovered(self) -> bool:
        """Whether the fleet trains on after the last fault: two epochs recorded after it ended (the first
        may be one in flight through it).  The run goes on past its window until then, up to the stall
        bound after the fault; past that, a ``recovery`` violation and the run ends."""
        injected = [f for f in self.report.faults if f.outcome == "injected"]
        if not injected or self.report.recovery_s is not None:
            return True
        since = max(f.time + (f.duration_s or 0.0) for f in injected)
        if time.time() < since:
            return False
        path = self.run_dir / "run.sqlite"
        try:  # read only, every half second until it holds: no schema set-up, no write on a full disk
            with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as db:
                rows = db.execute("SELECT time FROM progress WHERE time > ? ORDER BY epoch LIMIT 2",
                                  (since,)).fetchall()
        except sqlite3.Error:  # the store's own checks report an unreadable store
            rows = []
        if len(rows) == 2:
            self.report.recovery_s = round(rows[1][0] - since, 2)
            return True
        if time.time() - since > self.settings.stall_bound_s:
            self.report.violate(Violation("recovery", f"the fleet completed {len(rows)} epoch(s) in the "
                                                      f"{self.settings.stall_bound_s:g} s after the last fault"))
            return True
        return False

    def _end(self) -> None:
        """Lift every lasting fault, stop the run cleanly (every instance released), leave Ray."""
        for due in sorted(self._due):
            if getattr(due.action, "lifts", False):
                due.action()
        self._due.clear()
        if ray.is_initialized():
            try:
                self._stop_supervisor()
            finally:
                self._collect_supervisor_logs()
                ray.shutdown()
        self.report.state = "finished"
        self.report.ended_at = time.time()

    # ---- the supervisor --------------------------------------------------------------------------
    def _start_supervisor(self, resumed: bool) -> None:
        from orchestrator.fleet.supervisor import Supervisor

        if resumed:
            with closing(RunStore.open(self.run_dir)) as store:
                latest = store.latest_checkpoint()
                store.event("resume", detail={"checkpoint_epoch": latest[0] if latest else None, "by": "chaos"})
        # a killed actor's name stays taken until Ray has noticed: each incarnation gets its own
        name = f"supervisor-{self.config.cluster_name}-{len(self._supervisor_pids)}"
        self._supervisor = Supervisor.options(name=name, resources={"node:__internal_head__": 0.001}).remote(
            self.config.model_dump(mode="json"), str(self.run_dir.resolve()))
        self._supervisor_pid = ray.get(self._supervisor.pid.remote(), timeout=120)
        self._supervisor_pids.append(self._supervisor_pid)

    def _stop_supervisor(self) -> None:
        """Release every instance; a supervisor that died meanwhile is resumed first to do it."""
        if self._supervisor is None:
            return
        try:
            ray.get(self._supervisor.stop.remote(), timeout=180)
        except ray.exceptions.RayActorError:
            logger.warning("the supervisor was dead at the end; resuming the run to release its instances")
            self._start_supervisor(resumed=True)
            ray.get(self._supervisor.stop.remote(), timeout=180)
        ray.kill(self._supervisor)

    def _supervisor_status(self) -> dict | None:
        try:
            return ray.get(self._supervisor.status.remote(), timeout=chaos_faults.ASK_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - killed this moment, or busy: asked again next time
            return None

    def _wait_for_training(self) -> None:
        """The fault window opens once the fleet completed its first epoch."""
        deadline = time.monotonic() + self.settings.boot_timeout_s
        while time.monotonic() < deadline and not self.stop_event.is_set():
            status = self._supervisor_status()
            if status and status.get("fatal"):
                raise ChaosError(f"the run stopped before training: {status['fatal']}")
            if status and status["epoch"] >= 1:
                return
            self.stop_event.wait(0.5)
        if not self.stop_event.is_set():
            raise ChaosError(f"the fleet did not complete an epoch within {self.settings.boot_timeout_s:.0f} s")

    # ---- timed actions ---------------------------------------------------------------------------
    def _at(self, at: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._due, _Due(at, self._seq, action))

    def _run_due(self) -> None:
        while self._due and self._due[0].at <= time.monotonic():
            heapq.heappop(self._due).action()

    def _lift_later(self, seconds: float, busy_key: str, undo: Callable[[], None]) -> None:
        def lift() -> None:
            self._busy.pop(busy_key, None)
            undo()

        lift.lifts = True  # type: ignore[attr-defined]  # run at the end even if not due yet
        self._at(time.monotonic() + seconds, lift)

    # ---- injecting -------------------------------------------------------------------------------
    def _inject(self, kind: str) -> None:
        if kind in ("supervisor_kill", "disk_full") and "disk" in self._busy:
            self._at(time.monotonic() + 1.0, lambda: self._inject(kind))  # one at a time on the run directory
            return
        fault = Fault(time.time(), kind, "", "idle")
        try:
            getattr(self, f"_{kind}")(fault)
        except FaultSkipped as e:
            fault.outcome = f"skipped: {e}"
        logger.info("fault %s on %s in %s: %s (%s)", kind, fault.target or "-", fault.phase, fault.detail,
                    fault.outcome)
        self.report.faults.append(fault)

    def _aim(self, phases: tuple[str, ...]) -> str | None:
        """The phase this fault waits for (``aim_s`` at most), drawn from the seed; None: no aiming.
        Left to chance, faults land where a peer spends its time (idle, matchmaking)."""
        return self.rng.choice(phases) if self.settings.aim_s > 0 else None

    def _victim(self, fault: Fault) -> Node:
        """A live worker no lasting fault holds, answering: its phase is where the fault lands.  An
        aimed fault waits (bounded) for a worker in the phase it aims at, else takes any."""
        want = self._aim(WORKER_PHASES)
        deadline = time.monotonic() + self.settings.aim_s
        while True:
            nodes = [n for n in chaos_faults.live_nodes(self.run_dir) if n.instance_id not in self._busy]
            self.rng.shuffle(nodes)
            found = None
            for node in nodes:
                status = chaos_faults.worker_status(node.instance_id)
                if status is not None and not status.get("left") and status.get("peer_id"):
                    found = found or (node, status)
                    if want is None or status.get("phase") == want:
                        found = (node, status)
                        break
            hit = found is not None and (want is None or found[1].get("phase") == want)
            if hit or time.monotonic() >= deadline or self.stop_event.wait(0.05):
                break
        if found is None:
            raise FaultSkipped("no live worker to act on")
        node, status = found
        fault.target, fault.phase = node.instance_id, status.get("phase", "idle")
        return node

    def _supervisor_phase(self, fault: Fault) -> None:
        want = self._aim(RUN_PHASES)
        deadline = time.monotonic() + self.settings.aim_s
        while True:
            status = self._supervisor_status() or {}
            if want is None or status.get("phase") == want or time.monotonic() >= deadline \
                    or self.stop_event.wait(0.05):
                break
        fault.target, fault.phase = "supervisor", status.get("phase", "idle")

    def _worker_kill(self, fault: Fault) -> None:
        fault.detail = chaos_faults.kill_worker(self._victim(fault))

    def _node_kill(self, fault: Fault) -> None:
        fault.detail = chaos_faults.kill_whole_node(self._victim(fault))

    def _worker_pause(self, fault: Fault) -> None:
        node = self._victim(fault)
        fault.duration_s = round(max(self.rng.uniform(2, 20) * self._step_s, 0.5), 1)
        fault.detail, pid = chaos_faults.pause_worker(node)
        self._busy[node.instance_id] = "worker_pause"
        self._lift_later(fault.duration_s, node.instance_id, lambda: chaos_faults.resume_worker(pid))

    def _bandwidth_drop(self, fault: Fault) -> None:
        node = self._victim(fault)
        fault.duration_s = round(self.rng.uniform(5, 20), 1)
        link = chaos_faults.slow_link(node)
        fault.detail = link.detail
        self._busy[node.instance_id] = "bandwidth_drop"
        self._lift_later(fault.duration_s, node.instance_id, link.restore)

    def _clock_jump(self, fault: Fault) -> None:
        node = self._victim(fault)
        seconds = self.rng.choice((-1, 1)) * self.rng.uniform(30, 120)
        fault.detail = chaos_faults.jump_clock(node, seconds)

    def _supervisor_kill(self, fault: Fault) -> None:
        self._supervisor_phase(fault)
        if self._supervisor_pid is None:
            raise FaultSkipped("no supervisor process known")
        os.kill(self._supervisor_pid, signal.SIGKILL)
        with _suppress_all():
            psutil.Process(self._supervisor_pid).wait(timeout=10)
        started = time.monotonic()
        self._start_supervisor(resumed=True)
        fault.detail = (f"SIGKILL of the supervisor process {self._supervisor_pids[-2]}; resumed in "
                        f"{time.monotonic() - started:.1f} s")

    def _disk_full(self, fault: Fault) -> None:
        if self._disk_why:
            raise FaultSkipped(self._disk_why)
        self._supervisor_phase(fault)
        fault.target = "run directory"
        fault.duration_s = round(self.rng.uniform(3, 10), 1)
        fault.detail = chaos_faults.fill_disk(self.run_dir)
        self._busy["disk"] = "disk_full"
        self._lift_later(fault.duration_s, "disk", lambda: chaos_faults.free_disk(self.run_dir))

    # ---- invariants ------------------------------------------------------------------------------
    def _check_while_running(self) -> None:
        if (unreadable := store_unreadable(self.run_dir)) is not None:
            self.report.violate(unreadable)
            return
        if "disk" not in self._busy:  # opening the store may write; a full disk is checked after
            with closing(RunStore.open(self.run_dir)) as store:
                for v in check_store(store, stopped=False):
                    self.report.violate(v)
                self._check_stall(store)
        self._check_new_checkpoints()
        self._check_equal_params()

    def _check_stall(self, store: RunStore) -> None:
        rows = [(row[0], row[1]) for row in store.progress_rows()]
        recent = rows[-20:]
        if len(recent) >= 5 and recent[-1][1] > recent[0][1]:  # seconds per epoch lately: one global step
            self._step_s = (recent[-1][0] - recent[0][0]) / (recent[-1][1] - recent[0][1])
        if not rows:
            return
        downtimes = supervisor_downtimes(store)
        stall = stall_violation(rows, downtimes, time.time(), self.settings.stall_bound_s)
        if stall is not None and not any(v["invariant"] == "stall" for v in self.report.violations):
            self.report.violate(stall)

    def _check_new_checkpoints(self) -> None:
        for v in self._checkpoints.check_new():
            self.report.violate(v)

    def _check_equal_params(self) -> None:
        """Every live worker's epoch records (parameter digests), judged by ``ParamsAgreement``."""
        for node in chaos_faults.live_nodes(self.run_dir):
            if self._busy.get(node.instance_id) == "worker_pause":
                continue
            try:
                actor = ray.get_actor(chaos_faults.worker_actor_name(node.instance_id))
                history = ray.get(actor.history.remote(), timeout=chaos_faults.ASK_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - booting, dying: its epochs are read next time
                continue
            self._params.observe(node.instance_id, history)
        for v in self._params.judge():
            self.report.violate(v)

    def _final_checks(self, sockets_before: int) -> None:
        self._wait_released()
        result = check_run(self.run_dir, stopped=True, stall_bound_s=self.settings.stall_bound_s)
        known = {(v["invariant"], v["detail"]) for v in self.report.violations}
        for v in result.violations:
            if (v.invariant, v.detail) not in known:
                self.report.violate(v)
        self._check_new_checkpoints()
        sockets_after = _own_sockets()
        if sockets_after > sockets_before:
            self.report.violate(Violation("leaks", f"this process holds {sockets_after} sockets after the run, "
                                                   f"{sockets_before} before"))
        self.report.summary = summarize(self.report, self.run_dir, result.max_stall_s, len(self._params.rolled_back))
        self._save_report()

    def _wait_released(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while chaos_faults.live_nodes(self.run_dir) and time.monotonic() < deadline:
            time.sleep(0.2)  # the stop released every node; their processes exit within moments

    def _save_report(self) -> None:
        save_report(self.report, self.run_dir)

    def _collect_supervisor_logs(self) -> None:
        """Every supervisor's log, into the run directory, where ``check`` scans logs."""
        try:
            session = Path(ray._private.worker._global_node.get_session_dir_path())  # noqa: SLF001
        except Exception:  # noqa: BLE001 - no session to read from
            return
        target = self.run_dir / "logs"
        for pid in self._supervisor_pids:
            for log in (session / "logs").glob(f"worker-*-{pid}.err"):
                target.mkdir(exist_ok=True)
                with _suppress_all():
                    shutil.copyfile(log, target / f"supervisor-{pid}.log")


def _own_sockets() -> int:
    with _suppress_all():
        return len(psutil.Process().net_connections(kind="inet"))
    return 0


@contextmanager
def _suppress_all() -> Iterator[None]:
    try:
        yield
    except Exception as e:  # noqa: BLE001 - best effort: said in the debug log
        logger.debug("ignored: %s: %s", type(e).__name__, e)


