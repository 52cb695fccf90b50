"""The sans-IO codec: round trips, limits checked before allocation, and fuzzing of the decoder."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p import Limits, ProtocolError
from p2p.budget import FrameBudget
from p2p.wire import PREFIX, TENSOR_EXT, Decoder, EncodeError, Encoder

LIMITS = Limits(max_header_bytes=4096, max_frame_bytes=1 << 20, max_frames=8, max_message_bytes=2 << 20)


def roundtrip(header: dict, limits: Limits = Limits(), chunk: int | None = None) -> list[dict]:
    data = b"".join(bytes(b) for b in Encoder(limits).encode(header))
    dec = Decoder(limits)
    if chunk is None:
        return [h for h, _ in dec.feed(data)]
    out = []
    for i in range(0, len(data), chunk):
        out.extend(h for h, _ in dec.feed(data[i:i + chunk]))
    assert dec.idle
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool,
                                   torch.uint8, torch.complex64])
def test_torch_tensors_roundtrip_bit_exact(dtype):
    t = (torch.randn(3, 5, 7) * 100).to(dtype)
    (h,) = roundtrip({"p": {"t": t, "scalar": torch.tensor(2.5), "empty": torch.empty(0, 3)}})
    out = h["p"]["t"]
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out.view(torch.uint8), t.contiguous().view(torch.uint8))
    assert h["p"]["scalar"].item() == 2.5 and h["p"]["empty"].shape == (0, 3)


def test_numpy_and_noncontiguous_and_big_endian_inputs():
    a = np.arange(24, dtype=np.float64).reshape(4, 6)[:, ::2]
    b = np.arange(5, dtype=">i4")
    t = torch.arange(12.0).reshape(3, 4).t()
    (h,) = roundtrip({"p": [a, b, t]})
    assert np.array_equal(h["p"][0], a) and h["p"][0].flags.c_contiguous
    assert np.array_equal(h["p"][1], b) and h["p"][1].dtype == np.dtype("<i4")
    assert torch.equal(h["p"][2], t)


@pytest.mark.parametrize("chunk", [1, 7, 4096, 70_000])
def test_any_split_of_the_byte_stream_decodes_the_same(chunk):
    t = torch.randn(50_000)
    msgs = roundtrip({"s": 1, "p": [t, "x" * 300]}, chunk=chunk) + roundtrip({"s": 2, "p": None}, chunk=chunk)
    assert torch.equal(msgs[0]["p"][0], t) and msgs[1]["s"] == 2


def test_encoder_refuses_what_it_cannot_send():
    enc = Encoder(LIMITS)
    with pytest.raises(EncodeError, match="set"):
        enc.encode({"p": {1, 2}})
    with pytest.raises(EncodeError, match="max_frame_bytes"):
        enc.encode({"p": np.zeros(1 << 20, dtype=np.float32)})
    with pytest.raises(EncodeError, match="max_frames"):
        enc.encode({"p": [np.zeros(1)] * 9})
    with pytest.raises(EncodeError, match="max_header_bytes"):
        enc.encode({"p": "x" * 5000})
    with pytest.raises(EncodeError, match="dtype"):
        enc.encode({"p": np.array([object()])})
    assert enc.encode({"p": 1})  # the encoder is still usable after errors


def _prefix(header_len: int, frames: list[int]) -> bytes:
    return PREFIX.pack(header_len, len(frames)) + struct.pack(f"<{len(frames)}Q", *frames)


@pytest.mark.parametrize("data, reason", [
    (_prefix(0, []), "header length"),
    (_prefix(LIMITS.max_header_bytes + 1, []), "header length"),
    (PREFIX.pack(10, LIMITS.max_frames + 1), "max_frames"),
    (_prefix(10, [LIMITS.max_frame_bytes + 1]), "max_frame_bytes"),
    (_prefix(10, [LIMITS.max_frame_bytes] * 3), "max_message_bytes"),
    (_prefix(3, []) + b"\xc1\xc1\xc1", "undecodable"),
    (_prefix(3, []) + b"\x92\x01\x02", "must be a map"),
])
def test_oversized_or_malformed_input_is_refused_before_allocation(data, reason):
    with pytest.raises(ProtocolError, match=reason):
        Decoder(LIMITS).feed(data)


def test_tensor_descriptor_must_match_its_frame():
    def message(desc: list, frames: list[int]) -> bytes:
        body = msgpack.packb({"p": msgpack.ExtType(TENSOR_EXT, msgpack.packb(desc))})
        return _prefix(len(body), frames) + body

    with pytest.raises(ProtocolError, match="needs"):
        Decoder(LIMITS).feed(message([0, 1, "float32", [10]], [8]))
    with pytest.raises(ProtocolError, match="frame"):
        Decoder(LIMITS).feed(message([3, 1, "float32", [2]], [8]))
    with pytest.raises(ProtocolError, match="dtype"):
        Decoder(LIMITS).feed(message([0, 1, "object", [1]], [8]))
    with pytest.raises(ProtocolError, match="not referenced"):
        body = msgpack.packb({"p": 1})
        Decoder(LIMITS).feed(_prefix(len(body), [4]) + body)


def _valid_message() -> bytes:
    enc = Encoder(LIMITS)
    return b"".join(bytes(b) for b in enc.encode({"s": 1, "t": 4, "p": [np.arange(10, dtype=np.int32), "hi"]}))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2000))
def test_fuzz_random_bytes_never_crash_the_decoder(data):
    dec = Decoder(LIMITS)
    try:
        for header, size in dec.feed(data):
            assert isinstance(header, dict) and size > 0
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=len(_valid_message()) - 1), st.binary(max_size=64))
def test_fuzz_truncated_and_corrupted_messages(cut, junk):
    valid = _valid_message()
    dec = Decoder(LIMITS)
    assert dec.feed(valid[:cut]) == []  # a truncated message yields nothing yet, and no error
    try:
        dec.feed(junk)
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=2**32 - 1), st.integers(min_value=0, max_value=2**32 - 1),
       st.lists(st.integers(min_value=0, max_value=2**64 - 1), max_size=8))
def test_fuzz_declared_sizes_are_checked_before_allocation(header_len, n_frames, frames):
    data = PREFIX.pack(header_len, n_frames) + struct.pack(f"<{len(frames)}Q", *frames)
    dec = Decoder(LIMITS)
    try:
        dec.feed(data)
    except ProtocolError:
        return
    # accepted so far: every size the decoder has read is within the limits (lengths it has not
    # received yet cannot have been acted on), so nothing large was allocated
    assert header_len <= LIMITS.max_header_bytes and n_frames <= LIMITS.max_frames
    if len(frames) >= n_frames:
        assert all(f <= LIMITS.max_frame_bytes for f in frames[:n_frames])
        assert sum(frames[:n_frames]) <= LIMITS.max_message_bytes


# ---- before the handshake, and the frame budget ------------------------------------------------
def _encoded(header: dict) -> list[bytes]:
    return [bytes(b) for b in Encoder(LIMITS).encode(header)]


def test_before_the_handshake_headers_are_small_frames_refused_and_messages_come_one_at_a_time():
    with pytest.raises(ProtocolError, match="before the handshake outside 1..4096"):
        Decoder(Limits(), handshake=True).feed(PREFIX.pack(4097, 0))
    with pytest.raises(ProtocolError, match="frames before the handshake"):
        Decoder(Limits(), handshake=True).feed(b"".join(_encoded({"p": np.zeros(4, np.uint8)})))
    dec = Decoder(Limits(), handshake=True)
    first, second = _encoded({"t": 1})[0], b"".join(_encoded({"t": 2, "p": np.arange(3, dtype=np.uint8)}))
    assert [h["t"] for h, _ in dec.feed(first + second)] == [1]  # the frame after it is not judged yet
    assert dec.stopped_early
    dec.handshake_done()  # what the connection does when the first message completed the handshake
    (h, _), = dec.more()
    assert h["t"] == 2 and list(h["p"]) == [0, 1, 2]


def test_the_frame_budget_makes_a_message_wait_and_grants_it_when_another_completes():
    budget = FrameBudget(100)
    first, waiting = Decoder(LIMITS, budget), Decoder(LIMITS, budget)
    granted = []
    waiting.on_granted = lambda: granted.append(True)
    head1, frame1 = _encoded({"p": np.full(80, 1, np.uint8)})
    head2, frame2 = _encoded({"p": np.full(40, 2, np.uint8)})
    assert first.feed(head1) == [] and budget.reserved == 80
    assert waiting.feed(head2) == [] and waiting.blocked and budget.waiting == 1
    (h1, _), = first.feed(frame1)
    assert granted == [True] and not waiting.blocked and budget.reserved == 40
    assert waiting.more() == []  # header parsed, tensor allocated; its frame is still to come
    (h2, _), = waiting.feed(frame2)
    assert list(h1["p"]) == [1] * 80 and list(h2["p"]) == [2] * 40 and budget.reserved == 0


def test_the_frame_budget_refuses_what_could_never_fit_and_closing_gives_back_what_was_held():
    budget = FrameBudget(100)
    with pytest.raises(ProtocolError, match="over the node's max_pending_frame_bytes=100"):
        Decoder(LIMITS, budget).feed(_encoded({"p": np.zeros(101, np.uint8)})[0])
    holder, waiter, behind = Decoder(LIMITS, budget), Decoder(LIMITS, budget), Decoder(LIMITS, budget)
    holder.feed(_encoded({"p": np.zeros(60, np.uint8)})[0])
    waiter.feed(_encoded({"p": np.zeros(90, np.uint8)})[0])
    behind.feed(_encoded({"p": np.zeros(10, np.uint8)})[0])  # fits, but waits its turn (FIFO)
    assert budget.reserved == 60 and budget.waiting == 2
    waiter.close()  # its connection died while waiting
    assert budget.waiting == 0 and budget.reserved == 70 and not behind.blocked
    holder.close()
    behind.close()
    assert budget.reserved == 0
