"""How a group's vector is cut into chunks: spanning small tensors, sized by the leader for its group."""

from __future__ import annotations

import asyncio
import os
import platform

import pytest
import torch

from averaging import Codec, DecentralizedAverager
from averaging.allreduce import GroupInfo, capped_window
from averaging.partition import MAX_CHUNK, MIN_CHUNK, FlatTensors, auto_chunk_size
from averaging.reduction import Reducer
from p2p.allocator import keep_freed_buffers
from p2p.identity import Identity
from tests.averaging.means import assert_exact_mean_everywhere, exact_mean

pytestmark = pytest.mark.timeout(120)


def test_a_chunk_spans_neighbouring_tensors_of_one_codec_and_is_cut_where_the_codec_changes():
    # 20 small tensors (exact), a large one (compressed), two small ones: three runs of one codec
    shapes = [(10,)] * 20 + [(40_000,), (3,), (5,)]
    flat = FlatTensors([torch.zeros(s) for s in shapes])
    chunks = flat.chunks(0, flat.numel, 1 << 16, Codec.FLOAT16)
    assert [(c.start, c.end, c.codec) for c in chunks] == [
        (0, 200, Codec.NONE), (200, 40_200, Codec.FLOAT16), (40_200, 40_208, Codec.NONE)]
    # inside a part, every chunk_size elements, and never past the part
    chunks = flat.chunks(150, 40_205, 16_384, Codec.FLOAT16)
    assert [(c.start, c.end) for c in chunks] == [(150, 200), (200, 16_584), (16_584, 32_968), (32_968, 40_200),
                                                  (40_200, 40_205)]
    # without compression the whole vector is one run
    assert [(c.start, c.end) for c in flat.chunks(0, flat.numel, 1 << 20, Codec.NONE)] == [(0, 40_208)]


def test_chunks_are_sized_by_the_slowest_member_link():
    assert auto_chunk_size([1000, 1000, 1000]) == 1_000_000  # 4 MB: 32 ms at 1 Gbit/s
    assert auto_chunk_size([2000, 5000]) == MAX_CHUNK
    assert auto_chunk_size([1000, 100, 0]) == 100_000  # client-mode members (0) have no say
    assert auto_chunk_size([200, 100, 50]) == MIN_CHUNK  # 50 Mbit/s would give 50,000: the floor
    assert auto_chunk_size([0, 0]) == MIN_CHUNK
    assert auto_chunk_size([1e6]) == MAX_CHUNK


def _group(sizes=(10,), **extra) -> dict:
    me = Identity().peer_id
    return me, {"g": os.urandom(16), "p": [me.digest], "a": [None], "s": list(sizes), "w": [1.0], **extra}


def test_a_group_description_carries_its_chunk_size_and_a_bad_one_is_refused():
    me, raw = _group(c=300_000)
    assert GroupInfo.from_wire(raw, me, 10).chunk_size == 300_000
    me, raw = _group()  # a leader that names none: the follower's own setting
    assert GroupInfo.from_wire(raw, me, 10, 4096).chunk_size == 4096
    for bad in (0, -5, 1 << 30, 2.5, "big", None, True):
        me, raw = _group(c=bad)
        with pytest.raises(ValueError, match="malformed group description: chunk size"):
            GroupInfo.from_wire(raw, me, 10)


def test_a_leader_cannot_make_members_cut_millions_of_chunks_or_parts_that_do_not_fit():
    me, raw = _group(sizes=[10_000_000], c=1)  # one message per element
    with pytest.raises(ValueError, match="cuts 10000000 elements into more than 65536 chunks"):
        GroupInfo.from_wire(raw, me, 10_000_000)
    me, raw = _group(sizes=[10_000_000], c=153)  # the smallest chunk that keeps to 65,536 chunks
    assert GroupInfo.from_wire(raw, me, 10_000_000).chunk_size == 153
    for sizes in ([11], [12, -2], [5]):
        me, raw = _group(sizes=sizes, c=4)
        with pytest.raises(ValueError, match="part sizes .* do not divide our 10 elements"):
            GroupInfo.from_wire(raw, me, 10)
    # a leader's own choice keeps to the bound however large the vector
    assert auto_chunk_size([50], numel=10_000_000_000) == 152_588


def test_a_bad_chunk_size_setting_is_refused_with_its_value():
    with pytest.raises(ValueError, match=r"chunk_size: chunk size 0 is not an integer in \[1, 16777216\]"):
        DecentralizedAverager([torch.zeros(4)], object(), "x", chunk_size=0)


async def test_members_cut_as_their_leader_says_whatever_they_were_configured_with(swarm):
    nodes = await swarm(3)
    g = torch.Generator().manual_seed(5)
    tensors = [[torch.randn(5000, generator=g), torch.randn(7, generator=g)] for _ in range(3)]
    expected = exact_mean(tensors)
    # three settings: none of them can make a member cut differently from its group's leader
    averagers = [DecentralizedAverager(t, n, "cut", target_group_size=3, min_matchmaking_time=10.0, chunk_size=cs)
                 for t, n, cs in zip(tensors, nodes, (1000, 333, None), strict=True)]
    try:
        results = await asyncio.gather(*(a.step(timeout=30) for a in averagers))
        assert all(r.group_size == 3 and not r.failed_peers and r.complete for r in results)
        assert_exact_mean_everywhere(averagers, expected)
    finally:
        for a in averagers:
            await a.shutdown()


def test_the_allocator_keeps_freed_buffers_where_it_is_glibc():
    assert keep_freed_buffers() is (platform.libc_ver()[0] == "glibc")


def test_a_sender_keeps_at_most_12_mib_unanswered_per_reducer():
    assert capped_window(6, MIN_CHUNK) == 6  # 1.5 MiB
    assert capped_window(6, MAX_CHUNK) == 3  # 3 x 4 MiB
    assert capped_window(6, 1 << 24) == 2  # never under 2 ...
    assert capped_window(1, MAX_CHUNK) == 1  # ... unless asked


async def test_a_reducer_drops_its_copy_of_an_averaged_chunk_once_every_sender_had_it():
    flat = FlatTensors([torch.ones(10)])
    chunks = flat.chunks(0, 10, 5, Codec.NONE)
    reducer = Reducer(flat, chunks, {1: 1.0, 2: 1.0}, 1.0, {}, sender_timeout=5.0, norm_ratio=None)
    for sender in (1, 2):
        for c in range(2):
            reducer.add(sender, c, {"c": "none", "d": torch.full((5,), 4.0)})
    assert all(f.done() for f in reducer.done)
    first = reducer.take(0)
    torch.testing.assert_close(first["d"], torch.full((5,), 3.0))  # (1 + 4 + 4) / 3
    assert reducer.encoded[0] is not None  # sender 2 has yet to receive it
    assert reducer.take(0) is first
    assert reducer.encoded[0] is None and reducer.encoded[1] is not None
