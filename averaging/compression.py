"""Lossy codecs for float32 chunks on the wire, and the rule that picks one per tensor.

Error bounds (max absolute error of decode(encode(x)) against x, per element):

- ``none``: 0.
- ``fp16``: |x| * 2**-11 for |x| in fp16's normal range; chunks with |x| > 65504 are sent as
  float32 instead (no overflow to inf).
- ``uniform8``: (max(x) - min(x)) / 510 over the chunk: 256 levels between the chunk's min and max,
  rounded to nearest.
- ``blockwise8``: the same bound, but per block of ``BLOCK`` elements, so one outlier only costs
  precision in its own block.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

BLOCK = 256
FP16_MAX = 65504.0


class Codec(str, enum.Enum):
    NONE = "none"
    FP16 = "fp16"
    UNIFORM8 = "uniform8"
    BLOCKWISE8 = "blockwise8"


def error_bound(codec: Codec, x: torch.Tensor) -> float:
    """The documented worst-case absolute error of ``codec`` on ``x`` (used by tests)."""
    x = x.float()
    if codec is Codec.NONE or x.numel() == 0:
        return 0.0
    if codec is Codec.FP16:
        return 0.0 if x.abs().max() > FP16_MAX else float(x.abs().max()) * 2**-11
    if codec is Codec.UNIFORM8:
        return float(x.max() - x.min()) / 510
    blocks = _pad_blocks(x)
    return float((blocks.max(dim=1).values - blocks.min(dim=1).values).max()) / 510


def choose(numel: int, preferred: Codec, min_numel: int = 1 << 14) -> Codec:
    """Size-adaptive rule: small tensors (biases, norms) travel exact, large ones use ``preferred``."""
    return Codec.NONE if numel < min_numel else preferred


def encode(codec: Codec, x: torch.Tensor) -> dict[str, Any]:
    """Encode a contiguous float32 chunk into a message payload."""
    if codec is Codec.NONE or x.numel() == 0:
        return {"c": Codec.NONE.value, "d": x}
    if codec is Codec.FP16:
        if x.abs().max() > FP16_MAX:
            return {"c": Codec.NONE.value, "d": x}
        return {"c": codec.value, "d": x.half()}
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


def decode_into(payload: Any, out: torch.Tensor) -> None:
    """Decode a payload into ``out`` (float32, the chunk's destination); ValueError if malformed."""
    if not isinstance(payload, dict) or "c" not in payload or not isinstance(payload.get("d"), torch.Tensor):
        raise ValueError("chunk payload must be {'c': codec, 'd': tensor, ...}")
    data = payload["d"]
    if data.numel() != out.numel():
        raise ValueError(f"chunk has {data.numel()} elements, expected {out.numel()}")
    codec = Codec(payload["c"])
    if codec is Codec.NONE or codec is Codec.FP16:
        out.copy_(data.reshape(out.shape))
    elif codec is Codec.UNIFORM8:
        torch.add(data.reshape(out.shape).float() * float(payload["s"]), float(payload["lo"]), out=out)
    else:
        lo, scale = payload["lo"], payload["s"]
        n_blocks = -(-out.numel() // BLOCK)
        if not isinstance(lo, torch.Tensor) or lo.numel() != n_blocks or scale.numel() != n_blocks:
            raise ValueError("blockwise chunk has the wrong number of block scales")
        padded = torch.zeros(n_blocks * BLOCK, dtype=torch.float32)
        padded[: out.numel()] = data
        blocks = padded.reshape(n_blocks, BLOCK) * scale.reshape(-1, 1) + lo.reshape(-1, 1)
        out.copy_(blocks.reshape(-1)[: out.numel()].reshape(out.shape))


def _pad_blocks(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1).float()
    n_blocks = -(-flat.numel() // BLOCK)
    if flat.numel() == n_blocks * BLOCK:
        return flat.reshape(n_blocks, BLOCK)
    # pad with the last value so padding never widens a block's range
    padded = torch.cat([flat, flat[-1:].expand(n_blocks * BLOCK - flat.numel())])
    return padded.reshape(n_blocks, BLOCK)
