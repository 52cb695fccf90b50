"""What a finished round must leave: every member holding the exact mean, bit for bit alike."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def exact_mean(inputs: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """The members' mean of each tensor, computed in float64 on the CPU, as float32."""
    return [torch.stack([t[k].cpu() for t in inputs]).double().mean(0).float() for k in range(len(inputs[0]))]


def assert_exact_mean_everywhere(averagers: Sequence, expected: Sequence[torch.Tensor]) -> None:
    for a in averagers:
        for k, want in enumerate(expected):
            torch.testing.assert_close(a.tensors[k], want, rtol=1e-5, atol=1e-5)
            assert torch.equal(a.tensors[k], averagers[0].tensors[k])  # bit-identical everywhere
