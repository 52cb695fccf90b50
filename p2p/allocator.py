"""Keep the C allocator from returning message-sized buffers to the kernel after every message.

Every received tensor is a fresh buffer of up to a few MiB.  glibc serves buffers that large
with ``mmap`` at first, and gives freed memory at the top of its heap back to the kernel past a
small threshold, so each message then costs page faults that zero fresh pages: about a tenth of a
4 x 10M all-reduce's CPU on loopback.  Raising both thresholds keeps freed buffers in the process
for the next message; buffers over 64 MiB (a model's own tensors) are still mapped and unmapped
on their own.  A peer's memory then stays at its peak instead of shrinking between rounds.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 64 << 20
TRIM_THRESHOLD = 512 << 20
_applied: bool | None = None


def keep_freed_buffers() -> bool:
    """Apply the thresholds once per process; False where the C library is not glibc."""
    global _applied
    if _applied is None:
        _applied = _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and _mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        logger.debug("allocator thresholds %s", "raised" if _applied else "left as they are (not glibc)")
    return _applied


def _mallopt(param: int, value: int) -> bool:
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own symbols: libc's where it is glibc
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(param, value) == 1
