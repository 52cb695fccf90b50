"""Process-tree helpers shared by the benchmarks (Linux /proc; no third-party imports, so the
hivemind benchmark environment can use them too)."""

from __future__ import annotations

import os
import subprocess


def descendants(pid: int) -> list[int]:
    """Every process started (transitively) by ``pid`` that is still alive."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(x) for x in f.read().split()]
                out.extend(kids)
                todo.extend(kids)
        except (OSError, ValueError):
            pass
    return out


def close_pipes(proc: subprocess.Popen) -> None:
    """Close our ends of a child's stdin/stdout (no ResourceWarning for a child we stopped)."""
    for stream in (proc.stdin, proc.stdout):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass
