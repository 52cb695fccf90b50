"""One all-reduce peer of ``bench_allreduce.py`` (run as its own process; not a benchmark by itself).

Talks to the parent with lines: it reads commands on stdin and writes one JSON object per line on
stdout.  Commands: ``init <bootstrap address or ->`` (start the DHT node), ``avg <prefix> <group size>
<bandwidth>`` (a fresh averager on that node, so one set of processes serves several
configurations), ``prep <round>`` (refill the vector from the round's seed and report sampled
values and the float64 sum), ``go <round>`` (one averaging step), ``quit`` (shut down and report
peak RSS).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import uvloop  # noqa: E402
from _allreduce_vector import describe, fill, sample_indices  # noqa: E402
from _common import emit  # noqa: E402

from averaging import DecentralizedAverager  # noqa: E402
from dht import DHTNode  # noqa: E402

DIAG: dict[str, list[float]] = {}


def instrument() -> None:
    """--diag: time the phases of a step by wrapping library methods (this process only)."""
    from averaging.allreduce import AllReduceRound
    from averaging.matchmaking import Matchmaker

    def timed(cls, name, is_async=True):
        original = getattr(cls, name)
        if is_async:
            async def wrapper(*a, **kw):
                t0 = time.monotonic()
                try:
                    return await original(*a, **kw)
                finally:
                    DIAG.setdefault(name, []).append(time.monotonic() - t0)
        else:
            def wrapper(*a, **kw):
                t0 = time.monotonic()
                try:
                    return original(*a, **kw)
                finally:
                    DIAG.setdefault(name, []).append(time.monotonic() - t0)
        setattr(cls, name, wrapper)

    timed(Matchmaker, "_withdraw")
    timed(Matchmaker, "_candidates")
    timed(Matchmaker, "_lead")
    timed(Matchmaker, "_follow")
    timed(AllReduceRound, "__init__", is_async=False)
    timed(DHTNode, "store")


class MemoryWatch:
    """--diag: peak RSS and peak bytes held unread in the p2p connections, sampled every 5 ms."""

    def __init__(self) -> None:
        import threading

        self.node: DHTNode | None = None
        self.peak_rss = self.peak_buffered = 0
        self.rss_at_buffered_peak = 0
        self._page = os.sysconf("SC_PAGE_SIZE")
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(0.005)
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * self._page
            buffered = 0
            if self.node is not None:
                try:
                    buffered = sum(c._buffered for c in list(self.node.p2p._connections))
                except RuntimeError:
                    pass
            self.peak_rss = max(self.peak_rss, rss)
            if buffered > self.peak_buffered:
                self.peak_buffered, self.rss_at_buffered_peak = buffered, rss

    def take(self) -> dict:
        out = {"peak_rss_mb": self.peak_rss / 1e6, "peak_unread_mb": self.peak_buffered / 1e6,
               "rss_at_unread_peak_mb": self.rss_at_buffered_peak / 1e6}
        self.peak_rss = self.peak_buffered = self.rss_at_buffered_peak = 0
        return out


WATCH: MemoryWatch | None = None


def _membership(args: argparse.Namespace) -> tuple:
    """--membership-authority: this peer certifies itself with the run's authority key (a benchmark
    shortcut: a real member receives its certificate from whoever holds the key)."""
    if not args.membership_authority:
        return None, None
    from p2p import Identity
    from p2p.membership import Authority, Membership

    identity = Identity()
    authority = Authority.from_file(args.membership_authority, args.membership_run, create=False)
    cert = authority.issue(identity.peer_id, 3600)
    return identity, Membership(authority.run, authority.public_key, cert)


async def main(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()

    async def command() -> list[str]:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        return line.split() or ["quit"]  # the parent went away: stop

    idx = sample_indices(args.size)
    tensor = torch.empty(args.size, dtype=torch.float32)
    fill(tensor, args.seed)
    if args.floor:  # the memory floor: these imports and this vector, no averaging
        describe(tensor, idx)
        emit({"rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss})
        return
    emit({"hello": os.getpid()})
    cmd = await command()
    if cmd[0] != "init":
        return
    initial = [] if len(cmd) < 2 or cmd[1] == "-" else [cmd[1]]
    identity, membership = _membership(args)
    node = await DHTNode.create(initial, host=args.host, client_mode=args.client_mode, identity=identity,
                                p2p_options={"membership": membership} if membership else None)
    if WATCH is not None:
        WATCH.node = node
    emit({"ready": True, "addr": str(node.address) if node.address is not None else None})
    averager: DecentralizedAverager | None = None
    try:
        while True:
            cmd = await command()
            if cmd[0] == "avg":  # avg <prefix> <group size> <Mbit/s | measured>: a fresh averager on this node
                if averager is not None:
                    await averager.shutdown()
                averager = DecentralizedAverager(
                    [tensor], node, cmd[1], target_group_size=int(cmd[2]),
                    bandwidth=None if cmd[3] == "measured" else float(cmd[3]),
                    min_matchmaking_time=args.min_matchmaking_time, allreduce_timeout=args.allreduce_timeout,
                    byzantine=args.byzantine,
                    **({"chunk_size": args.chunk_size} if args.chunk_size else {}),
                    **({"window": args.window} if args.window else {}))
                emit({"avg_ready": cmd[1]})
            elif cmd[0] == "probe" and averager is not None:  # probe <address,address,...>: measure our upload
                figure = await averager.probe_bandwidth(cmd[1].split(",") if len(cmd) > 1 else [])
                emit({"probed": figure, "bandwidth": averager.bandwidth})
            elif cmd[0] == "prep":
                rnd = int(cmd[1])
                fill(tensor, args.seed + 1000 * (rnd + 1))
                emit({"prepped": rnd, **describe(tensor, idx)})
            elif cmd[0] == "go" and averager is not None:
                rnd = int(cmd[1])
                if WATCH is not None:
                    WATCH.take()
                cpu0 = time.process_time()
                t_start = time.monotonic()
                result = await averager.step(timeout=args.step_timeout)
                t_end = time.monotonic()
                cpu = time.process_time() - cpu0
                emit({"round": rnd, "t_start": t_start, "t_end": t_end, "cpu_s": cpu, "group_size": result.group_size,
                      "failed": len(result.failed_peers), "matchmaking_time": result.matchmaking_time,
                      "allreduce_time": result.allreduce_time, "part_sizes": result.part_sizes,
                      "my_index": result.my_index, "bytes_sent": result.bytes_sent,
                      "bytes_received": result.bytes_received, "bandwidth": averager.bandwidth,
                      **describe(tensor, idx),
                      **({"diag": {**{k: [round(x, 4) for x in v] for k, v in DIAG.items()},
                                   **(WATCH.take() if WATCH is not None else {})}} if args.diag else {})})
                DIAG.clear()
            else:
                break
    finally:
        if averager is not None:
            await averager.shutdown()
        await node.shutdown()
    emit({"rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss})


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--membership-authority", metavar="PATH", help="run membership on, with this authority key")
    parser.add_argument("--membership-run", default="bench", help="the run the certificates name")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--byzantine", default="off", choices=["off", "clip", "verify"],
                        help="how far reducers are trusted (averaging.robust.Byzantine)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--client-mode", action="store_true")
    parser.add_argument("--min-matchmaking-time", type=float, default=30.0)
    parser.add_argument("--allreduce-timeout", type=float, default=120.0)
    parser.add_argument("--step-timeout", type=float, default=150.0)
    parser.add_argument("--profile", default="", help="write cProfile stats of the whole run to this path")
    parser.add_argument("--diag", action="store_true", help="report how long matchmaking's phases took")
    parser.add_argument("--whatif-isfinite", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--whatif-bg-withdraw", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--chunk-size", type=int, default=0, help="DecentralizedAverager chunk_size (0: default)")
    parser.add_argument("--floor", action="store_true", help="fill the vector, report peak RSS and exit")
    parser.add_argument("--window", type=int, default=0, help="DecentralizedAverager window (0: default)")
    args = parser.parse_args()
    if args.whatif_isfinite:  # diagnosis only: what the finiteness checks cost (torch.isfinite, this process)
        _isfinite = torch.isfinite
        torch.isfinite = lambda x: _isfinite(torch.stack(torch.aminmax(x))) if x.numel() else _isfinite(x)
    if args.whatif_bg_withdraw:  # diagnosis only: matchmaking without awaiting the DHT withdrawal
        from averaging.matchmaking import Matchmaker

        _withdraw, _tasks = Matchmaker._withdraw, set()

        async def background_withdraw(self, key, expiration):
            task = asyncio.get_running_loop().create_task(_withdraw(self, key, expiration))
            _tasks.add(task)
            task.add_done_callback(_tasks.discard)
        Matchmaker._withdraw = background_withdraw
    if args.diag:
        instrument()
        WATCH = MemoryWatch()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.profile:
        import cProfile

        prof = cProfile.Profile(time.process_time)  # CPU time: peers share the cores
        prof.enable()
        try:
            uvloop.run(main(args))
        finally:
            prof.disable()
            prof.dump_stats(args.profile)
    else:
        uvloop.run(main(args))
