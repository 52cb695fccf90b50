"""Robust aggregation for a reducer's chunk: CenteredClip (Karimireddy et al. 2021, as in BTARD-SGD).

Why: a weighted mean lets one member with huge values or weight move the result arbitrarily far.
CenteredClip moves a centre ``v`` towards each input by at most ``tau`` per iteration:

    v <- v + sum_i (w_i / W) * (x_i - v) * min(1, tau / ||x_i - v||)

so an input of weight share ``w_i / W`` moves the centre by at most ``(w_i / W) * tau`` per
iteration, whatever its values.  Starting from the weighted medoid (the input with the least
weighted distance to the others), with ``tau`` twice the median distance of the others to it (the
honest scale while most inputs are honest), ``L`` iterations leave the result within
``L * f * tau`` of where the honest inputs alone would put it, ``f`` being the bad inputs' weight
share: ``bound``.

Every centre is a convex combination of the inputs, so the whole iteration runs on the ``m x m``
matrix of squared pairwise distances (``||x - sum a_k x_k||^2 = sum a_k ||x - x_k||^2 -
1/2 sum a_k a_l ||x_k - x_l||^2``): its cost is the m(m-1)/2 distances, and the result is the
inputs' weighted sum with the coefficients found, which the reducer forms like a weighted mean.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import torch

CLIP_ITERATIONS = 10
TAU_FACTOR = 2.0
# Under this ratio of a squared distance to the inputs' squared norms, the Gram identity loses the
# distance to float32 cancellation (parameters that agree to many digits): measure it directly
_CANCELLATION = 1e-2


class Byzantine(str, enum.Enum):
    """How far a group trusts its reducers: ``off`` (a fleet of our own), ``clip`` (CenteredClip per
    chunk: a minority of bad inputs moves a part by a bounded amount), ``verify`` (clip, and every
    reducer's output audited by the others: see ``audit.py``)."""

    OFF = "off"
    CLIP = "clip"
    VERIFY = "verify"

    @property
    def clips(self) -> bool:
        return self is not Byzantine.OFF

    @property
    def max_weight_ratio(self) -> float:
        """The default cap on a member's weight, in medians of the group's: none in a trusted fleet (a
        peer weighs the samples it trained, exactly); where the group clips, one member of four must
        hold under half the weight (2 / (2 + 3)), or CenteredClip bounds nothing."""
        return math.inf if self is Byzantine.OFF else 2.0


def squared_distances(xs: Sequence[torch.Tensor]) -> list[list[float]]:
    """``||x_i - x_j||^2`` for every pair, from dot products (one read of each pair, no temporary),
    measured directly where the dot products would cancel."""
    m = len(xs)
    gram = [[0.0] * m for _ in range(m)]
    for i in range(m):
        for j in range(i + 1):
            gram[i][j] = gram[j][i] = float(torch.dot(xs[i], xs[j]))
    out = [[0.0] * m for _ in range(m)]
    for i in range(m):
        for j in range(i):
            d2 = gram[i][i] + gram[j][j] - 2 * gram[i][j]
            if d2 < _CANCELLATION * (gram[i][i] + gram[j][j]):
                d2 = float(torch.dist(xs[i], xs[j])) ** 2
            out[i][j] = out[j][i] = max(d2, 0.0)
    return out


def clip_coefficients(d2: list[list[float]], weights: Sequence[float], iterations: int = CLIP_ITERATIONS,
                      tau_factor: float = TAU_FACTOR) -> tuple[list[float], float]:
    """CenteredClip's result as coefficients of the inputs (non-negative, summing to 1), and its tau.

    ``d2``: squared pairwise distances; ``weights``: non-negative, with a positive sum.
    """
    m = len(weights)
    total = float(sum(weights))
    if m == 0 or not total > 0:
        raise ValueError("CenteredClip needs inputs whose weights sum to a positive number")
    start = min(range(m), key=lambda i: (sum(weights[j] * math.sqrt(d2[i][j]) for j in range(m)), i))
    a = [0.0] * m
    a[start] = 1.0
    others = sorted(math.sqrt(d2[start][j]) for j in range(m) if j != start and weights[j] > 0)
    tau = tau_factor * others[(len(others) - 1) // 2] if others else 0.0
    if tau <= 0:
        return a, tau
    for _ in range(iterations):
        spread = 0.5 * sum(a[k] * a[j] * d2[k][j] for k in range(m) for j in range(m) if a[k] and a[j])
        step = [0.0] * m
        for i in range(m):
            if weights[i] <= 0:
                continue
            dist2 = sum(a[k] * d2[i][k] for k in range(m) if a[k]) - spread
            dist = math.sqrt(max(dist2, 0.0))
            step[i] = (weights[i] / total) * (1.0 if dist <= tau else tau / dist)
        moved = sum(step)
        previous, a = a, [(1.0 - moved) * a[k] + step[k] for k in range(m)]
        if max(abs(x - y) for x, y in zip(a, previous, strict=True)) <= 1e-12:
            break  # a fixed point (honest inputs: the weighted mean, after two iterations)
    return a, tau


def bound(bad_weight_share: float, tau: float, iterations: int = CLIP_ITERATIONS) -> float:
    """How far bad inputs of this weight share can move a chunk's CenteredClip, at most (L2)."""
    return iterations * bad_weight_share * tau


def centered_clip(xs: Sequence[torch.Tensor], weights: Sequence[float],
                  iterations: int = CLIP_ITERATIONS) -> torch.Tensor:
    """CenteredClip of ``xs`` (same shape each): the reducer's rule as one function, for callers that hold
    every input at once (the reducer forms the same sum in place, chunk by chunk)."""
    coefficients, _ = clip_coefficients(squared_distances(xs), weights, iterations)
    return weighted_sum(xs, coefficients)


def weighted_sum(xs: Sequence[torch.Tensor], coefficients: Sequence[float]) -> torch.Tensor:
    """``sum c_k x_k`` for coefficients summing to 1, as the reducer forms a mean: a running lerp in order."""
    out = torch.zeros_like(xs[0])
    total = 0.0
    for x, c in zip(xs, coefficients, strict=True):
        if c > 0:
            total += c
            out.lerp_(x, c / total)
    return out
