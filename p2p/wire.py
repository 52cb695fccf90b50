"""The wire format: a length prefix, a small msgpack header and raw binary frames.

Layout of one message (all integers little-endian)::

    u32 header_len | u32 n_frames | u64 frame_len * n_frames | header (msgpack) | frames

Tensors inside the header are msgpack ext values that name a frame, a dtype and a shape; their
bytes travel as a frame, so a tensor is never encoded element by element.  The decoder is sans-IO
(no sockets, no event loop): it hands out the buffer the next bytes should land in, which for a
tensor frame is the destination tensor's own memory, so received tensor bytes are copied once, by
the kernel.  Every size is checked against :class:`Limits` before anything is allocated.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from .errors import ProtocolError
from .limits import Limits

if TYPE_CHECKING:
    from .budget import FrameBudget

PREFIX = struct.Struct("<II")
TENSOR_EXT = 1
KIND_TORCH, KIND_NUMPY = 0, 1

# Names on the wire -> numpy dtypes.  bfloat16 has no numpy twin and travels as torch only.
_NUMPY_DTYPES = {
    name: np.dtype(name)
    for name in (
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
}
_TORCH_ONLY = {"bfloat16": 2}
_SCRATCH = 16 * 1024  # grows on demand; small so thousands of idle connections stay cheap
# Before the handshake: a stranger's connection must cost next to nothing, so the scratch buffer
# is allocated when the first bytes arrive, at this size, and grows only to the handshake limit.
_HANDSHAKE_SCRATCH = 1024
# A frame remainder at least this big is read straight into its destination, not via scratch.
_DIRECT_READ = 64 * 1024


class EncodeError(ValueError):
    """The message cannot be sent: an unsupported value or a size over the limits."""


def _torch():
    import torch  # deferred: peers that never touch tensors should not pay for torch's import

    return torch


def _torch_dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


class Encoder:
    """Turns one header dict into the list of buffers to write, in order."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._frames: list[memoryview] = []
        self._packer = msgpack.Packer(default=self._default, use_bin_type=True, autoreset=True)

    def encode(self, header: dict) -> list:
        self._frames = frames = []
        try:
            body = self._packer.pack(header)
        except EncodeError:
            self._packer.reset()
            raise
        except (TypeError, ValueError, OverflowError) as e:
            self._packer.reset()
            raise EncodeError(f"cannot encode message: {e}") from e
        if not frames:
            if len(body) > self.limits.max_header_bytes:
                self._check_sizes(len(body), frames)
            return [PREFIX.pack(len(body), 0) + body]
        self._check_sizes(len(body), frames)
        lens = [f.nbytes for f in frames]
        prefix = PREFIX.pack(len(body), len(frames)) + struct.pack(f"<{len(lens)}Q", *lens)
        return [prefix + body, *frames]

    def _default(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return self._numpy_ext(obj, self._frames)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._torch_ext(obj, self._frames)
        if isinstance(obj, (bytearray, memoryview)):
            return bytes(obj)
        raise EncodeError(f"cannot send a value of type {type(obj).__name__}: {obj!r:.80}")

    def _check_sizes(self, header_len: int, frames: list[memoryview]) -> None:
        lim = self.limits
        if header_len > lim.max_header_bytes:
            raise EncodeError(f"header of {header_len} bytes exceeds max_header_bytes={lim.max_header_bytes}")
        if len(frames) > lim.max_frames:
            raise EncodeError(f"{len(frames)} tensors in one message exceed max_frames={lim.max_frames}")
        total = 0
        for f in frames:
            if f.nbytes > lim.max_frame_bytes:
                raise EncodeError(f"tensor of {f.nbytes} bytes exceeds max_frame_bytes={lim.max_frame_bytes}")
            total += f.nbytes
        if total > lim.max_message_bytes:
            raise EncodeError(f"message of {total} bytes exceeds max_message_bytes={lim.max_message_bytes}")

    @staticmethod
    def _numpy_ext(arr: np.ndarray, frames: list) -> msgpack.ExtType:
        name = arr.dtype.name
        if name not in _NUMPY_DTYPES:
            raise EncodeError(f"numpy dtype {arr.dtype} cannot be sent")
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        arr = np.ascontiguousarray(arr)
        frames.append(memoryview(arr.reshape(-1).view(np.uint8)))
        meta = msgpack.packb([len(frames) - 1, KIND_NUMPY, name, list(arr.shape)])
        return msgpack.ExtType(TENSOR_EXT, meta)

    @staticmethod
    def _torch_ext(t: Any, frames: list) -> msgpack.ExtType:
        torch = _torch()
        name = _torch_dtype_name(t.dtype)
        if name not in _NUMPY_DTYPES and name not in _TORCH_ONLY:
            raise EncodeError(f"torch dtype {t.dtype} cannot be sent")
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        flat = t.contiguous().reshape(-1)
        frames.append(memoryview(flat.view(torch.uint8).numpy()))
        meta = msgpack.packb([len(frames) - 1, KIND_TORCH, name, list(t.shape)])
        return msgpack.ExtType(TENSOR_EXT, meta)


@dataclass
class _Frames:
    """Frame lengths of the message being read and the buffers its tensors will land in."""

    lengths: list[int]
    targets: list[memoryview | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.targets = [None] * len(self.lengths)


class Decoder:
    """Incremental message parser: ``get_buffer`` / ``buffer_updated`` like asyncio's BufferedProtocol.

    Raises :class:`ProtocolError` on any malformed or oversized input; after that the decoder
    (and the connection that owns it) must be discarded, and ``close`` called.

    With ``handshake=True`` it starts in the stricter pre-handshake mode (small scratch buffer,
    headers up to ``max_handshake_header_bytes``, no frames, one message per call so the owner
    can finish the handshake before later bytes are judged) until ``handshake_done``.  With a
    ``budget`` it reserves frame bytes there before allocating them, and may stop (``blocked``)
    until the budget grants them.
    """

    def __init__(self, limits: Limits, budget: FrameBudget | None = None, handshake: bool = False) -> None:
        self.limits = limits
        self.budget = budget
        self.handshake = handshake
        self._max_header = (min(limits.max_handshake_header_bytes, limits.max_header_bytes) if handshake
                            else limits.max_header_bytes)
        self._buf = bytearray(0 if handshake else _SCRATCH)
        self._start = 0
        self._end = 0
        self._state = 0  # 0 prefix, 1 lengths, 2 header, 3 frames, 4 waiting for budget, -1 closed
        self._header_len = 0
        self._n_frames = 0
        self._frames: _Frames | None = None
        self._header: Any = None
        self._frame_idx = 0
        self._frame_fill = 0
        self._direct = False
        self.message_bytes = 0  # size of the message being read, for flow-control accounting
        self.reserved = 0  # frame bytes of the current message held in the budget
        self.stopped_early = False  # the last parse left whole messages buffered (pre-handshake)
        self.on_granted: Callable[[], None] | None = None  # the budget granted a blocked message

    def handshake_done(self) -> None:
        """Lift the pre-handshake limits: the other side proved who it is."""
        self.handshake = False
        self._max_header = self.limits.max_header_bytes
        if len(self._buf) < _SCRATCH:
            avail = self._available()
            new = bytearray(_SCRATCH if avail <= _SCRATCH else avail)
            new[:avail] = self._buf[self._start:self._end]
            self._buf, self._start, self._end = new, 0, avail

    @property
    def blocked(self) -> bool:
        """True while the current message waits for the frame budget."""
        return self._state == 4

    def more(self) -> list[tuple[dict, int]]:
        """Parse what is already buffered (after a handshake message, or a budget grant)."""
        return self._parse()

    def close(self) -> None:
        """Stop parsing and give back any frame budget held or waited for; the connection is gone."""
        waiting, self._state = self._state == 4, -1
        self._frames = self._header = None
        if self.budget is None:
            return
        if waiting:
            self.budget.withdraw(self)
        if self.reserved:
            nbytes, self.reserved = self.reserved, 0
            self.budget.release(nbytes, self)

    def granted(self, nbytes: int) -> None:
        """The budget granted the frame bytes this decoder waited for: parse on."""
        self.reserved = nbytes
        self._state = 2
        if self.on_granted is not None:
            self.on_granted()

    # ---- buffer protocol -------------------------------------------------------------------
    def get_buffer(self) -> memoryview:
        target = self._current_target()
        if target is not None and self._start == self._end:
            remaining = len(target) - self._frame_fill
            if remaining >= _DIRECT_READ:
                self._direct = True
                return target[self._frame_fill:]
        self._direct = False
        if self._end == len(self._buf):
            self._compact(self._available() + 1)
        return memoryview(self._buf)[self._end:]

    def buffer_updated(self, nbytes: int) -> list[tuple[dict, int]]:
        """Account for ``nbytes`` written into the last buffer; return completed (header, size) pairs."""
        if self._direct:
            self._frame_fill += nbytes
            out: list[tuple[dict, int]] = []
            self._advance_frames(out)
            return out
        self._end += nbytes
        return self._parse()

    def feed(self, data: bytes) -> list[tuple[dict, int]]:
        """Push bytes through the buffer protocol; used by tests and the fuzzer."""
        out: list[tuple[dict, int]] = []
        view = memoryview(data)
        while view:
            buf = self.get_buffer()
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            out.extend(self.buffer_updated(n))
            view = view[n:]
        return out

    @property
    def idle(self) -> bool:
        """True between messages: nothing half-read."""
        return self._state == 0 and self._start == self._end

    # ---- parsing ---------------------------------------------------------------------------
    def _available(self) -> int:
        return self._end - self._start

    def _compact(self, need: int) -> None:
        """Move unread bytes to the front; grow the scratch buffer if it cannot hold ``need`` bytes."""
        avail = self._available()
        if need > len(self._buf):
            new = bytearray(max(need, len(self._buf) * 2, _HANDSHAKE_SCRATCH))
            new[:avail] = self._buf[self._start:self._end]
            self._buf = new
        else:
            self._buf[:avail] = self._buf[self._start:self._end]
        self._start, self._end = 0, avail

    def _take(self, n: int) -> memoryview | None:
        if self._available() < n:
            if self._start + n > len(self._buf):
                self._compact(n)
            return None
        view = memoryview(self._buf)[self._start:self._start + n]
        self._start += n
        return view

    def _parse(self) -> list[tuple[dict, int]]:
        out: list[tuple[dict, int]] = []
        self.stopped_early = False
        while True:
            if out and self.handshake:
                self.stopped_early = self._start < self._end
                break  # one message at a time until the owner has judged the handshake
            if self._state == 0 and self._fast_small(out):
                continue
            if self._state == 0:
                raw = self._take(PREFIX.size)
                if raw is None:
                    break
                self._on_prefix(*PREFIX.unpack(raw))
            elif self._state == 1:
                raw = self._take(8 * self._n_frames)
                if raw is None:
                    break
                self._on_lengths(list(struct.unpack(f"<{self._n_frames}Q", raw)))
            elif self._state == 2:
                raw = self._take(self._header_len)
                if raw is None:
                    break
                self._on_header(bytes(raw))
                self._advance_frames(out)
            elif self._state == 3:
                if not self._copy_into_frame():
                    break
                self._advance_frames(out)
            else:
                break  # waiting for the frame budget, or closed
        if self._start == self._end:
            self._start = self._end = 0
        return out

    def _fast_small(self, out: list[tuple[dict, int]]) -> bool:
        """Parse a whole frameless message in one go when it is already buffered (the common case)."""
        start = self._start
        if self._end - start < PREFIX.size:
            return False
        header_len, n_frames = PREFIX.unpack_from(self._buf, start)
        total = PREFIX.size + header_len
        if n_frames or self._end - start < total or not 0 < header_len <= self._max_header:
            return False
        self._start = start + total
        self._frames = _Frames([])
        self.message_bytes = total
        self._on_header(bytes(memoryview(self._buf)[start + PREFIX.size:start + total]))
        self._advance_frames(out)
        return True

    def _on_prefix(self, header_len: int, n_frames: int) -> None:
        lim = self.limits
        if header_len == 0 or header_len > self._max_header:
            what = "before the handshake " if self.handshake else ""
            raise ProtocolError(f"header length {header_len} {what}outside 1..{self._max_header}")
        if n_frames and self.handshake:
            raise ProtocolError(f"{n_frames} frames before the handshake finished")
        if n_frames > lim.max_frames:
            raise ProtocolError(f"{n_frames} frames exceed max_frames={lim.max_frames}")
        self._header_len, self._n_frames = header_len, n_frames
        self.message_bytes = PREFIX.size + 8 * n_frames + header_len
        if n_frames:
            self._state = 1
        else:
            self._frames = _Frames([])
            self._state = 2

    def _on_lengths(self, lengths: list[int]) -> None:
        lim = self.limits
        for n in lengths:
            if n > lim.max_frame_bytes:
                raise ProtocolError(f"frame of {n} bytes exceeds max_frame_bytes={lim.max_frame_bytes}")
        total = sum(lengths)
        if total > lim.max_message_bytes:
            raise ProtocolError(f"message of {total} bytes exceeds max_message_bytes={lim.max_message_bytes}")
        self.message_bytes += total
        self._frames = _Frames(lengths)
        if total and self.budget is not None:
            if not self.budget.reserve(self, total):
                self._state = 4
                return
            self.reserved = total
        self._state = 2

    def _on_header(self, raw: bytes) -> None:
        frames = self._frames
        assert frames is not None
        try:
            header = msgpack.unpackb(raw, ext_hook=self._ext_hook, raw=False, strict_map_key=False)
        except ProtocolError:
            raise
        except Exception as e:  # msgpack raises many types on garbage; all mean the same here
            raise ProtocolError(f"undecodable header: {type(e).__name__}: {e}") from None
        if not isinstance(header, dict):
            raise ProtocolError(f"header must be a map, got {type(header).__name__}")
        if any(t is None for t in frames.targets):
            raise ProtocolError("a frame is not referenced by any tensor in the header")
        self._header = header
        self._frame_idx = 0
        self._frame_fill = 0
        self._state = 3

    def _ext_hook(self, code: int, data: bytes) -> Any:
        assert self._frames is not None
        return _make_target(code, data, self._frames)

    def _current_target(self) -> memoryview | None:
        if self._state != 3 or self._frames is None or self._frame_idx >= len(self._frames.targets):
            return None
        return self._frames.targets[self._frame_idx]

    def _copy_into_frame(self) -> bool:
        """Copy buffered bytes into the current frame; False when more input is needed."""
        target = self._current_target()
        if target is None:
            return True
        n = min(self._available(), len(target) - self._frame_fill)
        if n == 0 and len(target) > self._frame_fill:
            return False
        target[self._frame_fill:self._frame_fill + n] = memoryview(self._buf)[self._start:self._start + n]
        self._start += n
        self._frame_fill += n
        return True

    def _advance_frames(self, out: list[tuple[dict, int]]) -> None:
        frames = self._frames
        assert frames is not None
        while self._frame_idx < len(frames.targets):
            if self._frame_fill < len(frames.targets[self._frame_idx]):
                return
            self._frame_idx += 1
            self._frame_fill = 0
        out.append((self._header, self.message_bytes))
        self._header = None
        self._frames = None
        self._state = 0
        if self.reserved:
            nbytes, self.reserved = self.reserved, 0
            assert self.budget is not None
            self.budget.release(nbytes, self)


def _make_target(code: int, data: bytes, frames: _Frames) -> Any:
    """ext_hook: allocate the tensor a frame will be read into, after checking its declared size."""
    if code != TENSOR_EXT:
        raise ProtocolError(f"unknown ext type {code}")
    try:
        idx, kind, dtype_name, shape = msgpack.unpackb(data, raw=False)
        shape = [int(s) for s in shape]
    except Exception:
        raise ProtocolError("malformed tensor descriptor") from None
    if not isinstance(idx, int) or not 0 <= idx < len(frames.lengths) or frames.targets[idx] is not None:
        raise ProtocolError(f"tensor refers to a missing or reused frame {idx!r}")
    if any(s < 0 for s in shape) or len(shape) > 32:
        raise ProtocolError(f"bad tensor shape {shape}")
    if kind == KIND_NUMPY and dtype_name in _NUMPY_DTYPES:
        itemsize = _NUMPY_DTYPES[dtype_name].itemsize
    elif kind == KIND_TORCH and (dtype_name in _NUMPY_DTYPES or dtype_name in _TORCH_ONLY):
        itemsize = _TORCH_ONLY.get(dtype_name) or _NUMPY_DTYPES[dtype_name].itemsize
    else:
        raise ProtocolError(f"unsupported tensor kind/dtype {kind!r}/{dtype_name!r}")
    numel = 1
    for s in shape:
        numel *= s
    if numel * itemsize != frames.lengths[idx]:
        raise ProtocolError(
            f"tensor {dtype_name}{shape} needs {numel * itemsize} bytes, frame has {frames.lengths[idx]}")
    if kind == KIND_NUMPY:
        arr = np.empty(shape, dtype=_NUMPY_DTYPES[dtype_name])
        frames.targets[idx] = memoryview(arr.reshape(-1).view(np.uint8))
        return arr
    torch = _torch()
    t = torch.empty(shape, dtype=getattr(torch, dtype_name))
    frames.targets[idx] = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    return t
