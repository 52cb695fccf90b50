"""CollaborativeOptimizer (DeDLOC): many peers train one model with one global batch.

Peers accumulate gradients locally and publish their progress in the DHT.  When the samples
accumulated by all peers at the current epoch reach ``target_batch_size``, they meet (matchmaking
keyed by the epoch), all-reduce their mean gradients weighted by samples, and every peer applies
the same optimizer step to the same parameters — so parameters stay bit-identical — and the epoch
advances.  A peer that finds itself behind the global epoch downloads the state from peers instead
of stepping; a peer that could not average with the others does not step alone either.  Only a
peer that got every part of the average back, without standing still mid-round, steps: a reducer
that vanished mid-round leaves its part local to each of the others (two peers stepping on those
would share an epoch with different parameters), and one back from a pause may be the only member
that got everything back.  The peers that did not step load the state of those that did.

The optimizer lives on the training thread; everything networked runs on the DHT's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from averaging import Codec, DecentralizedAverager, GroupPlan, Planned, StepResult, average_in_groups, quorum_of
from dht import DHT, DHTNode, SignatureValidator
from p2p import P2PError, PeerID

from .progress import GlobalProgress, PeerProgress, ProgressTracker
from .progress_tree import ProgressLayout
from .state import StateSharer, StateUnavailable, params_digest

logger = logging.getLogger(__name__)
PROBE_PEERS = 2  # peers a newcomer probes its upload to (see averaging/bandwidth.py)


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
    group_id: str | None = None  # the all-reduce group this epoch's gradients were averaged in
    matchmaking_time: float = 0.0  # of averaging_time, seconds in matchmaking (summed over a grouped epoch's rounds)
    allreduce_time: float = 0.0  # and in all-reduce rounds, the way down included


@dataclass
class _Averaged:
    """What this epoch's averaging gave us: whether we hold everyone's mean, with how many peers."""

    complete: bool
    group_size: int
    group_id: str | None = None
    why: str = ""  # why not complete, as the log line's tail
    matchmaking_time: float = 0.0
    allreduce_time: float = 0.0
    step: StepResult | None = None  # the one-group round this came from (None: no round, or a grouped one)


@dataclass
class _Beats:
    """When a periodic task last ran, and the longest wait between two of its runs."""

    last: float
    longest_gap: float = 0.0

    def beat(self) -> None:
        now = time.monotonic()
        self.longest_gap = max(self.longest_gap, now - self.last)
        self.last = now


class CollaborativeOptimizer:
    """Wraps ``optimizer``; call ``step(batch_size, loss)`` after each ``loss.backward()``.

    ``max_group_size``: the largest averaging group (with more live peers, groups of groups);
    ``swarm_size``: the most peers the run expects (sizes the tree of progress keys); ``view_interval``:
    seconds between reads of the swarm's progress; ``report_interval``: between our reports;
    ``fresh_for``: how old a peer's record may be before it counts as gone (a swarm on loaded
    machines, whose reports come late, needs more)."""

    def __init__(self, optimizer: torch.optim.Optimizer, dht: DHT, run: str, target_batch_size: int, *,
                 scheduler: Any = None, compression: str | Codec = Codec.NONE, min_matchmaking_time: float = 2.0,
                 averaging_timeout: float = 30.0, report_interval: float = 0.1, load_state_on_start: bool = True,
                 max_group_size: int = 256, bandwidth: float | None = None, swarm_size: int = 16,
                 view_interval: float = 0.1, fresh_for: float = 5.0, byzantine: str = "off") -> None:
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.dht = dht
        self.run = run
        self.target_batch_size = target_batch_size
        self.report_interval = report_interval
        self.averaging_timeout = averaging_timeout
        self.max_group_size = max_group_size
        # a run sized for more peers than a group averages in groups of groups at every epoch, however many
        # are live: every peer of a run must agree on how it averages, and views of who is live differ
        self.grouped = swarm_size > max_group_size
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
        self._interrupted = False  # give up matchmaking: the peer is stopping
        self._downloading = False
        self._alone_not_before = 0.0  # monotonic time before which we never step alone (see _rejoin)
        self._next_reconnect = 0.0  # monotonic time before which we do not try _reconnect_if_isolated again
        self._silent: dict[PeerID, float] = {}  # peers that did not answer, with the record time they had then
        self._answering = 0  # how many stale peers answered last time (logged when it changes)
        # (epoch, monotonic time): after a round that failed us but that another member may have stepped
        # on, we average for that epoch again only from then on (unless we load the others' state first)
        self._held: tuple[int, float] | None = None
        self.comm_seconds = 0.0  # spent averaging and downloading state, not computing: the dashboard's split
        # held while parameters, optimizer state and epoch change together, and while a donor snapshots
        # them (on another thread): a state served mid-step would label one epoch's parameters with another
        self._state_lock = threading.Lock()
        signer = signature_validator(dht)
        grads = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]

        async def build(node: DHTNode) -> tuple[DecentralizedAverager, ProgressTracker, StateSharer]:
            averager = DecentralizedAverager(grads, node, f"{run}_grad", target_group_size=max_group_size,
                                             min_group_size=2, min_matchmaking_time=min_matchmaking_time,
                                             allreduce_timeout=averaging_timeout, compression=compression,
                                             bandwidth=bandwidth, byzantine=byzantine)
            layout = ProgressLayout(run, capacity=swarm_size)
            tracker = ProgressTracker(node, run, target_batch_size, signer, layout=layout, fresh_for=fresh_for,
                                      expiration=max(30.0, 6 * fresh_for), refresh_interval=view_interval,
                                      roster=self.grouped)
            await tracker.start_view()
            sharer = StateSharer(node, run, signer, self._state_snapshot, lock=self._state_lock, layout=layout)
            return averager, tracker, sharer

        self.averager, self.tracker, self.state = dht.run_coroutine(build)
        self.host_buffers = self.averager.tensors  # views into the averager's flat buffer, on the CPU
        # gradients accumulate where the parameters are: on the CPU straight into the averager's
        # buffer, on a GPU in accumulators there, copied to the (page-locked) buffer to average
        on_cpu = all(p.device.type == "cpu" for p in self.params)
        self.grad_buffers = self.host_buffers if on_cpu else [torch.zeros_like(p, dtype=torch.float32)
                                                              for p in self.params]
        if load_state_on_start:
            loaded = self._load_state_if_any()
            # the others' records may not have reached us yet: nothing to load may mean a newcomer that
            # met only a restarting supervisor (stepping alone from epoch 0, we would hold epochs the
            # swarm passed long ago), and newcomers that loaded one checkpoint together would each step
            # alone from it into other parameters at the same epoch.  Never step alone before giving
            # them one freshness period.
            self._alone_not_before = time.monotonic() + self.tracker.fresh_for
            if loaded:
                self._probe_upload()
        self._report(force=True, wait=True)  # the others count us from the first step on
        self._advertise(wait=True)

    # ---- the training loop's entry point -------------------------------------------------------
    def step(self, batch_size: int, loss: float | None = None) -> bool:
        """Call after ``loss.backward()``; returns True when a global optimizer step happened."""
        if self._leaving:
            return False
        away = self._was_away()
        self._accumulate(batch_size, loss)
        self._report()
        self.keep_alive()
        self._reconnect_if_isolated()
        landed = self._round_in_flight()
        if landed is not None:
            return landed
        progress: GlobalProgress = self.tracker.view()  # no network on a micro-step: kept fresh in the background
        # standing still during the calls above (their requests timed out meanwhile) leaves a view
        # as stale as one from before a pause: the others would look dead
        away = away or self._was_away()
        if progress.epoch > self.epoch:
            self._catch_up(progress.epoch)
            return False
        if away:
            self._rejoin()
            return False
        if not progress.ready or self._holding():
            return False
        if progress.live_peers <= 1 and time.monotonic() < self._alone_not_before:
            return False  # our view of the others may be as old as our absence: wait for theirs to refresh
        return self._global_step(progress)

    def _round_in_flight(self) -> bool | None:
        """None unless a round of ours runs in the background (this mode averages in the foreground);
        else whether it just ended in a step."""
        return None

    def _was_away(self) -> bool:
        """Whether this process stood still (paused, swapped out) longer than a record stays fresh since
        its last step began, before this step or within it.  A step that waited that long for a group
        counts too: a cautious rejoin costs it one epoch's local gradients, never a divergence."""
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

    def _reconnect_if_isolated(self) -> None:
        """A DHT node drops a contact whose call timed out.  A process that stood still longer than a
        call's timeout comes back to find every call it had in flight timed out at once, and its DHT
        knowing nobody, while the others dropped it for not answering: nobody would call anybody again,
        our view of the others would never refresh, and we would step alone at their epoch numbers with
        other parameters.  Meet again the peers whose state adverts we still hold."""
        now = time.monotonic()
        if len(self.dht.node.routing) > 0 or now < self._next_reconnect:
            return
        self._next_reconnect = now + self.tracker.fresh_for  # dead donors cost a connect timeout each

        async def reconnect(node: DHTNode) -> int:
            addresses = [address for _, address in await self.state.donors()]
            if addresses:
                try:
                    await node.bootstrap(addresses)
                except P2PError as e:
                    logger.info("epoch %d: could not reach the peers we knew: %s", self.epoch, e)
            return len(node.routing)

        if self._call(reconnect):
            logger.info("epoch %d: our DHT had lost every contact; met the others again", self.epoch)
            self._alone_not_before = now + self.tracker.fresh_for  # their records reach us only now
            self._report(force=True)

    def _accumulate(self, batch_size: int, loss: float | None) -> None:
        self._take_micro_step()
        self.local_samples += batch_size
        self.local_steps += 1
        self.last_loss = loss if loss is not None else self.last_loss
        now = time.monotonic()
        if self._last_step_time is not None and now > self._last_step_time:
            rate = batch_size / (now - self._last_step_time)
            self._throughput = rate if self._throughput == 0 else 0.8 * self._throughput + 0.2 * rate
        self._last_step_time = now

    def _take_micro_step(self) -> None:
        """Fold this micro-batch's gradients into the epoch's sum."""
        for p, buf in zip(self.params, self.grad_buffers, strict=True):
            if p.grad is not None:
                buf.add_(p.grad)
                p.grad = None

    def _fill_buffers(self) -> None:
        """What the round averages: our mean gradient per micro-batch (weighted by samples in the round)."""
        if self.local_steps:
            for buf in self.grad_buffers:
                buf.div_(self.local_steps)

    def _round_weight(self) -> float:
        """What we weigh in the round: the samples behind what we contribute."""
        return float(self.local_samples)

    def _apply_average(self) -> None:
        """The global step on what the round gave us (``_state_lock`` held)."""
        for p, host in zip(self.params, self.host_buffers, strict=True):
            p.grad = host.view_as(p).to(device=p.device, dtype=p.dtype, copy=True)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def _global_step(self, progress: GlobalProgress) -> bool:
        self._prepare_round()
        started = time.monotonic()
        alone, live = self._round_peers(progress)
        if alone:
            return self._conclude(_Averaged(complete=True, group_size=1), 0.0, started, live, alone=True)
        return self._average_round(live, started)

    def _average_round(self, live: int, started: float) -> bool:
        """Average with the ``live`` peers and step on the outcome, waiting for both here."""
        # wait for every live peer, including one whose record still shows the previous epoch
        # (it is about to report this one); the matchmaking time bounds the wait for a dead one
        result, stood_still = self._call(lambda n: self._average(live))
        self.comm_seconds += time.monotonic() - started
        return self._conclude(result, stood_still, started, live)

    def _prepare_round(self) -> None:
        """What we contribute, into the buffers the averager sends from."""
        self._fill_buffers()
        if self.grad_buffers is not self.host_buffers:
            for host, buf in zip(self.host_buffers, self.grad_buffers, strict=True):
                host.copy_(buf)

    def _round_peers(self, progress: GlobalProgress) -> tuple[bool, int]:
        """Whether we step alone, and how many peers the round is for.  Step alone only when nobody
        else is alive: two peers that each stepped alone on a stale view of the other would share an
        epoch with different parameters, and never reconcile."""
        alone, live = progress.live_peers <= 1, progress.live_peers
        if alone and (answering := self._stale_peers_answering()):
            alone, live = False, 1 + answering
        return alone, live

    def _conclude(self, result: _Averaged, stood_still: float, started: float, live: int, alone: bool = False) -> bool:
        """Step on a round's outcome, or restore what we contributed and wait for the others' state."""
        if not alone and stood_still <= self.tracker.fresh_for:
            # a round that took longer than a record stays fresh is no absence: the watcher kept our
            # record fresh and saw no pause, so the next step must not rejoin for it (after a real
            # pause it must: the others' records we hold are as old as the pause)
            self._last_step_time = time.monotonic()
        if not alone and (not result.complete or stood_still > self.tracker.fresh_for):
            # A part whose reducer vanished mid-round holds our own values, not the group's: stepping on
            # it would give us other parameters than the peers that got it back, at the same epoch.
            # Back from standing still mid-round, we may be the only one that got every part back (the
            # others gave up on ours): stepping, we would hold an epoch nobody shares, while they retry
            # it without us.  Either way the peers that did step are the ones to load from.
            why = f" (stood still for {stood_still:.1f} s)" if result.complete else result.why
            logger.info("epoch %d: could not average with the other %d live peers%s; will load their state",
                        self.epoch, live - 1, why)
            self._restore_buffers()
            self._hold_if_others_stepped(result)
            return False
        with self._state_lock:
            self._apply_average()
            self.epoch += 1
        self.history.append(EpochReport(self.epoch - 1, result.group_size, self.local_samples, self.last_loss,
                                        time.monotonic() - started, result.group_id, result.matchmaking_time,
                                        result.allreduce_time))
        self._reset_accumulators()
        self._report(force=True)
        self._advertise()
        return True

    def _hold_if_others_stepped(self, result: _Averaged) -> None:
        """A group counts with a strict majority of the live peers, each peer counted once an epoch: a
        member whose round failed it but not the others, averaging again for the same epoch, would
        count twice, and let a second group step apart from the first.  Unless every other member of
        our round says it failed them too, wait for the others' state for a freshness period (they
        report and advertise their next epoch at once); average again only if none turns up."""
        if result.step is None:
            return
        timeout = min(self.averager.request_timeout, self.tracker.fresh_for / 2)
        others = self._call(lambda n: self.averager.others_completed(result.step, timeout))
        if others is False:
            return
        logger.info("epoch %d: a member of our round %s; waiting for the next epoch's state before averaging "
                    "this one again", self.epoch, "completed it and may have stepped" if others
                    else "did not say how it ended (it may have stepped)")
        self._held = (self.epoch, time.monotonic() + self.tracker.fresh_for)

    def _holding(self) -> bool:
        """Whether we wait for the state of a member of our last round instead of averaging again."""
        if self._held is None:
            return False
        epoch, until = self._held
        if epoch == self.epoch and time.monotonic() < until:
            return True
        if epoch == self.epoch:
            logger.info("epoch %d: nobody reported the next epoch; averaging for this one again", epoch)
        self._held = None
        return False

    def _stale_peers_answering(self) -> int:
        """How many of the peers whose records went stale still answer a ping.  A record is late when
        its peer is dead, but also when the DHT is slow to carry it (a lookup waiting out a stopped
        replica): two live peers that each took the other's late record for its death would both step
        alone, at the same epochs with other parameters, for good.  A ping is direct evidence; a peer
        that did not answer is not asked again until it publishes another record."""
        records: dict[PeerID, float] = {}
        for subkey, record in self.tracker.records().items():
            peer = self.tracker.peer_of(subkey)
            if peer is not None and subkey != self.tracker.subkey:
                records[peer] = record.time
        self._silent = {peer: t for peer, t in self._silent.items() if peer in records}  # expired ones go
        others = {peer: t for peer, t in records.items() if self._silent.get(peer) != t}
        if not others:
            return 0
        timeout = min(self.dht.node.rpc_timeout, self.tracker.fresh_for / 2)

        async def ping_all(node: DHTNode) -> list[bool]:
            return list(await asyncio.gather(*(node.answers(peer, timeout) for peer in others)))

        answered = dict(zip(others, self._call(ping_all), strict=True))
        for peer, alive in answered.items():
            if not alive:
                self._silent[peer] = others[peer]
        count = sum(answered.values())
        if count and count != self._answering:
            logger.info("epoch %d: %d peer(s) whose records went stale still answer: averaging with them, "
                        "not stepping alone", self.epoch, count)
        self._answering = count
        return count

    async def _average(self, live_peers: int, weight: float | None = None) -> tuple[_Averaged, float]:
        """All-reduce this epoch's gradients: in one group, or, in a run sized for more peers than a
        group holds, in groups of groups (``averaging/grouped.py``) planned over the peers at our epoch.
        Give up matchmaking as soon as the others have moved on without us (we then load their state)
        instead of waiting out the matchmaking time alone.  Also returns the longest time this process
        stood still meanwhile (seen as a gap in the watcher's beats: a paused process cannot see its
        pause otherwise).  ``weight``: ours, taken where the training thread stands (default: now)."""
        abort = asyncio.Event()
        beats = _Beats(time.monotonic())
        watcher = asyncio.create_task(self._watch_epoch(abort, beats))
        weight, key = self._round_weight() if weight is None else weight, f"e{self.epoch}"
        try:
            if self.grouped:
                plan = GroupPlan.of([*self.tracker.members(self.epoch), self.dht.peer_id], self.max_group_size)
                if len(plan.members) <= live_peers // 2:
                    # a roster that holds too few of the live peers would plan a swarm of its own: its top
                    # could count as the epoch's next to the others'.  Wait for the roster instead.
                    outcome = _Averaged(False, 1, why=f" (our roster holds {len(plan.members)} of the {live_peers} "
                                        "live peers)")
                else:
                    grouped = await average_in_groups(self.averager, plan, weight, key, self.averaging_timeout,
                                                      abort)
                    outcome = _Averaged(grouped.complete, len(plan.members), grouped.levels[-1].group_id,
                                        f" ({grouped.reason})" if grouped.reason else "", grouped.matchmaking_time,
                                        grouped.allreduce_time)
            else:
                # peers see the batch complete up to a view interval apart: the leader waits that long for them
                # all (none that a ping finds gone), and the group counts with a strict majority of the live
                # peers, so late ones that meet after it closed are too few to step apart from it
                patience = max(self.averager.min_matchmaking_time, 2 * self.tracker.refresh_interval)
                result = await self.averager.step(weight=weight, timeout=self.averaging_timeout, group_key=key,
                                                  target_group_size=live_peers, abort=abort,
                                                  min_group_size=quorum_of(live_peers), patience=patience,
                                                  planned=Planned(tuple(self.tracker.members(self.epoch))))
                outcome = _Averaged(result.complete, result.group_size, result.group_id,
                                    f" (parts {result.unaveraged_parts} did not come back)" if result.averaged else "",
                                    result.matchmaking_time, result.allreduce_time,
                                    result if result.averaged else None)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        beats.beat()
        return outcome, beats.longest_gap

    async def _watch_epoch(self, moved_on: asyncio.Event, beats: _Beats) -> None:
        """Set ``moved_on`` once the others are past our epoch.  Meanwhile keep our record fresh: a
        round that waits out a silent member outlasts it, and a peer that took us for dead would
        step alone at the epoch we are about to complete with the others."""
        refreshed = time.monotonic()
        while True:
            await asyncio.sleep(self.report_interval * 2)
            beats.beat()
            if not moved_on.is_set() and (self._interrupted or self.tracker.view().epoch > self.epoch):
                moved_on.set()  # the background view's read, or a stop
            last = self.tracker.last_report
            if last is not None and time.monotonic() - refreshed > self.tracker.fresh_for / 2:
                refreshed = time.monotonic()
                self.tracker.publish(last.model_copy(update={"time": self.tracker.now()}))

    def _restore_buffers(self) -> None:
        """Undo ``_fill_buffers``: the epoch's sum again, to go on accumulating into."""
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
    @property
    def served_parameters(self) -> list[torch.Tensor]:
        """The parameters a newcomer loads from us and a checkpoint holds."""
        return self.params

    def _install_state(self, state: dict) -> None:
        """A donor's state in place of ours (``_state_lock`` held)."""
        with torch.no_grad():
            for p, value in zip(self.params, state["params"], strict=True):
                p.copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])

    def _state_snapshot(self) -> tuple[int, Any]:
        """Called by the StateSharer with ``_state_lock`` held."""
        state = {"params": [p.detach() for p in self.params], "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}
        return self.epoch, state

    @property
    def phase(self) -> str:
        """What this peer's network work is busy with now: matchmaking, all-reduce, state download or idle."""
        return "state download" if self._downloading else self.averager.phase

    def _load_state_if_any(self, min_epoch: int = 0) -> bool:
        self._downloading = True
        started = time.monotonic()
        try:
            epoch, state = self._call(lambda n: self.state.download(min_epoch))
        except StateUnavailable as e:
            logger.info("no state to load yet (%s); starting from epoch %d", e, self.epoch)
            return False
        finally:
            self._downloading = False
            self.comm_seconds += time.monotonic() - started
        with self._state_lock:
            self._install_state(state)
            self.epoch = epoch
        self._reset_accumulators()
        self._advertise()  # a donor for the next newcomer at this epoch
        logger.info("loaded state of epoch %d from peers (parameters %s)", epoch,
                    params_digest(self.served_parameters))
        return True

    def _probe_upload(self) -> None:
        """A newcomer measures its upload to a few of the peers it could load state from, in the
        background while it trains its first epoch: its first round is then split by a measured
        figure instead of the default (the others' figures come from their rounds)."""
        if self.averager.meter is None:
            return
        me = str(self.dht.peer_id)

        async def run(node: DHTNode) -> None:
            peers = [address for _, address in await self.state.donors() if me not in address]
            await self.averager.probe_bandwidth(peers[:PROBE_PEERS])

        self.dht.spawn(run)

    def _catch_up(self, epoch: int) -> None:
        logger.info("behind: local epoch %d, global epoch %d; loading state", self.epoch, epoch)
        if not self._load_state_if_any(min_epoch=epoch):
            self._reset_accumulators()  # no donor yet: at least stop accumulating for a stale epoch
        self._report(force=True)

    # ---- DHT records ---------------------------------------------------------------------------
    def _report(self, force: bool = False, wait: bool = False) -> None:
        """Publish our progress: handed to the tracker's background view, or stored before returning."""
        now = time.monotonic()
        if not force and now - self._last_report < self.report_interval:
            return
        self._last_report = now
        progress = PeerProgress(epoch=self.epoch, samples=self.local_samples, samples_per_second=self._throughput,
                                time=self.tracker.now(), client_mode=self.dht.node.client_mode,
                                loss=self.last_loss)
        if wait:
            self._call(lambda n: self.tracker.report(progress))
        else:
            self.tracker.publish(progress)

    def keep_alive(self) -> None:
        """Refresh our DHT records well before they expire (also for callers that are not stepping)."""
        now = time.monotonic()
        if now - self._last_report > self.tracker.fresh_for / 2:  # others wait only for fresh peers
            self._report(force=True)
        if now - self._last_advert > self.advert_expiration / 3:
            self._advertise()

    def _advertise(self, wait: bool = False) -> None:
        self._last_advert = time.monotonic()
        epoch = self.epoch
        if wait:
            self._call(lambda n: self.state.advertise(epoch, self.advert_expiration))
        else:
            self.dht.spawn(lambda n: self.state.advertise(epoch, self.advert_expiration))

    def _call(self, fn: Any) -> Any:
        return self.dht.run_coroutine(fn)

    # ---- leaving -------------------------------------------------------------------------------
    def interrupt(self) -> None:
        """Give up the matchmaking in progress, if any (a round already under way runs to its end): a
        peer that stops stepping need not wait out a group the others will never join.  From any thread."""
        self._interrupted = True

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
