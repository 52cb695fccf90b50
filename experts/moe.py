"""RemoteMixtureOfExperts: a layer whose experts live on other machines and may vanish at any time.

A linear gate scores every coordinate of the expert grid; an expert's score is the sum of its
coordinates' scores.  For each input row, beam search over the DHT finds the ``k_best`` live
experts; each chosen expert gets one call with all the rows that chose it, all calls in parallel.
The layer waits until every row has ``k_min`` answers (or cannot get them), then up to
``timeout_after_k_min`` for the rest, and mixes the answers with a softmax over the answering
experts' scores only.  Backward goes only to experts that answered; each row needs
``backward_k_min`` of them.  A dead expert costs a little quality, never a stopped training run.
An expert hosted by several servers (replicas) is called at one of them; if that one fails, the
call goes to another holder listed in the expert's DHT record within the same deadline, and a
server that failed is avoided for a while by later calls while another holder is known.
Rows left short of ``k_min`` because chosen experts failed get a second wave: beam search again,
passing over the servers that failed, and calls to the next best experts, within the same deadline
(what a forward pass does when a tenth of the servers just died with their records still in the DHT).
With ``prefix_cache_s``, prefix records are reused that many seconds, so steady training reads each
prefix of the grid once per that period instead of on every pass.
An expert that answers with NaN, infinity or the wrong shape counts as failed for that call, like a
dead one; with ``trusted_servers``, experts declared at servers the policy does not trust are never
chosen.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.autograd.function import once_differentiable

from dht import DHT
from p2p.codecs import cast_codec

from .beam_search import FoundExpert, PrefixCache, find_best_experts
from .client import ExpertClient
from .declare import get_expert_holders
from .errors import (
    ExpertCallFailed,
    ExpertError,
    ExpertRequestTooLarge,
    ExpertSchemaError,
    NonFiniteValues,
    NotEnoughExperts,
    UnknownExpert,
)
from .grid import normalize_prefix
from .remote import DUMMY, call_backward, call_forward, call_info, on_host
from .schema import TensorSchema, check_finite, describe_tensors
from .trust import TrustPolicy

logger = logging.getLogger(__name__)

Key = tuple[str, str]  # (uid, address it was found at)
AVOID_S = 10.0  # how long a server that failed a call is passed over while another holder is known
#: the caller's own mistakes: another replica would refuse the same request
_NOT_THE_SERVERS_FAULT = (ExpertSchemaError, ExpertRequestTooLarge, NonFiniteValues)


@dataclass
class MixtureCallReport:
    """What the last forward (and backward) of a mixture did: for monitoring and tests."""

    chosen: list[list[str]]
    answered: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)
    forward_seconds: float = 0.0
    search_seconds: float = 0.0  # the beam search alone (DHT lookups included)
    fallbacks: int = 0  # experts called in a second wave, for rows the first left short of k_min
    backward_answered: set[str] = field(default_factory=set)
    backward_failed: dict[str, str] = field(default_factory=dict)


class RemoteMixtureOfExperts(nn.Module):
    """Mixture of the ``k_best`` live experts under ``uid_prefix`` on a grid of ``grid_size``.

    Input ``[..., in_features]``; experts take ``[in_features]`` rows and return one tensor per row.
    ``forward_timeout`` / ``backward_timeout`` bound a whole pass (None: each call's own default of
    30 s); ``timeout_after_k_min`` None waits for every chosen expert.  If a row gets fewer than
    ``k_min`` answers, forward raises ``NotEnoughExperts`` -- or, with ``allow_zero_outputs``, that
    row's output is zero.  ``dht`` finds the experts; calls go through ``client`` (default: the
    DHT's own endpoint).  ``trusted_servers(uid, peer_id)`` (e.g. :class:`AssignedServers`), if
    given, decides which declared servers may serve which uid; the others are treated as absent.
    ``prefix_cache_s``: how long beam search reuses a prefix record it read, re-reading it in the
    background after half that (0, the default: read every time); experts declared or moved since
    show up that much later, so it suits grids whose experts stay where they are (a run whose
    supervisor moves experts between servers after a preemption met k_min on 3% of its passes for
    the 10 s after, with a 10-s cache).
    Inputs or output gradients with NaN or infinity raise ``NonFiniteValues`` before any call.
    """

    def __init__(self, in_features: int, grid_size: Sequence[int], uid_prefix: str, k_best: int, k_min: int = 1,
                 forward_timeout: float | None = None, timeout_after_k_min: float | None = None,
                 backward_k_min: int = 1, backward_timeout: float | None = None, *, dht: DHT,
                 client: ExpertClient | None = None, beam_size: int | None = None,
                 allow_zero_outputs: bool = False, compression: str = "none",
                 trusted_servers: TrustPolicy | None = None, prefix_cache_s: float = 0.0) -> None:
        super().__init__()
        if not grid_size or any(int(n) < 1 for n in grid_size):
            raise ValueError(f"grid_size must be positive integers, got {grid_size!r}")
        if not 0 <= k_min <= k_best or not 0 <= backward_k_min <= k_best:
            raise ValueError("need 0 <= k_min <= k_best and 0 <= backward_k_min <= k_best")
        self.in_features = in_features
        self.grid_size = tuple(int(n) for n in grid_size)
        self.uid_prefix = normalize_prefix(uid_prefix)
        self.k_best, self.k_min, self.backward_k_min = k_best, k_min, backward_k_min
        self.forward_timeout, self.backward_timeout = forward_timeout, backward_timeout
        self.timeout_after_k_min = timeout_after_k_min
        self.beam_size = beam_size or k_best
        self.allow_zero_outputs = allow_zero_outputs
        self.compression = cast_codec(compression)
        self.trusted_servers = trusted_servers
        self.prefix_cache = PrefixCache(prefix_cache_s) if prefix_cache_s > 0 else None
        self.dht = dht
        self.client = client or ExpertClient.from_dht(dht)
        self.proj = nn.Linear(in_features, sum(self.grid_size))
        self.output_schema: TensorSchema | None = None
        self.last_call: MixtureCallReport | None = None
        self._stats = dict.fromkeys(("calls", "calls_meeting_k_min", "rows", "rows_meeting_k_min", "failovers"), 0)
        self._last_short_log = float("-inf")
        # on the client's loop: each uid's holders as last looked up, and servers to pass over until then
        self._holders: dict[str, list[str]] = {}
        self._avoid: dict[str, float] = {}  # address -> until (monotonic): it failed (unreachable, malformed)
        self._avoid_uid: dict[Key, float] = {}  # (uid, address) -> until: it no longer hosts uid

    def take_stats(self) -> dict[str, int]:
        """Forward passes and rows since the last call, how many got ``k_min`` answers (every row of
        a pass, for the pass), and calls that went to another replica after one failed; resets the
        counts.  For the trainer's k_min statistics."""
        stats, self._stats = self._stats, dict.fromkeys(self._stats, 0)
        return stats

    def _log_short(self, short: int, rows: int, failures: dict) -> None:
        """Why rows missed k_min, at most once every 10 s (a run that loses a server would log every call)."""
        now = time.monotonic()
        if now - self._last_short_log < 10.0:
            return
        self._last_short_log = now
        logger.info("mixture %r: %d of %d rows got fewer than k_min=%d answers; %s", self.uid_prefix, short, rows,
                    self.k_min, _short(failures) or "fewer experts found than k_min")

    def _count(self, rows: int, short: int) -> None:
        self._stats["calls"] += 1
        self._stats["calls_meeting_k_min"] += short == 0
        self._stats["rows"] += rows
        self._stats["rows_meeting_k_min"] += rows - short

    def find_experts(self, grid_scores: Sequence[np.ndarray]) -> list[list[FoundExpert]]:
        """Beam search for every row (blocking; runs on the DHT's loop)."""
        return self.dht.run_coroutine(lambda node: self._search(node, grid_scores))

    def _search(self, node: Any, grid_scores: Sequence[np.ndarray],
                failed: set[Key] | frozenset[Key] = frozenset()) -> Awaitable[list[list[FoundExpert]]]:
        """Beam search passing over experts whose every known server failed lately (and ``failed``)."""
        now = time.monotonic()
        servers = {a for a, until in self._avoid.items() if until > now}
        pairs = {key for key, until in self._avoid_uid.items() if until > now}

        def exclude(uid: str, address: str) -> bool:
            if (uid, address) in failed:
                return True
            return (address in servers or (uid, address) in pairs) and self._avoided(uid, self._route(uid, address))
        return find_best_experts(node, self.uid_prefix, grid_scores, self.k_best, self.beam_size,
                                 trusted_servers=self.trusted_servers,
                                 exclude=exclude if servers or pairs or failed else None,
                                 prefix_cache=self.prefix_cache)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected inputs [..., {self.in_features}], got {list(x.shape)}")
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        check_finite(f"mixture {self.uid_prefix!r}", "input", [flat])
        grid_scores = self.proj(flat).split(self.grid_size, dim=1)
        scores = [s.detach().float().cpu().numpy() for s in grid_scores]
        started = time.perf_counter()
        chosen = self.find_experts(scores)
        self.last_call = MixtureCallReport([[e.uid for e in c] for c in chosen],
                                           search_seconds=time.perf_counter() - started)
        expert_out, answered = _RemoteMixtureCall.apply(DUMMY, on_host(flat), self, chosen, scores)
        expert_out, answered = expert_out.to(flat.device), answered.to(flat.device)
        rows, k = flat.shape[0], max((len(c) for c in chosen), default=0)  # chosen: with the second wave's
        pad = (0,) * len(self.grid_size)
        idx = torch.tensor([[e.coords for e in experts] + [pad] * (max(k, 1) - len(experts)) for experts in chosen],
                           dtype=torch.long).reshape(rows, max(k, 1), len(self.grid_size))
        gate = sum(s.gather(1, idx[:, :, d].to(s.device)) for d, s in enumerate(grid_scores))
        any_answer = answered.any(dim=1, keepdim=True)
        gate = torch.where(any_answer, gate.masked_fill(~answered, float("-inf")), torch.zeros_like(gate))
        weights = torch.softmax(gate, dim=1) * answered
        weights = weights.to(expert_out.dtype).reshape(*weights.shape, *([1] * (expert_out.dim() - 2)))
        out = (weights * expert_out).sum(dim=1)
        return out.reshape(*lead, *out.shape[1:])

    # ---- calls (on the client's loop) ----------------------------------------------------------
    async def _call_all(self, calls: dict[Key, Coroutine], rows_of: dict[Key, list[int]], num_rows: int,
                        k_min: int | np.ndarray, timeout: float | None
                        ) -> tuple[dict[Key, Any], dict[Key, BaseException]]:
        """Run every call; stop once each row has ``k_min`` answers (or cannot get them; an array:
        per row) plus ``timeout_after_k_min``, or at ``timeout``.  Calls still running are cancelled."""
        loop = asyncio.get_running_loop()
        tasks = {asyncio.ensure_future(coro): key for key, coro in calls.items()}
        got = np.zeros(num_rows, dtype=np.int64)
        waiting = np.zeros(num_rows, dtype=np.int64)
        for key in tasks.values():
            waiting[rows_of[key]] += 1
        deadline = math.inf if timeout is None else loop.time() + timeout
        settled_at: float | None = None
        results: dict[Key, Any] = {}
        failures: dict[Key, BaseException] = {}
        pending = set(tasks)
        schema_error: ExpertSchemaError | None = None

        def settled() -> bool:
            return bool(np.all((got >= k_min) | (got + waiting < k_min)))

        if settled():
            settled_at = loop.time()
        try:
            while pending and schema_error is None:
                limit = deadline
                if settled_at is not None and self.timeout_after_k_min is not None:
                    limit = min(limit, settled_at + self.timeout_after_k_min)
                wait = None if limit == math.inf else max(limit - loop.time(), 0.0)
                done, pending = await asyncio.wait(pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    break
                for task in done:
                    key = tasks[task]
                    waiting[rows_of[key]] -= 1
                    exc = task.exception()
                    if exc is None:
                        results[key] = task.result()
                        got[rows_of[key]] += 1
                    elif isinstance(exc, ExpertSchemaError):
                        schema_error = exc  # the caller's mistake, not a dead expert: say so at once
                    else:
                        failures[key] = exc
                if settled_at is None and settled():
                    settled_at = loop.time()
        finally:
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        if schema_error is not None:
            raise schema_error
        for task in pending:
            failures[tasks[task]] = ExpertCallFailed("did not answer in time")
        return results, failures

    async def _forward_calls(self, x: torch.Tensor, chosen: list[list[FoundExpert]], scores: Sequence[np.ndarray]):
        """Every chosen expert's forward, then a second wave for the rows left short of ``k_min`` (its
        experts appended to ``chosen``): (groups, results, failures, the address that answered each)."""
        loop = asyncio.get_running_loop()
        deadline = None if self.forward_timeout is None else loop.time() + self.forward_timeout
        groups = _groups(chosen)
        results, failures, served = await self._forward_wave(x, groups, self.k_min, self.forward_timeout)
        got = np.zeros(x.shape[0], dtype=np.int64)
        for key in results:
            got[groups[key][0]] += 1
        short = np.flatnonzero(got < self.k_min)
        left = None if deadline is None else deadline - loop.time()
        if not len(short) or not failures or (left is not None and left <= 0):
            return groups, results, failures, served
        extra = await self._second_wave(chosen, scores, short, set(failures))
        if self.last_call is not None:
            self.last_call.fallbacks = len({(e.uid, e.address) for new in extra.values() for e in new})
        if not extra:
            return groups, results, failures, served
        more = _groups(chosen, extra)
        need = np.maximum(self.k_min - got, 0)
        results2, failures2, served2 = await self._forward_wave(x, more, need, left)
        for key, (rows, slots) in more.items():
            if key in results2 and key in results:  # answered for other rows in the first wave too
                results[key] = [torch.cat([results[key][0], results2[key][0]])]
                groups[key] = (groups[key][0] + rows, groups[key][1] + slots)
            elif key in results2:
                results[key], groups[key], served[key] = results2[key], (rows, slots), served2[key]
            elif key not in results:
                failures[key], groups[key] = failures2[key], (rows, slots)
        return groups, results, failures, served

    async def _forward_wave(self, x: torch.Tensor, groups: dict[Key, tuple[list[int], list[int]]],
                            k_min: int | np.ndarray, timeout: float | None):
        """One wave of forward calls: (results, failures, the address that answered each)."""
        def forward(key: Key, rows: list[int]) -> Coroutine:
            return self._with_failover(key, lambda address, left: self._checked_forward(address, key[0], x[rows],
                                                                                        left), timeout)
        calls = {key: forward(key, rows) for key, (rows, _) in groups.items()}
        answers, failures = await self._call_all(calls, {key: g[0] for key, g in groups.items()}, x.shape[0],
                                                 k_min, timeout)
        return ({key: outputs for key, (_, outputs) in answers.items()}, failures,
                {key: address for key, (address, _) in answers.items()})

    async def _second_wave(self, chosen: list[list[FoundExpert]], scores: Sequence[np.ndarray], short: np.ndarray,
                           failed: set[Key]) -> dict[int, list[FoundExpert]]:
        """For each short row, the experts of a new search (passing over the servers that failed) that
        it did not choose yet; appended to ``chosen``.  Why: a dead server's records outlive it (until
        they expire), so the first search still names its experts."""
        subset = [s[short] for s in scores]
        try:
            found = await self._on_dht(lambda node: self._search(node, subset, failed))
        except Exception as e:  # no DHT answer: the first wave's answers are all there is
            logger.debug("searching replacements for failed experts failed: %r", e)
            return {}
        extra: dict[int, list[FoundExpert]] = {}
        for r, experts in zip(short.tolist(), found, strict=True):
            had = {e.uid for e in chosen[r]}
            new = [e for e in experts if e.uid not in had]
            if new:
                extra[r] = new
                chosen[r].extend(new)
        return extra

    async def _on_dht(self, fn: Callable[[Any], Awaitable[Any]]) -> Any:
        """``fn(node)`` on the DHT's loop, from the client's loop (the same one, or another thread's)."""
        if asyncio.get_running_loop() is self.dht.loop:
            return await fn(self.dht.node)
        return await asyncio.wrap_future(self.dht.run_coroutine(fn, return_future=True))

    async def _checked_forward(self, address: str, uid: str, x: torch.Tensor, timeout: float | None) -> list:
        """One expert's forward; an answer that does not fit the layer's output schema is a failure."""
        outputs = await call_forward(self.client.p2p, address, uid, [x], timeout, self.compression)
        problem = _output_problem(outputs, self.output_schema)
        if problem:
            raise ExpertCallFailed(f"expert {uid!r} at {address} {problem}")
        return outputs

    async def _backward_calls(self, x: torch.Tensor, grads: dict[Key, torch.Tensor],
                              groups: dict[Key, tuple[list[int], list[int]]], served: dict[Key, str]):
        """Every answering expert's backward, first at the server that answered its forward."""
        p2p = self.client.p2p
        timeout = self.backward_timeout

        def backward(key: Key, g: torch.Tensor) -> Coroutine:
            inputs = [x[groups[key][0]]]
            return self._with_failover(
                (key[0], served.get(key, key[1])),
                lambda address, left: call_backward(p2p, address, key[0], inputs, [g], left, self.compression),
                timeout)
        calls = {key: backward(key, g) for key, g in grads.items()}
        answers, failures = await self._call_all(calls, {key: groups[key][0] for key in grads}, x.shape[0],
                                                 self.backward_k_min, timeout)
        return {key: grad_inputs for key, (_, grad_inputs) in answers.items()}, failures

    # ---- replicas (on the client's loop) -------------------------------------------------------
    async def _with_failover(self, key: Key, call: Callable[[str, float | None], Awaitable[Any]],
                             timeout: float | None) -> tuple[str, Any]:
        """``call(address, time left)`` at the expert's server, else at its other holders in turn,
        all within ``timeout``: (the address that answered, its answer), or the last failure."""
        uid, found_at = key
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        address = self._route(uid, found_at)
        tried: list[str] = []
        while True:
            left = None if deadline is None else max(deadline - loop.time(), 0.0)
            try:
                return address, await call(address, left)
            except _NOT_THE_SERVERS_FAULT:
                raise
            except ExpertError as e:
                self._avoid_after(uid, address, e)
                tried.append(address)
                error = e
            others = [a for a in await self._lookup_holders(uid) if a not in tried]
            if not others or (deadline is not None and loop.time() >= deadline):
                raise error
            address = min(others, key=lambda a: self._avoided(uid, a))  # stable: newest unavoided first
            self._stats["failovers"] += 1

    def _avoided(self, uid: str, address: str) -> bool:
        now = time.monotonic()
        return self._avoid.get(address, 0.0) > now or self._avoid_uid.get((uid, address), 0.0) > now

    def _route(self, uid: str, address: str) -> str:
        """Where to call first: where beam search found the expert, unless that server failed lately
        and another holder is known."""
        if not self._avoided(uid, address):
            return address
        return next((a for a in self._holders.get(uid, ()) if not self._avoided(uid, a)), address)

    def _avoid_after(self, uid: str, address: str, error: ExpertError) -> None:
        until = time.monotonic() + AVOID_S
        if isinstance(error, UnknownExpert):
            self._avoid_uid[(uid, address)] = until  # the server is fine, the expert moved away
        else:
            self._avoid[address] = until
        if len(self._avoid) + len(self._avoid_uid) > 4096:  # forget the expired ones now and then
            now = time.monotonic()
            self._avoid = {a: t for a, t in self._avoid.items() if t > now}
            self._avoid_uid = {k: t for k, t in self._avoid_uid.items() if t > now}

    async def _lookup_holders(self, uid: str) -> list[str]:
        """Every trusted holder of ``uid`` now (asking the DHT's replicas, not a local copy)."""
        def lookup(node: Any) -> Awaitable[dict[str, list[str]]]:
            return get_expert_holders(node, [uid], latest=True, trusted_servers=self.trusted_servers)
        try:
            found = await self._on_dht(lookup)
        except Exception as e:  # no DHT answer: no other holder to try
            logger.debug("looking up the holders of %s failed: %r", uid, e)
            return []
        self._holders[uid] = found[uid]
        return found[uid]

    async def _fetch_output_schema(self, keys: Sequence[Key]) -> TensorSchema | None:
        for uid, address in keys:
            try:
                info = await call_info(self.client.p2p, address, uid, self.forward_timeout or 5.0)
            except ExpertCallFailed:
                continue
            return info.outputs_schema[0]
        return None


def _groups(chosen: list[list[FoundExpert]],
            extra: dict[int, list[FoundExpert]] | None = None) -> dict[Key, tuple[list[int], list[int]]]:
    """Which rows (and slots of each row's choice) each expert serves: every chosen expert's, or
    only the ``extra`` ones, which sit at the end of their rows' lists."""
    groups: dict[Key, tuple[list[int], list[int]]] = {}
    if extra is None:
        items = [(r, j, e) for r, experts in enumerate(chosen) for j, e in enumerate(experts)]
    else:
        items = [(r, len(chosen[r]) - len(new) + j, e) for r, new in extra.items() for j, e in enumerate(new)]
    for r, j, e in items:
        g = groups.setdefault((e.uid, e.address), ([], []))
        g[0].append(r)
        g[1].append(j)
    return groups


def _output_problem(outputs: list, schema: TensorSchema | None) -> str | None:
    if len(outputs) != 1:
        return f"returns {len(outputs)} tensors; a mixture needs one"
    if schema is not None and not schema.matches(outputs[0]):
        return f"sent {describe_tensors(outputs)}; the mixture's experts return {schema.describe()}"
    return None


def _agreed_outputs(results: dict[Key, Any], failures: dict[Key, BaseException],
                    schema: TensorSchema | None) -> TensorSchema | None:
    """Keep the answers that fit ``schema`` (if unknown: the most common output schema among them);
    move the others to ``failures``.  Returns the schema."""
    if schema is None:
        seen = Counter(TensorSchema(tuple(o[0].shape[1:]), o[0].dtype) for o in results.values() if len(o) == 1)
        schema = seen.most_common(1)[0][0] if seen else None
    for key in list(results):
        problem = _output_problem(results[key], schema)
        if problem:
            failures[key] = ExpertCallFailed(f"expert {key[0]!r} at {key[1]} {problem}")
            del results[key]
    return schema


def _short(failures: dict[Key, BaseException], limit: int = 4) -> str:
    items = [f"{uid}: {e}" for (uid, _), e in list(failures.items())[:limit]]
    more = f"; and {len(failures) - limit} more" if len(failures) > limit else ""
    return "; ".join(items) + more


class _RemoteMixtureCall(torch.autograd.Function):
    """Calls every chosen expert; returns their outputs ``[rows, k, ...]`` and which ones answered."""

    @staticmethod
    def forward(ctx: Any, dummy: torch.Tensor, x: torch.Tensor, layer: RemoteMixtureOfExperts,
                chosen: list[list[FoundExpert]], scores: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        started = time.monotonic()
        x = x.detach()
        groups, results, failures, served = layer.client.run(layer._forward_calls(x, chosen, scores))
        rows, k = x.shape[0], max((len(c) for c in chosen), default=0)  # chosen: with the second wave's
        schema = _agreed_outputs(results, failures, layer.output_schema)
        report = layer.last_call
        if report is not None:
            report.chosen = [[e.uid for e in c] for c in chosen]
            report.answered = {uid for uid, _ in results}
            report.failed = {uid: f"{type(e).__name__}: {e}" for (uid, _), e in failures.items()}

        if schema is None and groups:
            schema = layer.client.run(layer._fetch_output_schema(list(groups)))
        answered = torch.zeros(rows, max(k, 1), dtype=torch.bool)
        counts = np.zeros(rows, dtype=np.int64)
        if schema is None:
            layer._count(rows, rows)
            raise NotEnoughExperts(f"no expert under {layer.uid_prefix!r} answered for any of {rows} rows "
                                   f"({len(groups)} chosen), so not even zeros can be returned; {_short(failures)}")
        layer.output_schema = schema
        out = torch.zeros((rows, max(k, 1), *schema.shape), dtype=schema.dtype)
        for key, (outputs,) in results.items():
            r_idx, s_idx = groups[key]
            out[r_idx, s_idx] = outputs
            answered[r_idx, s_idx] = True
            counts[r_idx] += 1
        short = np.flatnonzero(counts < layer.k_min)
        layer._count(rows, len(short))
        if len(short):
            layer._log_short(len(short), rows, failures)
        if len(short) and not layer.allow_zero_outputs:
            raise NotEnoughExperts(
                f"{len(short)} of {rows} rows got fewer than k_min={layer.k_min} expert answers "
                f"(row {short[0]}: {counts[short[0]]} of {len(chosen[short[0]])} chosen); {_short(failures)}")
        if len(short):
            answered[short] = False
            out[short] = 0
        if report is not None:
            report.forward_seconds = time.monotonic() - started
        ctx.layer = layer
        ctx.groups = {key: groups[key] for key in results}
        ctx.served = served
        ctx.save_for_backward(x)
        ctx.mark_non_differentiable(answered)
        return out, answered

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor, grad_answered: torch.Tensor) -> tuple:
        layer: RemoteMixtureOfExperts = ctx.layer
        (x,) = ctx.saved_tensors
        groups = ctx.groups
        check_finite(f"mixture {layer.uid_prefix!r}", "output gradient", [grad_out])
        grads = {key: grad_out[r_idx, s_idx] for key, (r_idx, s_idx) in groups.items()}
        results, failures = layer.client.run(layer._backward_calls(x, grads, groups, ctx.served))
        report = layer.last_call
        if report is not None:
            report.backward_answered = {uid for uid, _ in results}
            report.backward_failed = {uid: f"{type(e).__name__}: {e}" for (uid, _), e in failures.items()}
        counts = np.zeros(x.shape[0], dtype=np.int64)
        grad_x = torch.zeros_like(x)
        for key, grad_inputs in results.items():
            rows = groups[key][0]
            counts[rows] += 1
            if grad_inputs and grad_inputs[0] is not None:
                grad_x.index_add_(0, torch.tensor(rows, dtype=torch.long), grad_inputs[0].to(x.dtype))
        needs = np.zeros(x.shape[0], dtype=bool)
        for rows, _ in groups.values():
            needs[rows] = True  # rows that had an answer in forward; the others have nothing to send
        short = np.flatnonzero(needs & (counts < layer.backward_k_min))
        if len(short) and not layer.allow_zero_outputs:
            raise NotEnoughExperts(
                f"{len(short)} of {x.shape[0]} rows got fewer than backward_k_min={layer.backward_k_min} "
                f"backward answers; {_short(failures)}")
        return None, (grad_x if ctx.needs_input_grad[1] else None), None, None, None
