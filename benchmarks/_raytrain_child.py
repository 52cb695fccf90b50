"""The Ray Train contender of ``bench_vs_raytrain.py``: run in the benchmark-only virtualenv
(``make bench-env``), never with the project's dependencies.

A ``TorchTrainer`` (Ray Train V2) trains the project's task (``workers/task.py``, loaded as a
standalone module by ``_rival_task.py``: the package itself needs the project's dependencies) with
DistributedDataParallel over gloo: each of ``--workers`` workers runs ``--accum`` micro-batches per
step (gradients synchronized on the last), so a step covers the same global batch as a spotswarm
epoch; every micro-batch sleeps ``--device-ms`` first, standing in for an accelerator step, as the
spotswarm run's task does.  ``FailureConfig(max_failures=-1)``: any worker's death restarts the whole
group from the latest checkpoint, written every ``--checkpoint-every`` steps.

The instances are the worker slots (rank r runs on instance r), simulated by ``_rival_fleet.Fleet``
from the shared trace: when one ends, the worker on it is SIGKILLed and the replacement is usable
``--provisioning-s`` later; a (re)started worker group waits until every slot's instance is usable
(the fleet keeps those times in a JSON file), as it would wait for a new node to join.

Rank 0 appends one JSON line per step to ``--log`` (wall time, step, global mean loss); the driver
appends launches and kills.  The run stops at ``--stop-file`` (the parent writes it once the target
loss is reached) or after ``--limit-s``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import start_time  # noqa: E402  (standard library only)
from _rival_fleet import Fleet, add_arguments, append  # noqa: E402  (standard library only)
from _rival_task import load_task_module  # noqa: E402  (standard library only)


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


def kill_worker(pids: str, slot: int) -> int | None:
    """SIGKILL the Ray Train worker on ``slot``'s instance (that worker, not a later process with its pid)."""
    with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
        pid, started = (int(x) for x in Path(pids, f"{slot}.pid").read_text().split())
        if start_time(pid) == started:
            os.kill(pid, signal.SIGKILL)
            return pid
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--storage", default="ray-storage", help="Ray Train's checkpoints (relative: in the cwd)")
    args = parser.parse_args()
    args.pids = tempfile.mkdtemp(prefix="raytrain-pids-")
    args.usable = str(Path(args.pids, "usable.json"))

    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(num_cpus=args.workers + 1, include_dashboard=False,
             logging_level="WARNING", runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    lifetimes = json.loads(Path(args.trace).read_text()) if args.trace else []
    fleet = Fleet(args.workers, lifetimes, args.provisioning_s, args.log, args.usable,
                  kill=lambda slot: kill_worker(args.pids, slot))
    fleet.start()
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
        run_config=RunConfig(name="vs-spotswarm", storage_path=os.path.abspath(args.storage),
                             failure_config=FailureConfig(max_failures=-1),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    )
    try:
        trainer.fit()
        append(args.log, {"kind": "end", "t": time.time()})
    finally:
        timer.cancel()
        fleet.close()
        ray.shutdown()


if __name__ == "__main__":
    main()
