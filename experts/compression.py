"""Optional lossy compression of the float tensors an expert call sends: fp16 or bf16 on the wire.

Tensors still travel as raw p2p frames; compression only halves the bytes of float32/float64 ones.
The receiver casts them back (the server to the schema's dtype, the client to the dtypes the server
names in its reply), so callers see the dtypes they sent.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

CODECS: dict[str, torch.dtype | None] = {"none": None, "float16": torch.float16, "bfloat16": torch.bfloat16}


def codec_dtype(codec: str | None) -> torch.dtype | None:
    if codec is None:
        return None
    try:
        return CODECS[codec]
    except (KeyError, TypeError):
        raise ValueError(f"unknown compression {codec!r}; one of {sorted(CODECS)}") from None


def compress(tensors: Sequence[torch.Tensor | None], codec: str | None) -> list[torch.Tensor | None]:
    wire = codec_dtype(codec)
    if wire is None:
        return list(tensors)
    return [t.to(wire) if t is not None and t.dtype in (torch.float32, torch.float64) else t for t in tensors]


def restore(tensors: Sequence[torch.Tensor | None], dtypes: Sequence[torch.dtype | None]) -> list[torch.Tensor | None]:
    """Cast compressed floats back to ``dtypes`` (entries that are None or already right stay as they are)."""
    out = []
    for t, dtype in zip(tensors, dtypes, strict=False):
        if isinstance(t, torch.Tensor) and dtype is not None and t.dtype != dtype and t.is_floating_point() \
                and dtype.is_floating_point:
            t = t.to(dtype)
        out.append(t)
    return out + list(tensors[len(out):])
