"""CollaborativeOptimizer (DeDLOC): many peers train one model with one global batch.

Peers accumulate gradients locally and publish their progress in the DHT.  When the samples
accumulated by all peers at the current epoch reach ``target_batch_size``, they meet (matchmaking
keyed by the epoch), all-reduce their mean gradients weighted by samples, and every peer applies
the same optimizer step to the same parameters — so parameters stay bit-identical — and the epoch
advances.  A peer that finds itself behind the global epoch downloads the state from peers instead
of stepping; a peer that could not average with the others does not step alone either.

The optimizer lives on the training thread; everything networked runs on the DHT's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from averaging import Codec, DecentralizedAverager, StepResult
from dht import DHT, DHTNode, SignatureValidator

from .progress import GlobalProgress, PeerProgress, ProgressTracker
from .state import StateSharer, StateUnavailable

logger = logging.getLogger(__name__)


def signature_validator(dht: DHT) -> SignatureValidator:
    """The DHT's own SignatureValidator: progress and state adverts are signed subkeys."""
    for v in dht.node.validator.validators:
        if isinstance(v, SignatureValidator) and v.identity.peer_id == dht.peer_id:
            return v
    raise ValueError("the DHT must be created with validators=[SignatureValidator(identity)] using its identity")


@dataclass
class EpochReport:
    epoch: int
    group_size: int
    samples: int
    loss: float | None
    averaging_time: float


class CollaborativeOptimizer:
    def __init__(self, optimizer: torch.optim.Optimizer, dht: DHT, run: str, target_batch_size: int, *,
                 scheduler: Any = None, compression: str | Codec = Codec.NONE, min_matchmaking_time: float = 2.0,
                 averaging_timeout: float = 30.0, report_interval: float = 0.1, load_state_on_start: bool = True,
                 max_group_size: int = 256) -> None:
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.dht = dht
        self.run = run
        self.target_batch_size = target_batch_size
        self.report_interval = report_interval
        self.averaging_timeout = averaging_timeout
        self.max_group_size = max_group_size
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.epoch = 0
        self.local_samples = 0
        self.local_steps = 0
        self.last_loss: float | None = None
        self.history: list[EpochReport] = []
        self._throughput = 0.0
        self._last_step_time: float | None = None
        self._last_report = 0.0
        self._last_advert = 0.0
        self.advert_expiration = 60.0
        self._leaving = False
        self._alone_not_before = 0.0  # monotonic time before which we never step alone (see _rejoin)
        signer = signature_validator(dht)
        grads = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]

        async def build(node: DHTNode) -> tuple[DecentralizedAverager, ProgressTracker, StateSharer]:
            averager = DecentralizedAverager(grads, node, f"{run}_grad", target_group_size=max_group_size,
                                             min_group_size=2, min_matchmaking_time=min_matchmaking_time,
                                             allreduce_timeout=averaging_timeout, compression=compression)
            tracker = ProgressTracker(node, run, target_batch_size, signer)
            sharer = StateSharer(node, run, signer, self._state_snapshot)
            return averager, tracker, sharer

        self.averager, self.tracker, self.state = dht.run_coroutine(build)
        self.grad_buffers = self.averager.tensors  # views into the averager's flat buffer
        if load_state_on_start:
            self._load_state_if_any()
        self._report(force=True)
        self._advertise()

    # ---- the training loop's entry point -------------------------------------------------------
    def step(self, batch_size: int, loss: float | None = None) -> bool:
        """Call after ``loss.backward()``; returns True when a global optimizer step happened."""
        if self._leaving:
            return False
        away = self._was_away()
        self._accumulate(batch_size, loss)
        self._report()
        self.keep_alive()
        progress: GlobalProgress = self._call(lambda n: self.tracker.global_progress())
        if progress.epoch > self.epoch:
            self._catch_up(progress.epoch)
            return False
        if away:
            self._rejoin()
            return False
        if not progress.ready:
            return False
        if progress.live_peers <= 1 and time.monotonic() < self._alone_not_before:
            return False  # our view of the others may be as old as our absence: wait for theirs to refresh
        return self._global_step(progress)

    def _was_away(self) -> bool:
        """Whether this process stood still (paused, swapped out) longer than a record stays fresh since
        its last step began.  A step that waited that long for a group counts too: a cautious rejoin
        costs it one epoch's local gradients, never a divergence."""
        return self._last_step_time is not None and time.monotonic() - self._last_step_time > self.tracker.fresh_for

    def _rejoin(self) -> None:
        """Back from an absence, the others' records we hold are stale, so they look dead; more likely
        they moved on without us.  Load their newer state if any, and step alone only after giving
        their records as long to refresh as they gave ours: never on a stale view."""
        logger.info("epoch %d: back after standing still; checking whether the others moved on", self.epoch)
        self._alone_not_before = time.monotonic() + self.tracker.fresh_for
        if not self._load_state_if_any(min_epoch=self.epoch + 1):
            self._reset_accumulators()  # gradients of an epoch the others may have finished without us
        self._report(force=True)

    def _accumulate(self, batch_size: int, loss: float | None) -> None:
        for p, buf in zip(self.params, self.grad_buffers, strict=True):
            if p.grad is not None:
                buf.add_(p.grad)
                p.grad = None
        self.local_samples += batch_size
        self.local_steps += 1
        self.last_loss = loss if loss is not None else self.last_loss
        now = time.monotonic()
        if self._last_step_time is not None and now > self._last_step_time:
            rate = batch_size / (now - self._last_step_time)
            self._throughput = rate if self._throughput == 0 else 0.8 * self._throughput + 0.2 * rate
        self._last_step_time = now

    def _global_step(self, progress: GlobalProgress) -> bool:
        if self.local_steps:
            for buf in self.grad_buffers:  # mean gradient per micro-batch; weighted by samples below
                buf.div_(self.local_steps)
        started = time.monotonic()
        # Step alone only when nobody else is alive: two peers that each stepped alone on a stale view
        # of the other would share an epoch with different parameters, and never reconcile.
        alone = progress.live_peers <= 1
        if alone:
            result = StepResult(group_size=1)
        else:
            if progress.live_peers > self.max_group_size:
                logger.warning("epoch %d: %d live peers but groups hold at most %d: the groups will step apart; "
                               "raise group_size", self.epoch, progress.live_peers, self.max_group_size)
            # wait for every live peer, including one whose record still shows the previous epoch
            # (it is about to report this one); the matchmaking time bounds the wait for a dead one
            result = self._call(lambda n: self._average(progress.live_peers))
        if not alone and not result.averaged:
            logger.info("epoch %d: could not average with the other %d live peers; will load their state",
                        self.epoch, progress.live_peers - 1)
            self._restore_accumulated()
            return False
        for p, buf in zip(self.params, self.grad_buffers, strict=True):
            p.grad = buf.to(p.dtype).view_as(p).clone() if p.dtype != torch.float32 else buf.view_as(p).clone()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.history.append(EpochReport(self.epoch, result.group_size, self.local_samples, self.last_loss,
                                        time.monotonic() - started))
        self.epoch += 1
        self._reset_accumulators()
        self._report(force=True)
        self._advertise()
        return True

    async def _average(self, live_peers: int) -> StepResult:
        """All-reduce this epoch's gradients; give up matchmaking as soon as the others have moved on
        without us (we then load their state) instead of waiting out the matchmaking time alone."""
        abort = asyncio.Event()
        watcher = asyncio.create_task(self._watch_epoch(abort))
        try:
            return await self.averager.step(weight=float(self.local_samples), timeout=self.averaging_timeout,
                                            group_key=f"e{self.epoch}", target_group_size=live_peers, abort=abort)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    async def _watch_epoch(self, moved_on: asyncio.Event) -> None:
        while True:
            await asyncio.sleep(self.report_interval * 2)
            if (await self.tracker.global_progress()).epoch > self.epoch:
                moved_on.set()
                return

    def _restore_accumulated(self) -> None:
        if self.local_steps:
            for buf in self.grad_buffers:
                buf.mul_(self.local_steps)

    def _reset_accumulators(self) -> None:
        for buf in self.grad_buffers:
            buf.zero_()
        for p in self.params:
            p.grad = None
        self.local_samples = 0
        self.local_steps = 0

    # ---- state hand-off ------------------------------------------------------------------------
    def _state_snapshot(self) -> tuple[int, Any]:
        state = {"params": [p.detach() for p in self.params], "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}
        return self.epoch, state

    def _load_state_if_any(self, min_epoch: int = 0) -> bool:
        try:
            epoch, state = self._call(lambda n: self.state.download(min_epoch))
        except StateUnavailable as e:
            logger.info("no state to load yet (%s); starting from epoch %d", e, self.epoch)
            return False
        with torch.no_grad():
            for p, value in zip(self.params, state["params"], strict=True):
                p.copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.epoch = epoch
        self._reset_accumulators()
        self._advertise()  # a donor for the next newcomer at this epoch
        logger.info("loaded state of epoch %d from peers", epoch)
        return True

    def _catch_up(self, epoch: int) -> None:
        logger.info("behind: local epoch %d, global epoch %d; loading state", self.epoch, epoch)
        if not self._load_state_if_any(min_epoch=epoch):
            self._reset_accumulators()  # no donor yet: at least stop accumulating for a stale epoch
        self._report(force=True)

    # ---- DHT records ---------------------------------------------------------------------------
    def _report(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_report < self.report_interval:
            return
        self._last_report = now
        progress = PeerProgress(epoch=self.epoch, samples=self.local_samples, samples_per_second=self._throughput,
                                time=time.time(), client_mode=self.dht.node.client_mode, loss=self.last_loss)
        self._call(lambda n: self.tracker.report(progress))

    def keep_alive(self) -> None:
        """Refresh our DHT records well before they expire (also for callers that are not stepping)."""
        now = time.monotonic()
        if now - self._last_report > self.tracker.fresh_for / 2:  # others wait only for fresh peers
            self._report(force=True)
        if now - self._last_advert > self.advert_expiration / 3:
            self._advertise()

    def _advertise(self) -> None:
        self._last_advert = time.monotonic()
        self._call(lambda n: self.state.advertise(self.epoch, self.advert_expiration))

    def _call(self, fn: Any) -> Any:
        return self.dht.run_coroutine(fn)

    # ---- leaving -------------------------------------------------------------------------------
    def prepare_to_leave(self) -> None:
        """Stop taking part: withdraw progress and state adverts, unregister handlers."""
        if self._leaving:
            return
        self._leaving = True

        async def leave(node: DHTNode) -> None:
            await self.tracker.withdraw()
            await self.state.withdraw()
            self.state.close()
            await self.averager.shutdown()

        self._call(leave)

    @property
    def parameters(self) -> Iterable[torch.Tensor]:
        return self.params
