"""CenteredClip (averaging/robust.py): the rule on its own, and members' attacks on reducers that clip."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

from averaging.allreduce import AllReduceRound
from averaging.partition import Chunk
from averaging.robust import Byzantine, bound, centered_clip, clip_coefficients, squared_distances
from tests.security.test_averaging_attacks import CHUNK, Round, declaring


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]).double()


@pytest.mark.timeout(10)
def test_centered_clip_bounds_a_huge_outlier_and_equals_the_mean_of_close_inputs():
    g = torch.Generator().manual_seed(0)
    honest = [torch.randn(100, generator=g) for _ in range(3)]
    out = centered_clip([*honest, torch.full((100,), 1e30)], [1.0, 1.0, 1.0, 2.0])
    assert torch.isfinite(out).all()
    d2 = squared_distances(honest)
    _, tau = clip_coefficients(d2, [1.0] * 3)
    mean = torch.stack(honest).mean(0)
    assert float((out - mean).norm()) <= bound(2 / 5, 2 * tau)
    close = [torch.full((50,), 1.0), torch.full((50,), 1.5), torch.full((50,), 2.0)]
    torch.testing.assert_close(centered_clip(close, [1.0, 1.0, 2.0]), torch.full((50,), 1.625))


@pytest.mark.timeout(10)
def test_distances_of_nearly_equal_parameters_are_measured_not_cancelled():
    base = torch.full((10_000,), 1000.0)
    xs = [base, base + 1e-3, base - 1e-3]
    d2 = squared_distances(xs)
    exact = float((xs[1].double() - xs[2].double()).norm()) ** 2  # ~0.038: the Gram identity gives noise
    assert math.isclose(d2[1][2], exact, rel_tol=1e-3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["off", "clip"])
async def test_a_member_at_the_weight_cap_with_large_values_moves_a_clipped_part_by_a_bounded_amount(swarm, mode):
    """Issue 52's attack: weight 1e6 (the absolute cap) with values 90, under the 100x norm screen.
    Where the group clips, weights are capped at twice the group's median, and a clipping reducer moves
    each chunk by at most L x f x tau; a trusted group (off) takes the weight as declared."""
    game = Round(honest=3, attackers=1)
    (attacker,) = await game.start(swarm, byzantine=mode)
    declaring(attacker, 1e6)

    class AtTheCap(AllReduceRound):
        def _header(self) -> dict:
            return {**super()._header(), "w": 1e6}

        def _outgoing(self, chunk: Chunk) -> dict:
            payload = super()._outgoing(chunk)
            return {**payload, "d": torch.full_like(payload["d"], 90.0)}

    attacker.round_class = AtTheCap
    results = await game.run()
    assert all(r.group_size == 4 and not r.excluded for r in results[:3])
    honest = [flat(t) for t in game.tensors[:3]]
    mean = torch.stack(honest).mean(0)
    got = flat(game.averagers[0].tensors)
    assert all(torch.equal(flat(a.tensors), got) for a in game.averagers[1:3])
    share = 1e6 / (1e6 + 3) if mode == "off" else 2 / 5
    if mode == "off":  # the weighted mean: the attacker's share of the way to 90
        torch.testing.assert_close(got, (1 - share) * mean + share * 90.0, rtol=1e-5, atol=1e-5)
        return
    for start in range(0, got.numel(), CHUNK):  # every chunk: a reducer's chunk lies within CHUNK-aligned runs
        part = slice(start, min(start + CHUNK, got.numel()))
        spread = max(float((h[part] - mean[part]).norm()) for h in honest)
        # tau is twice the median distance to the medoid, at most 4 x the honest spread
        assert float((got[part] - mean[part]).norm()) <= bound(share, 4 * spread), start


@pytest.mark.timeout(60)
async def test_clipping_honest_peers_hold_the_same_bits_and_stay_near_the_mean(swarm):
    game = Round(honest=4, attackers=0)
    await game.start(swarm, byzantine=Byzantine.CLIP)
    results = await game.run()
    assert all(r.group_size == 4 and r.complete for r in results)
    got = flat(game.averagers[0].tensors)
    assert all(torch.equal(flat(a.tensors), got) for a in game.averagers[1:])
    everyone = torch.stack([flat(t) for t in game.tensors])
    # honest inputs of a chunk differ in scale (1x to 3x): clipping may trim the widest a little
    assert float((got - everyone.mean(0)).norm()) <= 0.5 * float((everyone - everyone.mean(0)).norm(dim=1).max())


@pytest.mark.timeout(60)
async def test_a_leader_that_rewrites_weights_is_refused_banned_and_the_honest_average_without_it(swarm):
    """Issue 52: a leader wrote 2e6 as each follower's weight and the honest members dropped each other.
    In a group that clips, weights come from each member's signed declaration: the followers refuse the
    altered group, ban its leader and average among themselves."""
    game = Round(honest=3, attackers=1, full=True)
    (rogue,) = await game.start(swarm, byzantine="clip")
    assemble = rogue.matchmaker._assemble

    def rewriting(lead: Any) -> Any:
        for follower in lead.followers:
            follower.weight = 2e6
        return assemble(lead)

    rogue.matchmaker._assemble = rewriting  # type: ignore[method-assign]
    leading = asyncio.ensure_future(rogue.step(timeout=3))
    key = f"{rogue.prefix}.mm.all"
    for _ in range(200):  # the rogue declared first, so it is everyone's first choice of leader
        found = await game.averagers[0].node.get(key, latest=True)
        if found is not None and isinstance(found.value, dict) and found.value:
            break
        await asyncio.sleep(0.01)
    honest = game.averagers[:3]
    results = await asyncio.gather(*(a.step(timeout=20, target_group_size=3) for a in honest))
    await leading
    for a, r in zip(honest, results, strict=True):
        assert r.group_size == 3 and rogue.peer_id not in r.group_peers
        assert rogue.peer_id in a.banned
        assert any("signed weight 1, the group says 2e+06" in b["evidence"] for b in a.ban_log), a.ban_log
    mean = torch.stack([flat(t) for t in game.tensors[:3]]).mean(0)
    got = flat(honest[0].tensors)
    assert all(torch.equal(flat(a.tensors), got) for a in honest[1:])
    assert float((got - mean).norm()) <= 0.5 * float(mean.norm())
    for a in game.averagers:
        await a.shutdown()
