"""Codecs for float tensors on the wire: one name per format, for averaging and for expert calls.

Formats and error bounds (max absolute error of decode(encode(x)) against x, per element):

- ``none``: 0.
- ``float16``: |x| * 2**-11 for |x| in float16's normal range; chunks with |x| > 65504 are sent as
  float32 instead (no overflow to inf).
- ``bfloat16``: |x| * 2**-8; chunks past bfloat16's largest value are sent as float32 instead.
- ``uniform8``: (max(x) - min(x)) / 510 over the chunk: 256 levels between the chunk's min and max,
  rounded to nearest.
- ``blockwise8``: the same bound, but per block of ``BLOCK`` elements, so one outlier only costs
  precision in its own block.

Averaging sends float32 chunks with any codec (``encode``, ``decode``); expert calls cast whole
tensors with ``none``, ``float16`` or ``bfloat16`` (``compress``, ``restore``).

Payloads come from other peers, so decoding trusts nothing: every codec's tensor must have the
dtype, shape and length that codec produces, and its scales must be what ``encode`` writes.
Anything else raises ``MalformedChunk`` before any destination memory is touched; a payload that
would decode to NaN/inf raises ``NonFiniteChunk``; nothing is ever cast from a foreign dtype.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
else:
    class _DeferredTorch:
        """torch, imported at first use: p2p stays importable without paying for torch."""

        def __getattr__(self, name: str) -> Any:
            import torch

            value = getattr(torch, name)
            setattr(self, name, value)  # later lookups are plain attributes
            return value

    torch = _DeferredTorch()

BLOCK = 256
FLOAT32_MAX = 3.4028234663852886e38

# Names from before the codecs were unified, still read from configs and peers; remove after the next release.
ALIASES = {"fp16": "float16"}


class Codec(str, enum.Enum):
    NONE = "none"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    UNIFORM8 = "uniform8"
    BLOCKWISE8 = "blockwise8"

    @classmethod
    def _missing_(cls, value: object) -> Codec | None:
        alias = ALIASES.get(value) if isinstance(value, str) else None
        return None if alias is None else cls(alias)


_DATA_DTYPE = {Codec.NONE: "float32", Codec.FLOAT16: "float16", Codec.BFLOAT16: "bfloat16",
               Codec.UNIFORM8: "uint8", Codec.BLOCKWISE8: "uint8"}
# The casts: the largest value each holds (a chunk past it travels as float32), and its unit roundoff.
_CASTS = {Codec.FLOAT16: (65504.0, 2**-11), Codec.BFLOAT16: (3.3895313892515355e38, 2**-8)}


class BadChunk(ValueError):
    """A peer's chunk payload that this peer refuses; the message says what was wrong."""


class MalformedChunk(BadChunk):
    """Not what any encoder of this codec produces (codec, dtype, shape, length or scales)."""


class NonFiniteChunk(BadChunk):
    """Well formed, but it would decode to NaN or inf."""


# ---- chunks (averaging) ----------------------------------------------------------------------
def error_bound(codec: Codec, x: torch.Tensor) -> float:
    """The documented worst-case absolute error of ``codec`` on ``x`` (used by tests)."""
    x = x.float()
    if codec is Codec.NONE or x.numel() == 0:
        return 0.0
    if codec in _CASTS:
        limit, roundoff = _CASTS[codec]
        return 0.0 if x.abs().max() > limit else float(x.abs().max()) * roundoff
    if codec is Codec.UNIFORM8:
        return float(x.max() - x.min()) / 510
    blocks = _pad_blocks(x)
    return float((blocks.max(dim=1).values - blocks.min(dim=1).values).max()) / 510


def encode(codec: Codec, x: torch.Tensor) -> dict[str, Any]:
    """Encode a contiguous float32 chunk into a message payload."""
    if codec is Codec.NONE or x.numel() == 0:
        return {"c": Codec.NONE.value, "d": x}
    if codec in _CASTS:
        if x.abs().max() > _CASTS[codec][0]:
            return {"c": Codec.NONE.value, "d": x}
        return {"c": codec.value, "d": x.to(getattr(torch, _DATA_DTYPE[codec]))}
    if codec is Codec.UNIFORM8:
        lo, hi = x.min(), x.max()
        scale = torch.clamp((hi - lo) / 255, min=1e-30)
        q = torch.round((x - lo) / scale).to(torch.uint8)
        return {"c": codec.value, "d": q, "lo": float(lo), "s": float(scale)}
    blocks = _pad_blocks(x)
    lo = blocks.min(dim=1, keepdim=True).values
    scale = torch.clamp((blocks.max(dim=1, keepdim=True).values - lo) / 255, min=1e-30)
    q = torch.round((blocks - lo) / scale).to(torch.uint8).reshape(-1)[: x.numel()]
    return {"c": codec.value, "d": q, "lo": lo.reshape(-1), "s": scale.reshape(-1)}


def check(payload: Any, n: int) -> Codec:
    """The codec of a payload meant to decode to ``n`` float32 values; MalformedChunk if it is not
    exactly what that codec's encoder produces.  Reads no data, only types, shapes and scales."""
    if not isinstance(payload, dict) or "c" not in payload or not isinstance(payload.get("d"), torch.Tensor):
        raise MalformedChunk("chunk payload must be {'c': codec, 'd': tensor, ...}")
    try:
        codec = Codec(payload["c"])
    except (ValueError, TypeError):
        raise MalformedChunk(f"unknown codec {str(payload['c'])[:40]!r}") from None
    data: torch.Tensor = payload["d"]
    expected = getattr(torch, _DATA_DTYPE[codec])
    if data.dtype != expected:
        raise MalformedChunk(f"{codec.value} chunk has dtype {data.dtype}, expected {expected}")
    if data.dim() != 1 or data.layout != torch.strided or data.device.type != "cpu":
        raise MalformedChunk(f"{codec.value} chunk has shape {tuple(data.shape)}, expected ({n},)")
    if data.numel() != n:
        raise MalformedChunk(f"{codec.value} chunk has {data.numel()} elements, expected {n}")
    if codec is Codec.UNIFORM8:
        lo, scale = payload.get("lo"), payload.get("s")
        if not _is_number(lo) or not _is_number(scale):
            raise MalformedChunk("uniform8 chunk needs numbers 'lo' and 's'")
        if scale < 0:
            raise MalformedChunk(f"uniform8 chunk has a negative scale {scale!r}")
    elif codec is Codec.BLOCKWISE8:
        n_blocks = -(-n // BLOCK)
        for name in ("lo", "s"):
            t = payload.get(name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1 \
                    or t.layout != torch.strided or t.device.type != "cpu":
                raise MalformedChunk(f"blockwise8 chunk's '{name}' must be a 1-d float32 tensor")
            if t.numel() != n_blocks:
                raise MalformedChunk(f"blockwise8 chunk has {t.numel()} values of '{name}', expected {n_blocks}")
        if n_blocks and float(payload["s"].min()) < 0:
            raise MalformedChunk("blockwise8 chunk has a negative scale")
    return codec


def norm(x: torch.Tensor) -> float:
    """The L2 norm of a float tensor: NaN or inf exactly when x holds a NaN or an inf.

    One pass: for float32, the BLAS dot product of x with itself (109 us per 1M floats in cache,
    against 154 us for ``vector_norm``; ``aminmax`` and ``isfinite().all()`` are slower still, and
    the latter allocates); only when the float32 squares overflow, i.e. for values past ~1e19, a
    second look tells a non-finite value from a huge finite one.
    """
    if x.numel() == 0:
        return 0.0
    flat = x.reshape(-1)
    if flat.dtype == torch.float32:
        squares = float(torch.dot(flat, flat))
    else:
        squares = float(torch.linalg.vector_norm(flat)) ** 2
    if math.isfinite(squares):
        return math.sqrt(squares)
    lo, hi = (float(v) for v in torch.aminmax(flat))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return math.nan if math.isnan(lo) or math.isnan(hi) else math.inf
    return float(torch.linalg.vector_norm(flat, dtype=torch.float64))


def decodes_finite(codec: Codec, payload: dict) -> bool:
    """Whether a checked payload decodes to finite float32 values, without decoding it."""
    data = payload["d"]
    if codec is Codec.NONE:
        return math.isfinite(norm(data))
    if codec in _CASTS:
        return data.numel() == 0 or all(math.isfinite(float(v)) for v in torch.aminmax(data))
    if codec is Codec.UNIFORM8:  # q * s + lo in float32, q in [0, 255]: the product must not overflow
        lo, scale = payload["lo"], payload["s"]
        return abs(lo) <= FLOAT32_MAX and 255 * scale <= FLOAT32_MAX and abs(lo + 255 * scale) <= FLOAT32_MAX
    lo, scale = payload["lo"].double(), payload["s"].double()
    if lo.numel() == 0:
        return True
    return max(float(lo.abs().max()), float(scale.max()) * 255, float((lo + 255 * scale).abs().max())) \
        <= FLOAT32_MAX


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def decode(payload: Any, n: int) -> tuple[torch.Tensor, float]:
    """The payload's ``n`` values as float32, and their L2 norm; an exact (``none``) payload is
    returned as is, without a copy.  Raises MalformedChunk, or NonFiniteChunk for NaN/inf."""
    codec = check(payload, n)
    if codec is Codec.NONE:
        values = payload["d"]
    else:
        values = torch.empty(n, dtype=torch.float32)
        write_checked(codec, payload, values)
    magnitude = norm(values)
    if not math.isfinite(magnitude):
        raise NonFiniteChunk(f"{codec.value} chunk decodes to non-finite values")
    return values, magnitude


def check_decodable(payload: Any, n: int) -> Codec:
    """The payload's codec if it decodes to ``n`` finite values; raises MalformedChunk or NonFiniteChunk."""
    codec = check(payload, n)
    if not decodes_finite(codec, payload):
        raise NonFiniteChunk(f"{codec.value} chunk decodes to non-finite values")
    return codec


def decode_into(payload: Any, out: torch.Tensor) -> None:
    """Decode a payload into ``out`` (float32, the chunk's destination); raises MalformedChunk or
    NonFiniteChunk, leaving ``out`` untouched, if the payload is malformed or not finite."""
    write_checked(check_decodable(payload, out.numel()), payload, out.view(-1))


def write_checked(codec: Codec, payload: dict, out: torch.Tensor) -> None:
    """Decode into ``out`` a payload that ``check_decodable`` passed (as ``codec``)."""
    data = payload["d"]
    if codec is Codec.NONE or codec in _CASTS:
        out.copy_(data)
    elif codec is Codec.UNIFORM8:
        torch.add(data.float() * float(payload["s"]), float(payload["lo"]), out=out)
    else:
        lo, scale = payload["lo"], payload["s"]
        n_blocks = lo.numel()
        if n_blocks == 0:
            return
        padded = torch.zeros(n_blocks * BLOCK, dtype=torch.float32)
        padded[: out.numel()] = data
        blocks = padded.reshape(n_blocks, BLOCK) * scale.reshape(-1, 1) + lo.reshape(-1, 1)
        out.copy_(blocks.reshape(-1)[: out.numel()])


def _pad_blocks(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1).float()
    n_blocks = -(-flat.numel() // BLOCK)
    if flat.numel() == n_blocks * BLOCK:
        return flat.reshape(n_blocks, BLOCK)
    # pad with the last value so padding never widens a block's range
    padded = torch.cat([flat, flat[-1:].expand(n_blocks * BLOCK - flat.numel())])
    return padded.reshape(n_blocks, BLOCK)


# ---- whole tensors (expert calls) ------------------------------------------------------------
def cast_codec(name: str | Codec | None) -> Codec:
    """``name`` (None: ``none``) as a codec that casts whole tensors; ValueError for any other."""
    try:
        codec = Codec(Codec.NONE if name is None else name)
    except (ValueError, TypeError):
        codec = None
    if codec is Codec.NONE or codec in _CASTS:
        return codec
    raise ValueError(f"unknown compression {str(name)[:40]!r} for whole tensors; one of none, float16, bfloat16")


def compress(tensors: Sequence[torch.Tensor | None], codec: str | Codec | None) -> list[torch.Tensor | None]:
    """Cast the float32/float64 tensors to the cast codec's dtype; others travel as they are."""
    codec = cast_codec(codec)
    if codec is Codec.NONE:
        return list(tensors)
    wire = getattr(torch, _DATA_DTYPE[codec])
    return [t.to(wire) if t is not None and t.dtype in (torch.float32, torch.float64) else t for t in tensors]


def restore(tensors: Sequence[torch.Tensor | None], dtypes: Sequence[torch.dtype | None]) -> list[torch.Tensor | None]:
    """Cast compressed floats back to ``dtypes`` (entries that are None or already right stay as they are)."""
    out = []
    for t, dtype in zip(tensors, dtypes, strict=False):
        if isinstance(t, torch.Tensor) and dtype is not None and t.dtype != dtype and t.is_floating_point() \
                and dtype.is_floating_point:
            t = t.to(dtype)
        out.append(t)
    return out + list(tensors[len(out):])
