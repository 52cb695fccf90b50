"""Training tasks for ``bench_preemption.py --device-ms MS``: the built-in ``synthetic`` task with
every forward pass padded by a sleep of MS milliseconds, standing in for an accelerator step.

A sleep holds no CPU, so each simulated instance adds its own compute capacity even though all of
them share this machine's cores (with the plain ``synthetic`` task, peers compete for the same CPU
and a fleet of 3 is not 3 times a fleet of 1).  The Ray actors import this module by name: Ray
puts the driver script's directory (``benchmarks/``) on their ``sys.path``, so the task spec is
``_preemption_task:synthetic_device_<MS>`` (``workers.task.load_task`` calls it with no arguments).
"""

from __future__ import annotations

import re
import time
from typing import Any

from workers.task import Task, synthetic_task


def synthetic_device(device_ms: float) -> Task:
    base = synthetic_task()
    inner = base.loss

    def loss(model: Any, batch: Any) -> Any:
        time.sleep(device_ms / 1000.0)
        return inner(model, batch)

    return Task(f"synthetic+{device_ms:g}ms", base.make_model, base.batches, loss, base.batch_size,
                make_optimizer=base.make_optimizer, make_scheduler=base.make_scheduler)


def task_spec(device_ms: float) -> str:
    return f"_preemption_task:synthetic_device_{int(round(device_ms))}"


def __getattr__(name: str) -> Any:  # synthetic_device_<MS> -> a factory for that padding
    m = re.fullmatch(r"synthetic_device_(\d+)", name)
    if m is None:
        raise AttributeError(name)
    ms = float(m.group(1))
    return lambda: synthetic_device(ms)
