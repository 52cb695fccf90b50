"""Moshpit SGD: every peer takes local optimizer steps, and every ``averaging_period`` steps the
peers average their parameters with Moshpit All-Reduce (groups re-mixed along a grid)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from averaging import Codec, MoshpitAverager, StepResult
from dht import DHT, DHTNode

logger = logging.getLogger(__name__)


class MoshpitSGD:
    def __init__(self, optimizer: torch.optim.Optimizer, dht: DHT, run: str, *, grid: Sequence[int],
                 averaging_period: int = 10, min_matchmaking_time: float = 2.0, averaging_timeout: float = 30.0,
                 compression: str | Codec = Codec.NONE) -> None:
        self.optimizer = optimizer
        self.dht = dht
        self.averaging_period = averaging_period
        self.averaging_timeout = averaging_timeout
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.local_steps = 0
        self.epoch = 0  # averaging rounds done
        self.last_result: StepResult | None = None
        copies = [p.detach().float().clone() for p in self.params]

        async def build(node: DHTNode) -> MoshpitAverager:
            return MoshpitAverager(copies, node, f"{run}_params", grid=grid, min_matchmaking_time=min_matchmaking_time,
                                   allreduce_timeout=averaging_timeout, compression=compression)

        self.averager: MoshpitAverager = dht.run_coroutine(build)

    def step(self, batch_size: int = 0, loss: float | None = None) -> bool:
        """A local step; returns True when this step also averaged parameters."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.local_steps += 1
        if self.local_steps % self.averaging_period:
            return False
        return self.average()

    def average(self) -> bool:
        buffers = self.averager.tensors
        with torch.no_grad():
            for p, buf in zip(self.params, buffers, strict=True):
                buf.copy_(p)
        averager = self.averager

        async def run(_node: DHTNode) -> StepResult:
            return await averager.step(timeout=self.averaging_timeout)

        result = self.dht.run_coroutine(run)
        self.last_result = result
        if result.averaged:
            with torch.no_grad():
                for p, buf in zip(self.params, buffers, strict=True):
                    p.copy_(buf)
        self.epoch += 1
        return result.averaged

    def prepare_to_leave(self) -> None:
        averager = self.averager

        async def stop(_node: DHTNode) -> None:
            await averager.shutdown()

        self.dht.run_coroutine(stop)
