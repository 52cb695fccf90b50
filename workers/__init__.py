"""workers: one training peer — a task, the DeDLOC collaborative optimizer, Moshpit SGD, state
hand-off to newcomers and graceful leave on a preemption notice."""

from .collaborative import CollaborativeOptimizer
from .moshpit_sgd import MoshpitSGD
from .peer import TrainingPeer, WorkerConfig
from .task import Task, load_task

__all__ = ["CollaborativeOptimizer", "MoshpitSGD", "Task", "TrainingPeer", "WorkerConfig", "load_task"]
