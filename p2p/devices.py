"""Where a peer's tensors live: ``auto`` is the GPU when torch sees one, else the CPU.

Below every layer that holds tensors (workers, expert servers, averaging), so each picks its device
the same way and says the same thing when a GPU was asked for and none is there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

DeviceName = Literal["auto", "cpu", "cuda"]


def pick_device(name: str) -> torch.device:
    """The device for ``auto``, ``cpu`` or ``cuda``; ValueError for ``cuda`` on a machine without one."""
    import torch  # here, not at the top: configs name a device without paying for torch's import

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ValueError(f"device cuda: torch ({torch.__version__}, {build}) sees no CUDA device here; "
                         "use auto or cpu")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def host_buffer(numel: int, for_device: torch.device | None = None) -> torch.Tensor:
    """A float32 CPU buffer; page-locked when it stages a GPU's tensors (their copies then skip a
    bounce buffer and can overlap)."""
    import torch

    pin = for_device is not None and for_device.type == "cuda" and torch.cuda.is_available()
    return torch.empty(numel, dtype=torch.float32, pin_memory=pin)
