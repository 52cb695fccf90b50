"""Unit tests of CenteredClip (averaging/robust.py)."""

from __future__ import annotations

import pytest
import torch

from averaging.robust import centered_clip


@pytest.mark.timeout(10)
def test_centered_clip_bounds_a_huge_outlier():
    g = torch.Generator().manual_seed(0)
    honest = torch.randn(3, 100, generator=g)
    xs = torch.cat([honest, torch.full((1, 100), 1e30)])
    out = centered_clip(xs, torch.tensor([1.0, 1.0, 1.0, 4.0]))
    assert torch.isfinite(out).all()
    spread = float((honest - honest.mean(0)).norm(dim=1).max())
    assert float((out.double() - honest.double().mean(0)).norm()) < 10 * spread
