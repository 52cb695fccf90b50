"""All-reduce with real peers on loopback: exact means, weights, Moshpit, client mode, faults."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import threading

import pytest
import torch
import uvloop

from averaging import Codec, DecentralizedAverager, MoshpitAverager, ShapeMismatch
from averaging.allreduce import AllReduceRound, GroupInfo
from averaging.partition import FlatTensors
from averaging.reduction import Reducer
from dht import DHTNode
from p2p import Identity, Limits, P2PError
from p2p.codecs import error_bound
from tests.averaging.means import assert_exact_mean_everywhere, exact_mean

pytestmark = pytest.mark.timeout(120)


def data(i: int, shapes=((300, 50), (7,), (1000,))) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return [torch.randn(*s, generator=g) * (i + 1) for s in shapes]


async def make_averagers(nodes, tensors, **options):
    options.setdefault("target_group_size", len(nodes))
    options.setdefault("min_matchmaking_time", 10.0)  # generous: the group fills up long before
    options.setdefault("chunk_size", 4096)  # many chunks: exercises streaming
    return [DecentralizedAverager(t, n, "exp", **options) for t, n in zip(tensors, nodes, strict=True)]


async def shutdown_all(averagers):
    for a in averagers:
        await a.shutdown()


async def test_eight_peers_end_with_the_exact_mean(swarm):
    nodes = await swarm(8)
    tensors = [data(i) for i in range(8)]
    expected = exact_mean(tensors)
    averagers = await make_averagers(nodes, tensors)
    results = await asyncio.gather(*(a.step(timeout=30) for a in averagers))
    try:
        assert all(r.group_size == 8 and not r.failed_peers for r in results)
        assert len({r.group_id for r in results}) == 1
        assert_exact_mean_everywhere(averagers, expected)
        assert all(r.bytes_sent > 0 and r.bytes_received > 0 for r in results)
    finally:
        await shutdown_all(averagers)


async def test_weighted_mean(swarm):
    nodes = await swarm(4)
    tensors = [data(i) for i in range(4)]
    weights = [1.0, 2.0, 0.5, 4.0]
    expected = [sum(w * t[k].double() for w, t in zip(weights, tensors, strict=True)) / sum(weights)
                for k in range(3)]
    averagers = await make_averagers(nodes, tensors)
    await asyncio.gather(*(a.step(weight=w, timeout=30) for a, w in zip(averagers, weights, strict=True)))
    try:
        for a in averagers:
            for k in range(3):
                torch.testing.assert_close(a.tensors[k].double(), expected[k], rtol=1e-5, atol=1e-5)
    finally:
        await shutdown_all(averagers)


async def test_one_chunk_window_and_unequal_parts_still_give_the_exact_mean(swarm):
    """window=1: every sender waits for each averaged chunk before sending the next (strict
    lock-step across all senders of a part); unequal bandwidths make the leader solve the LP."""
    nodes = await swarm(4)
    tensors = [data(i) for i in range(4)]
    expected = exact_mean(tensors)
    averagers = [DecentralizedAverager(t, n, "win", target_group_size=4, min_matchmaking_time=10.0, chunk_size=1000,
                                       window=1, bandwidth=b)
                 for t, n, b in zip(tensors, nodes, [200.0, 100.0, 50.0, 25.0], strict=True)]
    try:
        results = await asyncio.gather(*(a.step(timeout=30) for a in averagers))
        assert all(r.group_size == 4 and not r.failed_peers for r in results)
        assert len(set(results[0].part_sizes)) > 1  # the LP gave unequal parts
        for a in averagers:
            for k in range(3):
                torch.testing.assert_close(a.tensors[k], expected[k], rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="window"):
            DecentralizedAverager(data(9), nodes[0], "bad", window=0)
    finally:
        await shutdown_all(averagers)


async def test_moshpit_3x3_grid_is_exact_after_two_rounds(swarm):
    nodes = await swarm(9)
    tensors = [[torch.full((64,), float(i * i))] for i in range(9)]
    global_mean = sum(i * i for i in range(9)) / 9
    averagers = [MoshpitAverager(t, n, "mosh", grid=(3, 3), coordinates=(i // 3, i % 3), min_matchmaking_time=10.0)
                 for i, (t, n) in enumerate(zip(tensors, nodes, strict=True))]
    try:
        first = await asyncio.gather(*(a.step(timeout=30) for a in averagers))
        assert all(r.group_size == 3 for r in first)
        values = sorted({round(a.tensors[0][0].item(), 4) for a in averagers})
        assert len(values) == 3 and global_mean not in values  # three groups, three different means
        second = await asyncio.gather(*(a.step(timeout=30) for a in averagers))
        assert all(r.group_size == 3 for r in second)
        for a in averagers:
            torch.testing.assert_close(a.tensors[0], torch.full((64,), global_mean), rtol=1e-6, atol=1e-5)
    finally:
        await shutdown_all(averagers)


async def test_moshpit_peers_on_colliding_spots_still_reach_the_mean(swarm):
    """Three peers start on one grid spot and one peer alone: lone peers move to a fresh spot, so the
    swarm still mixes (a peer that kept retrying its empty key would never average again)."""
    nodes = await swarm(4)
    tensors = [[torch.full((16,), float(10 * i))] for i in range(4)]
    averagers = [MoshpitAverager(t, n, "collide", grid=(2, 2), coordinates=c, min_matchmaking_time=0.3,
                                   request_timeout=0.5)
                 for t, n, c in zip(tensors, nodes, [(0, 0), (0, 0), (0, 0), (1, 1)], strict=True)]
    try:
        averaged = [0] * 4
        for _ in range(30):
            results = await asyncio.gather(*(a.step(timeout=30) for a in averagers))
            averaged = [n + r.averaged for n, r in zip(averaged, results, strict=True)]
            assert all(a.round == averagers[0].round for a in averagers)  # still in phase
            total = sum(a.tensors[0][0].item() for a in averagers)
            assert total == pytest.approx(60.0, abs=1e-3)  # pairwise averaging keeps the sum
            if max(a.tensors[0].max().item() for a in averagers) - min(a.tensors[0].min().item()
                                                                       for a in averagers) < 1e-3:
                break
        assert all(n >= 1 for n in averaged), averaged
        for a in averagers:
            torch.testing.assert_close(a.tensors[0], torch.full((16,), 15.0), rtol=0, atol=1e-3)
    finally:
        await shutdown_all(averagers)


async def test_client_mode_peer_sends_and_receives_but_reduces_nothing(swarm):
    nodes = await swarm(4, client_modes=[False, False, False, True])
    tensors = [data(i) for i in range(4)]
    expected = [torch.stack([t[k] for t in tensors]).mean(0) for k in range(3)]
    averagers = await make_averagers(nodes, tensors)
    results = await asyncio.gather(*(a.step(timeout=30) for a in averagers))
    try:
        assert all(r.group_size == 4 and not r.failed_peers for r in results)
        client = results[3]
        assert client.my_index != 0  # a client-mode peer can never lead
        for a in averagers:
            for k in range(3):
                torch.testing.assert_close(a.tensors[k], expected[k], rtol=1e-5, atol=1e-5)
    finally:
        await shutdown_all(averagers)


def test_a_reducer_that_is_done_first_and_changes_its_tensors_at_once_still_serves_the_average():
    """The reducer's step returns once its part is averaged, while a member on a slow link is still
    receiving that part; its caller changes its tensors straight away (the optimizer step), and the
    member must still get the round's average, not those new values.  On uvloop, as peers run: its
    transport keeps views of what the kernel has not taken yet."""
    size = 1 << 24

    async def main() -> tuple[list, torch.Tensor]:
        first = await DHTNode.create()
        client = await DHTNode.create([str(first.address)], client_mode=True)  # reduces nothing
        # 64 MB each way at 200 MB/s, in 8 MB chunks: the replies trail the reduction by more than the
        # kernel's socket buffers hold, so one is still in the reducer's transport when its round ends
        client.p2p.set_rate_limit(200_000_000)
        averagers = await make_averagers([first, client], [[torch.full((size,), 1.0)], [torch.full((size,), 3.0)]],
                                         chunk_size=1 << 21)

        async def step_then_change(averager):
            result = await averager.step(timeout=60)
            averager.tensors[0].fill_(-7.0)  # before this loop runs anything else
            return result

        try:
            results = await asyncio.gather(step_then_change(averagers[0]), averagers[1].step(timeout=60))
            return [(r.group_size, r.failed_peers, r.unaveraged_parts) for r in results], averagers[1].tensors[0]
        finally:
            await shutdown_all(averagers)
            await asyncio.gather(client.shutdown(), first.shutdown())

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        outcomes, received = runner.run(main())
    assert outcomes == [(2, [], [])] * 2
    assert torch.equal(received, torch.full((size,), 2.0))


class _SendsThenStopsReading(AllReduceRound):
    """A member that sends its whole slice, then reads no reply until told to (a frozen process)."""

    resume: asyncio.Event
    received: list[torch.Tensor]
    ended_by: list[str]

    async def _exchange(self, j: int, deadline: float) -> None:
        call = await self.p2p.open(self.group.addresses[j], self.method, first=self._header())
        async with call:
            chunks = self._chunks(j)
            for c, chunk in enumerate(chunks):
                await call.send(self._outgoing(chunk), end=c == len(chunks) - 1)
            await self.resume.wait()
            self.outcome.unaveraged.add(j)  # whatever comes, this member keeps its own values
            try:
                async for payload in call:
                    self.received.append(payload["d"].clone())
                self.ended_by.append("the end of the stream")
            except P2PError as e:
                self.ended_by.append(type(e).__name__)


def test_a_member_that_stops_reading_after_the_round_is_cut_off_and_never_sees_later_values():
    """The bounded side of the wait above: a member that takes no averaged chunk for sender_timeout
    is dropped, and so is its connection with what was queued for it, so the reducer's step returns
    and its caller may change its tensors; the member reads only values from before that."""
    size = 1 << 24

    async def main() -> tuple:
        first = await DHTNode.create()
        # it stops taking bytes once 1 MiB waits unread on its side
        frozen = await DHTNode.create([str(first.address)], client_mode=True,
                                      p2p_options={"limits": Limits(max_buffered_bytes=1 << 20)})
        averagers = await make_averagers([first, frozen], [[torch.full((size,), 1.0)], [torch.full((size,), 3.0)]],
                                         chunk_size=1 << 20, sender_timeout=1.0)
        averagers[1].round_class = _SendsThenStopsReading
        _SendsThenStopsReading.resume, _SendsThenStopsReading.received = asyncio.Event(), []
        _SendsThenStopsReading.ended_by = []

        async def step_then_change(averager):
            started = asyncio.get_running_loop().time()
            result = await averager.step(timeout=60)
            took = asyncio.get_running_loop().time() - started
            averager.tensors[0].fill_(-7.0)
            _SendsThenStopsReading.resume.set()
            return result, took, averager.tensors[0][:1].clone()

        try:
            (reducer, took, _), member = await asyncio.gather(step_then_change(averagers[0]),
                                                              averagers[1].step(timeout=60))
            return reducer, took, member, averagers[1].tensors[0].clone()
        finally:
            await shutdown_all(averagers)
            await asyncio.gather(frozen.shutdown(), first.shutdown())

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        reducer, took, member, member_values = runner.run(main())
    assert took < 30, f"the reducer's step took {took:.1f} s"  # a bounded wait, not the 60-s deadline
    assert "took no averaged chunk" in reducer.excluded[member.group_peers[1]]
    assert _SendsThenStopsReading.ended_by == ["PeerUnreachable"]  # its connection was dropped
    assert len(_SendsThenStopsReading.received) < 16  # not every chunk reached it
    assert all(torch.equal(d, torch.full_like(d, 2.0)) for d in _SendsThenStopsReading.received)
    assert member.unaveraged_parts == [0] and torch.equal(member_values, torch.full((size,), 3.0))


async def test_averaged_chunks_no_sender_was_sent_when_the_round_ends_become_copies():
    """The other half of the case above: a chunk still waiting for a slow sender when the round ends
    is served as a copy of the average, not as the owner's buffer, which changes from then on."""
    flat = FlatTensors([torch.full((8,), 1.0)])
    reducer = Reducer(flat, flat.chunks(0, 8, 4, Codec.NONE), {1: 1.0}, 1.0, {}, 10.0, None)
    for c in range(2):
        reducer.add(1, c, {"c": "none", "d": torch.full((4,), 3.0)})
    assert reducer.take(0)["d"].data_ptr() == flat.flat.data_ptr()  # a view while the round lasts
    reducer.detach()
    flat.flat.fill_(-7.0)
    assert torch.equal(reducer.take(1)["d"], torch.full((4,), 2.0))


@pytest.mark.parametrize("own_weight", [0.0, 0.25, 1.0, 3.0])
async def test_a_reducer_ends_with_the_weighted_mean_of_its_own_values_and_the_senders(own_weight):
    """Our values become the running mean in place: whatever our weight, including none, the part
    ends at the weighted mean of the values admitted."""
    own = torch.linspace(-3.0, 5.0, 12)
    sent = {1: (2.0, torch.linspace(7.0, -1.0, 12)), 2: (1e6, torch.full((12,), 0.5)), 3: (0.5, torch.arange(12.0))}
    flat = FlatTensors([own.clone()])
    reducer = Reducer(flat, flat.chunks(0, 12, 4, Codec.NONE), {s: w for s, (w, _) in sent.items()}, own_weight,
                      {}, 10.0, None)
    for s, (_, values) in sent.items():
        for c in range(3):
            reducer.add(s, c, {"c": "none", "d": values[4 * c:4 * c + 4].clone()})
    terms = [(own_weight, own)] + list(sent.values())
    expected = sum(w * v.double() for w, v in terms) / sum(w for w, _ in terms)
    torch.testing.assert_close(flat.flat.double(), expected, rtol=1e-6, atol=1e-6)


async def test_large_values_at_a_large_weight_are_averaged_and_only_values_that_could_overflow_are_refused():
    """The running mean never holds more than the largest admitted value, so a weight cannot make it
    overflow; values past half the float32 range could (their difference with ours), and are refused."""
    flat = FlatTensors([torch.full((4,), -1e37)])
    reducer = Reducer(flat, flat.chunks(0, 4, 4, Codec.NONE), {1: 1e6, 2: 1.0}, 1.0, {}, 10.0, None)
    reducer.add(1, 0, {"c": "none", "d": torch.full((4,), 3e37)})
    reducer.add(2, 0, {"c": "none", "d": torch.full((4,), 1.5e38)})  # norm 3e38: over half the range
    assert list(reducer.failed) == [2] and "could overflow the average" in reducer.failed[2]
    expected = (1e6 * 3e37 - 1e37) / (1e6 + 1)
    torch.testing.assert_close(flat.flat.double(), torch.full((4,), expected, dtype=torch.float64), rtol=1e-6, atol=0)


def counting_norms(monkeypatch) -> list[int]:
    """Counts the reducer's own norm reads (the real function still answers)."""
    import averaging.reduction as reduction

    sizes: list[int] = []
    real = reduction.norm
    monkeypatch.setattr(reduction, "norm", lambda x: sizes.append(x.numel()) or real(x))
    return sizes


async def test_the_median_screen_reads_our_norm_only_where_it_could_change_a_verdict(monkeypatch):
    reads = counting_norms(monkeypatch)
    # three senders of like norms pass against any value ours could have: ours is not read
    flat = FlatTensors([torch.full((8,), 1e6)])
    reducer = Reducer(flat, flat.chunks(0, 8, 8, Codec.NONE), {1: 1.0, 2: 1.0, 3: 1.0}, 1.0, {}, 10.0, 100.0)
    for s, value in ((1, 1.0), (2, 2.0), (3, 50.0)):
        reducer.add(s, 0, {"c": "none", "d": torch.full((8,), value)})
    assert reads == [] and reducer.failed == {}
    torch.testing.assert_close(flat.flat, torch.full((8,), (1e6 + 53.0) / 4))

    # one sender: ours is the only reference, so it is read, and an outsized sender is refused
    flat = FlatTensors([torch.ones(8)])
    reducer = Reducer(flat, flat.chunks(0, 8, 8, Codec.NONE), {1: 1.0}, 1.0, {}, 10.0, 100.0)
    reducer.add(1, 0, {"c": "none", "d": torch.full((8,), 1000.0)})
    assert reads == [8] and "over 100 x the median norm" in reducer.failed[1]
    assert torch.equal(flat.flat, torch.ones(8))  # the refused chunk stayed out of the mean

    # a sender that passes only against our norm, not against the bound without it: ours decides
    reads.clear()
    flat = FlatTensors([torch.full((8,), 10.0)])
    reducer = Reducer(flat, flat.chunks(0, 8, 8, Codec.NONE), {1: 1.0, 2: 1.0, 3: 1.0}, 1.0, {}, 10.0, 100.0)
    for s, value in ((1, 0.01), (2, 1.0), (3, 50.0)):
        reducer.add(s, 0, {"c": "none", "d": torch.full((8,), value)})
    assert reads == [8] and reducer.failed == {}  # 50 is within 100 x 1, the median of (0.01, 1, ours 10)


@pytest.mark.parametrize("tiny", [1e-6, 1e-3])
async def test_in_a_group_of_three_a_tiny_chunk_does_not_have_the_others_refused(tiny):
    """A sender's reference is the upper median of the others: with two others, the larger.  Against the
    smaller, one member sending near-zero chunks (a peer whose update is tiny, or an attacker) would
    have every ordinary chunk refused and the part averaged without them; an outsized chunk, over 100 x
    both others, is still refused."""
    flat = FlatTensors([torch.full((8,), 2.0)])
    reducer = Reducer(flat, flat.chunks(0, 8, 8, Codec.NONE), {1: 1.0, 2: 1.0}, 1.0, {}, 10.0, 100.0)
    reducer.add(1, 0, {"c": "none", "d": torch.full((8,), tiny)})
    reducer.add(2, 0, {"c": "none", "d": torch.full((8,), 4.0)})
    assert reducer.failed == {}
    torch.testing.assert_close(flat.flat.double(), torch.full((8,), (2.0 + tiny + 4.0) / 3, dtype=torch.float64))

    flat = FlatTensors([torch.full((8,), 2.0)])
    reducer = Reducer(flat, flat.chunks(0, 8, 8, Codec.NONE), {1: 1.0, 2: 1.0}, 1.0, {}, 10.0, 100.0)
    reducer.add(1, 0, {"c": "none", "d": torch.full((8,), 4.0)})
    reducer.add(2, 0, {"c": "none", "d": torch.full((8,), 401.0)})  # over 100 x both 2 and 4
    assert list(reducer.failed) == [2] and "over 100 x the median norm" in reducer.failed[2]
    assert torch.equal(flat.flat, torch.full((8,), 3.0))


async def test_a_peer_sending_nan_is_excluded_and_the_others_are_correct(swarm):
    nodes = await swarm(5)
    tensors = [data(i) for i in range(5)]
    tensors[2][0][3, 3] = float("nan")
    tensors[2][2][:] = float("inf")
    honest = [t for i, t in enumerate(tensors) if i != 2]
    expected = [torch.stack([t[k] for t in honest]).mean(0) for k in range(3)]
    averagers = await make_averagers(nodes, tensors)
    results = await asyncio.gather(*(a.step(timeout=30) for a in averagers))
    try:
        bad = averagers[2].peer_id
        for i, (a, r) in enumerate(zip(averagers, results, strict=True)):
            if i != 2:
                assert bad in r.failed_peers
            for k in range(3):  # everyone, the offender included, ends with the honest mean
                torch.testing.assert_close(a.tensors[k], expected[k], rtol=1e-5, atol=1e-5)
    finally:
        await shutdown_all(averagers)


async def test_a_peer_holding_inf_is_excluded_from_every_part_and_the_check_thread_ends_with_the_averager(swarm):
    nodes = await swarm(2)
    tensors = [data(i) for i in range(2)]
    tensors[1][1][0] = float("-inf")
    averagers = await make_averagers(nodes, tensors)
    try:
        results = await asyncio.gather(*(a.step(timeout=30) for a in averagers))
        assert results[0].excluded == {averagers[1].peer_id: "part 0: it holds non-finite values"}
        for a in averagers:  # the offender keeps nothing of its own: it takes the other's values
            assert all(torch.equal(x, y) for x, y in zip(a.tensors, tensors[0], strict=True))
    finally:
        await shutdown_all(averagers)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("spotswarm-exp-check")]


async def test_mismatched_tensor_shapes_are_refused_with_the_difference_named(swarm):
    nodes = await swarm(3)
    tensors = [data(0), data(1), data(2, shapes=((300, 50), (8,), (1000,)))]
    averagers = await make_averagers(nodes[:2], tensors[:2], min_matchmaking_time=2.0)
    odd = DecentralizedAverager(tensors[2], nodes[2], "exp", target_group_size=3, min_matchmaking_time=2.0)
    try:
        step_odd = asyncio.ensure_future(odd.step(timeout=20))
        await asyncio.sleep(0)  # let the odd one start looking too
        results = await asyncio.gather(*(a.step(timeout=20) for a in averagers))
        with pytest.raises(ShapeMismatch, match=r"tensor 1 has shape \(8,\) where the group has \(7,\)"):
            await step_odd
        assert all(r.group_size == 2 for r in results)
    finally:
        await shutdown_all([*averagers, odd])


async def test_compressed_averaging_stays_within_the_codec_bound(swarm):
    nodes = await swarm(4)
    tensors = [[torch.randn(50_000, generator=torch.Generator().manual_seed(i))] for i in range(4)]
    exact = torch.stack([t[0] for t in tensors]).mean(0)
    # two lossy hops (to the reducer, back from it), each within its bound on what it carried;
    # computed first: a single float32 tensor is averaged in the caller's own memory
    bound = sum(error_bound(Codec.UNIFORM8, t[0]) for t in tensors) / 4 + error_bound(Codec.UNIFORM8, exact)
    averagers = await make_averagers(nodes, tensors, compression=Codec.UNIFORM8)
    try:
        await asyncio.gather(*(a.step(timeout=30) for a in averagers))
        for a in averagers:
            assert (a.tensors[0] - exact).abs().max().item() <= bound * 1.01
            assert torch.equal(a.tensors[0], averagers[0].tensors[0])
    finally:
        await shutdown_all(averagers)


async def test_alone_the_step_reports_no_group_and_changes_nothing(swarm):
    (node,) = await swarm(1)
    t = data(0)
    before = [x.clone() for x in t]
    averager = DecentralizedAverager(t, node, "solo", min_matchmaking_time=0.2, request_timeout=0.2)
    try:
        result = await averager.step(timeout=5)
        assert result.group_size == 1 and not result.averaged
        assert all(torch.equal(a, b) for a, b in zip(averager.tensors, before, strict=True))
    finally:
        await averager.shutdown()


async def test_members_tell_each_other_how_a_round_ended_and_tell_strangers_nothing(swarm):
    nodes = await swarm(4)
    averagers = await make_averagers(nodes[:3], [data(i) for i in range(3)], min_matchmaking_time=5.0)
    stranger = nodes[3]
    try:
        results = await asyncio.gather(*(a.step(timeout=30) for a in averagers))
        assert all(r.complete for r in results)
        assert [await a.others_completed(r) for a, r in zip(averagers, results, strict=True)] == [True] * 3
        group_id = bytes.fromhex(results[0].group_id)
        # a stranger learns nothing of a round it was not in; a malformed question gets a named error
        reply = await stranger.p2p.call(nodes[0].address, averagers[0].outcome_method, {"g": group_id}, timeout=5)
        assert reply == {"c": None}
        with pytest.raises(P2PError, match="an outcome request is"):
            await stranger.p2p.call(nodes[0].address, averagers[0].outcome_method, {"g": "x"}, timeout=5)
        # members whose round came back incomplete say so: nobody stepped on it
        for a in averagers[1:]:
            a._outcomes[group_id] = (a._outcomes[group_id][0], False)
        assert await averagers[0].others_completed(results[0]) is False
        # a member that cannot answer may have stepped: nobody can tell
        await averagers[2].shutdown()
        assert await averagers[0].others_completed(results[0], timeout=1.0) is None
    finally:
        await shutdown_all(averagers[:2])


async def test_a_member_gone_before_the_round_is_dropped_at_once_not_at_the_deadline(swarm):
    """A member killed between matchmaking and the all-reduce: its address refuses connections, so
    the others average their parts without it at once (nobody waits out ``sender_timeout``), and
    asked how the round ended, it counts as a member that did not step."""
    nodes = await swarm(2)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    gone = Identity().peer_id
    tensors = [data(0), data(1)]
    mean = torch.cat([m.flatten() for m in exact_mean(tensors)])
    averagers = await make_averagers(nodes, tensors)
    numel = averagers[0].flat.numel
    sizes = [numel // 3, numel // 3, numel - 2 * (numel // 3)]
    group = GroupInfo(os.urandom(20), [n.peer_id for n in nodes] + [gone],
                      [str(n.address) for n in nodes] + [f"{gone}@127.0.0.1:{port}"], sizes, [1.0] * 3,
                      chunk_size=4096)
    sender_timeout = 60.0
    loop = asyncio.get_running_loop()
    try:
        started = loop.time()
        results = await asyncio.gather(*(
            a._run_round(dataclasses.replace(group, my_index=i), 1.0, Codec.NONE, started + 120, sender_timeout, True)
            for i, a in enumerate(averagers)))
        took = loop.time() - started
        for r in results:
            assert r.failed_peers == [gone] and "cannot connect" in r.excluded[gone]
            assert r.unaveraged_parts == [2] and not r.complete
        for lo, hi in ((0, sizes[0]), (sizes[0], sizes[0] + sizes[1])):  # the two parts they reduce
            for a in averagers:
                torch.testing.assert_close(a.flat.flat[lo:hi], mean[lo:hi], rtol=1e-5, atol=1e-5)
        assert took < sender_timeout / 2, f"the round took {took:.1f} s: it waited for the gone member"
        assert await averagers[0].others_completed(results[0], timeout=5.0) is False  # member 1 failed too
    finally:
        await shutdown_all(averagers)
