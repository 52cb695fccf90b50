"""Expert kinds used by the tests; servers load this file with ``--custom-module``."""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

from experts import register_expert_class


@register_expert_class("stall", lambda batch, hid: torch.empty(batch, hid))
class StallExpert(nn.Module):
    """Answers the schema probe at creation, then announces every later forward and hangs in it,
    so a test can kill its server in the middle of a forward pass."""

    def __init__(self, hidden_dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_dim, hidden_dim)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 1:
            print("FORWARD_STARTED", flush=True)
            sys.stdout.flush()
            time.sleep(600)
        return self.linear(x)


@register_expert_class("gated_sum", lambda batch, hid: (torch.empty(batch, hid), torch.empty(batch, hid),
                                                         torch.empty(batch, dtype=torch.bool)))
class GatedSum(nn.Module):
    """Two float inputs and a bool mask: ``where(mask, W a, W b * b)``, for multi-input autograd."""

    def __init__(self, hidden_dim: int) -> None:
        super().__init__()
        self.w = nn.Linear(hidden_dim, hidden_dim)

    def forward(self, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.where(mask[:, None], self.w(a), self.w(b) * b)
