"""ExpertServer: hosts experts on one P2P endpoint, batches their calls, trains them, declares them.

RPCs (unary): ``expert.forward`` ``{"uid", "inputs": [tensors], "c"?}`` -> ``{"outputs": [...]}``;
``expert.backward`` ``{"uid", "inputs", "grad_outputs", "c"?}`` -> ``{"grad_inputs": [...]}``;
``expert.info`` ``{"uid"}`` -> schemas and limits; ``expert.state`` ``{"uid"}`` -> the expert's
state as ``torch.save`` bytes with checksums (see ``handoff.py``).  Requests are checked (uid,
schema, rows, finite values) on the event loop before they are queued, so a bad request is refused
on its own and the server keeps serving; the torch work runs on the runtime thread.  With
``initial_peers`` (``[]`` starts a new DHT) the same endpoint is a DHT peer that declares every
hosted expert and re-declares before expiry; it checks record signatures (``SignatureValidator``)
unless ``dht_options`` names validators.  The hosted set may change while the server runs
(``add_experts`` / ``remove_experts``), starting from none at all.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dht import DHTNode, SignatureValidator
from p2p import P2P, CallContext, Identity, Limits, PeerAddress
from p2p.codecs import Codec, cast_codec, compress, restore
from p2p.loop_thread import BlockingFace
from p2p.membership import SERVING_ROLES, serves_experts

from .backend import ExpertBackend
from .batching import BatchScheduler, TaskPool
from .checkpoints import load_experts, save_experts
from .declare import declare_experts, withdraw_experts
from .errors import ExpertRequestTooLarge, NonFiniteValues, UnknownExpert
from .handoff import STATE, params_checksum, state_bytes
from .runtime import Runtime
from .schema import check_finite, dtype_name

logger = logging.getLogger(__name__)

FORWARD, BACKWARD, INFO = "expert.forward", "expert.backward", "expert.info"
METHODS = (FORWARD, BACKWARD, INFO, STATE)


class ExpertServer:
    """Create with ``await ExpertServer.create(experts, ...)``; stop with ``await shutdown()``."""

    def __init__(self, p2p: P2P, backends: Mapping[str, ExpertBackend], dht: DHTNode | None, *,
                 batch_timeout: float, update_period: float, expiration: float,
                 checkpoint_dir: Path | None, checkpoint_period: float | None, announce_host: str | None,
                 runtime: Runtime | None = None) -> None:
        self.p2p = p2p
        self.backends = dict(backends)
        self.dht = dht
        self.update_period = update_period
        self.expiration = expiration
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_period = checkpoint_period
        self._owns_runtime = runtime is None  # a shared runtime outlives this server
        self.runtime = runtime if runtime is not None else Runtime()
        self.scheduler = BatchScheduler(self.runtime, batch_timeout)
        self._forward_pools: dict[str, TaskPool] = {}
        self._backward_pools: dict[str, TaskPool] = {}
        self._requests: dict[str, list[int]] = {}  # uid -> [accepted forward, accepted backward] requests
        for uid, b in self.backends.items():
            self._add_pools(uid, b)
        assert p2p.address is not None
        addr = p2p.address if announce_host is None else PeerAddress(announce_host, p2p.address.port, p2p.peer_id)
        self.address = str(addr)
        self.declared_until: float | None = None  # expiration of the last declaration that went through
        self._latest_until = 0.0  # the newest expiration this server stored anything with
        # declarations and withdrawals one at a time, so a withdrawal is always newer than what it hides
        self._dht_lock = asyncio.Lock()
        self._background: list[asyncio.Task] = []
        self._closed = False
        self.declaring = True  # False: the periodic re-declarations stop (a server about to leave)
        self.quiet: set[str] = set()  # hosted but no longer declared (moving to another server)

    def _add_pools(self, uid: str, backend: ExpertBackend) -> None:
        self._forward_pools[uid] = self.scheduler.add_pool(
            TaskPool(f"{uid}/forward", backend.forward, backend.max_batch_size))
        self._backward_pools[uid] = self.scheduler.add_pool(
            TaskPool(f"{uid}/backward", _backward_fn(backend), backend.max_batch_size))
        self._requests[uid] = [0, 0]

    @classmethod
    async def create(cls, experts: Mapping[str, ExpertBackend] | Sequence[ExpertBackend], *,
                     host: str = "127.0.0.1", port: int = 0, initial_peers: Sequence[str] | None = None,
                     identity: Identity | None = None, limits: Limits | None = None, batch_timeout: float = 0.0,
                     update_period: float = 30.0, expiration: float | None = None,
                     checkpoint_dir: str | Path | None = None, checkpoint_period: float | None = None,
                     announce_host: str | None = None, dht_options: dict | None = None,
                     p2p_options: dict | None = None, runtime: Runtime | None = None) -> ExpertServer:
        """Listen on ``host:port``, load checkpoints, and (with ``initial_peers``) declare the experts
        in the DHT before returning, so callers can find them at once.

        ``runtime``: a runtime shared with other servers of this loop (many small servers in one
        process then use one torch thread between them); the caller shuts it down after them."""
        backends = dict(experts) if isinstance(experts, Mapping) else {b.uid: b for b in experts}
        if not isinstance(experts, Mapping) and len(backends) != len(experts):
            raise ValueError("two experts have the same uid")
        for uid, b in backends.items():
            if uid != b.uid:
                raise ValueError(f"expert {b.uid!r} is listed under uid {uid!r}")
        expiration = expiration if expiration is not None else 2 * update_period
        if expiration <= update_period:
            raise ValueError(f"expiration ({expiration}) must be longer than update_period ({update_period})")
        p2p = await P2P.create(host, port, identity=identity, limits=limits,
                               **{"announce_host": announce_host, **(p2p_options or {})})
        dht = None
        server = None
        try:
            if initial_peers is not None:
                options = {"validators": [SignatureValidator(p2p.identity)], **(dht_options or {})}
                dht = await DHTNode.create(initial_peers, p2p=p2p, **options)
            server = cls(p2p, backends, dht, batch_timeout=batch_timeout, update_period=update_period,
                         expiration=expiration, checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir else None,
                         checkpoint_period=checkpoint_period, announce_host=announce_host, runtime=runtime)
            await server._start()
        except BaseException:
            if server is not None:
                await server.shutdown()
            else:
                if dht is not None:
                    await dht.shutdown()
                await p2p.shutdown()
            raise
        return server

    async def _start(self) -> None:
        certificate = self.p2p.membership.certificate if self.p2p.membership is not None else None
        if certificate is not None:
            refused = [uid for uid in self.backends if not serves_experts(certificate.roles, uid)]
            if refused:
                raise ValueError(f"this peer's certificate names roles {', '.join(certificate.roles) or '(none)'}, "
                                 f"which do not cover experts {', '.join(refused[:4])}: worker, supervisor and "
                                 "experts:<uid prefix> peers serve experts (spotswarm token issue --role ...)")
        if self.checkpoint_dir is not None:
            await self.runtime.run(load_experts, self.backends, self.checkpoint_dir)
        self.p2p.register(FORWARD, self.rpc_forward)
        self.p2p.register(BACKWARD, self.rpc_backward)
        self.p2p.register(INFO, self.rpc_info)
        self.p2p.register(STATE, self.rpc_state, roles=SERVING_ROLES)  # an expert's parameters: servers only
        self.scheduler.start()
        loop = asyncio.get_running_loop()
        if self.dht is not None:  # declares whatever is hosted at each period, maybe nothing yet
            await self.declare()
            self._background.append(loop.create_task(self._declare_loop(), name="expert-declare"))
        if self.checkpoint_dir is not None and self.checkpoint_period:
            self._background.append(loop.create_task(self._checkpoint_loop(), name="expert-checkpoints"))
        logger.info("expert server at %s hosts %d experts", self.address, len(self.backends))

    # ---- RPC handlers (overridable, e.g. to inject latency) ------------------------------------
    def _backend(self, request: Any) -> ExpertBackend:
        if not isinstance(request, dict) or not isinstance(request.get("uid"), str):
            raise ValueError("an expert request must be a dict with a string 'uid'")
        backend = self.backends.get(request["uid"])
        if backend is None:
            hosted = ", ".join(sorted(self.backends)[:8]) + (", ..." if len(self.backends) > 8 else "")
            raise UnknownExpert(f"this server hosts no expert {request['uid']!r} (it hosts: {hosted})")
        return backend

    @staticmethod
    def _codec(request: dict) -> Codec | None:
        codec = cast_codec(request.get("c"))
        return None if codec is Codec.NONE else codec

    def _limit(self, backend: ExpertBackend, rows: int) -> None:
        if rows > backend.max_batch_size:
            raise ExpertRequestTooLarge(f"expert {backend.uid!r} accepts at most {backend.max_batch_size} rows "
                                        f"per request, got {rows}")

    @staticmethod
    def _check_finite(backend: ExpertBackend, ctx: CallContext, what: str, tensors: list) -> None:
        """Refuse NaN and infinity before the request can join a batch shared with other callers."""
        try:
            check_finite(backend.uid, what, tensors)
        except NonFiniteValues as e:
            logger.info("refused %s from %s: %s", ctx.method, ctx.peer_id, e)
            raise

    async def rpc_forward(self, request: Any, ctx: CallContext) -> dict:
        backend = self._backend(request)
        codec = self._codec(request)
        inputs = request.get("inputs")
        if codec is not None and isinstance(inputs, list):
            inputs = restore(inputs, [s.dtype for s in backend.args_schema])
        rows = backend.check_inputs(inputs)
        self._limit(backend, rows)
        self._check_finite(backend, ctx, "input", inputs)
        self._requests[backend.uid][0] += 1
        outputs = await self.scheduler.submit(self._forward_pools[backend.uid], inputs, rows)
        if codec is None:
            return {"outputs": outputs}
        return {"outputs": compress(outputs, codec), "dt": [dtype_name(o.dtype) for o in outputs]}

    async def rpc_backward(self, request: Any, ctx: CallContext) -> dict:
        backend = self._backend(request)
        codec = self._codec(request)
        inputs, grads = request.get("inputs"), request.get("grad_outputs")
        if codec is not None and isinstance(inputs, list) and isinstance(grads, list):
            inputs = restore(inputs, [s.dtype for s in backend.args_schema])
            grads = restore(grads, [s.dtype for s in backend.outputs_schema])
        rows = backend.check_inputs(inputs)
        backend.check_grad_outputs(grads, rows)
        self._limit(backend, rows)
        self._check_finite(backend, ctx, "input", inputs)
        self._check_finite(backend, ctx, "grad_output", grads)
        self._requests[backend.uid][1] += 1
        grad_inputs = await self.scheduler.submit(self._backward_pools[backend.uid], [*inputs, *grads], rows)
        if codec is None:
            return {"grad_inputs": grad_inputs}
        return {"grad_inputs": compress(grad_inputs, codec),
                "dt": [None if g is None else dtype_name(g.dtype) for g in grad_inputs]}

    async def rpc_info(self, request: Any, ctx: CallContext) -> dict:
        return self._backend(request).info()

    async def rpc_state(self, request: Any, ctx: CallContext) -> dict:
        """The expert's state (module, optimizer, counters) and checksums, all taken between two
        batches on the runtime thread.  The bytes go as a uint8 tensor: a frame, which may be far
        larger than a message header."""
        backend = self._backend(request)
        data, params = await self.runtime.run(_state_snapshot, backend)
        return {"uid": backend.uid, "state": torch.frombuffer(bytearray(data), dtype=torch.uint8),
                "checksum": hashlib.sha256(data).hexdigest(), "params": params}

    # ---- the hosted set --------------------------------------------------------------------------
    async def add_experts(self, backends: Sequence[ExpertBackend]) -> None:
        """Host more experts: they serve at once and, with a DHT, are declared before this returns.
        ValueError naming the uid if one is hosted already (or listed twice)."""
        if self._closed:
            raise RuntimeError("this expert server is shut down")
        uids = [b.uid for b in backends]
        for uid in uids:
            if uid in self.backends:
                raise ValueError(f"expert {uid!r} is already hosted by this server")
            if uids.count(uid) > 1:
                raise ValueError(f"expert {uid!r} is listed twice")
        for b in backends:
            self.backends[b.uid] = b
            self._add_pools(b.uid, b)
        logger.info("expert server at %s now hosts %s too", self.address, ", ".join(uids))
        if self.dht is not None and uids:
            await self.declare(uids)

    async def remove_experts(self, uids: Sequence[str], withdraw: bool = True) -> None:
        """Stop hosting ``uids``: later requests get UnknownExpert, queued ones fail with it (a batch
        already running still answers).  With ``withdraw`` this server's DHT records of them are
        overwritten with None; without, they expire.
        ValueError naming the uid if one is not hosted."""
        uids = list(dict.fromkeys(uids))
        for uid in uids:
            if uid not in self.backends:
                raise ValueError(f"expert {uid!r} is not hosted by this server")
        for uid in uids:
            del self.backends[uid]
            self._requests.pop(uid, None)
            for pool in (self._forward_pools.pop(uid), self._backward_pools.pop(uid)):
                self.scheduler.remove_pool(
                    pool, lambda uid=uid: UnknownExpert(f"expert {uid!r} was removed from this server"))
        logger.info("expert server at %s no longer hosts %s", self.address, ", ".join(uids))
        if withdraw and self.dht is not None and uids:
            await self.withdraw(list(uids))

    # ---- DHT declarations ----------------------------------------------------------------------
    async def declare(self, uids: Sequence[str] | None = None) -> bool:
        """Declare every hosted expert (or those of ``uids`` still hosted) and its prefixes now,
        valid for ``expiration`` seconds; True if every record was accepted (nothing to declare: True)."""
        assert self.dht is not None
        async with self._dht_lock:
            chosen = [uid for uid in (self.backends if uids is None else uids)
                      if uid in self.backends and uid not in self.quiet]
            if not chosen:
                return True
            # newer than anything stored before, a withdrawal of an expert hosted again included
            until = max(self.dht.clock.now() + self.expiration, self._latest_until + 1e-3)
            self._latest_until = until  # even a failed store may have left records
            ok = await declare_experts(self.dht, chosen, self.address, until)
            self.declared_until = max(self.declared_until or 0.0, until)
        if not ok:
            # also when another server holds a newer record of the same expert (a replica): no harm then
            logger.info("some expert declarations were not accepted by any DHT replica (a newer record of "
                        "another server, or no replica reachable)")
        return ok

    async def redeclare(self) -> bool:
        """Declare every hosted expert now, e.g. so that after a replica's server died this one's
        records replace the dead one's at once instead of at the next period."""
        if self.dht is None:
            return True
        return await self.declare()

    async def withdraw(self, uids: list[str]) -> bool:
        assert self.dht is not None
        async with self._dht_lock:
            # just newer than our last declaration, so any later declaration (a restart, a replica) wins
            until = max(self._latest_until, self.dht.clock.now()) + 1e-3
            self._latest_until = until
            ok = await withdraw_experts(self.dht, uids, self.address, until)
        if not ok:
            logger.info("some expert withdrawals were not accepted by any DHT replica (a newer record of "
                        "another server, or no replica reachable)")
        return ok

    async def _declare_loop(self) -> None:
        while True:
            await asyncio.sleep(self.update_period)
            if not self.declaring:
                continue
            try:
                await self.declare()
            except Exception as e:  # a DHT hiccup must not stop the server; the next period retries
                logger.warning("declaring experts failed: %r", e)

    async def _checkpoint_loop(self) -> None:
        assert self.checkpoint_period
        while True:
            await asyncio.sleep(self.checkpoint_period)
            try:
                await self.save_checkpoints()
            except Exception as e:
                logger.warning("saving expert checkpoints failed: %r", e)

    async def save_checkpoints(self) -> None:
        if self.checkpoint_dir is not None:
            await self.runtime.run(save_experts, dict(self.backends), self.checkpoint_dir)  # the set may change

    # ---- lifetime ------------------------------------------------------------------------------
    async def shutdown(self, withdraw_timeout: float = 5.0, withdraw: bool = True) -> None:
        """Withdraw the experts from the DHT (unless ``withdraw`` is False: an expert another server
        also hosts stays findable, its next declaration taking the records over), stop serving,
        save checkpoints, close the endpoint."""
        if self._closed:
            return
        self._closed = True
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if withdraw and self.dht is not None and self._latest_until and self.backends:
            try:
                await asyncio.wait_for(self.withdraw(list(self.backends)), withdraw_timeout)
            except Exception as e:
                logger.warning("withdrawing experts from the DHT failed: %r", e)
        for method in METHODS:
            self.p2p.unregister(method)
        if self.dht is not None:
            await self.dht.shutdown()
        await self.p2p.shutdown()
        await self.scheduler.stop()
        try:
            await self.save_checkpoints()
        except Exception as e:
            logger.warning("saving expert checkpoints at shutdown failed: %r", e)
        if self._owns_runtime:
            await asyncio.get_running_loop().run_in_executor(None, self.runtime.shutdown)

    @property
    def stats(self) -> dict[str, dict[str, float]]:
        """Per hosted expert: batches, accepted requests, rows per forward batch (how full batches
        are), samples, busy time and optimizer steps."""
        out: dict[str, dict[str, float]] = {}
        for uid, b in self.backends.items():
            fwd, bwd = self._forward_pools[uid], self._backward_pools[uid]
            requests = self._requests.get(uid, [0, 0])
            out[uid] = {"forward_batches": fwd.batches, "backward_batches": bwd.batches,
                        "busy_seconds": fwd.busy_seconds + bwd.busy_seconds,
                        "requests_forward": requests[0], "requests_backward": requests[1],
                        "rows_per_batch": fwd.rows / fwd.batches if fwd.batches else 0.0,
                        "samples_forward": b.samples_forward, "samples_backward": b.samples_backward,
                        "optimizer_steps": b.optimizer_steps, "skipped_steps": b.skipped_steps}
        return out


def _state_snapshot(backend: ExpertBackend) -> tuple[bytes, str]:
    """On the runtime thread: the state's bytes and the parameters' checksum of the same moment."""
    return state_bytes(backend), params_checksum(backend.module)


def _backward_fn(backend: ExpertBackend):
    n = len(backend.args_schema)

    def run(tensors: list) -> list:
        return backend.backward(tensors[:n], tensors[n:])
    return run


class BackgroundExpertServer(BlockingFace):
    """An ExpertServer on its own event-loop thread, for code that is not async (scripts, tests);
    ``run(coro)`` runs a coroutine on the server's loop (e.g. ``server.declare()``)."""

    shutdown_timeout = 60.0

    def __init__(self, experts: Mapping[str, ExpertBackend] | Sequence[ExpertBackend],
                 startup_timeout: float = 60.0, server_cls: type[ExpertServer] = ExpertServer,
                 **options: Any) -> None:
        super().__init__(thread_name="spotswarm-experts")
        self._withdraw_on_close = True
        self.server: ExpertServer = self._start(server_cls.create(experts, **options), startup_timeout)

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def backends(self) -> dict[str, ExpertBackend]:
        return self.server.backends

    def add_experts(self, backends: Sequence[ExpertBackend], timeout: float | None = 60.0) -> None:
        self.run(self.server.add_experts(backends), timeout)

    def remove_experts(self, uids: Sequence[str], withdraw: bool = True, timeout: float | None = 60.0) -> None:
        self.run(self.server.remove_experts(uids, withdraw), timeout)

    def shutdown(self, withdraw: bool = True) -> None:
        """Stop the server (see ``ExpertServer.shutdown``) and its loop thread."""
        self._withdraw_on_close = withdraw
        super().shutdown()

    async def _aclose(self) -> None:
        await self.server.shutdown(withdraw=self._withdraw_on_close)
