"""What a peer trains: a model, its data, its loss and its optimizer, packaged as a ``Task``.

Two built-in tasks need no download: ``charlm`` (a small character-level transformer on the
Python standard library's own source files, which exist on every Python install) and
``synthetic`` (regression onto a fixed random teacher network, generated on the fly). Users plug
their own task in by import path: ``mypackage.tasks:make_task`` (a callable returning a Task).
"""

from __future__ import annotations

import importlib
import math
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

Batch = Any


@dataclass
class Task:
    name: str
    make_model: Callable[[], nn.Module]
    batches: Callable[[int], Iterator[Batch]]  # seed -> endless stream of batches
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    batch_size: int
    make_optimizer: Callable[[Any], torch.optim.Optimizer] = field(
        default=lambda params: torch.optim.Adam(params, lr=1e-3))
    make_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None

    def model(self, seed: int = 0) -> nn.Module:
        """The model with seeded initial weights: every peer of a run starts from the same point."""
        torch.manual_seed(seed)
        return self.make_model()


# ---- synthetic regression ------------------------------------------------------------------
def synthetic_task(in_features: int = 32, hidden: int = 64, batch_size: int = 32, lr: float = 3e-3) -> Task:
    teacher_gen = torch.Generator().manual_seed(1234)
    w1 = torch.randn(in_features, hidden, generator=teacher_gen) / math.sqrt(in_features)
    w2 = torch.randn(hidden, 1, generator=teacher_gen) / math.sqrt(hidden)

    def batches(seed: int) -> Iterator[Batch]:
        g = torch.Generator().manual_seed(seed)
        while True:
            x = torch.randn(batch_size, in_features, generator=g)
            yield x, torch.tanh(x @ w1) @ w2

    def make_model() -> nn.Module:
        return nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    return Task("synthetic", make_model, batches, loss, batch_size,
                make_optimizer=lambda params: torch.optim.Adam(params, lr=lr))


# ---- character-level language model ----------------------------------------------------------
def stdlib_corpus(max_bytes: int = 2_000_000) -> bytes:
    """Text every Python install has: the standard library's .py files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for path in sorted(root.glob("*.py")):
        try:
            out += path.read_bytes()
        except OSError:
            continue
        if len(out) >= max_bytes:
            break
    if not out:
        raise RuntimeError(f"no Python source found under {root}")
    return bytes(out[:max_bytes])


class CharTransformer(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 2, context: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:n]
        return self.head(self.blocks(h, mask=self.mask[:n, :n], is_causal=True))


def charlm_task(batch_size: int = 16, context: int = 64, lr: float = 2e-3) -> Task:
    corpus = torch.frombuffer(bytearray(stdlib_corpus()), dtype=torch.uint8).long()

    def batches(seed: int) -> Iterator[Batch]:
        g = torch.Generator().manual_seed(seed)
        while True:
            starts = torch.randint(0, len(corpus) - context - 1, (batch_size,), generator=g)
            window = torch.stack([corpus[s:s + context + 1] for s in starts.tolist()])
            yield window[:, :-1], window[:, 1:]

    def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    return Task("charlm", lambda: CharTransformer(context=context), batches, loss, batch_size,
                make_optimizer=lambda params: torch.optim.Adam(params, lr=lr))


BUILTIN_TASKS: dict[str, Callable[[], Task]] = {"synthetic": synthetic_task, "charlm": charlm_task}


def load_task(spec: str, **kwargs: Any) -> Task:
    """A built-in task by name, or ``module.path:callable`` returning a Task."""
    if spec in BUILTIN_TASKS:
        return BUILTIN_TASKS[spec](**kwargs)
    if ":" not in spec:
        raise ValueError(f"unknown task {spec!r}: use one of {sorted(BUILTIN_TASKS)} or 'module.path:callable'")
    module_name, attr = spec.split(":", 1)
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load task {spec!r}: {e}") from None
    task = factory(**kwargs)
    if not isinstance(task, Task):
        raise TypeError(f"{spec} returned {type(task).__name__}, expected workers.task.Task")
    return task
