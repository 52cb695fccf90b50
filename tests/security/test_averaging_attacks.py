"""Hostile members of an averaging group, against real peers on loopback.

Every attacker below is a real averaging peer whose own code was changed to misbehave: a subclass
of the all-reduce round that rewrites the chunks or the header it sends, or a wrapper around its
own matchmaker that declares another weight.  Nothing on the honest side is mocked.  Unless a test
says otherwise the attackers are client-mode members, so every part is reduced by an honest peer
and the honest result can be compared with the honest-only average over the whole vector.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from averaging import Codec, DecentralizedAverager, StepResult
from averaging.allreduce import AllReduceRound
from averaging.partition import Chunk
from p2p.codecs import BLOCK, MalformedChunk, NonFiniteChunk, decode, decode_into, encode, norm

SHAPES = ((3, 5), (300,))
CHUNK = 64  # several chunks per part: a misbehaving sender is caught in every one of them


def data(i: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return [torch.randn(*s, generator=g) * (1 + i % 3) for s in SHAPES]


Tamper = Callable[[dict, Chunk], dict]


def sending(tamper: Tamper) -> type[AllReduceRound]:
    """The attacker's own round: it sends ``tamper(honest payload, chunk)`` instead of its chunks."""

    class HostileRound(AllReduceRound):
        def _outgoing(self, chunk: Chunk) -> dict:
            return tamper(super()._outgoing(chunk), chunk)

    return HostileRound


def calling_with_weight(weight: Any) -> type[AllReduceRound]:
    """The attacker's own round: it joined with one weight and tells the reducers another."""

    class HostileRound(AllReduceRound):
        def _header(self) -> dict:
            return {**super()._header(), "w": weight}

    return HostileRound


def declaring(averager: DecentralizedAverager, weight: Any) -> None:
    """The attacker's own matchmaker declares ``weight`` to the group, whatever its step was given."""
    form_group = averager.matchmaker.form_group

    async def lying(group_key: str, deadline: float, target: int | None = None, _weight: float = 1.0,
                    *rest: Any) -> Any:
        return await form_group(group_key, deadline, target, weight, *rest)

    averager.matchmaker.form_group = lying  # type: ignore[method-assign]


def values(fill: Callable[[torch.Tensor], None]) -> Tamper:
    def tamper(payload: dict, chunk: Chunk) -> dict:
        d = payload["d"].clone()
        fill(d)
        return {**payload, "d": d}
    return tamper


def replaced(make: Callable[[int], dict]) -> Tamper:
    return lambda payload, chunk: make(chunk.end - chunk.start)


class Round:
    """One all-reduce among honest peers and attackers; attackers are client-mode unless ``full``."""

    def __init__(self, honest: int, attackers: int, full: bool = False) -> None:
        self.n_honest, self.n_attackers, self.full = honest, attackers, full
        self.tensors = [data(i) for i in range(honest + attackers)]
        self.averagers: list[DecentralizedAverager] = []

    async def start(self, swarm: Any, **options: Any) -> list[DecentralizedAverager]:
        n = self.n_honest + self.n_attackers
        nodes = await swarm(n, [False] * self.n_honest + [not self.full] * self.n_attackers)
        self.averagers = [DecentralizedAverager(t, node, "atk", target_group_size=n, min_matchmaking_time=10.0,
                                                chunk_size=CHUNK, **options)
                          for t, node in zip(self.tensors, nodes, strict=True)]
        return self.averagers[self.n_honest:]

    async def run(self) -> list[StepResult]:
        try:
            return await asyncio.gather(*(a.step(timeout=30) for a in self.averagers))
        finally:
            for a in self.averagers:
                await a.shutdown()

    def honest_mean(self) -> list[torch.Tensor]:
        honest = self.tensors[: self.n_honest]
        return [torch.stack([t[k] for t in honest]).double().mean(0) for k in range(len(SHAPES))]

    def check(self, results: list[StepResult], reasons: list[str]) -> None:
        """Each attacker is named by every honest peer with a reason matching its pattern; honest
        peers hold the honest-only mean, bit-identical among them, and nobody names an honest peer."""
        honest_ids = [a.peer_id for a in self.averagers[: self.n_honest]]
        attacker_ids = [a.peer_id for a in self.averagers[self.n_honest:]]
        expected = self.honest_mean()
        for a, r in zip(self.averagers[: self.n_honest], results, strict=False):
            assert r.group_size == self.n_honest + self.n_attackers
            assert set(r.excluded) == set(attacker_ids) == set(r.failed_peers), r.excluded
            for peer, pattern in zip(attacker_ids, reasons, strict=True):
                assert re.search(pattern, r.excluded[peer]), (pattern, r.excluded[peer])
            assert not set(honest_ids) & set(r.excluded)
            for k in range(len(SHAPES)):
                torch.testing.assert_close(a.tensors[k].double(), expected[k], rtol=1e-6, atol=1e-6)
                assert torch.equal(a.tensors[k], self.averagers[0].tensors[k])


@pytest.mark.timeout(60)
async def test_nan_inf_and_huge_finite_values_are_excluded_named_and_the_honest_mean_is_exact(swarm):
    game = Round(honest=4, attackers=4)
    nan, inf, huge, large = await game.start(swarm)
    nan.round_class = sending(values(lambda d: d.__setitem__(0, math.nan)))  # one NaN per chunk
    inf.round_class = sending(values(lambda d: d.fill_(math.inf)))
    huge.round_class = sending(values(lambda d: d.fill_(1e38)))  # finite, but any sum with it overflows
    large.round_class = sending(values(lambda d: d.mul_(1e6)))  # finite, no overflow: the median rule
    results = await game.run()
    game.check(results, ["non-finite", "non-finite", "overflow", r"norm .* over 100 x the median norm"])
    # the excluded peers are still served: they end with the honest mean too, without an error
    for a in game.averagers[4:]:
        for k in range(len(SHAPES)):
            assert torch.equal(a.tensors[k], game.averagers[0].tensors[k])


@pytest.mark.timeout(60)
async def test_in_a_group_of_three_a_member_sending_tiny_values_cannot_have_an_honest_one_refused(swarm):
    """Against the lower median of a sender's two others, a member sending values 1e-4 of the usual
    would have each honest reducer refuse the other honest sender, and every part would be the
    average of one honest peer and the attacker.  Against the upper median, nobody is refused: the
    tiny values are plausible and are averaged in like any others."""
    game = Round(honest=2, attackers=1)
    (tiny,) = await game.start(swarm)
    tiny.round_class = sending(values(lambda d: d.mul_(1e-4)))
    sent = [[t * 1e-4 for t in game.tensors[2]]]
    results = await game.run()
    expected = [torch.stack([t[k] for t in [*game.tensors[:2], *sent]]).double().mean(0) for k in range(len(SHAPES))]
    for a, r in zip(game.averagers[:2], results, strict=False):
        assert r.group_size == 3 and r.excluded == {}, r.excluded
        for k in range(len(SHAPES)):
            torch.testing.assert_close(a.tensors[k].double(), expected[k], rtol=1e-6, atol=1e-6)
            assert torch.equal(a.tensors[k], game.averagers[0].tensors[k])


@pytest.mark.timeout(60)
async def test_out_of_range_weights_exclude_their_peer_everywhere(swarm):
    game = Round(honest=3, attackers=4)
    declares_huge, declares_nan, declares_negative, calls_huge = await game.start(swarm)
    declaring(declares_huge, 1e30)
    declaring(declares_nan, math.nan)
    declaring(declares_negative, -5.0)
    calls_huge.round_class = calling_with_weight(1e30)  # joined with 1.0: the reducers hold it to that
    results = await game.run()
    game.check(results, ["weight 1e\\+30 is over max_weight 1e\\+06", "weight nan is not finite",
                         "weight -5 is negative", "called with weight 1e\\+30 but joined with 1"])
    with pytest.raises(ValueError, match="over max_weight"):  # an honest peer refuses its own
        await game.averagers[0].step(weight=2e6)


def blockwise(n: int, **overrides: Any) -> dict:
    n_blocks = -(-n // BLOCK)
    payload = {"c": "blockwise8", "d": torch.zeros(n, dtype=torch.uint8), "lo": torch.zeros(n_blocks),
               "s": torch.ones(n_blocks)}
    return {**payload, **overrides}


@pytest.mark.timeout(60)
async def test_malformed_compressed_chunks_are_refused_cleanly_and_their_senders_named(swarm):
    game = Round(honest=3, attackers=5)
    short_fp16, scale_tensor, blocks, float64_scales, two_d = await game.start(swarm)
    short_fp16.round_class = sending(replaced(  # "fp16": the codec's old name, still read as "float16"
        lambda n: {"c": "fp16", "d": torch.zeros(n - 1, dtype=torch.float16)}))
    scale_tensor.round_class = sending(replaced(
        lambda n: {"c": "uniform8", "d": torch.zeros(n, dtype=torch.uint8), "lo": 0.0, "s": torch.ones(2)}))
    blocks.round_class = sending(replaced(lambda n: blockwise(n, s=torch.ones(2))))
    float64_scales.round_class = sending(replaced(
        lambda n: blockwise(n, lo=torch.zeros(-(-n // BLOCK), dtype=torch.float64))))
    two_d.round_class = sending(replaced(lambda n: {"c": "none", "d": torch.zeros(n, 1)}))
    results = await game.run()
    game.check(results, [r"chunk 0: float16 chunk has \d+ elements, expected \d+",
                         r"uniform8 chunk needs numbers 'lo' and 's'",
                         r"blockwise8 chunk has 2 values of 's', expected 1",
                         r"blockwise8 chunk's 'lo' must be a 1-d float32 tensor",
                         r"none chunk has shape \(\d+, 1\), expected \(\d+,\)"])


@pytest.mark.timeout(60)
async def test_foreign_dtypes_are_refused_and_named_never_cast(swarm):
    game = Round(honest=3, attackers=2)
    doubles, longs = await game.start(swarm)
    # plausible values in the wrong dtype: cast, they would pass every other check
    doubles.round_class = sending(lambda p, chunk: {**p, "d": p["d"].double()})
    longs.round_class = sending(lambda p, chunk: {**p, "d": p["d"].round().long()})
    results = await game.run()
    game.check(results, ["none chunk has dtype torch.float64, expected torch.float32",
                         "none chunk has dtype torch.int64, expected torch.float32"])


@pytest.mark.timeout(60)
async def test_a_full_member_is_excluded_from_honest_parts_and_reduces_its_own(swarm):
    """A member that reduces a part itself decides what that part becomes: here its reducer is
    honest code, so its part is the mean of everyone's local values, the same on every peer."""
    game = Round(honest=3, attackers=1, full=True)
    (attacker,) = await game.start(swarm)
    attacker.round_class = sending(values(lambda d: d.mul_(1e6)))
    results = await game.run()
    everyone = [torch.cat([t.reshape(-1) for t in ts]).double() for ts in game.tensors]
    honest_mean, all_mean = torch.stack(everyone[:3]).mean(0), torch.stack(everyone).mean(0)
    flat = [torch.cat([t.reshape(-1) for t in a.tensors]) for a in game.averagers]
    r = results[0]
    start = 0
    for peer, size in zip(r.group_peers, r.part_sizes, strict=True):
        part = slice(start, start + size)
        start += size
        expected = all_mean[part] if peer == attacker.peer_id else honest_mean[part]
        for f in flat[:3]:
            assert torch.equal(f[part], flat[0][part])
            torch.testing.assert_close(f[part].double(), expected, rtol=1e-6, atol=1e-6)
    assert all(re.search("over 100 x the median norm", res.excluded[attacker.peer_id]) for res in results[:3])


@pytest.mark.timeout(60)
async def test_an_attack_in_one_chunk_drops_the_sender_from_there_to_the_end_of_that_part(swarm):
    """Exclusion is decided per part by its reducer, from the chunk it catches onwards: chunks
    already released keep the sender's (checked) values, and every honest peer holds the same."""
    game = Round(honest=3, attackers=1)
    (attacker,) = await game.start(swarm)
    target: dict[str, int] = {}

    def tamper(payload: dict, chunk: Chunk) -> dict:
        return {**payload, "d": payload["d"] * 1e6} if chunk.start == target["start"] else payload

    attacker.round_class = sending(tamper)
    # the second chunk of part 0 (parts are 3 x 105; a chunk spans tensors of one codec, so part 0
    # is cut into [0, CHUNK) and [CHUNK, 105))
    target["start"] = CHUNK
    results = await game.run()
    everyone = [torch.cat([t.reshape(-1) for t in ts]).double() for ts in game.tensors]
    honest_mean, all_mean = torch.stack(everyone[:3]).mean(0), torch.stack(everyone).mean(0)
    flat = [torch.cat([t.reshape(-1) for t in a.tensors]) for a in game.averagers[:3]]
    assert all(res.part_sizes == [105, 105, 105, 0] for res in results[:3])
    for f in flat:
        assert torch.equal(f, flat[0])
    caught, end = target["start"], 105
    torch.testing.assert_close(flat[0][:caught].double(), all_mean[:caught], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(flat[0][caught:end].double(), honest_mean[caught:end], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(flat[0][end:].double(), all_mean[end:], rtol=1e-6, atol=1e-6)
    assert all(re.search(r"^part 0: chunk 1: norm .* over 100 x the median norm", res.excluded[attacker.peer_id])
               for res in results[:3])


@pytest.mark.timeout(60)
async def test_a_reducer_returning_nan_is_refused_and_its_senders_keep_their_values(swarm):
    game = Round(honest=2, attackers=1, full=True)
    (attacker,) = await game.start(swarm)

    class PoisoningReducer(AllReduceRound):  # the attacker's own reducer answers with NaN
        async def serve(self, *args: Any, **kwargs: Any) -> Any:
            async for payload in super().serve(*args, **kwargs):
                yield {**payload, "d": torch.full_like(payload["d"], math.nan)}

    attacker.round_class = PoisoningReducer
    before = [torch.cat([t.reshape(-1) for t in ts]) for ts in game.tensors]
    results = await game.run()
    r = results[0]
    index = r.group_peers.index(attacker.peer_id)
    part = slice(sum(r.part_sizes[:index]), sum(r.part_sizes[: index + 1]))
    for i, (a, res) in enumerate(zip(game.averagers[:2], results, strict=False)):
        flat = torch.cat([t.reshape(-1) for t in a.tensors])
        assert torch.isfinite(flat).all()
        assert torch.equal(flat[part], before[i][part])  # its own values, untouched
        assert re.search(r"reducer failed after 0/\d+ chunks: none chunk decodes to non-finite",
                         res.excluded[attacker.peer_id])


# ---- decoding in isolation: every malformed payload is refused before anything is written -----

N = 300
MALFORMED = {
    "not a dict": "junk",
    "no tensor": {"c": "none", "d": [1.0] * N},
    "unknown codec": {"c": "zip", "d": torch.zeros(N)},
    "none, short": {"c": "none", "d": torch.zeros(N - 1)},
    "none, float64": {"c": "none", "d": torch.zeros(N, dtype=torch.float64)},
    "none, int64": {"c": "none", "d": torch.zeros(N, dtype=torch.int64)},
    "none, 2-d": {"c": "none", "d": torch.zeros(N // 3, 3)},
    "float16, float32 data": {"c": "float16", "d": torch.zeros(N)},
    "float16, long": {"c": "float16", "d": torch.zeros(N + 1, dtype=torch.float16)},
    "bfloat16, float16 data": {"c": "bfloat16", "d": torch.zeros(N, dtype=torch.float16)},
    "uniform8, float data": {"c": "uniform8", "d": torch.zeros(N), "lo": 0.0, "s": 1.0},
    "uniform8, no scale": {"c": "uniform8", "d": torch.zeros(N, dtype=torch.uint8), "lo": 0.0},
    "uniform8, scale tensor": {"c": "uniform8", "d": torch.zeros(N, dtype=torch.uint8), "lo": 0.0,
                               "s": torch.ones(3)},
    "uniform8, string scale": {"c": "uniform8", "d": torch.zeros(N, dtype=torch.uint8), "lo": 0.0, "s": "1"},
    "uniform8, negative scale": {"c": "uniform8", "d": torch.zeros(N, dtype=torch.uint8), "lo": 0.0, "s": -1.0},
    "blockwise8, scales missing": {"c": "blockwise8", "d": torch.zeros(N, dtype=torch.uint8)},
    "blockwise8, one block short": blockwise(N, lo=torch.zeros(1), s=torch.ones(1)),
    "blockwise8, int scales": blockwise(N, s=torch.ones(2, dtype=torch.int32)),
    "blockwise8, 2-d scales": blockwise(N, s=torch.ones(2, 1)),
    "blockwise8, negative scale": blockwise(N, s=-torch.ones(2)),
    "blockwise8, int8 data": blockwise(N, d=torch.zeros(N, dtype=torch.int8)),
}
NONFINITE = {
    "none, nan": {"c": "none", "d": torch.full((N,), math.nan)},
    "float16, inf": {"c": "float16", "d": torch.full((N,), math.inf, dtype=torch.float16)},
    "bfloat16, nan": {"c": "bfloat16", "d": torch.full((N,), math.nan, dtype=torch.bfloat16)},
    "uniform8, nan lo": {"c": "uniform8", "d": torch.zeros(N, dtype=torch.uint8), "lo": math.nan, "s": 1.0},
    "uniform8, overflowing scale": {"c": "uniform8", "d": torch.full((N,), 255, dtype=torch.uint8), "lo": -3e38,
                                    "s": 2.3e36},
    "blockwise8, inf lo": blockwise(N, lo=torch.tensor([0.0, math.inf])),
    "blockwise8, overflowing scale": blockwise(N, d=torch.full((N,), 255, dtype=torch.uint8),
                                               s=torch.tensor([1.0, 3e38])),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_payloads_raise_a_specific_error_and_leave_the_destination_alone(name):
    out = torch.full((N,), 7.0)
    with pytest.raises(MalformedChunk):
        decode_into(MALFORMED[name], out)
    with pytest.raises(MalformedChunk):
        decode(MALFORMED[name], N)
    assert torch.equal(out, torch.full((N,), 7.0))


@pytest.mark.parametrize("name", list(NONFINITE))
def test_payloads_that_decode_to_nan_or_inf_are_refused_before_writing(name):
    out = torch.full((N,), 7.0)
    with pytest.raises(NonFiniteChunk):
        decode_into(NONFINITE[name], out)
    with pytest.raises(NonFiniteChunk):
        decode(NONFINITE[name], N)
    assert torch.equal(out, torch.full((N,), 7.0))


@pytest.mark.parametrize("codec", list(Codec))
def test_every_codec_reports_the_norm_of_what_it_decodes_to(codec):
    x = torch.linspace(-3.0, 2.0, N)
    decoded, magnitude = decode(encode(codec, x), N)
    assert decoded.dtype == torch.float32
    assert magnitude == pytest.approx(torch.linalg.vector_norm(decoded).item(), rel=1e-6)
    assert norm(torch.full((N,), 1e30)) == pytest.approx(1e30 * N**0.5)  # float32 squares overflow here
    assert math.isnan(norm(torch.tensor([1.0, math.nan]))) and norm(torch.tensor([1.0, -math.inf])) == math.inf


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_norm_is_the_l2_norm_for_any_float_dtype_and_shape(dtype):
    x = torch.arange(-6.0, 6.0).reshape(3, 4).to(dtype)
    rel = 1e-3 if dtype == torch.float16 else 1e-6  # a float16 norm is a float16
    assert norm(x) == pytest.approx(math.sqrt(sum(v * v for v in range(-6, 6))), rel=rel)
    assert norm(x[:, 1]) == pytest.approx(math.sqrt(25 + 1 + 9), rel=rel)  # strided
    assert norm(x[:0]) == 0.0
    bad = x.clone()
    bad[1, 2] = math.nan
    assert math.isnan(norm(bad))
    bad[1, 2] = -math.inf
    assert norm(bad) == math.inf
