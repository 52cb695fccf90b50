"""The benchmarks' rivals (Ray Train, torchft) train the project's task by loading ``workers/task.py``
on its own, in a virtualenv without the project's packages (``benchmarks/_rival_task.py``).  When that
load broke, every rival worker failed on import and the comparison trained nothing.  These tests load
it the same way, with the project's packages and its own dependencies unimportable, and check that
the rivals get the very same task: the same initial weights, batches and losses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workers.task import BUILTIN_TASKS, load_task
from workers.worker_config import BUILTIN_TASK_NAMES

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
RIVAL_TASKS = ("charlm", "synthetic")  # what bench_vs_raytrain and bench_vs_torchft train

# What a rival's child has not: the project's packages and the dependencies only the project brings.
# Each is refused at import, wherever it would be found (the test's virtualenv has all of them).
CHILD = r"""
import importlib.abc, json, sys
BLOCKED = {"p2p", "dht", "averaging", "experts", "workers", "orchestrator", "pydantic", "msgpack",
           "cryptography", "yaml", "tenacity", "scipy", "boto3", "uvloop", "ray"}

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not installed in a rival's virtualenv")
        return None

sys.meta_path.insert(0, Refuse())
root, benchmarks = sys.argv[1], sys.argv[2]
sys.path = [p for p in sys.path if p not in ("", root)]
sys.path.insert(0, benchmarks)  # a rival's child has benchmarks/ on its path, not the checkout
from _rival_task import load_task_module
import torch
tasks = load_task_module(root)
out = {}
for name in json.loads(sys.argv[3]):
    task = tasks.load_task(name, batch_size=4)
    model = task.model(seed=0)
    loss = task.loss(model, next(task.batches(7)))
    loss.backward()
    task.make_optimizer(model.parameters()).step()
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    out[name] = {"loss": float(loss.detach()), "checksum": checksum}
print(json.dumps(out))
"""


def reference(name: str) -> dict:
    """The same computation through the package, as spotswarm's own workers do it."""
    task = load_task(name, batch_size=4)
    model = task.model(seed=0)
    loss = task.loss(model, next(task.batches(7)))
    loss.backward()
    task.make_optimizer(model.parameters()).step()
    return {"loss": float(loss.detach()), "checksum": sum(float(p.detach().double().sum()) for p in model.parameters())}


def test_a_rival_child_loads_the_task_standalone_and_trains_the_same_steps():
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(ROOT / "benchmarks"), json.dumps(RIVAL_TASKS)],
                          capture_output=True, text=True, timeout=100, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    standalone = json.loads(proc.stdout.strip().splitlines()[-1])
    torch.set_num_threads(1)  # the same kernels as the child's, so the sums agree to the bit
    for name in RIVAL_TASKS:
        assert standalone[name] == reference(name), name


def test_the_task_names_the_config_accepts_are_the_tasks_there_are():
    assert tuple(BUILTIN_TASKS) == BUILTIN_TASK_NAMES
