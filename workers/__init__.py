"""workers: one training peer — a task, the DeDLOC collaborative optimizer, Moshpit SGD, state
hand-off to newcomers and graceful leave on a preemption notice."""
