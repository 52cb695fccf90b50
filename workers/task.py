"""What a peer trains: a model, its data, its loss and its optimizer, packaged as a ``Task``.

Three built-in tasks need no download: ``charlm`` (a small character-level transformer on the
Python standard library's own source files, which exist on every Python install), ``moe-charlm``
(the same with remote mixture-of-experts feed-forward layers over a run's expert grid) and
``synthetic`` (regression onto a fixed random teacher network, generated on the fly). Users plug
their own task in by import path: ``mypackage.tasks:make_task`` (a callable returning a Task).

This module imports only torch and the standard library at its top: the benchmarks' rivals (Ray
Train, torchft) load this file on its own, in a virtualenv without the project's dependencies
(``benchmarks/_rival_task.py``), so that every contender trains the very same task.
"""

from __future__ import annotations

import importlib
import inspect
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
    make_model: Callable[..., nn.Module]  # (); with needs_dht, (dht)
    batches: Callable[[int], Iterator[Batch]]  # seed -> endless stream of batches
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    batch_size: int
    make_optimizer: Callable[[Any], torch.optim.Optimizer] = field(
        default=lambda params: torch.optim.Adam(params, lr=1e-3))
    make_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    needs_dht: bool = False  # the model calls the run's experts, found through the run's DHT

    def model(self, seed: int = 0, dht: Any = None) -> nn.Module:
        """The model with seeded initial weights: every peer of a run starts from the same point."""
        if self.needs_dht and dht is None:
            raise ValueError(f"task {self.name!r} calls remote experts: its model needs the run's DHT (dht=...)")
        torch.manual_seed(seed)
        return self.make_model(dht) if self.needs_dht else self.make_model()


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


def _charlm_data(batch_size: int, context: int) -> tuple[Callable[[int], Iterator[Batch]],
                                                          Callable[[nn.Module, Batch], torch.Tensor]]:
    """The character-level tasks' batches (windows of the standard library's source) and loss."""
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

    return batches, loss


def charlm_task(batch_size: int = 16, context: int = 64, lr: float = 2e-3) -> Task:
    batches, loss = _charlm_data(batch_size, context)
    return Task("charlm", lambda: CharTransformer(context=context), batches, loss, batch_size,
                make_optimizer=lambda params: torch.optim.Adam(params, lr=lr))


# ---- character-level language model with remote experts ----------------------------------------
class MoECharTransformer(nn.Module):
    """``CharTransformer`` whose feed-forward layers are ``RemoteMixtureOfExperts`` over the run's
    expert grid.  Every block's mixture has its own gate but calls the same experts (parameters
    shared across depth), so one grid serves the whole model.  A block is pre-norm causal
    attention, then ``h + mixture(norm(h))``: an ``ffn`` expert returns ``layer_norm(x + ffn(x))``,
    and a row that got no answers (zeros, with ``allow_zero_outputs``) keeps its hidden state."""

    def __init__(self, dht: Any, vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 2,
                 context: int = 64, grid: Any = (2, 4), uid_prefix: str = "ffn", **mixture: Any) -> None:
        from experts import RemoteMixtureOfExperts  # here: only this task needs the experts layer
        from experts.schema import TensorSchema

        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        self.attn_norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.attns = nn.ModuleList(nn.MultiheadAttention(dim, heads, batch_first=True) for _ in range(layers))
        self.moe_norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.moes = nn.ModuleList(RemoteMixtureOfExperts(dim, grid, uid_prefix, dht=dht, **mixture)
                                  for _ in range(layers))
        for moe in self.moes:  # an expert answers one row per row: zeros can stand in before any expert is up
            moe.output_schema = TensorSchema((dim,), torch.float32)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:n]
        mask = self.mask[:n, :n]
        for attn_norm, attn, moe_norm, moe in zip(self.attn_norms, self.attns, self.moe_norms, self.moes,
                                                  strict=True):
            x = attn_norm(h)
            h = h + attn(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0]
            h = h + moe(moe_norm(h))
        return self.head(self.norm(h))


def moe_charlm_task(batch_size: int = 16, context: int = 64, lr: float = 2e-3, dim: int = 64, heads: int = 4,
                    layers: int = 2, grid: Any = (2, 4), uid_prefix: str = "ffn", k_best: int = 4, k_min: int = 2,
                    backward_k_min: int = 1, forward_timeout: float = 5.0, timeout_after_k_min: float = 0.5,
                    backward_timeout: float = 5.0, allow_zero_outputs: bool = True) -> Task:
    """charlm with remote mixture-of-experts feed-forward layers (``dim`` is the experts' hidden_dim)."""
    batches, loss = _charlm_data(batch_size, context)
    mixture = dict(k_best=k_best, k_min=k_min, backward_k_min=backward_k_min, forward_timeout=forward_timeout,
                   timeout_after_k_min=timeout_after_k_min, backward_timeout=backward_timeout,
                   allow_zero_outputs=allow_zero_outputs)

    def make_model(dht: Any) -> nn.Module:
        return MoECharTransformer(dht, dim=dim, heads=heads, layers=layers, context=context, grid=tuple(grid),
                                  uid_prefix=uid_prefix, **mixture)
    return Task("moe-charlm", make_model, batches, loss, batch_size, needs_dht=True,
                make_optimizer=lambda params: torch.optim.Adam(params, lr=lr))


# the names are also workers.worker_config.BUILTIN_TASK_NAMES (which must not import torch); a test keeps them equal
BUILTIN_TASKS: dict[str, Callable[..., Task]] = {"synthetic": synthetic_task, "charlm": charlm_task,
                                                 "moe-charlm": moe_charlm_task}


def load_task(spec: str, **kwargs: Any) -> Task:
    """A built-in task by name, or ``module.path:callable`` returning a Task; ``kwargs`` go to its
    factory (an option it does not take is a ValueError naming it)."""
    if spec in BUILTIN_TASKS:
        return _made(spec, BUILTIN_TASKS[spec], kwargs)
    if ":" not in spec:
        raise ValueError(f"unknown task {spec!r}: use one of {sorted(BUILTIN_TASKS)} or 'module.path:callable'")
    module_name, attr = spec.split(":", 1)
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load task {spec!r}: {e}") from None
    task = _made(spec, factory, kwargs)
    if not isinstance(task, Task):
        raise TypeError(f"{spec} returned {type(task).__name__}, expected workers.task.Task")
    return task


def _made(spec: str, factory: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as e:
        raise ValueError(f"task {spec!r}: {e} (options given: {', '.join(sorted(kwargs)) or 'none'})") from None
    except ValueError:  # no signature to check (a builtin): the call itself will say
        pass
    return factory(**kwargs)
