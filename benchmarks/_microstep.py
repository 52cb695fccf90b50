"""Child of bench_training.py: what a collaborative micro-step costs over plain gradient accumulation.

Two CollaborativeOptimizer peers (two DHT nodes on loopback, one process) train the charlm
task's model with a global batch far larger than the run, so every step is a micro-step.  The
step of peer A is timed (``step(batch)`` after the gradients exist), and so is what a local loop
over the wrapped torch optimizer does on a micro-step instead: adding the gradients into
accumulators.  Peer B steps on a thread meanwhile, so A's view holds a live peer.  Also timed: one
blocking read of the swarm's progress from the DHT, what a micro-step would pay for a lookup.

``--device cuda``: both models, their gradients and the accumulators on the GPU.

Prints one JSON line: medians and p90s in microseconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from _common import emit, percentile  # noqa: E402

from dht import DHT, SignatureValidator  # noqa: E402
from p2p import Identity  # noqa: E402
from workers.collaborative import CollaborativeOptimizer  # noqa: E402
from workers.task import load_task  # noqa: E402


def make_peer(initial: list[str], device: torch.device) -> tuple[DHT, CollaborativeOptimizer, torch.nn.Module]:
    identity = Identity()
    dht = DHT(initial, host="127.0.0.1", validators=[SignatureValidator(identity)], identity=identity)
    task = load_task("charlm")
    model = task.model(seed=0).to(device)  # before its optimizer sees it
    opt = CollaborativeOptimizer(task.make_optimizer(model.parameters()), dht, "microstep",
                                 target_batch_size=10**12, load_state_on_start=bool(initial))
    return dht, opt, model


def fill_grads(model: torch.nn.Module, grads: list[torch.Tensor]) -> None:
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g.clone()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    # on a GPU both timed regions wait for their kernels: each then counts the work it queued, not its launch
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dht_a, opt_a, model_a = make_peer([], device)
    dht_b, opt_b, model_b = make_peer(dht_a.addresses, device)
    grads = [torch.randn_like(p) for p in model_a.parameters()]
    stop = threading.Event()

    def peer_b() -> None:
        while not stop.is_set():
            fill_grads(model_b, grads)
            opt_b.step(16)
            time.sleep(0.001)

    other = threading.Thread(target=peer_b, daemon=True)
    other.start()
    accumulators = [torch.zeros_like(g) for g in grads]
    step_us, plain_us, read_us = [], [], []
    def timed_step() -> None:
        fill_grads(model_a, grads)
        sync()
        t = time.perf_counter()
        opt_a.step(16)
        sync()
        step_us.append((time.perf_counter() - t) * 1e6)

    def timed_plain() -> None:
        fill_grads(model_a, grads)
        sync()
        t = time.perf_counter()
        for p, acc in zip(model_a.parameters(), accumulators, strict=True):  # what a local loop does instead
            acc.add_(p.grad)
            p.grad = None
        sync()
        plain_us.append((time.perf_counter() - t) * 1e6)

    for i in range(args.steps):
        for timed in ((timed_step, timed_plain) if i % 2 else (timed_plain, timed_step)):  # neither always first
            timed()
        if i % 20 == 0:
            t = time.perf_counter()
            dht_a.run_coroutine(lambda _n: opt_a.tracker.global_progress())
            read_us.append((time.perf_counter() - t) * 1e6)
    view = opt_a.tracker.view()
    stop.set()
    other.join()
    for opt, dht in ((opt_b, dht_b), (opt_a, dht_a)):
        opt.prepare_to_leave()
        dht.shutdown()
    step_med, plain_med = percentile(step_us, 0.5), percentile(plain_us, 0.5)
    emit({"steps": args.steps, "device": device.type, "params": sum(g.numel() for g in grads),
          "live_peers_seen": view.live_peers,
          "step_us_p50": step_med, "step_us_p90": percentile(step_us, 0.9),
          "accumulate_us_p50": plain_med, "accumulate_us_p90": percentile(plain_us, 0.9),
          "overhead_us_p50": step_med - plain_med, "dht_read_us_p50": percentile(read_us, 0.5)})


if __name__ == "__main__":
    main()
