"""The torchft contender of ``bench_vs_torchft.py``: run in the benchmark-only virtualenv
(``make bench-env``), never with the project's dependencies.

torchft's fault-tolerant DDP, configured as its README and ``train_ddp.py`` example do:
- a lighthouse (``LighthouseServer``, ``min_replicas=1``, ``quorum_tick_ms=100``,
  ``join_timeout_ms=10000``, its default heartbeat timeout) in this driver process, which stands
  where spotswarm's supervisor runs;
- one replica group of one rank per instance, its own process: a ``Manager`` (``min_replica_size=1``,
  ``timeout=30 s``, live recovery through ``PGTransport`` with a 10-s timeout),
  ``ProcessGroupGloo(timeout=5 s)``, torchft's ``DistributedDataParallel`` and ``Optimizer`` wrappers.

One change to torchft: its DDP comm hook is replaced by one that survives a failed all-reduce
(``tolerant_ddp``).  As shipped (0.2.0), a peer's death mid-step kills every surviving replica with an
``AssertionError`` and the run restarts from step 0; with the change, the step is refused and the
survivors go on, as torchft's manager intends.

Each replica trains the project's task (``workers/task.py`` through ``_rival_task.py``): ``--accum``
micro-batches per step (gradients synchronized on the last), each first sleeping ``--device-ms`` for
an accelerator step, so that with every replica present a step covers the same global batch as a
spotswarm epoch.  A step whose quorum lost a replica covers fewer samples; the log says how many
replicas took part.

The instances come from the shared trace (``_rival_fleet.Fleet``): when one ends, its replica process
is SIGKILLed; the replacement's process starts once it is usable (``--provisioning-s`` after its
launch), joins the next quorum and recovers the model and optimizer live from a healthy replica.
torchft has no use for preemption notices.

Every replica appends a JSON line per step to ``--log``: wall time, the step, its own loss, whether
the step committed, whether it took part, and how many replicas did.  The run stops at
``--stop-file`` or after ``--limit-s``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rival_fleet import Fleet, add_arguments, append  # noqa: E402  (standard library only)
from _rival_task import load_task_module  # noqa: E402  (standard library only)

LIGHTHOUSE = {"min_replicas": 1, "quorum_tick_ms": 100, "join_timeout_ms": 10000}
MANAGER_TIMEOUT_S, GLOO_TIMEOUT_S, TRANSPORT_TIMEOUT_S = 30.0, 5.0, 10.0


def tolerant_ddp(ddp_class: type, torch: Any) -> type:
    """torchft's ``DistributedDataParallel`` with a comm hook that survives a peer's death.

    torchft 0.2.0's own hook asserts that the all-reduce's future is set, which it is not when the
    all-reduce failed (a peer died mid-step) or the manager had already errored: every surviving
    replica then dies of an ``AssertionError`` in the backward pass, and with all of them gone the
    run starts again from step 0.  This hook does what the manager intends: the error is already
    reported to it, so the local gradient is handed back, ``should_commit()`` refuses the step, and
    the next quorum goes on without the dead replica."""

    class TolerantDDP(ddp_class):  # type: ignore[misc, valid-type]
        @staticmethod
        def _comm_hook(state, bucket):  # type: ignore[no-untyped-def]  (DDP checks annotations: none)
            work = state.allreduce(bucket.buffer())
            if work.wait():
                fut = work.get_future()
                inner = getattr(fut, "_fut", None)  # torchft's managed future wraps the real one
                if inner is not None:
                    return inner
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

    return TolerantDDP


def replica(args: argparse.Namespace) -> None:
    """One replica group (one rank): train until the stop file appears."""
    import torch
    import torch.distributed as dist
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    torch.set_num_threads(1)
    task = load_task_module(args.root).load_task(args.task, batch_size=args.batch_size)
    model = task.model(seed=0)
    inner = task.make_optimizer(model.parameters())
    store = dist.TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=GLOO_TIMEOUT_S))
    manager = Manager(
        pg=pg, min_replica_size=1,
        load_state_dict=lambda state: (model.load_state_dict(state["model"]), inner.load_state_dict(state["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=f"slot{args.slot}-launch{args.launch}", store_addr="localhost", store_port=store.port, rank=0,
        world_size=1, lighthouse_addr=args.lighthouse, hostname="localhost",
        timeout=timedelta(seconds=MANAGER_TIMEOUT_S),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=TRANSPORT_TIMEOUT_S),
                                         device=torch.device("cpu")))
    ddp = tolerant_ddp(DistributedDataParallel, torch)(manager, model)
    optimizer = Optimizer(manager, inner)
    batches = task.batches(1000 * args.slot + args.launch)
    pause = args.device_ms / 1000.0
    append(args.log, {"kind": "start", "t": time.time(), "slot": args.slot})
    try:
        while not os.path.exists(args.stop_file):
            optimizer.zero_grad()  # starts the quorum
            total = 0.0
            for i in range(args.accum):
                with contextlib.nullcontext() if i == args.accum - 1 else ddp.no_sync():
                    time.sleep(pause)
                    loss = task.loss(ddp, next(batches)) / args.accum
                    loss.backward()
                total += float(loss.detach())
            before = manager.current_step()
            taking_part = manager.is_participating()  # a healing replica's gradients count for nothing
            optimizer.step()
            append(args.log, {"kind": "step", "t": time.time(), "slot": args.slot, "step": manager.current_step(),
                              "loss": total, "committed": manager.current_step() > before,
                              "participating": taking_part, "participants": manager.num_participants()})
    finally:
        manager.shutdown(wait=False)


class Replicas:
    """The replica processes, one per slot: started when a slot's instance is usable, SIGKILLed (with
    their process group) when it ends."""

    def __init__(self, args: argparse.Namespace, lighthouse: str) -> None:
        self.args, self.lighthouse = args, lighthouse
        self.procs: dict[int, subprocess.Popen] = {}
        self.launches = [0] * args.workers
        self.lock = threading.Lock()

    def start(self, slot: int) -> None:
        a = self.args
        self.launches[slot] += 1
        argv = [sys.executable, __file__, "--replica", "--slot", str(slot), "--launch", str(self.launches[slot]),
                "--lighthouse", self.lighthouse, "--root", a.root, "--task", a.task, "--batch-size", str(a.batch_size),
                "--accum", str(a.accum), "--device-ms", str(a.device_ms), "--log", a.log, "--stop-file", a.stop_file]
        with self.lock, open(Path(a.stderr_dir, f"slot{slot}.log"), "ab") as err:
            self.procs[slot] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)

    def kill(self, slot: int) -> int | None:
        with self.lock:
            proc = self.procs.pop(slot, None)
        if proc is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the instance and everything on it
        proc.wait()
        return proc.pid

    def kill_all(self) -> None:
        for slot in list(self.procs):
            self.kill(slot)


def driver(args: argparse.Namespace) -> None:
    import json

    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", **LIGHTHOUSE)
    address = "http://localhost:" + lighthouse.address().rsplit(":", 1)[1]
    args.stderr_dir = args.stderr_dir or tempfile.mkdtemp(prefix="torchft-replicas-")
    usable = str(Path(args.stderr_dir, "usable.json"))
    replicas = Replicas(args, address)
    lifetimes = json.loads(Path(args.trace).read_text()) if args.trace else []
    fleet = Fleet(args.workers, lifetimes, args.provisioning_s, args.log, usable, kill=replicas.kill,
                  arrive=replicas.start)
    fleet.start()
    deadline = time.monotonic() + args.limit_s
    try:
        while time.monotonic() < deadline and not os.path.exists(args.stop_file):
            time.sleep(0.2)  # the parent's stop file, or the limit
        Path(args.stop_file).touch()
    finally:
        fleet.close()
        replicas.kill_all()
        lighthouse.shutdown()
        append(args.log, {"kind": "end", "t": time.time()})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica", action="store_true", help="run one replica group (the driver starts them)")
    parser.add_argument("--slot", type=int, default=0)
    parser.add_argument("--launch", type=int, default=0)
    parser.add_argument("--lighthouse", default=None)
    add_arguments(parser)
    parser.add_argument("--stderr-dir", default=None, help="each slot's replicas' stderr, appended")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    replica(args) if args.replica else driver(args)


if __name__ == "__main__":
    main()
