"""Robust aggregation for a reducer's part: CenteredClip (Karimireddy et al. 2021, as in BTARD-SGD).

Why: a weighted mean lets one member with huge values or weight move the result arbitrarily far;
CenteredClip bounds what any single input can move the centre by in one iteration to
``w_i * tau / sum(w)``, with ``tau`` the median distance of the inputs to the start point, so a
minority of outliers moves the result by at most about ``f_weight * tau`` per iteration.
"""

from __future__ import annotations

import torch


def centered_clip(xs: torch.Tensor, weights: torch.Tensor, iterations: int = 5,
                  tau: float | None = None) -> torch.Tensor:
    """v <- v + sum w_i (x_i - v) min(1, tau/||x_i - v||) / sum w_i, from the coordinate-wise median.

    ``xs``: (n, d) inputs; ``weights``: (n,) non-negative.  ``tau`` defaults to the median distance of
    the inputs to the start point, doubled (the honest scale when most inputs are honest; doubling
    leaves most honest inputs unclipped).  Computed in float64.
    """
    x = xs.double()
    w = weights.double()
    total = w.sum()
    if total <= 0:
        raise ValueError("weights must sum to a positive number")
    v = x.median(dim=0).values
    if tau is None:
        tau = 2.0 * float((x - v).norm(dim=1).median())
    if tau <= 0:
        return v.to(xs.dtype)
    for _ in range(iterations):
        diff = x - v
        dist = diff.norm(dim=1).clamp_min(1e-300)
        scale = torch.clamp(tau / dist, max=1.0)
        v = v + (w * scale) @ diff / total
    return v.to(xs.dtype)
