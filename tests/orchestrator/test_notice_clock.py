"""A preemption notice is dated by the swarm clock, so a worker whose machine's wall clock is off
still gets the notice's whole period (by the wall clocks, 90 s ahead, it would get 0.5 s)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from dht import DHTNode
from orchestrator.instance.core import WorkerCore

pytestmark = pytest.mark.timeout(60)


class LeaveRecorder:
    """Stands in for the TrainingPeer (a real one trains a model for seconds before it can take a
    notice): it records the deadline ``prepare_to_leave`` is given.  The clocks are real DHT nodes'."""

    def __init__(self, dht: DHTNode) -> None:
        self.dht = SimpleNamespace(clock=dht.clock)
        self.deadlines: list[float] = []
        self.called = threading.Event()

    def prepare_to_leave(self, deadline: float, train_for: float) -> None:
        self.deadlines.append(deadline)
        self.called.set()


async def test_a_notice_keeps_its_period_on_a_machine_whose_wall_clock_is_ahead(until):
    """The supervisor's machine and another agree on a time 90 s behind this process's wall clock;
    the worker runs here: its machine's clock is 90 s ahead of the swarm's."""
    behind = {"clock": lambda: time.time() - 90.0, "clock_sample_interval": 0.5}
    supervisor = await DHTNode.create(**behind)
    nodes = [supervisor]
    try:
        nodes.append(await DHTNode.create([str(supervisor.address)], **behind))
        worker = await DHTNode.create([str(supervisor.address)], clock_sample_interval=0.5)
        nodes.append(worker)
        await until(lambda: worker.clock.voters == 2, 20, "the worker's node sampling both others")
        assert abs(worker.clock.now() - supervisor.clock.now()) < 1.0  # outvoted: the swarm's time

        actor = WorkerCore()  # what the worker's actor holds, outside Ray
        actor.peer = recorder = LeaveRecorder(worker)
        actor.notice(30.0, supervisor.clock.now())  # as RayWorkers dates it: the supervisor's swarm clock
        assert await asyncio.to_thread(recorder.called.wait, 10)
        assert recorder.deadlines[0] == pytest.approx(30.0, abs=1.0)  # by the wall clocks: 0.5
        assert await asyncio.to_thread(actor.left.wait, 10)
    finally:
        await asyncio.gather(*(n.shutdown() for n in nodes))
