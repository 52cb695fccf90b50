"""One hosted expert: its module, schemas, optimizer, and the forward/backward the runtime calls.

The server is stateless between calls: a backward request carries the inputs again, and the
backend recomputes the forward pass with autograd before applying the gradients.  Parameter
gradients accumulate and the expert's own optimizer steps every ``update_period`` backward batches
(asynchronous training: each expert learns from whoever calls it, whenever they call).  Outputs and
gradients that are not finite never reach the parameters: such a batch fails, and a step that would
still leave a parameter non-finite is rolled back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .grid import parse_uid
from .layers import get_expert_kind
from .schema import TensorSchema, check_batch, check_finite, count_non_finite

logger = logging.getLogger(__name__)

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


class ExpertBackend:
    """``module`` hosted under ``uid``; its methods run on the runtime thread, one batch at a time."""

    def __init__(self, uid: str, module: nn.Module, args_schema: Sequence[TensorSchema],
                 outputs_schema: Sequence[TensorSchema] | None = None, optimizer: torch.optim.Optimizer | None = None,
                 max_batch_size: int = 4096, update_period: int = 1, max_grad_norm: float | None = None,
                 device: torch.device | str = "cpu") -> None:
        parse_uid(uid)
        if max_batch_size < 1 or update_period < 1:
            raise ValueError("max_batch_size and update_period must be at least 1")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm!r}")
        self.uid = uid
        self.device = torch.device(device)  # the module's; requests and answers travel on the CPU
        self.module = module.to(self.device)
        self.args_schema = tuple(args_schema)
        self.optimizer = optimizer
        self.max_batch_size = max_batch_size
        self.update_period = update_period
        self.max_grad_norm = max_grad_norm  # bounds what one step can do with finite garbage gradients
        self.backward_batches = 0
        self.optimizer_steps = 0
        self.skipped_steps = 0  # steps refused because they would have made parameters non-finite
        self.samples_forward = 0
        self.samples_backward = 0
        if outputs_schema is None:
            outputs_schema = self._probe_outputs()
        self.outputs_schema = tuple(outputs_schema)

    def _probe_outputs(self) -> list[TensorSchema]:
        """Output schemas from sample inputs; output dimensions that follow an open input size stay open."""
        with torch.no_grad():
            first = self._as_list(self.module(*(s.sample(2, 1).to(self.device) for s in self.args_schema)))
            if not any(None in s.shape for s in self.args_schema):
                return [TensorSchema.from_tensor(o.cpu()) for o in first]
            second = self._as_list(self.module(*(s.sample(2, 3).to(self.device) for s in self.args_schema)))
        return [TensorSchema(tuple(d if d == d2 else None for d, d2 in zip(a.shape[1:], b.shape[1:], strict=True)),
                             a.dtype) for a, b in zip(first, second, strict=True)]

    @classmethod
    def from_kind(cls, uid: str, kind: str, hidden_dim: int, optimizer: OptimizerFactory | None = None,
                  module_kwargs: dict | None = None, device: torch.device | str = "cpu",
                  **options: Any) -> ExpertBackend:
        """A backend for a registered expert kind (``ffn``, ``transformer``, ...): schemas come from its sample."""
        spec = get_expert_kind(kind)
        module = spec.cls(hidden_dim, **(module_kwargs or {})).to(device)  # before its optimizer sees it
        schema = []
        for t in spec.sample(2, hidden_dim):
            s = TensorSchema.from_tensor(t)
            schema.append(TensorSchema(tuple(None if i in spec.open_dims else d for i, d in enumerate(s.shape)),
                                       s.dtype))
        opt = optimizer(module.parameters()) if optimizer is not None else None
        return cls(uid, module, schema, optimizer=opt, device=device, **options)

    @staticmethod
    def _as_list(outputs: Any) -> list[torch.Tensor]:
        return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]

    # ---- checks (event loop) -------------------------------------------------------------------
    def check_inputs(self, inputs: Any) -> int:
        return check_batch(self.uid, "inputs", self.args_schema, inputs)

    def check_grad_outputs(self, grad_outputs: Any, rows: int) -> int:
        return check_batch(self.uid, "grad_outputs", self.outputs_schema, grad_outputs, rows)

    # ---- work (runtime thread) -----------------------------------------------------------------
    def forward(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            outputs = self._as_list(self.module(*self._here(inputs)))
        check_finite(self.uid, "computed output", outputs)  # finite inputs can still overflow
        self.samples_forward += inputs[0].shape[0]
        return [o.detach().cpu() for o in outputs]

    def _here(self, tensors: Sequence[torch.Tensor | None]) -> list[Any]:
        """Request tensors on the module's device (no copy on the CPU)."""
        return [t.to(self.device, non_blocking=True) if t is not None else None for t in tensors]

    def backward(self, inputs: list[torch.Tensor], grad_outputs: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Gradients of the inputs (None for non-float ones); accumulates parameter gradients and
        steps the optimizer every ``update_period`` calls.  A batch whose outputs or gradients are not
        finite raises NonFiniteValues and leaves the parameters and their gradients as they were."""
        params = [p for p in self.module.parameters() if p.requires_grad] if self.optimizer is not None else []
        inputs, grad_outputs = self._here(inputs), self._here(grad_outputs)
        with torch.enable_grad():
            args = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
            outputs = self._as_list(self.module(*args))
            pairs = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True) if o.requires_grad]
            wanted = [a for a in args if a.requires_grad]
            targets = wanted + params
            grads: list[torch.Tensor | None] = [None] * len(targets)
            if pairs and targets:
                grads = list(torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs],
                                                 allow_unused=True))
        input_grads, param_grads = grads[:len(wanted)], grads[len(wanted):]
        check_finite(self.uid, "computed output", outputs)
        check_finite(self.uid, "computed input gradient", input_grads)
        check_finite(self.uid, "computed parameter gradient", param_grads)
        for p, g in zip(params, param_grads, strict=True):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        it = iter(input_grads)
        result: list[torch.Tensor | None] = []
        for a in args:
            if not a.requires_grad:
                result.append(None)
                continue
            g = next(it)
            result.append(torch.zeros_like(a).cpu() if g is None else g.cpu())
        self.samples_backward += inputs[0].shape[0]
        self.backward_batches += 1
        if self.optimizer is not None and self.backward_batches % self.update_period == 0:
            self._step()
        return result

    def _step(self) -> None:
        """One optimizer step, skipped (and logged) where it would leave a parameter non-finite."""
        assert self.optimizer is not None
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        try:
            if any(p.grad is not None and count_non_finite(p.grad) for p in params):
                # each batch's gradients were finite, but their sum overflowed
                logger.warning("expert %s: accumulated gradients are not finite; optimizer step skipped", self.uid)
                self.skipped_steps += 1
                return
            if self.max_grad_norm is not None:
                nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], self.max_grad_norm)
            before = [p.detach().clone() for p in params]
            self.optimizer.step()
            if any(count_non_finite(p) for p in params):
                with torch.no_grad():
                    for p, old in zip(params, before, strict=True):
                        p.copy_(old)
                self.optimizer.state.clear()  # it took part in the bad step, so it cannot be trusted either
                logger.error("expert %s: an optimizer step made parameters non-finite; rolled back, optimizer "
                             "state reset", self.uid)
                self.skipped_steps += 1
                return
            self.optimizer_steps += 1
        finally:
            self.optimizer.zero_grad(set_to_none=True)

    # ---- description and state -----------------------------------------------------------------
    def info(self) -> dict:
        return {"uid": self.uid, "args_schema": [s.to_wire() for s in self.args_schema],
                "outputs_schema": [s.to_wire() for s in self.outputs_schema],
                "max_batch_size": self.max_batch_size}

    def state_dict(self) -> dict:
        return {"uid": self.uid, "module": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                "backward_batches": self.backward_batches, "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.backward_batches = int(state.get("backward_batches", 0))
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
