"""One process of ``bench_scale.py``'s training part: many real DeDLOC peers sharing one event loop.

Each peer is the real stack: a DHT node on loopback TCP with the run's validators, a
``CollaborativeOptimizer`` (progress in the run's tree of keys, matchmaking, butterfly all-reduce in
groups of groups when the swarm is larger than ``group_size``, state hand-off to newcomers) over a
tiny regression model, so that what is measured is the control plane and averaging.  Every peer's
networking runs on the process's one event loop (``DHT(loop=...)``); its training loop is a thread,
because the optimizer's API is blocking, which sleeps between micro-steps to train at its own
speed (compute that differs 4x).

Protocol: argv[1] is a JSON object of settings; the child prints ``{"ready": [addresses]}``, waits
for a ``go <wall time>`` line, trains ``duration`` seconds from then, and prints ``{"result": {...}}``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import resource
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import uvloop

from benchmarks._common import emit
from dht import DHT
from p2p import Identity, PeerUnreachable
from workers.collaborative import CollaborativeOptimizer
from workers.run_keys import run_validators

logger = logging.getLogger("scale_trainers")
RUN = "scaletrain"
FEATURES = 16
BATCH = 4  # samples per micro-step
CONTROL = ("dht.", "avg.join.")  # the control plane: DHT calls and matchmaking joins (all-reduce is data)


@dataclass
class Trainer:
    dht: DHT
    opt: CollaborativeOptimizer
    model: torch.nn.Linear
    tick: float  # seconds of "compute" per micro-step
    rng: random.Random
    closed: bool = False
    stepped: dict[int, list[float]] = field(default_factory=dict)  # epoch reached by its own step -> params
    step_times: list[tuple[int, float]] = field(default_factory=list)  # (epoch reached, wall time)
    rounds: list[tuple[float, float]] = field(default_factory=list)  # per step: matchmaking s, all-reduce s
    loaded: int = 0  # epochs reached by loading state
    error: str = ""


def make_trainer(settings: dict, initial: list[str], loop, rng: random.Random, newcomer: bool) -> Trainer:
    identity = Identity()
    client = rng.random() < settings["client_fraction"] and bool(initial)
    for attempt in range(3):  # on a loaded machine an entrance may not answer within one call's timeout
        try:
            dht = DHT(initial, host="127.0.0.1", identity=identity, validators=run_validators(RUN, identity),
                      client_mode=client, loop=loop)
            break
        except PeerUnreachable:
            if attempt == 2:
                raise
    torch.manual_seed(0)  # every peer starts from the same parameters; a newcomer loads the swarm's
    model = torch.nn.Linear(FEATURES, 1)
    opt = CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), dht, RUN, settings["target"],
                                 max_group_size=settings["group_size"], swarm_size=settings["capacity"],
                                 min_matchmaking_time=1.0, averaging_timeout=settings["averaging_timeout"],
                                 report_interval=settings["report"], view_interval=settings["refresh"],
                                 fresh_for=settings["fresh_for"],
                                 load_state_on_start=newcomer)
    tick = settings["tick"] / rng.choice([1.0, 2.0, 4.0])
    return Trainer(dht, opt, model, tick, random.Random(rng.random()))


TEACHER = torch.linspace(-1, 1, FEATURES)


def train(t: Trainer, end: float) -> None:
    """Micro-steps until ``end``: a batch of the teacher's regression, then the collaborative step."""
    gen = torch.Generator().manual_seed(t.rng.randrange(2**31))
    try:
        while time.time() < end and not t.closed:
            x = torch.randn(BATCH, FEATURES, generator=gen)
            loss = torch.nn.functional.mse_loss(t.model(x).squeeze(1), x @ TEACHER)
            loss.backward()
            before = t.opt.epoch
            if t.opt.step(BATCH, float(loss)):
                t.stepped[t.opt.epoch] = [float(v) for p in t.model.parameters() for v in p.detach().flatten()]
                t.step_times.append((t.opt.epoch, time.time()))
                last = t.opt.history[-1]
                t.rounds.append((last.matchmaking_time, last.allreduce_time))
            elif t.opt.epoch > before:
                t.loaded += 1
            time.sleep(t.tick)
    except Exception as e:  # noqa: BLE001 - a closed peer's calls fail; anything else is reported
        if not t.closed:
            t.error = f"{type(e).__name__}: {e}"


def control_traffic(trainers: list[Trainer]) -> tuple[int, int, dict[str, int]]:
    """Control-plane messages and bytes, both ways, summed over ``trainers``; bytes by method too."""
    totals = [t.dht.node.p2p.traffic.total(CONTROL) for t in trainers]
    by_method: dict[str, int] = {}
    for t in trainers:
        for method, entry in t.dht.node.p2p.traffic.by_method.items():
            if method.startswith(CONTROL):
                name = method.split(".")[1] if method.startswith("dht.") else "matchmaking join"
                by_method[name] = by_method.get(name, 0) + entry.bytes
    return sum(x.messages for x in totals), sum(x.bytes for x in totals), by_method


def main(settings: dict) -> None:
    loop = uvloop.new_event_loop()
    threading.Thread(target=loop.run_forever, name="scale-loop", daemon=True).start()
    rng = random.Random(settings["seed"])
    initial = list(settings["initial"])
    trainers: list[Trainer] = []
    for _ in range(settings["n"]):
        trainers.append(make_trainer(settings, initial, loop, rng, newcomer=settings.get("newcomers", False)))
        if not initial and trainers[-1].dht.addresses:
            initial = trainers[-1].dht.addresses
    entrances = [t for t in trainers if t.dht.addresses][:3]  # others join through these
    emit({"ready": [t.dht.addresses[0] for t in entrances]})
    start = float(sys.stdin.readline().split()[1])
    end = start + settings["duration"]
    time.sleep(max(start - time.time(), 0.0))
    threads = [threading.Thread(target=train, args=(t, end), daemon=True) for t in trainers]
    for th in threads:
        th.start()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    window = (start + settings["warmup"], end - 0.5)
    time.sleep(max(window[0] - time.time(), 0.0))
    for t in trainers:
        t.dht.node.p2p.traffic.reset()
    epochs0 = {id(t): t.opt.epoch for t in trainers}
    if settings.get("close_count"):
        time.sleep(max(start + settings["close_at"] - time.time(), 0.0))
        others = [t for t in trainers if t not in entrances]
        for t in rng.sample(others, min(settings["close_count"], len(others))):
            t.closed = True  # gone without a word: no withdrawal, its calls cut mid-way
            t.dht.shutdown()
        for _ in range(sum(t.closed for t in trainers)):  # and replaced by newcomers that load state
            newcomer = make_trainer(settings, initial, loop, rng, newcomer=True)
            trainers.append(newcomer)
            epochs0[id(newcomer)] = newcomer.opt.epoch
            threads.append(threading.Thread(target=train, args=(newcomer, end), daemon=True))
            threads[-1].start()
    time.sleep(max(window[1] - time.time(), 0.0))
    live = [t for t in trainers if not t.closed]
    msgs, nbytes, by_method = control_traffic(live)
    epochs = sum(t.opt.epoch - epochs0[id(t)] for t in live)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    for th in threads:
        th.join(timeout=settings["averaging_timeout"] + 5)
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * resource.getpagesize()
    emit({"result": {
        "peers": len(live), "messages": msgs, "bytes": nbytes, "bytes_by_method": by_method, "peer_epochs": epochs,
        "seconds": window[1] - window[0],
        "cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime), "rss": rss,
        "stepped": [{str(e): p for e, p in t.stepped.items()} for t in trainers],
        "steps": [s for t in trainers for s in t.step_times],
        "rounds": [r for t in trainers for r in t.rounds],
        "loaded": sum(t.loaded for t in trainers),
        "errors": [t.error for t in trainers if t.error][:5],
        "stuck": sum(th.is_alive() for th in threads)}})
    for t in live:
        try:
            t.opt.prepare_to_leave()
        except Exception as e:  # noqa: BLE001 - leaving is best effort at the run's end
            logger.info("leaving: %s", e)
        t.dht.shutdown()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(threadName)s %(name)s %(message)s")
    logger.setLevel(logging.INFO)
    if os.environ.get("SPOTSWARM_SCALE_LOGS"):
        for name in ("workers", "averaging.grouped", "workers.collaborative", "workers.progress"):
            logging.getLogger(name).setLevel(logging.INFO if name == "workers" else logging.DEBUG)
    main(json.loads(sys.argv[1]))
