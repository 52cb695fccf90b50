"""One process of ``bench_scale.py``'s swarm: many peers' DHT nodes and progress views on one event loop.

Each peer is a real DHT node on loopback TCP with the run's validators and a ``ProgressTracker`` on
the run's layout; it "trains" by adding samples at its own speed and steps its epoch when its view
says the global batch is complete (a peer whose view shows a later epoch catches up, as loading
state would).  No thread or interpreter per peer.

Protocol: argv[1] is a JSON object of settings; the child prints ``{"ready": [addresses]}``, waits
for a ``go <wall time>`` line, runs ``duration`` seconds from then, and prints ``{"result": {...}}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import resource
import signal
import sys
import time
from dataclasses import dataclass, field

from benchmarks._common import emit
from dht import DHTNode
from p2p import Identity, PeerUnreachable
from workers.progress import PeerProgress, ProgressTracker
from workers.progress_tree import ProgressLayout
from workers.run_keys import run_validators

logger = logging.getLogger("scale_peers")
RUN = "scale"
TICK = 0.2  # seconds between a peer's simulated micro-steps
REPORT_EVERY = 1.0  # seconds between its reports, but for a step's, which goes out at once


@dataclass
class Peer:
    tracker: ProgressTracker
    speed: float  # samples per second
    epoch: int = 0
    samples: float = 0.0
    closed: bool = False
    seen: dict[int, float] = field(default_factory=dict)  # epoch -> when this peer's view first showed it
    joined: float = 0.0  # when its view first read the swarm
    steps: list[tuple[int, float, int]] = field(default_factory=list)  # (epoch done, when, live peers seen)


async def make_peer(settings: dict, initial: list[str], rng: random.Random) -> Peer:
    identity = Identity()
    validators = run_validators(RUN, identity)
    client = rng.random() < settings["client_fraction"] and bool(initial)
    for attempt in range(3):  # on a loaded machine an entrance may not answer within one call's timeout
        try:
            node = await DHTNode.create(initial, identity=identity, validators=validators, client_mode=client)
            break
        except PeerUnreachable:
            if attempt == 2:
                raise
    layout = ProgressLayout(RUN, capacity=settings["capacity"])
    tracker = ProgressTracker(node, RUN, settings["target"], validators[0], refresh_interval=settings["refresh"],
                              layout=layout)
    speed = settings["speed"] * rng.choice([1.0, 2.0, 4.0])  # compute that differs 4x
    return Peer(tracker, speed)


async def train(peer: Peer, end: float, violations: list[str]) -> None:
    """Add samples, publish, step when the view says the batch is complete (as DeDLOC's peers do)."""
    tracker = peer.tracker
    await tracker.start_view()
    peer.joined = time.time()
    reported = 0.0
    while time.time() < end and not peer.closed:
        peer.samples += peer.speed * TICK
        view = tracker.view()
        now = time.time()
        if view.epoch not in peer.seen:
            peer.seen[view.epoch] = now
        if view.epoch > peer.epoch:
            peer.epoch, peer.samples = view.epoch, 0.0  # behind: load the state, do not step
        elif view.ready:
            if view.live_peers <= 1:
                violations.append(f"epoch {peer.epoch}: stepped seeing no other live peer")
            rest = tracker.rest
            if tracker.layout.depth > 1 and (rest is None or tracker.now() - rest.time > tracker.fresh_for):
                violations.append(f"epoch {peer.epoch}: stepped on a stale view of the rest of the swarm")
            peer.steps.append((peer.epoch, now, view.live_peers))
            peer.epoch, peer.samples = peer.epoch + 1, 0.0
            peer.seen.setdefault(peer.epoch, now)
            reported = 0.0
        if now - reported >= REPORT_EVERY:
            reported = now
            tracker.publish(PeerProgress(epoch=peer.epoch, samples=int(peer.samples),
                                         samples_per_second=peer.speed, time=tracker.now()))
        await asyncio.sleep(TICK)  # a micro-step's compute


def traffic(peers: list[Peer]) -> tuple[int, int]:
    """DHT messages and bytes, both ways, summed over ``peers``."""
    totals = [p.tracker.node.p2p.traffic.total(["dht."]) for p in peers]
    return sum(t.messages for t in totals), sum(t.bytes for t in totals)


def dump_tasks() -> None:
    """SIGUSR1: every task's stack to stderr (what a child that stopped answering waits on)."""
    for task in asyncio.all_tasks():
        task.print_stack(limit=6, file=sys.stderr)


async def main(settings: dict) -> None:
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_tasks)
    rng = random.Random(settings["seed"])
    initial = list(settings["initial"])
    peers: list[Peer] = []
    for _ in range(settings["n"]):
        peer = await make_peer(settings, initial, rng)
        peers.append(peer)
        if not initial and peer.tracker.node.address is not None:
            initial = [str(peer.tracker.node.address)]
    entrances = [p for p in peers if p.tracker.node.address is not None][:3]  # others join through these
    emit({"ready": [str(p.tracker.node.address) for p in entrances]})
    logger.info("ready: %d peers", len(peers))
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    start = float(line.split()[1])
    end = start + settings["duration"]
    await asyncio.sleep(max(start - time.time(), 0.0))
    violations: list[str] = []
    tasks = [asyncio.ensure_future(train(p, end, violations)) for p in peers]
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    window = (start + settings["warmup"], end - 0.5)
    await asyncio.sleep(max(window[0] - time.time(), 0.0))
    for p in peers:
        p.tracker.node.p2p.traffic.reset()
    counted = {id(p): p.tracker.refreshes for p in peers}
    if settings.get("close_count"):
        await asyncio.sleep(max(start + settings["close_at"] - time.time(), 0.0))
        # closed without a word, no withdrawal (not the entrances: others join through them)
        others = [p for p in peers if p not in entrances]
        for p in rng.sample(others, min(settings["close_count"], len(others))):
            p.closed = True
            await p.tracker.node.shutdown()
        for _ in range(sum(p.closed for p in peers)):  # and replaced
            newcomer = await make_peer(settings, initial, rng)
            newcomer.epoch = max(p.epoch for p in peers if not p.closed)
            peers.append(newcomer)
            counted[id(newcomer)] = 0
            tasks.append(asyncio.ensure_future(train(newcomer, end, violations)))
    await asyncio.sleep(max(window[1] - time.time(), 0.0))
    live = [p for p in peers if not p.closed]
    logger.info("window over %.1f s late; %d peers, refreshes %s", time.time() - window[1], len(live),
                sum(p.tracker.refreshes for p in live))
    msgs, nbytes = traffic(live)
    refreshes = sum(p.tracker.refreshes - counted[id(p)] for p in live)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    await asyncio.gather(*tasks, return_exceptions=True)
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * resource.getpagesize()
    emit({"result": {
        "peers": len(live), "messages": msgs, "bytes": nbytes, "refreshes": refreshes,
        "seconds": window[1] - window[0],
        "cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime), "rss": rss,
        "steps": [s for p in peers for s in p.steps], "seen": [{"joined": p.joined, "epochs": p.seen} for p in live],
        "violations": violations[:20], "violation_count": len(violations)}})
    await asyncio.gather(*(p.tracker.node.shutdown() for p in live))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logger.setLevel(logging.INFO)
    asyncio.run(main(json.loads(sys.argv[1])))
