"""The averaged tensors as one flat float32 vector, cut into parts (one per reducer) and chunks.

Averaging happens in place in this buffer, so a round allocates no copy of the model; the
user's tensors are views into it.  A chunk spans neighbouring tensors that travel with the same
codec (a model's many small biases and norms then cost a few messages, not one each), and is cut
where the codec changes.
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
        """Cut [start, end) where the codec changes and every ``chunk_size`` elements."""
        out: list[Chunk] = []
        for lo, hi, codec in self._runs(start, end, preferred):
            for a in range(lo, hi, chunk_size):
                out.append(Chunk(a, min(a + chunk_size, hi), codec))
        return out

    def _runs(self, start: int, end: int, preferred: Codec) -> list[tuple[int, int, Codec]]:
        """[start, end) as maximal ranges of neighbouring tensors that use one codec."""
        runs: list[tuple[int, int, Codec]] = []
        for t_start, t_end in zip(self.offsets, self.offsets[1:], strict=False):
            lo, hi = max(start, t_start), min(end, t_end)
            if lo >= hi:
                continue
            codec = choose(t_end - t_start, preferred)
            if runs and runs[-1][2] is codec and runs[-1][1] == lo:
                runs[-1] = (runs[-1][0], hi, codec)
            else:
                runs.append((lo, hi, codec))
        return runs


# Chunk sizes a group may use (elements): the smallest keeps per-message work from dominating,
# the largest keeps a reducer's held chunks (window x senders) to tens of MB.
MIN_CHUNK = 1 << 16
MAX_CHUNK = 1 << 20
CHUNK_SECONDS = 0.032  # a chunk is what the slowest member's link moves in about this long
# What a member accepts from a leader: a chunk's buffers stay far below a message's limit, and a
# round's per-chunk state (futures, held slices) stays small
MAX_CHUNK_SIZE = 1 << 24
MAX_CHUNKS = 1 << 16


def auto_chunk_size(bandwidths: Sequence[float], numel: int = 0) -> int:
    """The chunk size for a group whose members declared ``bandwidths`` (Mbit/s; 0: client mode),
    averaging ``numel`` elements (never more than MAX_CHUNKS chunks, which members refuse).

    Per chunk, a round pays a fixed cost (messages, futures, syscalls): on fast links that cost
    dominates unless chunks are large (4 MB chunks take a 4 x 10M loopback round from 0.31 to
    0.16 s).  On slow links a chunk's transfer time is what reduce-scatter and all-gather cannot
    overlap, so chunks stay small there: sized so that the slowest link moves one in ~32 ms.
    """
    slowest = min((b for b in bandwidths if b > 0), default=0.0)
    elements = int(slowest * 1e6 / 8 * CHUNK_SECONDS / 4)
    return max(MIN_CHUNK, min(MAX_CHUNK, elements), -(-numel // MAX_CHUNKS))


def chunk_size_problem(value: object, numel: int) -> str | None:
    """Why a chunk size is refused for a vector of ``numel`` elements (a leader's choice binds every
    member, so a hostile one must not make them cut millions of chunks), or None if it is fine."""
    if type(value) is not int or not 1 <= value <= MAX_CHUNK_SIZE:
        return f"chunk size {str(value)[:40]} is not an integer in [1, {MAX_CHUNK_SIZE}]"
    if -(-numel // value) > MAX_CHUNKS:
        return f"chunk size {value} cuts {numel} elements into more than {MAX_CHUNKS} chunks"
    return None


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
