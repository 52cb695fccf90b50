"""One hivemind training peer for ``bench_training.py --vs-hivemind``.

Runs ONLY with the reference library's separate virtualenv (``.bench-venv/bin/python``, made by
``make bench-env``); it imports nothing from this project.  It trains the same task as
``python -m orchestrator.cli.main worker --task synthetic``: regression onto a fixed random teacher
(seeded 1234; 32 -> 64 tanh -> 1), batches of 32 drawn from a generator seeded with ``--seed``,
the same initial weights (``torch.manual_seed(0)``), Adam lr 3e-3, with ``hivemind.Optimizer``
(synchronous: ``use_local_updates=False``) accumulating ``--target-batch-size`` samples per epoch.

Protocol, the same as the project's worker where it matters: the first stdout line is
``worker <peer id> listening at <multiaddr>``; then it waits for a line ``go`` on stdin (the
parent sends it once every peer is up) and for ``--min-peers`` peers to appear under a barrier key
in the DHT (the equivalent of the worker's ``--min-peers``), trains, and appends one JSON line per
epoch (``opt.local_epoch`` advanced) to ``--report-file``: epoch, loss, samples_per_second, peers
(the tracker's ``global_progress.num_peers``), params (digest), time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import select
import signal
import sys
import time

import hivemind
import torch
from hivemind.utils import get_dht_time
from torch import nn

# ---- the task (an equivalent of workers/task.py: synthetic_task) ----------------------------------
IN_FEATURES, HIDDEN, BATCH_SIZE, LR = 32, 64, 32, 3e-3


def teacher() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    w1 = torch.randn(IN_FEATURES, HIDDEN, generator=g) / math.sqrt(IN_FEATURES)
    w2 = torch.randn(HIDDEN, 1, generator=g) / math.sqrt(HIDDEN)
    return w1, w2


def batches(seed: int):
    w1, w2 = teacher()
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(BATCH_SIZE, IN_FEATURES, generator=g)
        yield x, torch.tanh(x @ w1) @ w2


def make_model() -> nn.Module:
    torch.manual_seed(0)  # every peer starts from the same weights (Task.model(seed=0))
    return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def params_digest(params) -> str:
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--target-batch-size", type=int, default=128)
    parser.add_argument("--max-epochs", type=int, required=True)
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument("--start-timeout", type=float, default=120.0)
    parser.add_argument("--matchmaking-time", type=float, default=5.0)
    parser.add_argument("--averaging-timeout", type=float, default=30.0)
    parser.add_argument("--report-file", required=True)
    parser.add_argument("--min-peers", type=int, default=1, help="wait until this many peers are in the DHT")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # the parent ends the run with SIGTERM: leave through the finally below (hivemind's shutdown
    # stops its daemons and removes their sockets), not at once
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    torch.set_num_threads(1)

    model = make_model()
    dht = hivemind.DHT(initial_peers=args.initial_peers, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    opt = hivemind.Optimizer(
        dht=dht, run_id=args.run, batch_size_per_step=BATCH_SIZE, target_batch_size=args.target_batch_size,
        params=model.parameters(), optimizer=lambda params: torch.optim.Adam(params, lr=LR),
        use_local_updates=False, matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout,
        verbose=False)
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    print(f"worker {dht.peer_id} listening at {maddrs[0] if maddrs else '-'}", flush=True)
    ready, _, _ = select.select([sys.stdin], [], [], args.start_timeout)
    if not ready or sys.stdin.readline().strip() != "go":
        print("no 'go' from the parent; leaving", file=sys.stderr, flush=True)
        opt.shutdown()
        dht.shutdown()
        return

    # the equivalent of the worker's --min-peers: everyone waits until all peers have joined the DHT
    # (hivemind's progress tracker only publishes a peer once it has accumulated samples, so the
    # barrier uses its own key)
    barrier = f"{args.run}_bench_barrier"
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        dht.store(barrier, subkey=str(dht.peer_id), value=True, expiration_time=get_dht_time() + 600)
        found = dht.get(barrier, latest=True)
        if found is not None and isinstance(found.value, dict) and len(found.value) >= args.min_peers:
            break
        time.sleep(0.1)
    else:
        print(f"fewer than {args.min_peers} peers after {args.start_timeout:.0f} s", file=sys.stderr, flush=True)

    report = open(args.report_file, "a")
    data = batches(args.seed)
    loss_fn = nn.functional.mse_loss
    started = time.monotonic()
    samples, window_start, losses = 0, time.monotonic(), []
    try:
        while opt.local_epoch < args.max_epochs and time.monotonic() - started < args.max_seconds:
            x, y = next(data)
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            losses.append(loss.item())
            samples += BATCH_SIZE
            before = opt.local_epoch
            opt.step()
            if opt.local_epoch != before:
                elapsed = max(time.monotonic() - window_start, 1e-9)
                record = {"epoch": opt.local_epoch, "loss": sum(losses) / len(losses),
                          "samples_per_second": samples / elapsed,
                          "peers": opt.tracker.global_progress.num_peers,
                          "params": params_digest(model.parameters()), "time": time.time()}
                report.write(json.dumps(record) + "\n")
                report.flush()
                samples, window_start, losses = 0, time.monotonic(), []
    finally:
        report.close()
        opt.shutdown()
        dht.shutdown()


if __name__ == "__main__":
    main()
