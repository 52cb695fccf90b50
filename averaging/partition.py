"""The averaged tensors as one flat float32 vector, cut into parts (one per reducer) and chunks.

Averaging happens in place in this buffer, so a round allocates no copy of the model; the
user's tensors are views into it.  Chunks never span two tensors, so each can use the codec
chosen for its tensor's size.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import torch

from p2p.devices import host_buffer

from .compression import Codec, choose


@dataclass(frozen=True)
class Chunk:
    start: int  # offset in the flat vector
    end: int
    codec: Codec


class FlatTensors:
    """Owns the flat buffer; ``views`` are the tensors in their original shapes."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        if not tensors:
            raise ValueError("averaging needs at least one tensor")
        for i, t in enumerate(tensors):
            if not t.is_floating_point():
                raise TypeError(f"tensor {i} has dtype {t.dtype}; only floating-point tensors can be averaged")
        self.shapes = [tuple(t.shape) for t in tensors]
        sizes = [t.numel() for t in tensors]
        self.offsets = [0]
        for n in sizes:
            self.offsets.append(self.offsets[-1] + n)
        single = tensors[0]
        reusable = single.dtype == torch.float32 and single.is_contiguous() and single.device.type == "cpu"
        if len(tensors) == 1 and reusable:
            self.flat = single.detach().reshape(-1)  # use the caller's memory: no copy of a big model
        else:  # GPU tensors are staged in page-locked memory
            gpu = next((t.device for t in tensors if t.device.type == "cuda"), None)
            self.flat = host_buffer(self.offsets[-1], gpu)
            for t, start, end in zip(tensors, self.offsets, self.offsets[1:], strict=False):
                self.flat[start:end].copy_(t.detach().reshape(-1))
        self.views = [self.flat[s:e].view(shape) for s, e, shape in zip(self.offsets, self.offsets[1:], self.shapes,
                                                                         strict=False)]

    @property
    def numel(self) -> int:
        return self.offsets[-1]

    @property
    def schema(self) -> list[list[int]]:
        return [list(s) for s in self.shapes]

    @property
    def schema_hash(self) -> str:
        return hashlib.sha256(msgpack.packb(self.schema)).hexdigest()[:16]

    def chunks(self, start: int, end: int, chunk_size: int, preferred: Codec) -> list[Chunk]:
        """Cut [start, end) at tensor boundaries and every ``chunk_size`` elements."""
        out: list[Chunk] = []
        for t_start, t_end in zip(self.offsets, self.offsets[1:], strict=False):
            lo, hi = max(start, t_start), min(end, t_end)
            codec = choose(t_end - t_start, preferred)
            for a in range(lo, hi, chunk_size):
                out.append(Chunk(a, min(a + chunk_size, hi), codec))
        return out


def part_bounds(part_sizes: Sequence[int]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for size in part_sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def describe_mismatch(mine: list[list[int]], theirs: list[list[int]]) -> str:
    """A readable account of how two tensor lists differ."""
    if len(mine) != len(theirs):
        return f"{len(theirs)} tensors against the group's {len(mine)}"
    for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        if list(a) != list(b):
            return f"tensor {i} has shape {tuple(b)} where the group has {tuple(a)}"
    return "tensor lists differ"
