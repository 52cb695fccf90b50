"""The chaos report's vocabulary: fault kinds, phases and the report's file name.  Ray-free, so the
dashboard and the benchmark read reports without importing what injects the faults."""

from __future__ import annotations

REPORT = "chaos.json"  # in the run directory
FAULT_KINDS = ("worker_kill", "node_kill", "supervisor_kill", "worker_pause", "bandwidth_drop", "disk_full",
               "clock_jump")
PHASES = ("matchmaking", "all-reduce", "state download", "checkpoint write", "idle")
WORKER_PHASES = ("matchmaking", "all-reduce", "state download", "idle")  # a worker's
RUN_PHASES = ("checkpoint write", "idle")  # the supervisor's: what a supervisor kill or a full disk hits
