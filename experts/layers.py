"""Expert kinds a server can host by name: built-in ``ffn``, ``transformer`` and ``nop``, plus your own.

A kind is a module class built from ``hidden_dim`` and a function giving a sample batch; the sample
fixes the input schema and one forward pass on it fixes the output schema::

    @register_expert_class("perceptron", lambda batch, hid: torch.empty(batch, hid))
    class Perceptron(nn.Module):
        def __init__(self, hid): ...
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

SampleInput = Callable[[int, int], "torch.Tensor | tuple[torch.Tensor, ...]"]


@dataclass(frozen=True)
class ExpertKind:
    name: str
    cls: Callable[..., nn.Module]
    sample_input: SampleInput
    open_dims: tuple[int, ...] = ()  # per-row dimensions of every argument that may have any size

    def sample(self, batch: int, hidden_dim: int) -> tuple[torch.Tensor, ...]:
        out = self.sample_input(batch, hidden_dim)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)


_KINDS: dict[str, ExpertKind] = {}


def register_expert_class(name: str, sample_input: SampleInput,
                          open_dims: tuple[int, ...] = ()) -> Callable[[type], type]:
    """Class decorator: make ``cls(hidden_dim)`` available to servers as expert kind ``name``.

    ``open_dims`` lists per-row dimensions (0 = the first after the batch) that may have any size,
    e.g. the sequence length of a transformer block."""
    def wrap(cls: type) -> type:
        if name in _KINDS and _KINDS[name].cls is not cls:
            raise ValueError(f"expert kind {name!r} is already registered to {_KINDS[name].cls.__name__}")
        _KINDS[name] = ExpertKind(name, cls, sample_input, tuple(open_dims))
        return cls
    return wrap


def get_expert_kind(name: str) -> ExpertKind:
    try:
        return _KINDS[name]
    except KeyError:
        raise ValueError(f"unknown expert kind {name!r}; registered: {sorted(_KINDS)}") from None


def expert_kinds() -> list[str]:
    return sorted(_KINDS)


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


@register_expert_class("ffn", lambda batch, hid: torch.empty(batch, hid))
class FeedforwardBlock(nn.Module):
    """x -> LayerNorm(x + W2 gelu(W1 x)), with a 4x wider hidden layer (the usual transformer FFN)."""

    def __init__(self, hidden_dim: int) -> None:
        super().__init__()
        self.ffn = nn.Linear(hidden_dim, 4 * hidden_dim)
        self.ffn_output = nn.Linear(4 * hidden_dim, hidden_dim)
        self.layer_norm = nn.LayerNorm(hidden_dim, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(x + self.ffn_output(_gelu_fast(self.ffn(x))))


@register_expert_class("transformer", lambda batch, hid: torch.empty(batch, 16, hid), open_dims=(0,))
class TransformerBlock(nn.Module):
    """A post-norm transformer encoder layer over (batch, sequence, hidden); any sequence length."""

    def __init__(self, hidden_dim: int, num_heads: int | None = None, dropout: float = 0.0) -> None:
        super().__init__()
        heads = num_heads or next(h for h in (16, 8, 4, 2, 1) if hidden_dim % h == 0)
        self.layer = nn.TransformerEncoderLayer(hidden_dim, heads, dim_feedforward=4 * hidden_dim,
                                                dropout=dropout, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


@register_expert_class("nop", lambda batch, hid: torch.empty(batch, hid))
class NopExpert(nn.Module):
    """Returns its input: measures what the machinery around an expert costs."""

    def __init__(self, hidden_dim: int) -> None:
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


def create_expert(kind: str, hidden_dim: int, **kwargs: Any) -> nn.Module:
    return get_expert_kind(kind).cls(hidden_dim, **kwargs)
