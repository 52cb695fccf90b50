"""A peer SIGKILLed in the middle of an all-reduce: the others finish, agree, and report it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from averaging import DecentralizedAverager

HERE = Path(__file__).parent
SIZE = 40_000


@pytest.mark.timeout(90)
async def test_others_finish_within_one_timeout_with_identical_parts(swarm):
    nodes = await swarm(3)
    env = {**os.environ, "PYTHONPATH": str(HERE.parent.parent)}
    proc = subprocess.Popen([sys.executable, str(HERE / "victim_peer.py"), str(nodes[0].address), str(SIZE), "3"],
                            stdout=subprocess.PIPE, text=True, env=env)
    sender_timeout = 3.0
    averagers = [DecentralizedAverager([torch.full((SIZE,), float(i))], n, "kill", target_group_size=4,
                                       min_matchmaking_time=20.0, chunk_size=1024, sender_timeout=sender_timeout)
                 for i, n in enumerate(nodes)]
    try:
        line = await asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline)
        assert line.strip() == "ready"
        started = time.monotonic()
        results = await asyncio.gather(*(a.step(timeout=60) for a in averagers))
        elapsed = time.monotonic() - started
        assert proc.wait(timeout=30) == -9  # it really died by SIGKILL mid-round
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for a in averagers:
            await a.shutdown()

    group = results[0].group_peers
    assert len(group) == 4 and all(r.group_peers == group for r in results)
    victim = next(p for p in group if p not in [a.peer_id for a in averagers])
    assert all(victim in r.failed_peers for r in results)
    # its part did not all come back: the survivors know that they do not hold the same values
    assert all(r.unaveraged_parts == [group.index(victim)] and not r.complete for r in results)
    assert elapsed < 20.0 + sender_timeout + 5  # matchmaking wait + at most one sender timeout

    bounds, start = [], 0
    for size in results[0].part_sizes:
        bounds.append((start, start + size))
        start += size
    for index, (lo, hi) in enumerate(bounds):
        values = [a.tensors[0][lo:hi] for a in averagers]
        if group[index] == victim:
            # its part: each survivor kept its own values for what it did not get back
            for a, v in zip(averagers, values, strict=True):
                assert set(v.unique().tolist()) <= {float(averagers.index(a)), 1.0, 250.75}
        else:
            assert all(torch.equal(v, values[0]) for v in values), f"part {index} differs between survivors"
            # survivors' mean (0+1+2)/3 = 1, or with the victim's early chunks (0+1+2+1000)/4 = 250.75
            assert set(values[0].unique().tolist()) <= {1.0, 250.75}
