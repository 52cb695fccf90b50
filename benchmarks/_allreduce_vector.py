"""The vector an all-reduce peer of ``bench_allreduce.py`` averages, and how it reports it: ours and
the reference library's peers (two virtualenvs) fill and describe it alike, so the parent can check
the mean from sampled elements, the float64 sum and a CRC of the bytes."""

from __future__ import annotations

import zlib

import numpy as np
import torch


def sample_indices(size: int, count: int = 256) -> np.ndarray:
    """The same indices in every peer and in the parent: random ones plus both ends."""
    rng = np.random.default_rng(12345)
    return np.unique(np.concatenate([rng.integers(0, size, count), [0, size - 1]]))


def fill(tensor: torch.Tensor, seed: int) -> None:
    tensor.normal_(generator=torch.Generator().manual_seed(seed))


def describe(tensor: torch.Tensor, idx: np.ndarray) -> dict:
    arr = tensor.numpy()
    return {"samples": arr[idx].astype(np.float64).tolist(), "sum": float(arr.sum(dtype=np.float64)),
            "crc": zlib.crc32(memoryview(arr).cast("B"))}
