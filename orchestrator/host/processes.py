"""This machine's processes: a session or a process tree listed, signalled and ended.

A session, not a process group: a machine's boot script, a Ray head or a benchmark's child starts a
session of its own, and Ray gives each of its workers a process group of its own, so the group alone
would leave the actors alive.  A tree (a process and its descendants) for children that did not
start one.  Ending is SIGTERM, a grace period, then SIGKILL of whatever is left, found anew (a
process may have started meanwhile), each wait bounded.

Waiting for processes to end counts a zombie as ended and never reaps one: a child of ours reaped
here would lose its exit status to the ``subprocess.Popen`` that owns it (and its pid, which may be a
session id the caller still uses, could be reused at once).  That is why it polls instead of using
``psutil.wait_procs``, which reaps the caller's children and waits on other processes' zombies.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Callable, Iterable
from contextlib import suppress

import psutil

from orchestrator.host.wait import wait_for

logger = logging.getLogger(__name__)

KILL_WAIT_S = 5.0  # after SIGKILL, how long the processes get to be gone before the survivors are named


def _scan(belongs: Callable[[int], bool]) -> list[psutil.Process]:
    """Every live (not zombie) process for whose pid ``belongs`` holds."""
    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and belongs(proc.pid):
                found.append(proc)
        except (OSError, psutil.Error):  # gone meanwhile, or not ours to ask
            continue
    return found


def session_processes(sid: int) -> list[psutil.Process]:
    """Every live process of session ``sid`` (its leader's pid): the leader's whole tree, including
    the processes that made process groups of their own, and those whose parent died."""
    return _scan(lambda pid: os.getsid(pid) == sid)


def session_pids(sid: int) -> list[int]:
    return [proc.pid for proc in session_processes(sid)]


def tree(pid: int) -> list[psutil.Process]:
    """The process and its descendants now (none if it is gone): what to remember of a child whose
    descendants may leave its tree (their parent dies) before it is killed."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def processes_mentioning(marker: str, exclude: Iterable[int] = ()) -> list[psutil.Process]:
    """Live processes whose command line names ``marker`` (a run directory, a session's path)."""
    skip = set(exclude)
    out = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        with suppress(psutil.Error):
            if proc.pid in skip or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if any(marker in part for part in proc.info["cmdline"] or ()):
                out.append(proc)
    return out


def running(proc: psutil.Process) -> bool:
    """Alive and not a zombie; False for a process whose pid now belongs to another."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def signal_all(procs: Iterable[psutil.Process], sig: int) -> list[int]:
    """``sig`` to each process that is still the one it was (never to a reused pid); the pids signalled."""
    sent = []
    for proc in procs:
        with suppress(psutil.Error):
            proc.send_signal(sig)
            sent.append(proc.pid)
    return sent


def signal_session(sid: int, sig: int) -> list[int]:
    """``sig`` to every process of session ``sid`` at once (SIGKILL: a machine's power cut)."""
    return signal_all(session_processes(sid), sig)


def wait_gone(procs: Iterable[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait (bounded) until none of ``procs`` runs; those still running.  Never reaps (see above)."""
    procs = list(procs)
    with suppress(TimeoutError):
        wait_for(lambda: not any(running(p) for p in procs), timeout, "processes to end")
    return [p for p in procs if running(p)]


def end(find: Callable[[], list[psutil.Process]], grace_s: float, what: str) -> list[int]:
    """SIGTERM what ``find()`` returns and give it ``grace_s`` seconds (none: SIGKILL at once), then
    SIGKILL what it returns then and wait up to ``KILL_WAIT_S``; the pids that survived, logged."""
    steps = ((signal.SIGTERM, grace_s), (signal.SIGKILL, KILL_WAIT_S)) if grace_s > 0 else \
        ((signal.SIGKILL, KILL_WAIT_S),)
    for sig, wait_s in steps:
        procs = find()
        if not procs:
            return []
        signal_all(procs, sig)
        wait_gone(procs, wait_s)
    left = [p.pid for p in find()]
    if left:
        logger.warning("%s: processes %s survived SIGKILL", what, left)
    return left


def kill_session(sid: int, grace_s: float = 0.0) -> list[int]:
    """End every process of session ``sid`` (``end``); the pids that survived."""
    return end(lambda: session_processes(sid), grace_s, f"session {sid}")


def kill_tree(pid: int, remembered: Iterable[psutil.Process] = (), grace_s: float = 0.0) -> list[int]:
    """End process ``pid``, its descendants, the processes of the group it leads (those that left its
    tree but not its group), and ``remembered`` (``tree`` taken earlier: those that left both), each
    only while it is still the process it was; the pids that survived."""
    remembered = list(remembered)

    def find() -> list[psutil.Process]:
        group = _scan(lambda other: os.getpgid(other) == pid)
        return [p for p in {p.pid: p for p in [*remembered, *group, *tree(pid)]}.values() if running(p)]

    return end(find, grace_s, f"process tree of {pid}")


def exited(proc: subprocess.Popen) -> bool:
    """Whether a child exited, without reaping it: its pid (and session id) stays its own meanwhile,
    so that what it left can still be found and killed by that id."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def session_still_ours(sid: int, marker: str) -> bool:
    """Whether session ``sid`` is still one we started: its leader (pid ``sid``) is gone or a zombie,
    or runs with ``marker`` (a directory of ours) in its command line.  A live leader without it is
    another program that got the pid after ours exited, leading a session of its own."""
    try:
        leader = psutil.Process(sid)
        return leader.status() == psutil.STATUS_ZOMBIE or marker in " ".join(leader.cmdline())
    except psutil.NoSuchProcess:  # gone: what is left of the session is ours
        return True
    except psutil.Error:  # not ours to read: not ours to kill either
        return False
