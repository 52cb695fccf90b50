"""This machine's processes and ports (``orchestrator.host``), on real processes: a session ended whole
(its detached members too), a tree ended without taking a child's exit status from its Popen, waits
that name what they waited for, and ports outside the ranges Ray's processes draw from."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from orchestrator.host.ports import RAY_WORKER_PORTS_END, free_port
from orchestrator.host.processes import (
    exited,
    kill_session,
    kill_tree,
    session_pids,
    session_still_ours,
    signal_session,
    tree,
)
from orchestrator.host.wait import wait_for, wait_for_async

pytestmark = pytest.mark.timeout(60)

# a session leader whose child leaves its process group (as Ray's workers do) and ignores SIGTERM
STUBBORN = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c",
        "import os, signal, time; os.setpgid(0, 0); signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        " print(os.getpid(), flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    print(child.stdout.readline().strip(), flush=True)
    time.sleep(120)
""")


def _stubborn_session() -> tuple[subprocess.Popen, int]:
    leader = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    return leader, int(leader.stdout.readline())


def test_wait_for_returns_the_value_and_a_timeout_names_what_it_waited_for():
    started = time.monotonic()
    assert wait_for(lambda: time.monotonic() - started > 0.1 and "done", 5, "a tenth of a second") == "done"
    with pytest.raises(TimeoutError, match="the impossible"):
        wait_for(lambda: False, 0.2, "the impossible")


def test_wait_for_ends_at_once_when_the_condition_raises():
    def hopeless() -> bool:
        raise RuntimeError("the process it waits on exited")

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited"):
        wait_for(hopeless, 30, "something")
    assert time.monotonic() - started < 1


async def test_wait_for_async_lets_the_loop_run():
    import asyncio

    flag: list[bool] = []
    asyncio.get_running_loop().call_later(0.05, flag.append, True)
    assert await wait_for_async(lambda: flag, 5, "the callback") == [True]
    with pytest.raises(TimeoutError, match="never"):
        await wait_for_async(lambda: False, 0.1, "never")


def test_a_session_is_ended_whole_with_sigkill_for_what_ignores_sigterm():
    leader, child = _stubborn_session()
    try:
        assert set(session_pids(leader.pid)) == {leader.pid, child}
        assert kill_session(leader.pid, grace_s=0.5) == []  # SIGTERM, half a second, then SIGKILL
        assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
        assert leader.wait(timeout=10) == -signal.SIGTERM  # its exit status is still its Popen's
    finally:
        signal_session(leader.pid, signal.SIGKILL)
        leader.wait(timeout=10)


def test_a_tree_is_ended_with_what_left_it_and_its_root_is_not_reaped():
    leader, child = _stubborn_session()
    remembered = tree(leader.pid)
    assert {p.pid for p in remembered} >= {leader.pid, child}
    assert kill_tree(leader.pid, remembered) == []
    assert exited(leader) and leader.returncode is None  # ended, but a zombie its Popen still reaps
    assert leader.wait(timeout=10) == -signal.SIGKILL
    assert exited(leader)
    psutil.wait_procs([p for p in remembered if p.pid == child], timeout=10)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_a_session_led_by_another_program_is_not_ours():
    me = os.getpid()
    assert session_still_ours(me, psutil.Process().cmdline()[0])
    assert not session_still_ours(me, "/no/such/directory/of/ours")
    assert session_still_ours(2**22 + 12345, "anything")  # gone: what it left is ours


def test_free_ports_are_above_rays_worker_ports_and_below_the_ephemeral_range():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    ports = {free_port() for _ in range(20)}
    if ephemeral_low > RAY_WORKER_PORTS_END + 2:
        assert all(RAY_WORKER_PORTS_END < p < ephemeral_low for p in ports), ports
    assert len(ports) > 1
