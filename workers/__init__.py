"""workers: one training peer — a task, the DeDLOC collaborative optimizer, Moshpit SGD, state
hand-off to newcomers and graceful leave on a preemption notice — and the expert host, the
expert-server role of a mixture-of-experts run."""

from .collaborative import CollaborativeOptimizer
from .expert_host import ExpertGridSpec, ExpertHost, ExpertHostConfig, HandOff
from .moshpit_sgd import MoshpitSGD
from .peer import TrainingPeer, WorkerConfig
from .task import Task, load_task

__all__ = ["CollaborativeOptimizer", "ExpertGridSpec", "ExpertHost", "ExpertHostConfig", "HandOff", "MoshpitSGD",
           "Task", "TrainingPeer", "WorkerConfig", "load_task"]
