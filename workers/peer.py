"""TrainingPeer: one training peer on one machine — the process ``spotswarm worker`` runs.

It joins the DHT, loads the freshest state from peers, trains its share, averages with the others
(collaborative or Moshpit), and leaves cleanly on ``prepare_to_leave`` (SIGTERM: a preemption
notice).  One log line per epoch; optionally one JSON line per epoch in ``report_file``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from dht import DHT
from experts.errors import NotEnoughExperts
from p2p import Identity
from p2p.devices import pick_device
from p2p.membership import Certificate, Membership
from p2p.route import RelayRoute

from .collaborative import CollaborativeOptimizer
from .diloco import DiLoCoOptimizer, round_samples
from .moshpit_sgd import MoshpitSGD
from .rounds import RoundSplitter
from .run_keys import run_validators
from .state import params_digest as params_digest  # where it always was, for importers
from .task import load_task
from .worker_config import WorkerConfig as WorkerConfig  # where it always was, for importers

logger = logging.getLogger(__name__)


def _on(device: torch.device, batch: Any) -> Any:
    """A batch (a tensor, or a tuple or list of them) on the model's device."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_on(device, item) for item in batch)
    return batch


def run_membership(config: WorkerConfig, identity: Identity) -> Membership | None:
    """The peer's membership of its run, from its token (None: open mode)."""
    if not config.membership_token:
        return None
    try:
        return Membership.from_token(config.membership_token, identity, run=config.run)
    except ValueError as e:
        raise ValueError(f"membership_token: {e}") from None


class TrainingPeer:
    def __init__(self, config: WorkerConfig, identity: Identity | None = None, standby: bool = False) -> None:
        """``standby``: a warm spare — everything a peer builds before it trains (the task, the model,
        its optimizer, a DHT node joined to the swarm), but no progress reports and no state until
        ``join`` (or ``run``): the swarm does not count it, and it takes over a preempted peer's
        place in a fraction of a cold boot."""
        self.config = config
        self.task = load_task(config.task, **config.task_options)
        self.device = pick_device(config.device)
        if identity is None:
            identity = Identity.from_file(config.identity_path) if config.identity_path else Identity()
        membership = run_membership(config, identity)
        self.dht = DHT(config.initial_peers, host=config.host, port=config.port, client_mode=config.client_mode,
                       announce_host=config.announce_host, identity=identity,
                       validators=run_validators(config.run, identity, config.byzantine),
                       p2p_options={"membership": membership, "route": RelayRoute.parse(config.route)
                                    if config.route else None})
        try:  # a model with remote experts finds them through the run's DHT
            self.model = self.task.model(seed=0, dht=self.dht).to(self.device)  # before its optimizer sees it
        except BaseException:
            self.dht.shutdown()
            raise
        self.mixtures = [m for m in self.model.modules() if hasattr(m, "take_stats")]
        self._moe_totals = dict.fromkeys(("calls", "calls_meeting_k_min", "rows", "rows_meeting_k_min",
                                          "failovers"), 0)
        # the task's own optimizer is built now even for a standby: a torch optimizer's first call
        # imports torch._dynamo, seconds of CPU that a spare pays before it is needed
        self._local_optimizer = self.task.make_optimizer(self.model.parameters())
        self._scheduler = self.task.make_scheduler(self._local_optimizer) if self.task.make_scheduler else None
        self.optimizer: CollaborativeOptimizer | MoshpitSGD | None = None  # None: a standby, until join
        if not standby:
            self.join()
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._run_lock = threading.Lock()  # run's start against prepare_to_leave: one of them goes first
        self._running = False
        self._leave_at: float | None = None  # monotonic time by which a noticed peer stops training
        self._epoch_s: float | None = None  # how long the last global epoch took, seen from here
        self._report = Path(config.report_file).open("a") if config.report_file else None
        self.history: deque[dict] = deque(maxlen=10_000)  # the per-epoch records, newest last
        self._samples_total = 0  # samples this peer trained on since it started
        self._train_started: float | None = None  # monotonic, when the training loop began
        self._rounds = RoundSplitter()  # each epoch's compute and communication seconds

    def join(self) -> None:
        """Take part in the run: load the swarm's state and report progress from now on (a standby's
        activation; at once for any other peer).  Safe to call twice."""
        if self.optimizer is not None:
            return
        config = self.config
        if config.mode == "diloco":
            self.optimizer = DiLoCoOptimizer(
                self._local_optimizer, self.dht, config.run,
                round_samples(config.inner_steps, self.task.batch_size, config.round_peers), scheduler=self._scheduler,
                outer_lr=config.outer_lr, outer_momentum=config.outer_momentum, overlap=config.overlap,
                compression=config.compression, byzantine=config.byzantine,
                min_matchmaking_time=config.min_matchmaking_time, averaging_timeout=config.averaging_timeout,
                bandwidth=config.bandwidth, swarm_size=config.swarm_size)
        elif config.mode == "collaborative":
            self.optimizer = CollaborativeOptimizer(
                self._local_optimizer, self.dht, config.run, config.target_batch_size, scheduler=self._scheduler,
                compression=config.compression, min_matchmaking_time=config.min_matchmaking_time,
                averaging_timeout=config.averaging_timeout, bandwidth=config.bandwidth, swarm_size=config.swarm_size,
                byzantine=config.byzantine)
        else:
            self.optimizer = MoshpitSGD(self._local_optimizer, self.dht, config.run, grid=config.moshpit_grid,
                                        averaging_period=config.averaging_period,
                                        averaging_timeout=config.averaging_timeout, compression=config.compression,
                                        max_group_size=config.group_size, bandwidth=config.bandwidth,
                                        swarm_size=config.swarm_size, byzantine=config.byzantine)

    @property
    def address(self) -> str | None:
        return self.dht.addresses[0] if self.dht.addresses else None

    @property
    def epoch(self) -> int:
        return self.optimizer.epoch if self.optimizer is not None else 0

    @property
    def phase(self) -> str:
        """matchmaking, all-reduce, state download, idle (computing gradients), or standby (a spare)."""
        if self.optimizer is None:
            return "standby"
        return getattr(self.optimizer, "phase", "idle")

    def run(self) -> None:
        """Train until max_epochs / max_seconds or ``prepare_to_leave`` (a standby joins first)."""
        with self._run_lock:
            if self._stop.is_set():  # told to leave before it ever trained
                self._stopped.set()
                return
            self._running = True
        try:
            self.join()
            self._train()
        finally:
            self._stopped.set()

    def _train(self) -> None:
        cfg = self.config
        assert self.optimizer is not None
        self._wait_for_peers()
        started = self._train_started = time.monotonic()
        # busy is 0 now by definition; what it averaged before training (state, peers) is no epoch's
        self._rounds.start(self.epoch, 0.0, self._time_totals()[1])
        batches = self.task.batches(cfg.seed)
        samples, window_start, losses = 0, time.monotonic(), []
        epoch_started = time.monotonic()
        progress_losses: list[float] = []  # since the last progress line (report_every_s)
        next_progress = time.monotonic() + (cfg.report_every_s or 0.0)
        while not self._stop.is_set():
            if self._leave_at is not None and time.monotonic() >= self._leave_at:
                break
            if cfg.max_epochs is not None and self.epoch >= cfg.max_epochs:
                break
            if cfg.max_seconds is not None and time.monotonic() - started > cfg.max_seconds:
                break
            batch = _on(self.device, next(batches))
            try:
                loss = self.task.loss(self.model, batch)
            except NotEnoughExperts as e:  # remote experts out of reach: try again, never die of it
                logger.warning("step skipped: %s", e)
                self._stop.wait(0.5)
                continue
            loss.backward()
            losses.append(loss.item())
            progress_losses.append(losses[-1])
            samples += self.task.batch_size
            self._samples_total += self.task.batch_size
            epoch_before = self.epoch
            self.optimizer.step(self.task.batch_size, loss.item())
            if self.epoch != epoch_before:
                now = time.monotonic()
                self._epoch_s, epoch_started = now - epoch_started, now
                elapsed = max(now - window_start, 1e-9)
                self._log_epoch(sum(losses) / len(losses), samples / elapsed)
                samples, window_start, losses = 0, now, []
                if self._leave_at is not None and now + self._epoch_s > self._leave_at:
                    break  # another epoch would not fit before we must go: leave between rounds
            if cfg.report_every_s is not None and time.monotonic() >= next_progress:
                next_progress = time.monotonic() + cfg.report_every_s
                self._log_progress(sum(progress_losses) / len(progress_losses))
                progress_losses = []

    def renew_membership(self, token: str) -> None:
        """Take a renewed certificate (before the current one expires): new and open connections
        present it from now on."""
        cert = Certificate.from_token(token)
        self.dht.renew_certificate(cert)

    def throttle(self, bytes_per_s: float | None) -> None:
        """Limit what this peer sends, and what it receives, to ``bytes_per_s`` each (None: lift the
        limit), as if its link had slowed down: fault injection where ``tc`` cannot shape traffic.

        Safe from any thread (the change is handed to each node's event loop); ValueError for a value
        that is not a positive finite number.  The DHT, the averager, state sharing and the experts
        found through the DHT all talk through the DHT's one P2P node; a mixture with a client of its
        own is limited as well."""
        nodes = [self.dht.node.p2p, *(m.client.p2p for m in self.mixtures if hasattr(m, "client"))]
        for p2p in {id(p): p for p in nodes}.values():
            p2p.set_rate_limit(bytes_per_s)

    def jump_clock(self, seconds: float) -> None:
        """Step this peer's wall clock by ``seconds``, as an NTP step or a VM resume would (from any
        thread; a fault injector's hook).  Everything the peer compares across machines reads it
        through its DHT's swarm clock, so the others' clocks keep its view of liveness right."""
        self.dht.clock.jump(seconds)

    def _wait_for_peers(self) -> None:
        """Start together: a lone first peer would otherwise race through epochs on its own."""
        cfg = self.config
        if cfg.min_peers <= 1:
            return
        optimizer = self.optimizer
        assert optimizer is not None
        deadline = time.monotonic() + cfg.min_peers_timeout
        while not self._stop.is_set() and time.monotonic() < deadline:
            optimizer.keep_alive()  # our report must outlive the wait, however long the others take
            seen = self.dht.run_coroutine(lambda _n: optimizer.tracker.global_progress()).peers
            if seen >= cfg.min_peers:
                return
            self._stop.wait(0.1)
        logger.warning("started with fewer than %d peers after %.0f s", cfg.min_peers, cfg.min_peers_timeout)

    def _log_epoch(self, loss: float, samples_per_second: float) -> None:
        peers = self._peers()
        logger.info("epoch %d loss %.4f samples/s %.1f peers %d", self.epoch, loss, samples_per_second, peers)
        now, totals = time.time(), self._time_totals()  # one reading: the record's totals are the split's
        split = self._rounds.close(self.epoch, *totals, at=now)
        record = {"epoch": self.epoch, "loss": loss, "samples_per_second": samples_per_second, "peers": peers,
                  "time": now, **self.costs(totals), "epoch_compute_s": split.compute_s,
                  "epoch_comm_s": split.comm_s}
        record.update(self._moe_record())
        if self._report is not None or self.config.param_digests:  # hashing every parameter is not free
            # the parameters every peer holds alike (DiLoCo: the global ones, not its inner copy)
            held = getattr(self.optimizer, "served_parameters", None) or self.model.parameters()
            record["params"] = params_digest(list(held))
            steps = getattr(self.optimizer, "history", None)
            record["group"] = getattr(steps[-1], "group_id", None) if steps else None  # who it averaged with
        self.history.append(record)
        if self._report is not None:
            self._report.write(json.dumps(record) + "\n")
            self._report.flush()

    def costs(self, totals: tuple[float, float] | None = None) -> dict:
        """What training cost this peer so far: samples, bytes sent (every call, the DHT's included),
        seconds spent averaging or downloading state instead of computing, and seconds since it
        started training (from any thread; ``totals``: those two seconds as ``_time_totals`` read them)."""
        busy, comm = self._time_totals() if totals is None else totals
        out = {"samples_total": self._samples_total, "bytes_sent": self.dht.node.p2p.traffic.total().bytes_out,
               "comm_s": round(comm, 4), "busy_s": round(busy, 3)}
        averager = getattr(self.optimizer, "averager", None)
        if averager is not None and averager.ban_log:  # members this peer's audits caught (byzantine=verify)
            out["bans"] = list(averager.ban_log)
        return out

    def _time_totals(self) -> tuple[float, float]:
        """Seconds since training began, and seconds of them spent averaging or downloading state,
        unrounded: each epoch's split is their growth, and a rounded total would skew a short epoch's."""
        busy = time.monotonic() - self._train_started if self._train_started is not None else 0.0
        return busy, getattr(self.optimizer, "comm_seconds", 0.0)

    def recent_rounds(self, after: int | None = None) -> list[dict]:
        """The epochs this peer completed one after another, each with the seconds it spent computing
        and communicating in it (from any thread), oldest first: those after epoch ``after`` (a few
        score at most; the caller asks again for the rest), or without it the newest few.  What its
        status carries to the supervisor's per-round table."""
        return self._rounds.recent() if after is None else self._rounds.after(after)

    def _log_progress(self, loss: float) -> None:
        """A line of the report between epochs (``report_every_s``): the loss since the last line."""
        if self._report is not None:
            record = {"kind": "progress", "epoch": self.epoch, "loss": loss, "time": time.time(), **self.costs()}
            self._report.write(json.dumps(record) + "\n")
            self._report.flush()

    def _moe_record(self) -> dict:
        """The mixtures' forward passes since the last record and the fraction whose every row got
        k_min answers (nothing for a model without remote experts, or without calls)."""
        if not self.mixtures:
            return {}
        taken = [m.take_stats() for m in self.mixtures]
        window = {key: sum(t[key] for t in taken) for key in self._moe_totals}
        for key, value in window.items():
            self._moe_totals[key] += value
        if not window["calls"]:
            return {}
        return {"moe_calls": window["calls"], "kmin_fraction": window["calls_meeting_k_min"] / window["calls"]}

    def moe_stats(self) -> dict[str, int]:
        """The mixtures' forward passes since the start, up to the last epoch record (cumulative)."""
        return dict(self._moe_totals)

    def _peers(self) -> int:
        opt = self.optimizer
        if opt is None:
            return 0
        if isinstance(opt, CollaborativeOptimizer):
            return opt.history[-1].group_size if opt.history else 1
        return opt.last_result.group_size if opt.last_result else 1

    def stop_stepping(self, timeout: float = 30.0) -> dict:
        """Let the current round finish (bounded by ``timeout``), then take no more steps while staying
        in the swarm: this peer's state is still served to others, and it no longer changes, so a
        checkpoint taken now holds exactly the parameters the peer stopped with.  Returns the epoch,
        the digest of the parameters it serves, whether the training loop did stop in time
        (``settled``), and the address its state is served from.  ``prepare_to_leave`` follows."""
        with self._run_lock:
            running = self._running
            self._stop.set()
        interrupt = getattr(self.optimizer, "interrupt", None)
        if interrupt is not None:  # the others stop too: a group being formed now would never fill
            interrupt()
        settled = self._stopped.wait(timeout=timeout) if running else True
        if not settled:
            logger.warning("training loop did not stop within %.1f s", timeout)
        optimizer = self.optimizer
        served = getattr(optimizer, "served_parameters", None) or getattr(optimizer, "params", None)
        params = list(served or self.model.parameters())
        record = {"epoch": self.epoch, "params": params_digest(params), "settled": settled, "address": self.address,
                  "loss": self.history[-1]["loss"] if self.history else None}
        logger.info("stopped stepping at epoch %d (parameters %s)", record["epoch"], record["params"])
        return record

    def prepare_to_leave(self, deadline: float = 30.0, train_for: float = 0.0) -> None:
        """Stop starting new rounds, let the current one finish (bounded by ``deadline``), withdraw
        our DHT records and shut down.  Safe to call from a signal handler's thread or another.

        ``train_for`` > 0 (a preemption notice with time to spare): keep contributing for up to that
        long, leaving at the first epoch boundary after which another epoch would not fit, so the
        notice period is spent training instead of idle, and we still leave between rounds."""
        started = time.monotonic()
        with self._run_lock:
            running = self._running
            if not running:  # a standby, or a peer never started: nothing to finish
                self._stop.set()
        if running:
            if train_for > 0 and not self._stop.is_set():
                self._leave_at = started + min(train_for, deadline)
                self._stopped.wait(timeout=min(train_for, deadline))
            self._stop.set()
            if not self._stopped.wait(timeout=max(deadline - (time.monotonic() - started), 0.0)):
                logger.warning("training loop did not stop within %.1f s; leaving anyway", deadline)
        if self.optimizer is not None:
            self.optimizer.prepare_to_leave()
        self.shutdown()

    def shutdown(self) -> None:
        self.dht.shutdown()
        if self._report is not None:
            self._report.close()
            self._report = None
