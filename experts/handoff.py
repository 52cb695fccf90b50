"""An expert's state handed from one server to another: what a replacement server loads.

When a server hosting an expert leaves, the server that takes the expert over loads its latest
state from a live replica over ``expert.state`` (module, optimizer and counters, as
``torch.save(backend.state_dict())`` bytes).  The bytes travel with their SHA-256, and the donor
also says the checksum of the module's parameters at the moment it took the state
(:func:`params_checksum`), so the receiver can prove that what it loaded is exactly what the donor
held.  Loading never unpickles arbitrary objects (``weights_only``).
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from p2p import P2P, P2PError, RemoteError

from .backend import ExpertBackend
from .errors import ExpertCallFailed

STATE = "expert.state"


def params_checksum(module: nn.Module) -> str:
    """SHA-256 (hex) over every parameter's bytes in ``named_parameters()`` order: equal only for
    bit-identical parameters, wherever they live."""
    h = hashlib.sha256()
    for _, p in module.named_parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def state_bytes(backend: ExpertBackend) -> bytes:
    """``torch.save(backend.state_dict())`` as bytes (run it where no batch of the backend runs)."""
    buffer = io.BytesIO()
    torch.save(backend.state_dict(), buffer)
    return buffer.getvalue()


def load_state_bytes(data: bytes, uid: str) -> dict:
    """The state dict in ``data`` (on the CPU, tensors and plain values only); ValueError if it is
    undecodable or holds another expert than ``uid``."""
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"the state of expert {uid!r} could not be decoded: {type(e).__name__}: {e}") from None
    if not isinstance(state, dict):
        raise ValueError(f"the state of expert {uid!r} is a {type(state).__name__}, not a dict")
    if state.get("uid") != uid:
        raise ValueError(f"the state sent for expert {uid!r} belongs to expert {state.get('uid')!r}")
    return state


@dataclass
class ExpertState:
    """An expert's state as a donor sent it; ``checksum`` is the SHA-256 of the bytes it came in,
    ``params_checksum`` the donor's :func:`params_checksum` of the same moment."""

    uid: str
    state: dict
    checksum: str
    params_checksum: str


def _wire_bytes(value: Any) -> bytes | None:
    """The state as bytes: a uint8 tensor on the wire (a frame, not bounded by the header's size), or bytes."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1:
        return value.numpy().tobytes()
    return None


async def fetch_expert_state(p2p: P2P, address: str, uid: str, timeout: float = 30.0) -> ExpertState:
    """Expert ``uid``'s state from the server at ``address``, checked against the checksum it came
    with; ExpertCallFailed naming the uid, the address and what was wrong otherwise."""
    where = f"state of expert {uid!r} from {address}"
    try:
        reply = await p2p.call(address, STATE, {"uid": uid}, timeout=timeout)
    except RemoteError as e:
        raise ExpertCallFailed(f"{where}: the server refused: {e.type_name}: {e.message}") from e
    except (P2PError, OSError, ValueError) as e:  # ValueError: an address that is not one
        raise ExpertCallFailed(f"{where}: unreachable: {type(e).__name__}: {e}") from e
    if not isinstance(reply, dict):
        raise ExpertCallFailed(f"{where}: malformed answer (a {type(reply).__name__}, not a map)")
    data = _wire_bytes(reply.get("state"))
    checksum, params = reply.get("checksum"), reply.get("params")
    if data is None or not isinstance(checksum, str) or not isinstance(params, str):
        raise ExpertCallFailed(f"{where}: malformed answer (needs state bytes, a checksum and a params checksum)")
    actual = hashlib.sha256(data).hexdigest()
    if actual != checksum:
        raise ExpertCallFailed(f"{where}: checksum mismatch: the {len(data)} bytes hash to {actual[:16]}..., "
                               f"the server said {checksum[:16]}...")
    try:
        state = load_state_bytes(data, uid)
    except ValueError as e:
        raise ExpertCallFailed(f"{where}: {e}") from None
    return ExpertState(uid, state, checksum, params)


__all__ = ["STATE", "ExpertState", "fetch_expert_state", "load_state_bytes", "params_checksum", "state_bytes"]
