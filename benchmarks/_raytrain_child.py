"""The Ray Train contender of ``bench_vs_raytrain.py``: run in the benchmark-only virtualenv
(``make bench-env``), never with the project's dependencies.

A ``TorchTrainer`` (Ray Train V2) trains the project's task (``workers/task.py``, loaded as a
standalone module: the package itself needs the project's dependencies) with
DistributedDataParallel over gloo: each of ``--workers`` workers runs ``--accum`` micro-batches per
step (gradients synchronized on the last), so a step covers the same global batch as a spotswarm
epoch; every micro-batch sleeps ``--device-ms`` first, standing in for an accelerator step, as the
spotswarm run's task does.  ``FailureConfig(max_failures=-1)``: any worker's death restarts the whole
group from the latest checkpoint, written every ``--checkpoint-every`` steps.

The instances are the worker slots (rank r runs on instance r).  Each instance's lifetime comes from
the shared trace (one lifetime per launch, in launch order, from its launch): when it ends, the worker
on it is SIGKILLed and the replacement is usable ``--provisioning-s`` later; a (re)started worker
group waits until every slot's instance is usable (the driver keeps those times in a JSON file), as
it would wait for a new node to join.

Rank 0 appends one JSON line per step to ``--log`` (wall time, step, global mean loss); the driver
appends launches and kills.  The run stops at ``--stop-file`` (the parent writes it once the target
loss is reached) or after ``--limit-s``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import start_time  # noqa: E402  (standard library only)


def load_task_module(root: str) -> Any:
    spec = importlib.util.spec_from_file_location("spotswarm_task", Path(root) / "workers" / "task.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["spotswarm_task"] = module
    spec.loader.exec_module(module)
    return module


def append(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def wait_for_instances(usable_file: str) -> None:
    """Every instance of the group must be up: a replacement is usable only after its provisioning."""
    while True:
        try:
            ready = max(json.loads(Path(usable_file).read_text()))
        except (ValueError, FileNotFoundError):  # not written yet
            ready = time.time() + 0.05
        if time.time() >= ready:
            return
        time.sleep(min(ready - time.time(), 0.5))  # re-read: another instance may end meanwhile


def train_func(config: dict) -> None:
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    task = load_task_module(config["root"]).load_task(config["task"], batch_size=config["batch_size"])
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    Path(config["pids"], f"{rank}.pid").write_text(f"{os.getpid()} {start_time(os.getpid())}")
    wait_for_instances(config["usable"])
    model = task.model(seed=0)
    optimizer = task.make_optimizer(model.parameters())
    step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d) / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
    if rank == 0:
        append(config["log"], {"kind": "start", "t": time.time(), "step": step})
    model = ray.train.torch.prepare_model(model)
    batches = task.batches(1000 * rank + step)  # a fresh stream after every restart
    accum, pause = config["accum"], config["device_ms"] / 1000.0
    while True:
        total = 0.0
        for i in range(accum):
            sync = contextlib.nullcontext() if i == accum - 1 else model.no_sync()
            with sync:
                time.sleep(pause)
                loss = task.loss(model, next(batches)) / accum
                loss.backward()
            total += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        agreed = torch.tensor([total, float(os.path.exists(config["stop_file"]))])
        dist.all_reduce(agreed)  # the global mean loss, and a stop every rank sees at the same step
        if rank == 0:
            append(config["log"], {"kind": "step", "t": time.time(), "step": step, "loss": float(agreed[0]) / world})
        if step % config["checkpoint_every"] == 0:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                "step": step}, Path(d) / "state.pt")
                ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0
                                 else None)
        if agreed[1] > 0:
            return


class Fleet:
    """The instances: lifetimes from the trace, SIGKILL of the worker on an instance that ends, and the
    time each slot's (replacement) instance becomes usable."""

    def __init__(self, args: argparse.Namespace, lifetimes: list[float], t0: float) -> None:
        self.args, self.lifetimes, self.t0 = args, list(lifetimes), t0
        self.stop = threading.Event()
        self.usable = [t0 + args.provisioning_s] * args.workers
        # kill time per slot: every instance, the first ones included, is usable provisioning_s after its launch
        self.ends = [self.launch(slot, t0) for slot in range(args.workers)]

    def launch(self, slot: int, at: float) -> float:
        lifetime = self.lifetimes.pop(0) if self.lifetimes else float("inf")
        append(self.args.log, {"kind": "launch", "t": at, "slot": slot, "lifetime": lifetime})
        self.usable[slot] = at + self.args.provisioning_s
        tmp = Path(self.args.usable + ".tmp")
        tmp.write_text(json.dumps(self.usable))
        tmp.replace(self.args.usable)  # workers never read a half-written file
        return at + lifetime

    def run(self) -> None:
        while not self.stop.is_set():
            now = time.time()
            for slot, end in enumerate(self.ends):
                if now >= end:
                    self.kill(slot, end)
                    self.ends[slot] = self.launch(slot, now)
            self.stop.wait(0.05)  # the trace's clock: checked every 50 ms

    def kill(self, slot: int, at: float) -> None:
        pid_file = Path(self.args.pids, f"{slot}.pid")
        killed = None
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            pid, started = (int(x) for x in pid_file.read_text().split())
            if start_time(pid) == started:  # that worker, not a later process with its pid
                os.kill(pid, signal.SIGKILL)
                killed = pid
        append(self.args.log, {"kind": "kill", "t": time.time(), "due": at, "slot": slot, "pid": killed})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--task", default="charlm")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--accum", type=int, required=True)
    parser.add_argument("--device-ms", type=float, default=0.0)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--provisioning-s", type=float, default=2.0)
    parser.add_argument("--trace", default=None, help="JSON list of lifetimes (real s), in launch order")
    parser.add_argument("--log", required=True)
    parser.add_argument("--stop-file", required=True)
    parser.add_argument("--limit-s", type=float, default=600.0)
    parser.add_argument("--storage", required=True)
    args = parser.parse_args()
    args.pids = tempfile.mkdtemp(prefix="raytrain-pids-")
    args.usable = str(Path(args.pids, "usable.json"))

    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(num_cpus=args.workers + 1, include_dashboard=False,
             logging_level="WARNING", runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    lifetimes = json.loads(Path(args.trace).read_text()) if args.trace else []
    t0 = time.time()
    fleet = Fleet(args, lifetimes, t0)
    killer = threading.Thread(target=fleet.run, name="fleet", daemon=True)
    killer.start()
    timer = threading.Timer(args.limit_s, lambda: Path(args.stop_file).touch())
    timer.start()
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"root": args.root, "task": args.task, "batch_size": args.batch_size, "accum": args.accum,
                           "device_ms": args.device_ms, "checkpoint_every": args.checkpoint_every,
                           "log": args.log, "stop_file": args.stop_file, "pids": args.pids,
                           "usable": args.usable},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False,
                                     resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="vs-spotswarm", storage_path=args.storage,
                             failure_config=FailureConfig(max_failures=-1),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    )
    try:
        trainer.fit()
        append(args.log, {"kind": "end", "t": time.time()})
    finally:
        timer.cancel()
        fleet.stop.set()
        killer.join(5)
        ray.shutdown()


if __name__ == "__main__":
    main()
