"""One hivemind all-reduce peer for ``bench_allreduce.py --vs-hivemind``.

Runs ONLY with the reference library's separate virtualenv (``.bench-venv/bin/python``, made by
``make bench-env``); it imports nothing from this project.  Same line protocol as
``_allreduce_peer.py``: ``init <multiaddr or ->``, ``prep <round>``, ``go <round>``, ``quit``.
hivemind averages in a background process (plus a DHT process and a p2pd daemon), so the peak
RSS it reports covers every process of this peer's tree (each one's VmHWM, summed).
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
import time

import torch
from _allreduce_vector import describe, fill, sample_indices
from _common import cpu_seconds, descendants, emit
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage


def hwm_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of this process and every live descendant."""
    return cpu_seconds([pid, *descendants(pid)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--group-size", type=int, required=True)
    parser.add_argument("--prefix", default="bench")
    parser.add_argument("--min-matchmaking-time", type=float, default=30.0)
    parser.add_argument("--allreduce-timeout", type=float, default=120.0)
    parser.add_argument("--step-timeout", type=float, default=150.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    idx = sample_indices(args.size)
    tensor = torch.empty(args.size, dtype=torch.float32)
    fill(tensor, args.seed)
    emit({"hello": os.getpid()})
    cmd = (sys.stdin.readline().split() or ["quit"])
    if cmd[0] != "init":
        return
    initial = [] if len(cmd) < 2 or cmd[1] == "-" else [cmd[1]]
    dht = DHT(initial_peers=initial, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = DecentralizedAverager([tensor], dht, prefix=args.prefix, target_group_size=args.group_size,
                                     min_matchmaking_time=args.min_matchmaking_time,
                                     allreduce_timeout=args.allreduce_timeout, start=True)
    del tensor  # the averager moved it to shared memory; read and write through get_tensors()
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    emit({"ready": True, "addr": maddrs[0] if maddrs else None})
    peak_tree = 0
    try:
        for line in sys.stdin:
            cmd = line.split() or ["quit"]
            if cmd[0] == "prep":
                rnd = int(cmd[1])
                with averager.get_tensors() as tensors:
                    fill(tensors[0], args.seed + 1000 * (rnd + 1))
                    info = describe(tensors[0], idx)
                emit({"prepped": rnd, **info})
            elif cmd[0] == "go":
                rnd = int(cmd[1])
                cpu0 = tree_cpu_s(os.getpid())
                t_start = time.monotonic()
                control = averager.step(wait=False, timeout=args.step_timeout)
                t_matched = None
                while not control.done():  # the stage lives in shared memory: poll it for the split
                    if t_matched is None and control.stage == AveragingStage.RUNNING_ALLREDUCE:
                        t_matched = time.monotonic()
                    time.sleep(0.002)
                t_end = time.monotonic()
                cpu = tree_cpu_s(os.getpid()) - cpu0
                error = None
                try:
                    gathered = control.result(timeout=0)
                    group_size = len(gathered) if gathered is not None else 1
                except Exception as e:  # hivemind reports a failed round as an exception
                    error, group_size = repr(e), 1
                t_matched = t_matched if t_matched is not None else t_end
                with averager.get_tensors() as tensors:
                    info = describe(tensors[0], idx)
                emit({"round": rnd, "t_start": t_start, "t_end": t_end, "cpu_s": cpu, "group_size": group_size,
                      "failed": 0 if error is None else 1, "error": error,
                      "matchmaking_time": t_matched - t_start, "allreduce_time": t_end - t_matched, **info})
                peak_tree = max(peak_tree, sum(hwm_kb(p) for p in descendants(os.getpid())))
            else:
                break
        peak_tree = max(peak_tree, sum(hwm_kb(p) for p in descendants(os.getpid())))
    finally:
        averager.shutdown()
        dht.shutdown()
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    emit({"rss_kb": own + peak_tree, "main_rss_kb": own, "children_hwm_kb": peak_tree})


if __name__ == "__main__":
    main()
