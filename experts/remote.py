"""RemoteExpert: a torch module whose forward and backward run on an expert server.

Autograd works through it: forward sends the inputs (``expert.forward``), backward sends the inputs
again with the output gradients (``expert.backward``) and returns the input gradients; the server
updates the expert's parameters itself.  Every call has a deadline.  The coroutines below are also
what ``RemoteMixtureOfExperts`` uses to call many experts at once.  An answer with the wrong number
of rows, wrong gradient shapes, or NaN/infinity is the server's failure (``ExpertCallFailed``): it
never reaches the caller's model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from p2p import P2P, P2PError, RemoteError
from p2p.codecs import Codec, cast_codec, compress, restore
from p2p.membership import serves_experts

from .client import ExpertClient, default_client
from .errors import ExpertCallFailed, from_remote
from .grid import parse_uid
from .schema import TensorSchema, count_non_finite, dtype_from_name
from .server import BACKWARD, FORWARD, INFO

# Requires grad, so autograd always calls backward and the server always learns, even when no input
# of the expert needs a gradient.
DUMMY = torch.empty(0, requires_grad=True)


@dataclass(frozen=True)
class ExpertInfo:
    uid: str
    args_schema: tuple[TensorSchema, ...]
    outputs_schema: tuple[TensorSchema, ...]
    max_batch_size: int

    @classmethod
    def from_wire(cls, raw: Any) -> ExpertInfo:
        if not isinstance(raw, dict):
            raise ValueError(f"bad expert info {raw!r}")
        return cls(raw["uid"], tuple(TensorSchema.from_wire(s) for s in raw["args_schema"]),
                   tuple(TensorSchema.from_wire(s) for s in raw["outputs_schema"]), int(raw["max_batch_size"]))


async def _call(p2p: P2P, address: str, uid: str, method: str, request: dict, timeout: float | None) -> Any:
    try:
        if p2p.membership is not None:  # in a run: only its workers serve experts, not volunteers
            certificate = p2p.peer_certificate(await p2p.connect(address, timeout))
            if certificate is not None and not serves_experts(certificate.roles, uid):
                raise ExpertCallFailed(f"expert {uid!r} at {address} is served by a peer whose certificate names "
                                       f"{', '.join(certificate.roles) or 'no role'}: only workers serve experts")
        return await p2p.call(address, method, request, timeout=timeout)
    except RemoteError as e:
        local = from_remote(e)
        if local is e:
            raise ExpertCallFailed(f"expert {uid!r} at {address} failed: {e}") from e
        raise local from None
    except P2PError as e:
        raise ExpertCallFailed(f"expert {uid!r} at {address}: {type(e).__name__}: {e}") from e


def _tensors(response: Any, key: str, uid: str) -> list:
    items = response.get(key) if isinstance(response, dict) else None
    if not isinstance(items, list) or not all(t is None or isinstance(t, torch.Tensor) for t in items):
        raise ExpertCallFailed(f"expert {uid!r} sent a malformed answer (no tensor list under {key!r})")
    dtypes = response.get("dt")
    if isinstance(dtypes, list):
        items = restore(items, [dtype_from_name(d) if isinstance(d, str) else None for d in dtypes])
    return items


def _check_finite_answer(uid: str, address: str, what: str, tensors: Sequence[torch.Tensor | None]) -> None:
    for i, t in enumerate(tensors):
        bad = 0 if t is None else count_non_finite(t)
        if bad:
            raise ExpertCallFailed(f"expert {uid!r} at {address} sent {bad} non-finite values in {what} {i}")


def check_outputs(uid: str, address: str, inputs: Sequence[torch.Tensor], outputs: list) -> None:
    """ExpertCallFailed unless every output is a finite tensor with one row per input row."""
    rows = inputs[0].shape[0] if inputs else None
    for i, o in enumerate(outputs):
        if o is None or o.dim() == 0 or (rows is not None and o.shape[0] != rows):
            got = "nothing" if o is None else f"shape {list(o.shape)}"
            raise ExpertCallFailed(f"expert {uid!r} at {address} sent a malformed answer: output {i} has {got} "
                                   f"for {rows} input rows")
    _check_finite_answer(uid, address, "output", outputs)


def check_grad_inputs(uid: str, address: str, inputs: Sequence[torch.Tensor], grads: list) -> None:
    """ExpertCallFailed unless there is one finite gradient (or None) per input, shaped like it."""
    if len(grads) != len(inputs):
        raise ExpertCallFailed(f"expert {uid!r} at {address} returned {len(grads)} gradients for {len(inputs)} "
                               f"inputs")
    for i, (g, x) in enumerate(zip(grads, inputs, strict=True)):
        if g is not None and g.shape != x.shape:
            raise ExpertCallFailed(f"expert {uid!r} at {address} sent a gradient of shape {list(g.shape)} for "
                                   f"input {i} of shape {list(x.shape)}")
    _check_finite_answer(uid, address, "input gradient", grads)


def _request(uid: str, compression: str | Codec | None, **tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
    """A call's request: its tensor lists compressed, and the codec named unless it is ``none``."""
    codec = cast_codec(compression)
    request: dict[str, Any] = {"uid": uid, **{k: compress([t.detach() for t in v], codec) for k, v in tensors.items()}}
    if codec is not Codec.NONE:
        request["c"] = codec.value
    return request


async def call_forward(p2p: P2P, address: str, uid: str, inputs: Sequence[torch.Tensor],
                       timeout: float | None = None, compression: str | Codec | None = None) -> list[torch.Tensor]:
    request = _request(uid, compression, inputs=inputs)
    outputs = _tensors(await _call(p2p, address, uid, FORWARD, request, timeout), "outputs", uid)
    check_outputs(uid, address, inputs, outputs)
    return outputs


async def call_backward(p2p: P2P, address: str, uid: str, inputs: Sequence[torch.Tensor],
                        grad_outputs: Sequence[torch.Tensor], timeout: float | None = None,
                        compression: str | Codec | None = None) -> list[torch.Tensor | None]:
    request = _request(uid, compression, inputs=inputs, grad_outputs=grad_outputs)
    grads = _tensors(await _call(p2p, address, uid, BACKWARD, request, timeout), "grad_inputs", uid)
    check_grad_inputs(uid, address, inputs, grads)
    return grads


async def call_info(p2p: P2P, address: str, uid: str, timeout: float | None = None) -> ExpertInfo:
    raw = await _call(p2p, address, uid, INFO, {"uid": uid}, timeout)
    try:
        return ExpertInfo.from_wire(raw)
    except (KeyError, TypeError, ValueError) as e:
        raise ExpertCallFailed(f"expert {uid!r} sent malformed info: {e}") from None


class RemoteExpert(nn.Module):
    """Calls expert ``uid`` hosted at ``address`` (``peerid@host:port``); usable like any module.

    ``client`` defaults to the process's shared :func:`default_client`.  ``forward_timeout`` and
    ``backward_timeout`` bound each call (seconds); ``compression`` is ``"none"``, ``"float16"`` or
    ``"bfloat16"`` for the floats on the wire.  Errors: ``ExpertSchemaError`` (wrong inputs; names
    the expert and its schema), ``ExpertRequestTooLarge``, ``UnknownExpert``, ``NonFiniteValues`` (NaN
    or infinity in what was sent), ``ExpertCallFailed`` (unreachable, died, timed out, or answered
    with malformed or non-finite tensors).
    """

    def __init__(self, uid: str, address: str, client: ExpertClient | None = None, *,
                 forward_timeout: float | None = 30.0, backward_timeout: float | None = 30.0,
                 compression: str = "none") -> None:
        super().__init__()
        parse_uid(uid)
        self.uid = uid
        self.address = str(address)
        self.client = client or default_client()
        self.forward_timeout = forward_timeout
        self.backward_timeout = backward_timeout
        self.compression = cast_codec(compression)
        self._info: ExpertInfo | None = None

    @property
    def info(self) -> ExpertInfo:
        """The expert's schemas and limits (one ``expert.info`` call, then cached)."""
        if self._info is None:
            self._info = self.client.run(call_info(self.client.p2p, self.address, self.uid, self.forward_timeout))
        return self._info

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        device = inputs[0].device if inputs else torch.device("cpu")
        outputs = tuple(o.to(device) for o in _RemoteExpertCall.apply(DUMMY, self, *map(on_host, inputs)))
        return outputs[0] if len(outputs) == 1 else outputs

    def extra_repr(self) -> str:
        return f"uid={self.uid!r}, address={self.address!r}"


def on_host(t: torch.Tensor) -> torch.Tensor:
    """A remote call's tensor in host memory, moved there by autograd (differentiably), so the
    call's own backward runs on the caller's thread, not a GPU's autograd thread: blocking that one
    thread for a network round trip would stall every GPU backward of the process, an expert
    server's of the same GPU included, until the call timed out."""
    return t.cpu()


class _RemoteExpertCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, dummy: torch.Tensor, expert: RemoteExpert, *inputs: torch.Tensor) -> tuple:
        ctx.expert = expert
        ctx.save_for_backward(*inputs)
        outputs = expert.client.run(call_forward(expert.client.p2p, expert.address, expert.uid, inputs,
                                                 expert.forward_timeout, expert.compression))
        ctx.mark_non_differentiable(*(o for o in outputs if not o.is_floating_point()))
        return tuple(outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple:
        expert: RemoteExpert = ctx.expert
        inputs = ctx.saved_tensors
        grads = expert.client.run(call_backward(expert.client.p2p, expert.address, expert.uid, inputs,
                                                grad_outputs, expert.backward_timeout, expert.compression))
        return (None, None, *grads)
