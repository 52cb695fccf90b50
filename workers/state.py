"""State hand-off: a new or lagging peer downloads the freshest training state from other peers.

A donor advertises ``{epoch, bytes, address}`` under ``<run>.state`` and serves a snapshot of its
state (taken when asked, so it keeps training meanwhile, under the lock its training holds while it
steps: never half a step, nor one epoch's parameters under another's number): a skeleton (the
nested structure with tensors replaced by indices) plus the tensors, each with a SHA-256.  A
downloader asks every donor at the freshest epoch for a share of the tensors in parallel, checks
every checksum, and retries what failed from another donor; a dead donor costs a retry, never a hang.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dht import DHTNode, ReplicaSets, SignatureValidator
from p2p import CallKind, P2PError, PeerAddress
from p2p.node import CallContext

from .progress_tree import ProgressLayout

logger = logging.getLogger(__name__)
ADVERT_REPLICAS_REUSED_FOR = 30.0  # seconds an advert key's replica set is reused while its peers answer
DONOR_KEYS_PER_READ = 16  # state-advert keys a newcomer reads at once, in a run with more than one

_TENSOR = "__tensor__"


class StateUnavailable(RuntimeError):
    """No donor could provide a complete, verified state."""


def flatten_state(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """Split nested dicts/lists into a tensor-free skeleton and the list of tensors it refers to."""
    tensors: list[torch.Tensor] = []

    def walk(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            # a snapshot in host memory: training goes on while we serve it (from a GPU too)
            tensors.append(obj.detach().to("cpu", copy=True))
            return {_TENSOR: len(tensors) - 1}
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [walk(v) for v in obj]
        return obj

    return walk(state), tensors


def unflatten_state(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    def walk(obj: Any) -> Any:
        if isinstance(obj, dict):
            if set(obj) == {_TENSOR}:
                return tensors[obj[_TENSOR]]
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        return obj

    return walk(skeleton)


def checksum(t: torch.Tensor) -> bytes:
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return hashlib.sha256(raw).digest()


def params_digest(params: list[torch.Tensor]) -> str:
    """A short digest of parameters' exact bytes: equal digests, bit-equal parameters."""
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass
class _Snapshot:
    epoch: int
    skeleton: Any
    tensors: list[torch.Tensor]
    sums: list[bytes]


class StateSharer:
    """Serves this peer's state to others and downloads others' state."""

    def __init__(self, node: DHTNode, run: str, signer: SignatureValidator,
                 get_state: Callable[[], tuple[int, Any]], rpc_timeout: float = 30.0,
                 lock: threading.Lock | None = None, layout: ProgressLayout | None = None) -> None:
        self.node = node
        self.run = run
        # adverts live in the leaf of the run's key layout where our progress does: one key in a
        # run of up to 16 peers, about 16 adverts a key in a larger one
        self.layout = layout or ProgressLayout(run)
        self.key = self.layout.key(self.layout.leaf_of(node.peer_id), "state")
        self.subkey = f"{signer.marker}{node.peer_id}"
        self.get_state = get_state
        self.lock = lock or threading.Lock()  # the owner's, held while it changes its state
        self.rpc_timeout = rpc_timeout
        self._snapshot: _Snapshot | None = None
        # a peer advertises at every epoch: a lookup each time would cost more than the advert (readers
        # look up the key's nearest, which a set found up to this long ago still mostly is)
        self._replicas = ReplicaSets(node, ADVERT_REPLICAS_REUSED_FOR)
        self.meta_method = f"state.meta.{run}"
        self.data_method = f"state.tensors.{run}"
        if not node.client_mode:
            node.p2p.register(self.meta_method, self._rpc_meta)
            node.p2p.register(self.data_method, self._rpc_tensors, CallKind.SERVER_STREAM)

    def close(self) -> None:
        self.node.p2p.unregister(self.meta_method)
        self.node.p2p.unregister(self.data_method)

    # ---- donating ------------------------------------------------------------------------------
    async def advertise(self, epoch: int, expiration: float = 60.0) -> None:
        if self.node.client_mode:
            return
        await self.node.store(self.key, {"epoch": epoch, "a": str(self.node.address)},
                              self.node.clock.now() + expiration, subkey=self.subkey,
                              at=await self._replicas.of(self.key))

    async def withdraw(self) -> None:
        await self.node.store(self.key, None, self.node.clock.now() + 3600, subkey=self.subkey,
                              at=await self._replicas.of(self.key))

    def _current(self) -> _Snapshot:
        with self.lock:  # the copy, not only the read: the owner changes its tensors in place
            epoch, state = self.get_state()
            if self._snapshot is None or self._snapshot.epoch != epoch:
                skeleton, tensors = flatten_state(state)
                self._snapshot = _Snapshot(epoch, skeleton, tensors, [checksum(t) for t in tensors])
            return self._snapshot

    async def _rpc_meta(self, request: Any, ctx: CallContext) -> dict:
        snap = await asyncio.to_thread(self._current)  # waiting for the lock must not stall the event loop
        return {"epoch": snap.epoch, "skeleton": snap.skeleton, "n": len(snap.tensors), "sums": snap.sums}

    async def _rpc_tensors(self, request: Any, ctx: CallContext) -> Any:
        if not isinstance(request, dict) or not isinstance(request.get("idx"), list):
            raise ValueError("request must be {'epoch': int, 'idx': [tensor indices]}")
        snap = self._snapshot
        if snap is None or snap.epoch != request.get("epoch"):
            # keep serving the snapshot a downloader's metadata came from, even if training moved
            # on meanwhile; any donor can serve tensors, not only the one asked for the metadata
            snap = await asyncio.to_thread(self._current)
        if snap.epoch != request.get("epoch"):
            raise ValueError(f"this peer no longer serves epoch {request.get('epoch')}")
        for i in request["idx"]:
            if not isinstance(i, int) or not 0 <= i < len(snap.tensors):
                raise ValueError(f"no tensor {i!r}")
            yield {"i": i, "t": snap.tensors[i], "h": snap.sums[i]}

    # ---- downloading ---------------------------------------------------------------------------
    async def donors(self, min_epoch: int = 0, enough: int = 8) -> list[tuple[int, str]]:
        """(epoch, address) of peers offering state, freshest first.  In a large run our leaf is read
        first, then the others a batch at a time, until ``enough`` donors turned up (a newcomer needs
        a few, not every peer's advert; our leaf alone holds about 16)."""
        leaves = self.layout.all_leaves()
        mine = self.layout.leaf_of(self.node.peer_id)
        random.shuffle(leaves)
        others = [self.layout.key(path, "state") for path in leaves if path != mine]
        batches = [[self.key]] + [others[i:i + DONOR_KEYS_PER_READ] for i in range(0, len(others), DONOR_KEYS_PER_READ)]
        out: list[tuple[int, str]] = []
        for batch in batches:
            found = await self.node.get_many(batch, latest=True)
            for entry in found.values():
                out.extend(self._adverts(entry, min_epoch))
            if len(out) >= enough:
                break
        return sorted(out, reverse=True)

    def _adverts(self, found: Any, min_epoch: int) -> list[tuple[int, str]]:
        out = []
        if found is not None and isinstance(found.value, dict):
            for subkey, item in found.value.items():
                value = item.value
                if not isinstance(value, dict) or str(subkey) == self.subkey:
                    continue
                epoch, address = value.get("epoch"), value.get("a")
                if isinstance(epoch, int) and epoch >= min_epoch and isinstance(address, str):
                    out.append((epoch, address))
        return out

    async def download(self, min_epoch: int = 0, max_donors: int = 4) -> tuple[int, Any]:
        """The freshest verified state at or after ``min_epoch``, from up to ``max_donors`` in parallel."""
        donors = await self.donors(min_epoch)
        if not donors:
            raise StateUnavailable(f"no peer offers state of epoch >= {min_epoch}")
        return await self.download_from([a for _, a in donors], min_epoch, max_donors)  # freshest first

    async def download_from(self, addresses: list[str], min_epoch: int = 0, max_donors: int = 4) -> tuple[int, Any]:
        """``download`` from these donors (the freshest first) instead of those advertised in the DHT: a
        caller that knows who holds the newest state need not wait for their adverts to spread."""
        addresses = list(addresses)
        last_error: Exception | None = None
        while addresses:  # every try removes at least one donor from the list
            try:
                return await self._download_once(addresses, min_epoch, max_donors)
            except StateUnavailable as e:
                last_error = e
        raise StateUnavailable(f"every donor failed: {last_error}")

    async def _download_once(self, addresses: list[str], min_epoch: int, max_donors: int) -> tuple[int, Any]:
        """The state of the first donor that answers at ``min_epoch`` or later (training goes on
        while adverts travel, so a donor is often an epoch or more past what it advertised).
        Removes from ``addresses`` every donor that failed, or that answered but could not serve."""
        meta = None
        while addresses and meta is None:
            address = addresses.pop(0)
            try:
                meta = await self.node.p2p.call(address, self.meta_method, None, timeout=self.rpc_timeout)
            except P2PError as e:
                logger.info("state donor %s failed: %s", address, e)
                continue
            if not (isinstance(meta, dict) and isinstance(meta.get("epoch"), int) and meta["epoch"] >= min_epoch):
                meta = None
        if meta is None:
            raise StateUnavailable(f"no donor answered for epoch {min_epoch} or later")
        epoch = meta["epoch"]
        n, sums = int(meta["n"]), list(meta["sums"])
        got: dict[int, torch.Tensor] = {}
        pending = list(range(n))
        alive = [address, *addresses]  # the donor that answered serves first; others at its epoch help
        while pending and alive:  # share what is missing among live donors; drop those that fail
            use = alive[:max_donors]
            shares = [pending[k::len(use)] for k in range(len(use))]
            ok = await asyncio.gather(*(self._fetch(a, epoch, idx, sums, got) for a, idx in zip(use, shares,
                                                                                               strict=True)))
            alive = [a for a in alive if a not in use or ok[use.index(a)]]
            pending = [i for i in range(n) if i not in got]
        if pending:
            raise StateUnavailable(f"{len(pending)} of {n} tensors could not be fetched and verified")
        return epoch, unflatten_state(meta["skeleton"], [got[i] for i in range(n)])

    async def _fetch(self, address: str, epoch: int, idx: list[int], sums: list[bytes],
                     got: dict[int, torch.Tensor]) -> bool:
        if not idx:
            return True
        try:
            async with await self.node.p2p.call_stream(address, self.data_method, {"epoch": epoch, "idx": idx},
                                                       timeout=self.rpc_timeout) as call:
                async for item in call:
                    i, tensor, digest = item["i"], item["t"], item["h"]
                    if checksum(tensor) != digest or digest != sums[i]:
                        raise ValueError(f"tensor {i} failed its checksum")
                    got[i] = tensor
        except (P2PError, ValueError, KeyError, TypeError) as e:
            logger.info("state download from %s failed: %s", PeerAddress.parse(address).without_id(), e)
            return False
        return True
