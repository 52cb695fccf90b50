"""What an expert accepts and returns: per-row shape (the batch dimension excluded) and dtype.

Servers check every request against the schema before it is queued, so a wrong shape or dtype is
refused with an error that names the expert and what it expects, instead of failing a whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import ExpertSchemaError, NonFiniteValues

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class TensorSchema:
    """One argument or output of an expert: ``shape`` is per row (``None`` = any size), plus dtype."""

    shape: tuple[int | None, ...]
    dtype: torch.dtype = torch.float32

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> TensorSchema:
        """The schema of a batched sample tensor (its first dimension is the batch)."""
        return cls(tuple(t.shape[1:]), t.dtype)

    def matches(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor) or t.dtype != self.dtype or t.dim() != len(self.shape) + 1:
            return False
        return all(want is None or want == got for want, got in zip(self.shape, t.shape[1:], strict=True))

    def describe(self) -> str:
        dims = ", ".join("*" if d is None else str(d) for d in self.shape)
        return f"{dtype_name(self.dtype)}[batch{', ' if dims else ''}{dims}]"

    def sample(self, rows: int, open_size: int = 1) -> torch.Tensor:
        """A zero tensor of ``rows`` rows (dimensions left open get ``open_size``)."""
        return torch.zeros((rows, *(open_size if d is None else d for d in self.shape)), dtype=self.dtype)

    def to_wire(self) -> list:
        return [list(self.shape), dtype_name(self.dtype)]

    @classmethod
    def from_wire(cls, raw: Any) -> TensorSchema:
        if not (isinstance(raw, list) and len(raw) == 2 and isinstance(raw[0], list) and isinstance(raw[1], str)):
            raise ValueError(f"bad tensor schema {raw!r}")
        return cls(tuple(None if d is None else int(d) for d in raw[0]), dtype_from_name(raw[1]))


def describe(schema: Sequence[TensorSchema]) -> str:
    return "(" + ", ".join(s.describe() for s in schema) + ")"


def describe_tensors(tensors: Sequence[Any]) -> str:
    def one(t: Any) -> str:
        if not isinstance(t, torch.Tensor):
            return type(t).__name__
        return f"{dtype_name(t.dtype)}[{', '.join(map(str, t.shape))}]"
    return "(" + ", ".join(one(t) for t in tensors) + ")"


def check_batch(uid: str, what: str, schema: Sequence[TensorSchema], tensors: Any, rows: int | None = None) -> int:
    """The number of rows of ``tensors`` if they match ``schema`` (and ``rows``, if given); else
    ExpertSchemaError naming the expert and the expected schema."""
    ok = isinstance(tensors, (list, tuple)) and len(tensors) == len(schema) \
        and all(s.matches(t) for s, t in zip(schema, tensors, strict=False))
    if ok:
        batch = {t.shape[0] for t in tensors}
        ok = len(batch) == 1 and (rows is None or rows in batch)
    if not ok:
        got = describe_tensors(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
        same_rows = "" if rows is None else f" with {rows} rows"
        raise ExpertSchemaError(f"expert {uid!r} expects {what} {describe(schema)}{same_rows}, "
                                f"all with the same batch size; got {got}")
    return int(tensors[0].shape[0]) if tensors else 0


_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


def count_non_finite(t: torch.Tensor) -> int:
    """NaN and infinite entries of a float tensor (0 for other dtypes, which cannot hold them)."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return 0
    if t.device.type == "cpu" and t.dtype in _NUMPY_FLOATS:  # fast path: numpy's check is 5-20x torch's here
        if np.isfinite(t.detach().resolve_neg().numpy()).all():
            return 0
    elif t.is_floating_point():  # one pass: min and max propagate NaN and show infinities
        low, high = torch.aminmax(t.detach())
        if bool(torch.isfinite(low)) and bool(torch.isfinite(high)):
            return 0
    return int(t.numel() - int(torch.isfinite(t).sum()))


def check_finite(uid: str, what: str, tensors: Sequence[torch.Tensor | None]) -> None:
    """NonFiniteValues naming the first tensor of ``tensors`` that holds NaN or infinity, e.g.
    ``input 0 of ffn.3.7 has 12 non-finite values``: one such value poisons a whole batch and,
    through the optimizer, every parameter."""
    for i, t in enumerate(tensors):
        bad = 0 if t is None else count_non_finite(t)
        if bad:
            raise NonFiniteValues(f"{what} {i} of {uid} has {bad} non-finite values (NaN or infinity)")


def shape_signature(tensors: Sequence[torch.Tensor]) -> tuple:
    """Per-row shapes: requests batch together only when these agree (schemas may leave sizes open)."""
    return tuple(tuple(t.shape[1:]) for t in tensors)
