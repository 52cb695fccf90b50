"""Training tasks for ``bench_preemption.py --device-ms MS`` and ``bench_vs_raytrain.py``: the built-in
``synthetic`` and ``charlm`` tasks with every forward pass padded by a sleep of MS milliseconds,
standing in for an accelerator step.

A sleep holds no CPU, so each simulated instance adds its own compute capacity even though all of
them share this machine's cores (with the plain ``synthetic`` task, peers compete for the same CPU
and a fleet of 3 is not 3 times a fleet of 1).  The Ray actors import this module by name: Ray
puts the driver script's directory (``benchmarks/``) on their ``sys.path``, so the task spec is
``_preemption_task:synthetic_device_<MS>`` or ``_preemption_task:charlm_device_<MS>``
(``workers.task.load_task`` passes the run's ``task_options`` on).
"""

from __future__ import annotations

import re
import time
from typing import Any

from workers.task import Task, charlm_task, synthetic_task


def padded(base: Task, device_ms: float) -> Task:
    inner = base.loss

    def loss(model: Any, batch: Any) -> Any:
        time.sleep(device_ms / 1000.0)
        return inner(model, batch)

    return Task(f"{base.name}+{device_ms:g}ms", base.make_model, base.batches, loss, base.batch_size,
                make_optimizer=base.make_optimizer, make_scheduler=base.make_scheduler)


def synthetic_device(device_ms: float, **options: Any) -> Task:
    return padded(synthetic_task(**options), device_ms)


def charlm_device(device_ms: float, **options: Any) -> Task:
    return padded(charlm_task(**options), device_ms)


def task_spec(device_ms: float) -> str:
    return f"_preemption_task:synthetic_device_{int(round(device_ms))}"


def __getattr__(name: str) -> Any:  # synthetic_device_<MS>, charlm_device_<MS> -> a factory for that padding
    m = re.fullmatch(r"(synthetic|charlm)_device_(\d+)", name)
    if m is None:
        raise AttributeError(name)
    make, ms = (synthetic_device if m.group(1) == "synthetic" else charlm_device), float(m.group(2))
    return lambda **options: make(ms, **options)
