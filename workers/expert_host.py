"""ExpertHost: the expert-server role of a mixture-of-experts run, on one machine.

The orchestrator places every expert of the run's grid on several hosts (replicas) and moves
experts when a host is preempted.  A host starts with no experts, joined to the run's DHT (the
run's validators, its membership); ``assign`` makes it host experts, each loaded from a live
replica (``expert.state``, checksummed, and the loaded parameters proven equal to what the donor
held), else from a checkpoint the caller passes, else fresh (seeded by its uid, so every replica of
a new expert starts equal).  A hosted expert is declared in the DHT at once, so callers find it
without waiting for the next period.

Replicas of one expert train on whatever calls reach them, so they drift apart; every
``replica_average_every_s`` seconds (aligned to the swarm clock, so the replicas look for each other
at the same moments) each hosted expert averages its parameters with its other replicas through a
``DecentralizedAverager`` of its own.  The average is taken of a snapshot, never of the live
parameters under the runtime thread, and what the expert learned meanwhile is kept: the live
parameters move by ``averaged - snapshot``.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import pydantic
import torch

from averaging import DecentralizedAverager
from experts import BackgroundExpertServer, ExpertBackend, ExpertCallFailed, expert_kinds
from experts.grid import make_uid, parse_uid
from experts.handoff import fetch_expert_state, load_state_bytes, params_checksum, state_bytes
from p2p import Identity
from p2p.devices import DeviceName, pick_device
from p2p.membership import Certificate
from p2p.route import RelayRoute

from .peer import run_membership
from .run_keys import run_validators
from .worker_config import check_route

logger = logging.getLogger(__name__)


class ExpertGridSpec(pydantic.BaseModel):
    """The run's experts: a grid of ``uid_prefix.i.j...`` of one kind and width."""

    model_config = pydantic.ConfigDict(extra="forbid")

    uid_prefix: str = pydantic.Field("ffn", pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$",
                                     description="the grid's name (uids are prefix.i.j...)")
    grid: list[int] = pydantic.Field([2, 4], min_length=1, description="experts along each grid dimension")
    kind: str = pydantic.Field("ffn", description="registered expert kind (ffn, transformer, nop, ...)")
    hidden_dim: int = pydantic.Field(64, gt=0)
    lr: float = pydantic.Field(1e-3, gt=0, description="each expert's Adam learning rate")
    max_batch_size: int = pydantic.Field(4096, gt=0, description="rows per request and per batch")
    max_grad_norm: float | None = pydantic.Field(1.0, gt=0, description="clip each step's gradient norm")

    @pydantic.field_validator("grid")
    @classmethod
    def _positive(cls, grid: list[int]) -> list[int]:
        if any(g < 1 for g in grid):
            raise ValueError(f"every grid size must be at least 1, got {grid}")
        return grid

    @pydantic.field_validator("uid_prefix")
    @classmethod
    def _grid_name(cls, prefix: str) -> str:
        if parse_uid(make_uid(prefix, [0]))[0] != prefix:
            raise ValueError(f"uid_prefix {prefix!r} must not end with a number (it would read as a coordinate)")
        return prefix

    @pydantic.field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        if kind not in expert_kinds():
            raise ValueError(f"unknown expert kind {kind!r}; registered: {', '.join(sorted(expert_kinds()))}")
        return kind


def grid_uids(spec: ExpertGridSpec) -> list[str]:
    """Every uid of the grid, row-major: ``ffn.0.0, ffn.0.1, ..., ffn.1.3``."""
    return [make_uid(spec.uid_prefix, coords) for coords in itertools.product(*(range(g) for g in spec.grid))]


def _uid_seed(uid: str) -> int:
    """A seed every process derives alike from the uid (Python's ``hash`` differs between processes)."""
    return int.from_bytes(hashlib.sha256(uid.encode()).digest()[:8], "little") & ((1 << 63) - 1)


_FRESH_LOCK = threading.Lock()


def fresh_expert(spec: ExpertGridSpec, uid: str, device: torch.device | str = "cpu") -> ExpertBackend:
    """A new expert ``uid``: its parameters are a function of the uid alone, so every replica of a
    new expert starts equal; trained by Adam(``spec.lr``).  The global torch RNG is left as it was.

    Module initialization draws from torch's global CPU generator, seeded here for the duration;
    another thread drawing from it at the same moment would change the values, so an ExpertHost
    builds its experts on its runtime thread, the one thread of the process that runs torch work."""
    with _FRESH_LOCK, torch.random.fork_rng(devices=[]):  # made on the CPU, then moved: alike on every device
        torch.manual_seed(_uid_seed(uid))
        return ExpertBackend.from_kind(uid, spec.kind, spec.hidden_dim,
                                       optimizer=lambda params: torch.optim.Adam(params, lr=spec.lr),
                                       device=device, max_batch_size=spec.max_batch_size,
                                       max_grad_norm=spec.max_grad_norm)


class ExpertHostConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    run: str = pydantic.Field(pattern=r"^[A-Za-z0-9_-]+$", description="the run whose experts this host serves")
    initial_peers: list[str] = pydantic.Field([], description="peers to join through ([]: start a new DHT)")
    host: str = pydantic.Field("127.0.0.1", description="address to listen on")
    announce_host: str | None = pydantic.Field(None, description="the address other machines reach (default: host)")
    port: int = pydantic.Field(0, ge=0, le=65535, description="port to listen on; 0 is any free port")
    route: str | None = pydantic.Field(None, description="emulated regions: dial these hosts through the "
                                             "regions' relay (WorkerConfig.route)")
    identity_path: str | None = pydantic.Field(None, description="private key file (keeps the peer id)")
    membership_token: str | None = pydantic.Field(None, description="the run's certificate for this peer")
    experts: ExpertGridSpec = pydantic.Field(default_factory=ExpertGridSpec)
    declare_period: float = pydantic.Field(2.0, gt=0, description="seconds between DHT re-declarations "
                                           "(records expire after twice that)")
    replica_average_every_s: float = pydantic.Field(10.0, ge=0, description="seconds between replica averaging "
                                                    "rounds; 0 disables them")
    averaging_timeout: float = pydantic.Field(10.0, gt=0, description="seconds one replica averaging round may take")
    bandwidth: float | None = pydantic.Field(None, gt=0, allow_inf_nan=False,
                                             description="Mbit/s to declare for load balancing (default: measured)")
    device: DeviceName = pydantic.Field("auto", description="where the experts live: auto, cpu or cuda")

    _route = pydantic.field_validator("route")(check_route)


@dataclass
class HandOff:
    """Where a newly hosted expert's state came from."""

    uid: str
    source: Literal["replica", "checkpoint", "fresh"]
    donor: str | None  # the replica's address (source "replica")
    params_checksum: str  # of the parameters as loaded, before any training here
    error: str | None = None  # why earlier donors (or the checkpoint) were skipped, if any were


@dataclass
class _Replica:
    """A hosted expert's averaging with its other replicas."""

    averager: DecentralizedAverager
    task: asyncio.Task | None = None  # the round in progress
    rounds: int = 0
    averaged: int = 0


@dataclass
class _Counters:
    rounds: int = 0
    averaged: int = 0


class ExpertHost:
    """One endpoint serving the run's experts assigned to it; blocking methods, for any thread
    but the server's own loop (a Ray actor's, a script's)."""

    def __init__(self, config: ExpertHostConfig, identity: Identity | None = None) -> None:
        self.config = config
        self.spec = config.experts
        self._grid = set(grid_uids(self.spec))
        self.device = pick_device(config.device)
        if identity is None:
            identity = Identity.from_file(config.identity_path) if config.identity_path else Identity()
        membership = run_membership(config, identity)  # type: ignore[arg-type]  # needs .run and .membership_token
        self._face = BackgroundExpertServer(
            [], host=config.host, port=config.port, announce_host=config.announce_host,
            initial_peers=list(config.initial_peers), identity=identity, update_period=config.declare_period,
            dht_options={"validators": run_validators(config.run, identity)},
            p2p_options={"membership": membership,
                         "route": RelayRoute.parse(config.route) if config.route else None})
        self.server = self._face.server
        self._replicas: dict[str, _Replica] = {}
        self._counters = _Counters()
        self._lock: asyncio.Lock | None = None  # assign/unassign one at a time (made on the loop)
        self._loop_task: asyncio.Task | None = None
        self._closed = False
        if config.replica_average_every_s > 0:
            try:
                self._loop_task = self._face.run(self._start_replica_loop(), 30)
            except BaseException:
                self._face.shutdown()
                raise
        logger.info("expert host of run %s at %s", config.run, self.address)

    # ---- identity --------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return self.server.address

    @property
    def peer_id(self) -> str:
        return str(self.server.p2p.peer_id)

    def renew_membership(self, token: str) -> None:
        """Take a renewed certificate (before the current one expires) for new and open connections."""
        cert = Certificate.from_token(token)

        async def renew() -> None:
            self.server.p2p.renew_certificate(cert)
        self._face.run(renew(), 30)

    def throttle(self, bytes_per_s: float | None) -> None:
        """Limit what this host sends and receives to ``bytes_per_s`` each (None: lift the limit), as if
        its link had slowed down; its expert server, DHT and replica averaging share the one P2P node.
        Safe from any thread; ValueError for a value that is not a positive finite number."""
        self.server.p2p.set_rate_limit(bytes_per_s)

    # ---- the hosted set --------------------------------------------------------------------------
    def assign(self, uids: list[str], donors: dict[str, list[str]] | None = None,
               checkpoints: dict[str, bytes] | None = None, timeout: float = 30.0) -> list[HandOff]:
        """Host ``uids`` (those not hosted yet; the others are skipped and not reported): each is
        loaded from the first of ``donors[uid]`` that hands over a checked state, else from
        ``checkpoints[uid]`` (``torch.save(backend.state_dict())`` bytes), else fresh; then served
        and declared at once.  ``timeout`` bounds each donor's transfer.  ValueError naming a uid
        outside the run's grid (nothing is assigned then)."""
        outside = [uid for uid in uids if uid not in self._grid]
        if outside:
            dims = ".".join(f"[0:{g}]" for g in self.spec.grid)
            raise ValueError(f"expert {outside[0]!r} is not in this run's grid {self.spec.uid_prefix}.{dims}")
        return self._face.run(self._assign(list(dict.fromkeys(uids)), donors or {}, checkpoints or {}, timeout))

    async def _assign(self, uids: list[str], donors: dict[str, list[str]], checkpoints: dict[str, bytes],
                      timeout: float) -> list[HandOff]:
        async with self._the_lock():
            stays = [uid for uid in uids if uid in self.server.quiet]  # about to move away, it stays after all
            self.server.quiet.difference_update(stays)
            if stays and self.server.declaring:
                await self.server.declare(stays)  # its withdrawal at the move's start is undone
            wanted = [uid for uid in uids if uid not in self.server.backends]
            loaded = await asyncio.gather(*(self._load(uid, donors.get(uid) or [], checkpoints.get(uid), timeout)
                                            for uid in wanted))
            backends = [b for b, _ in loaded]
            await self.server.add_experts(backends)
            for b in backends:
                self._start_replica(b)
            handoffs = [h for _, h in loaded]
        for h in handoffs:
            logger.info("hosting expert %s from %s%s%s", h.uid, h.source, f" {h.donor}" if h.donor else "",
                        f" (skipped: {h.error})" if h.error else "")
        return handoffs

    async def _load(self, uid: str, donors: Sequence[str], checkpoint: bytes | None,
                    timeout: float) -> tuple[ExpertBackend, HandOff]:
        # experts are built on the runtime thread: no batch draws random numbers while one is seeded
        problems: list[str] = []
        for donor in donors:
            try:
                got = await fetch_expert_state(self.server.p2p, donor, uid, timeout)
                backend, checksum = await self.server.runtime.run(self._from_state, uid, got.state)
            except ExpertCallFailed as e:
                problems.append(str(e))
                continue
            except Exception as e:  # a state that does not fit this run's experts
                problems.append(f"state of expert {uid!r} from {donor} does not load: {type(e).__name__}: {e}")
                continue
            if checksum != got.params_checksum:
                problems.append(f"state of expert {uid!r} from {donor}: the loaded parameters hash to "
                                f"{checksum[:16]}..., the donor's to {got.params_checksum[:16]}...")
                continue
            return backend, HandOff(uid, "replica", donor, checksum, "; ".join(problems) or None)
        if checkpoint is not None:
            try:
                if not isinstance(checkpoint, (bytes, bytearray)):
                    raise ValueError(f"a checkpoint must be bytes, got {type(checkpoint).__name__}")
                state = load_state_bytes(bytes(checkpoint), uid)
                backend, checksum = await self.server.runtime.run(self._from_state, uid, state)
            except Exception as e:
                problems.append(f"checkpoint of expert {uid!r}: {type(e).__name__}: {e}")
            else:
                return backend, HandOff(uid, "checkpoint", None, checksum, "; ".join(problems) or None)
        backend, checksum = await self.server.runtime.run(self._from_state, uid, None)
        return backend, HandOff(uid, "fresh", None, checksum, "; ".join(problems) or None)

    def _from_state(self, uid: str, state: dict | None) -> tuple[ExpertBackend, str]:
        """On the runtime thread: expert ``uid``, fresh or loaded from ``state``, and its params checksum."""
        backend = fresh_expert(self.spec, uid, self.device)
        if state is not None:
            backend.load_state_dict(state)
        return backend, params_checksum(backend.module)

    def unassign(self, uids: list[str], withdraw: bool = True, linger: float = 0.0) -> None:
        """Stop hosting ``uids`` (those not hosted are ignored) and, with ``withdraw``, remove this
        server from their DHT records.  With ``linger`` (an expert that moved to another server) the
        records go at once but the expert still answers for that long, so callers that found this
        server a moment ago are served while the others' records take over."""
        self._face.run(self._unassign(list(dict.fromkeys(uids)), withdraw, linger))

    def leaving(self) -> None:
        """A preemption notice: stop declaring and remove this server from every hosted expert's
        records at once (callers find the other holders), while it still answers until it goes."""
        async def stop() -> None:
            self.server.declaring = False
            hosted = list(self.server.backends)
            if hosted:
                await self.server.withdraw(hosted)
        self._face.run(stop(), 30)

    async def _unassign(self, uids: list[str], withdraw: bool = True, linger: float = 0.0) -> None:
        if linger > 0:
            moving = [uid for uid in uids if uid in self.server.backends]
            self.server.quiet.update(moving)
            if withdraw and moving:
                await self.server.withdraw(moving)
                withdraw = False  # done already
            await asyncio.sleep(linger)
            uids = [uid for uid in uids if uid in self.server.quiet]  # not assigned here again meanwhile
        async with self._the_lock():
            self.server.quiet.difference_update(uids)
            hosted = [uid for uid in uids if uid in self.server.backends]
            await asyncio.gather(*(self._stop_replica(uid) for uid in hosted))
            if hosted:
                await self.server.remove_experts(hosted, withdraw=withdraw)

    def _the_lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def hosted(self) -> list[str]:
        async def take() -> list[str]:  # read on the loop, where the set changes
            return sorted(self.server.backends)
        return self._face.run(take())

    def params_checksums(self) -> dict[str, str]:
        """uid -> ``params_checksum`` of its parameters now (between two batches)."""
        async def take() -> dict[str, str]:
            backends = dict(self.server.backends)
            return await self.server.runtime.run(lambda: {uid: params_checksum(b.module)
                                                          for uid, b in sorted(backends.items())})
        return self._face.run(take())

    def states(self, uids: list[str] | None = None) -> dict[str, bytes]:
        """uid -> ``torch.save(backend.state_dict())`` bytes, for the run's expert checkpoints; all
        hosted experts by default, and only hosted ones of ``uids``."""
        async def take() -> dict[str, bytes]:
            backends = {uid: b for uid, b in self.server.backends.items() if uids is None or uid in uids}
            return await self.server.runtime.run(lambda: {uid: state_bytes(b) for uid, b in sorted(backends.items())})
        return self._face.run(take())

    def redeclare(self) -> None:
        """Declare every hosted expert now (e.g. after another replica's server died)."""
        self._face.run(self.server.redeclare())

    def stats(self) -> dict:
        """Per-expert server stats and their totals, and the replica averaging rounds (per expert
        and round: attempted, and averaged with at least one other replica)."""
        async def take() -> dict:
            return self.server.stats
        per_uid = self._face.run(take())
        batches = sum(s["forward_batches"] for s in per_uid.values())
        rows = sum(s["rows_per_batch"] * s["forward_batches"] for s in per_uid.values())
        return {"experts": per_uid,
                "requests_forward": sum(s["requests_forward"] for s in per_uid.values()),
                "requests_backward": sum(s["requests_backward"] for s in per_uid.values()),
                "samples_forward": sum(s["samples_forward"] for s in per_uid.values()),
                "forward_batches": batches, "rows_per_batch": rows / batches if batches else 0.0,
                "replica_rounds": self._counters.rounds, "replica_averaged": self._counters.averaged}

    # ---- replica averaging -----------------------------------------------------------------------
    def _start_replica(self, backend: ExpertBackend) -> None:
        if self.config.replica_average_every_s <= 0:
            return
        assert self.server.dht is not None
        buffers = [torch.zeros(p.shape, dtype=torch.float32) for p in backend.module.parameters()]
        prefix = f"{self.config.run}_x{backend.uid.replace('.', '_')}"  # a matchmaking key the run's rules accept
        averager = DecentralizedAverager(buffers, self.server.dht, prefix, min_group_size=2,
                                         min_matchmaking_time=0.5, allreduce_timeout=self.config.averaging_timeout,
                                         bandwidth=self.config.bandwidth)
        self._replicas[backend.uid] = _Replica(averager)

    async def _stop_replica(self, uid: str) -> None:
        replica = self._replicas.pop(uid, None)
        if replica is None:
            return
        if replica.task is not None:
            replica.task.cancel()
            await asyncio.gather(replica.task, return_exceptions=True)
        await replica.averager.shutdown()

    async def _start_replica_loop(self) -> asyncio.Task:
        return asyncio.get_running_loop().create_task(self._replica_loop(), name="expert-replica-averaging")

    async def _replica_loop(self) -> None:
        every = self.config.replica_average_every_s
        while True:
            # every host's ticks fall on the same multiples of the swarm clock, so replicas meet at once
            now = self.server.dht.clock.now() if self.server.dht is not None else time.time()
            await asyncio.sleep(every - now % every)
            for uid, replica in list(self._replicas.items()):
                if replica.task is None or replica.task.done():
                    replica.task = asyncio.get_running_loop().create_task(self._average(uid, replica),
                                                                          name=f"expert-average-{uid}")
            running = [r.task for r in self._replicas.values() if r.task is not None]
            await asyncio.gather(*running, return_exceptions=True)

    async def _average(self, uid: str, replica: _Replica) -> None:
        backend = self.server.backends.get(uid)
        if backend is None:
            return
        self._counters.rounds += 1
        replica.rounds += 1
        tensors = replica.averager.tensors
        try:
            snapshot = await self.server.runtime.run(_snapshot, backend, tensors)
            result = await replica.averager.step(timeout=self.config.averaging_timeout)
            if not result.averaged:
                logger.debug("expert %s: no other replica to average with this round", uid)
                return
            await self.server.runtime.run(_apply, backend, snapshot, tensors)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the next round tries again
            logger.warning("expert %s: replica averaging failed: %r", uid, e)
            return
        self._counters.averaged += 1
        replica.averaged += 1
        logger.debug("expert %s: averaged with %d other replicas", uid, result.group_size - 1)

    # ---- lifetime --------------------------------------------------------------------------------
    def shutdown(self, withdraw: bool = False) -> None:
        """Stop serving; ``withdraw=True`` removes this server from its experts' records at once,
        without it they expire (``leaving`` has usually removed them already)."""
        if self._closed:
            return
        self._closed = True

        async def stop() -> None:
            if self._loop_task is not None:
                self._loop_task.cancel()
                await asyncio.gather(self._loop_task, return_exceptions=True)
            await asyncio.gather(*(self._stop_replica(uid) for uid in list(self._replicas)))
        try:
            self._face.run(stop(), 60)
        except Exception as e:
            logger.warning("stopping replica averaging failed: %r", e)
        finally:
            self._face.shutdown(withdraw=withdraw)


def _snapshot(backend: ExpertBackend, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """On the runtime thread: the parameters now, into the averager's buffers and a copy kept aside."""
    with torch.no_grad():
        for p, buf in zip(backend.module.parameters(), buffers, strict=True):
            buf.copy_(p.detach())
        return [buf.clone() for buf in buffers]


def _apply(backend: ExpertBackend, snapshot: list[torch.Tensor], averaged: list[torch.Tensor]) -> None:
    """On the runtime thread: move each parameter by ``averaged - snapshot``, keeping what was
    learned since the snapshot (a parameter untouched since is set to the average exactly)."""
    with torch.no_grad():
        for p, s, a in zip(backend.module.parameters(), snapshot, averaged, strict=True):
            s_here, a_here = s.to(p.device, p.dtype), a.to(p.device, p.dtype)
            if torch.equal(p, s_here):
                p.copy_(a_here)
            else:
                p.add_(a_here - s_here)


__all__ = ["ExpertGridSpec", "ExpertHost", "ExpertHostConfig", "HandOff", "fresh_expert", "grid_uids"]
