"""The simulated fleet of a rival's run (Ray Train's, torchft's): the same preemption trace and the
same provisioning delay as spotswarm's simulated instances get in ``_vs_rival.py``.

One instance per slot.  Each launch takes the next lifetime of the trace (in launch order).  An
instance is usable ``provisioning_s`` after its launch and lives ``lifetime`` from then on, as the
local simulator's instances do.  When it ends, ``kill(slot)`` SIGKILLs what runs on it, and its
replacement is launched at once.  The rival is told when each slot is usable: through
``usable_file`` (a JSON list of times, which a restarted Ray Train group waits on) and, if given,
``arrive(slot)`` (the torchft driver starts the replica then).

Events go to the run's JSON-lines log: ``launch`` (with ``usable`` and ``lifetime``), ``arrive`` and
``kill``.  Standard library only: the rivals' virtualenv runs it.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

CLOCK_S = 0.05  # how often the trace's clock is checked


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """What every rival's child is told by ``_vs_rival.run_rival``: the checkout, the task, the fleet,
    the trace, its log and stop file."""
    parser.add_argument("--root", required=True, help="the checkout whose workers/task.py to train")
    parser.add_argument("--task", default="charlm")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--accum", type=int, required=True)
    parser.add_argument("--device-ms", type=float, default=0.0)
    parser.add_argument("--provisioning-s", type=float, default=3.0)
    parser.add_argument("--trace", default=None, help="JSON list of lifetimes (real s), in launch order")
    parser.add_argument("--log", required=True)
    parser.add_argument("--stop-file", required=True)
    parser.add_argument("--limit-s", type=float, default=600.0)


def append(path: str | Path, record: dict) -> None:
    """One JSON line to a log that several processes append to (each line one write)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class Fleet:
    def __init__(self, workers: int, lifetimes: list[float], provisioning_s: float, log: str, usable_file: str,
                 kill: Callable[[int], int | None], arrive: Callable[[int], None] | None = None) -> None:
        self.lifetimes, self.provisioning_s = list(lifetimes), provisioning_s
        self.log, self.usable_file = log, usable_file
        self.kill_slot, self.arrive = kill, arrive
        self.stop = threading.Event()
        self.usable = [0.0] * workers
        self.arrived = [False] * workers
        now = time.time()
        self.ends = [self.launch(slot, now) for slot in range(workers)]
        self._thread = threading.Thread(target=self._run, name="fleet", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self.stop.set()
        self._thread.join(5)

    def launch(self, slot: int, at: float) -> float:
        """A new instance on ``slot``: returns when it ends (usable time + its lifetime)."""
        lifetime = self.lifetimes.pop(0) if self.lifetimes else float("inf")
        usable = at + self.provisioning_s
        append(self.log, {"kind": "launch", "t": at, "slot": slot, "usable": usable, "lifetime": lifetime})
        self.usable[slot], self.arrived[slot] = usable, False
        tmp = Path(self.usable_file + ".tmp")
        tmp.write_text(json.dumps(self.usable))
        tmp.replace(self.usable_file)  # workers never read a half-written file
        return usable + lifetime

    def _run(self) -> None:
        while not self.stop.is_set():
            now = time.time()
            for slot, end in enumerate(self.ends):
                if now >= end:
                    killed = self.kill_slot(slot)
                    append(self.log, {"kind": "kill", "t": time.time(), "due": end, "slot": slot, "pid": killed})
                    self.ends[slot] = self.launch(slot, now)
                elif not self.arrived[slot] and now >= self.usable[slot]:
                    self.arrived[slot] = True
                    append(self.log, {"kind": "arrive", "t": now, "slot": slot})
                    if self.arrive is not None:
                        self.arrive(slot)
            self.stop.wait(CLOCK_S)
