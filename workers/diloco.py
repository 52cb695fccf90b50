"""DiLoCo: training over slow links, with little communication (Douillard et al. 2023).

Each peer trains its own copy of the model with its inner optimizer (AdamW, say) between outer
rounds.  A round comes when the swarm has processed ``target_batch_size`` samples since the last
one, counted by the same progress records as the collaborative mode: a slow peer contributes the
fewer samples it got through, weighted by them, and holds nobody.  The peers then average their
pseudo-gradients, ``θ_global − θ_local``, weighted by samples, with the same all-reduce (one group,
or groups of groups in a large run), and every peer applies the same outer step (SGD with Nesterov
momentum) to the global parameters, which it then trains from.  The global parameters and the outer
optimizer's state are the same on every peer after every round, and they are what a newcomer loads.

A round sends one model-sized vector per peer where the collaborative mode sends one per global
batch: with H inner steps per round, H times less.

A peer that leaves on notice hands its partial pseudo-gradient, with its sample count, to one peer
still at its round (``diloco.bequest.<run>``), which folds it into its own contribution, weighted:
the round's mean is the one it would have been had the leaver stayed for it.  A killed peer loses
only its own inner work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from dht import DHT, DHTNode
from p2p import P2PError, PeerID
from p2p.node import CallContext

from .collaborative import CollaborativeOptimizer, _Averaged

logger = logging.getLogger(__name__)
ROUND_VIEW_INTERVAL = 1.0  # seconds between reads of the swarm's progress (the collaborative mode's: 0.1)
BEQUEST_TIMEOUT = 5.0  # seconds a leaver spends handing its pseudo-gradient on, all heirs tried
BEQUEST_NORM_RATIO = 10.0  # a bequest whose norm is over this many times the heir's own is refused
BEQUESTS_HELD = 16  # bequests a peer holds for its round at most (each is a model-sized vector)


@dataclass
class _InFlight:
    """A round averaging in the background (``overlap``) while the next inner phase trains."""

    future: concurrent.futures.Future  # (_Averaged, seconds the event loop stood still)
    launched_from: list[torch.Tensor]  # our parameters when its pseudo-gradient was taken
    started: float  # monotonic
    live: int  # the peers it was for
    samples: int  # our samples and steps behind its pseudo-gradient
    steps: int
    share: float  # samples past which we wait for it (one round's worth of ours): an update at most a round late


def round_samples(inner_steps: int, batch_size: int, peers: int) -> int:
    """The samples an outer round stands for: each of the ``peers`` a run keeps up taking
    ``inner_steps`` steps of ``batch_size`` (every trainer and the supervisor size it alike)."""
    return inner_steps * batch_size * peers


class DiLoCoOptimizer(CollaborativeOptimizer):
    """Wraps any ``torch.optim`` optimizer as the inner one; call ``step`` after each
    ``loss.backward()`` like the collaborative optimizer.  ``outer_lr`` and ``outer_momentum``:
    the outer SGD's (Nesterov when the momentum is above 0); the other options are the
    collaborative optimizer's (a ``scheduler`` steps with the inner optimizer; ``view_interval``
    is 1 s unless given).  ``overlap``: a round all-reduces in the background while the next inner
    phase trains; its outer step lands when the round ends, at most one round late (we wait for it
    once we have trained another round's share), and the inner progress made meanwhile is kept on
    top of the new global parameters."""

    def __init__(self, optimizer: torch.optim.Optimizer, dht: DHT, run: str, target_batch_size: int, *,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, overlap: bool = False, **options: Any) -> None:
        if not 0 < outer_lr < float("inf"):
            raise ValueError(f"outer_lr must be a positive number, got {outer_lr!r}")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        # the global parameters: the same on every peer after every round (float32, where the model is)
        self.global_params = [p.detach().to(dtype=torch.float32, copy=True) for p in params]
        self.outer = torch.optim.SGD(self.global_params, lr=outer_lr, momentum=outer_momentum,
                                     nesterov=outer_momentum > 0)
        # a round lasts many inner steps: a view read a second apart notices its end soon enough (the view
        # also reads when it expects the round complete), at a tenth of the control traffic
        options.setdefault("view_interval", ROUND_VIEW_INTERVAL)
        # bequests of leavers for this round, (epoch, weight, flat pseudo-gradient); sealed once the
        # round's contribution is taken, so that none arrives too late to count and is lost unsaid
        self._bequests: list[tuple[int, float, torch.Tensor]] = []
        self._bequeathers: set[tuple[int, PeerID]] = set()  # (epoch, peer): one bequest per peer and round
        self._merged: list[tuple[int, float, torch.Tensor]] = []
        self._sealed = -1
        self._bequest_lock = threading.Lock()
        self.bequest_method = f"diloco.bequest.{run}"
        self.bequeathed: tuple[int, float, torch.Tensor, str | None] | None = None  # what we handed on, to whom
        self.overlap = overlap
        self._inflight: _InFlight | None = None
        self._landing: _InFlight | None = None  # the round whose outer step is being applied
        self._carried = (0, 0)  # samples and steps trained while it averaged: they count for the next round
        super().__init__(optimizer, dht, run, target_batch_size, **options)

        async def take_bequests(node: DHTNode) -> None:
            node.p2p.register(self.bequest_method, self._rpc_bequest)

        dht.run_coroutine(take_bequests)

    @property
    def served_parameters(self) -> list[torch.Tensor]:
        """What a newcomer loads and a checkpoint holds: the global parameters, not our inner copy."""
        return self.global_params

    # ---- the inner phase -----------------------------------------------------------------------
    def _take_micro_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()

    # ---- the outer step ------------------------------------------------------------------------
    def _fill_buffers(self) -> None:
        """Our pseudo-gradient, ``θ_global − θ_local``, into the buffers the round averages, with
        the bequests of this round's leavers folded in, weighted by their samples."""
        with torch.no_grad():
            for buf, g, p in zip(self.grad_buffers, self.global_params, self.params, strict=True):
                torch.sub(g.view_as(buf), p.detach().to(dtype=torch.float32).view_as(buf), out=buf)
        with self._bequest_lock:
            self._sealed = self.epoch
            self._merged = [b for b in self._bequests if b[0] == self.epoch]
            self._bequests = []
        if self._merged:
            self._fold_in(self._merged)

    def _fold_in(self, bequests: list[tuple[int, float, torch.Tensor]]) -> None:
        own = float(self.local_samples)
        flat = torch.cat([b.reshape(-1) for b in self.grad_buffers]).to(device="cpu", dtype=torch.float32)
        bound = BEQUEST_NORM_RATIO * max(float(flat.norm()), 1e-12)
        kept = [b for b in bequests if float(b[2].norm()) <= bound]
        if len(kept) < len(bequests):
            logger.warning("epoch %d: refused %d bequest(s) over %g times our own pseudo-gradient's norm",
                           self.epoch, len(bequests) - len(kept), BEQUEST_NORM_RATIO)
        self._merged = kept
        total = own + sum(w for _, w, _ in kept)
        if not kept or total <= 0:
            return
        flat.mul_(own)
        for _, w, values in kept:
            flat.add_(values, alpha=w)
        flat.div_(total)
        start = 0
        for buf in self.grad_buffers:
            buf.copy_(flat[start:start + buf.numel()].view_as(buf))
            start += buf.numel()

    def _round_weight(self) -> float:
        """Our samples and our leavers', bounded by what a member may declare."""
        return min(float(self.local_samples) + sum(w for _, w, _ in self._merged), self.averager.max_weight)

    def _restore_buffers(self) -> None:
        """The pseudo-gradient is taken afresh next time from where our inner phase got to; the
        bequests we folded in wait for that round."""
        with self._bequest_lock:
            self._bequests = self._merged + self._bequests
            self._merged = []
            self._sealed = -1

    def _apply_average(self) -> None:
        for g, avg in zip(self.global_params, self.host_buffers, strict=True):
            g.grad = avg.view_as(g).to(device=g.device, copy=True)
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        if self._landing is None:
            self._start_from_global()
            return
        with torch.no_grad():  # θ_local = θ_global + what we trained since the round's pseudo-gradient was taken
            for p, g, then in zip(self.params, self.global_params, self._landing.launched_from, strict=True):
                p.copy_(g + (p.detach().to(dtype=torch.float32) - then))

    def _start_from_global(self) -> None:
        with torch.no_grad():
            for p, g in zip(self.params, self.global_params, strict=True):
                p.copy_(g)

    def _reset_accumulators(self) -> None:
        for p in self.params:
            p.grad = None
        self.local_samples, self.local_steps = self._carried
        with self._bequest_lock:
            self._merged = []

    # ---- overlap: the round averages while the next inner phase trains ------------------------------
    def _average_round(self, live: int, started: float) -> bool:
        """With ``overlap``, launch the round on the DHT's loop and go back to training."""
        if not self.overlap:
            return super()._average_round(live, started)
        launched_from = [p.detach().to(dtype=torch.float32, copy=True) for p in self.params]
        weight = self._round_weight()  # the training thread goes on counting samples meanwhile
        future = self.dht.run_coroutine(lambda n: self._average(live, weight), return_future=True)
        share = self.target_batch_size / max(live, 1)
        self._inflight = _InFlight(future, launched_from, started, live, self.local_samples, self.local_steps, share)
        return False

    def _round_in_flight(self) -> bool | None:
        """Land the round in flight once it ended, or once we trained a round's share since it began
        (its update then waits for nobody longer than one round); meanwhile just train."""
        flight = self._inflight
        if flight is None:
            return None
        if not flight.future.done() and self.local_samples - flight.samples < flight.share:
            return False
        return self._land()

    def _land(self) -> bool:
        """The round in flight's outcome: its outer step under the inner progress made since (kept), or,
        as in the foreground mode, our contribution back and the others' state to load."""
        flight, self._inflight = self._inflight, None
        assert flight is not None
        waited = time.monotonic()
        try:
            result, stood_still = flight.future.result(timeout=self.averaging_timeout + self.tracker.fresh_for)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError, P2PError, OSError) as e:
            flight.future.cancel()
            result, stood_still = _Averaged(False, flight.live, why=f" ({type(e).__name__}: {e})"), 0.0
        self.comm_seconds += time.monotonic() - waited  # only what the training waited for
        carried = (self.local_samples - flight.samples, self.local_steps - flight.steps)
        self.local_samples, self.local_steps = flight.samples, flight.steps
        self._landing, self._carried = flight, carried
        try:
            stepped = self._conclude(result, stood_still, flight.started, flight.live)
        finally:
            self._landing, self._carried = None, (0, 0)
        if not stepped:  # the next round's pseudo-gradient covers everything since the last step
            self.local_samples += carried[0]
            self.local_steps += carried[1]
        return stepped

    async def _rpc_bequest(self, request: Any, ctx: CallContext) -> dict:
        """A leaver's partial pseudo-gradient for our round: ``{"e": epoch, "w": samples, "t": flat
        float32 tensor}``; ``{"ok": true}`` once it will count, else why not."""
        if not isinstance(request, dict) or not isinstance(request.get("e"), int) \
                or not isinstance(request.get("t"), torch.Tensor):
            raise ValueError("a bequest is {'e': epoch, 'w': samples, 't': flat float32 tensor}")
        epoch, weight, values = request["e"], request.get("w"), request["t"]
        numel = sum(p.numel() for p in self.params)
        if values.dtype != torch.float32 or values.dim() != 1 or values.numel() != numel:
            raise ValueError(f"a bequest holds {numel} float32 values, got {values.dtype} {tuple(values.shape)}")
        if not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or not 0 < weight <= self.averager.max_weight:
            raise ValueError(f"a bequest's weight must be in (0, {self.averager.max_weight:g}], got {weight!r}")
        if not bool(torch.isfinite(values).all()):
            raise ValueError("a bequest holds values that are not finite")
        with self._bequest_lock:
            if epoch != self.epoch or self._sealed == epoch:
                busy = " and averaging it" if epoch == self.epoch else ""
                return {"ok": False, "why": f"we are at epoch {self.epoch}{busy}"}
            self._bequeathers = {b for b in self._bequeathers if b[0] >= epoch}
            if (epoch, ctx.peer_id) in self._bequeathers:
                return {"ok": False, "why": "one bequest per peer and round"}
            if len(self._bequests) >= BEQUESTS_HELD:
                return {"ok": False, "why": f"we hold {BEQUESTS_HELD} bequests for this round already"}
            self._bequeathers.add((epoch, ctx.peer_id))
            self._bequests.append((epoch, float(weight), values.clone()))
        logger.info("epoch %d: a leaver's %d samples will count in our contribution", epoch, int(weight))
        return {"ok": True}

    def prepare_to_leave(self) -> None:
        if self._leaving:
            return
        if self._inflight is not None:  # the bequest needs the buffers, and the averager must end: land it first
            self._land()
        if self.local_samples > 0:
            self._bequeath()

        async def refuse_bequests(node: DHTNode) -> None:
            node.p2p.unregister(self.bequest_method)

        self._call(refuse_bequests)
        super().prepare_to_leave()

    def _bequeath(self) -> None:
        """Hand our inner work since the last round to one peer still at our epoch."""
        self._fill_buffers()
        with self._bequest_lock:
            self._sealed = -1
        values = torch.cat([b.reshape(-1) for b in self.grad_buffers]).to(device="cpu", dtype=torch.float32)
        request = {"e": self.epoch, "w": self._round_weight(), "t": values}
        me = str(self.dht.peer_id)

        async def hand_on(node: DHTNode) -> str | None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + BEQUEST_TIMEOUT
            for _, address in await self.state.donors(min_epoch=self.epoch):
                if me in address or loop.time() >= deadline:
                    continue
                try:
                    reply = await node.p2p.call(address, self.bequest_method, request,
                                                timeout=max(deadline - loop.time(), 0.1))
                except P2PError as e:
                    logger.info("could not hand our pseudo-gradient to %s: %s", address, e)
                    continue
                if isinstance(reply, dict) and reply.get("ok"):
                    return address
            return None

        heir = self._call(hand_on)
        if heir is None:
            logger.info("epoch %d: nobody took our %d samples' pseudo-gradient; leaving without it",
                        self.epoch, self.local_samples)
        else:
            logger.info("epoch %d: handed our %d samples' pseudo-gradient to %s", self.epoch, int(request["w"]),
                        heir)
        self.bequeathed = (self.epoch, request["w"], values, heir)

    # ---- state hand-off ------------------------------------------------------------------------
    def _state_snapshot(self) -> tuple[int, Any]:
        """Called by the StateSharer with ``_state_lock`` held: the global state, plus our inner
        optimizer's as a warm start for the newcomer's (it is each peer's own)."""
        state = {"params": list(self.global_params), "optimizer": self.optimizer.state_dict(),
                 "outer": self.outer.state_dict(),
                 "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}
        return self.epoch, state

    def _install_state(self, state: dict) -> None:
        if not isinstance(state.get("outer"), dict):
            raise ValueError("the state holds no outer optimizer: it is not a DiLoCo run's")
        with torch.no_grad():
            for g, value in zip(self.global_params, state["params"], strict=True):
                g.copy_(value)
        self.outer.load_state_dict(state["outer"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self._start_from_global()
