"""Moshpit SGD: every peer takes local optimizer steps, and every ``averaging_period`` steps the
peers average their parameters with Moshpit All-Reduce (groups re-mixed along a grid)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from averaging import Codec, MoshpitAverager, StepResult
from dht import DHT, DHTNode

from .progress import PeerProgress, ProgressTracker
from .progress_tree import ProgressLayout

logger = logging.getLogger(__name__)


class MoshpitSGD:
    def __init__(self, optimizer: torch.optim.Optimizer, dht: DHT, run: str, *, grid: Sequence[int],
                 averaging_period: int = 10, min_matchmaking_time: float = 0.5, request_timeout: float = 1.0,
                 averaging_timeout: float = 30.0, compression: str | Codec = Codec.NONE,
                 max_group_size: int | None = None, bandwidth: float | None = None, swarm_size: int = 16,
                 byzantine: str = "off") -> None:
        self.optimizer = optimizer
        self.dht = dht
        self.averaging_period = averaging_period
        self.averaging_timeout = averaging_timeout
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.local_steps = 0
        self.last_result: StepResult | None = None
        self.samples = 0
        self.last_loss: float | None = None
        self._last_report = 0.0
        self.comm_seconds = 0.0  # spent averaging, not computing
        copies = [p.detach().float().clone() for p in self.params]
        signer = _signer(dht)
        # the grid sets the group size (max(grid) peers meet per round); max_group_size only caps it
        largest = max(grid, default=1)  # an empty grid is refused by the averager, with its reason
        target_group_size = largest if max_group_size is None else min(max_group_size, largest)

        async def build(node: DHTNode) -> tuple[MoshpitAverager, ProgressTracker]:
            # short matchmaking: a peer alone on its grid key should get back to training quickly
            averager = MoshpitAverager(copies, node, f"{run}_params", grid=grid, target_group_size=target_group_size,
                                       min_matchmaking_time=min_matchmaking_time, request_timeout=request_timeout,
                                       allreduce_timeout=averaging_timeout, compression=compression,
                                       bandwidth=bandwidth, byzantine=byzantine)
            # progress is published as in collaborative runs, for start-up and for the orchestrator; with
            # no background view, a peer of a run over 16 peers reads its own leaf's rounds only (its
            # leaf mates are a random sample of the swarm: they join the swarm's round as well)
            return averager, ProgressTracker(node, run, 1, signer, layout=ProgressLayout(run, capacity=swarm_size))

        self.averager, self.tracker = dht.run_coroutine(build)
        self.keep_alive()

    @property
    def epoch(self) -> int:
        """Averaging rounds done (attempted), which is also the averager's grid round."""
        return self.averager.round

    def step(self, batch_size: int = 0, loss: float | None = None) -> bool:
        """A local step; returns True when this step also averaged parameters."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.local_steps += 1
        self.samples += batch_size
        self.last_loss = loss if loss is not None else self.last_loss
        self.keep_alive()
        if self.local_steps % self.averaging_period:
            return False
        return self.average()

    def average(self) -> bool:
        buffers = self.averager.tensors
        with torch.no_grad():
            for p, buf in zip(self.params, buffers, strict=True):
                buf.copy_(p)
        averager, tracker = self.averager, self.tracker

        async def run(_node: DHTNode) -> StepResult:
            # a newcomer, or a peer that lost a round, joins the swarm's current round: a peer out of
            # phase looks for group mates along another grid dimension than everyone else
            swarm = (await tracker.global_progress()).epoch
            averager.round = max(averager.round, swarm)
            return await averager.step(timeout=self.averaging_timeout)

        started = time.monotonic()
        result = self.dht.run_coroutine(run)
        self.comm_seconds += time.monotonic() - started
        self.last_result = result
        if result.averaged:
            with torch.no_grad():
                for p, buf in zip(self.params, buffers, strict=True):
                    p.copy_(buf)
        self.keep_alive(force=True)
        return result.averaged

    def keep_alive(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._last_report < self.tracker.expiration / 3:
            return
        self._last_report = time.monotonic()
        progress = PeerProgress(epoch=self.epoch, samples=self.samples, samples_per_second=0.0, time=self.tracker.now(),
                                client_mode=self.dht.node.client_mode, loss=self.last_loss)
        tracker = self.tracker
        self.dht.run_coroutine(lambda _n: tracker.report(progress))

    def prepare_to_leave(self) -> None:
        averager, tracker = self.averager, self.tracker

        async def stop(_node: DHTNode) -> None:
            await tracker.withdraw()
            await averager.shutdown()

        self.dht.run_coroutine(stop)


def _signer(dht: DHT):
    from .collaborative import signature_validator

    return signature_validator(dht)
