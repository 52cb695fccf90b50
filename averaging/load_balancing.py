"""DeDLOC load balancing: how much of the vector each peer reduces, from measured bandwidths.

Peer i reduces a share w_i of the P-element vector. With n peers, the time of the round is
bounded by each peer's traffic over its bandwidth b_i; DeDLOC's linear program is

    minimize T  subject to  T >= P * (1 + (n - 2) * w_i) / b_i   for peers with b_i > 0,
                            sum(w) = 1,  w >= 0,  w_i = 0 for peers with b_i = 0,

and the shares are rounded to integer part sizes that add up to P.

Its optimum has a closed form, so no LP solver runs (nor is imported: importing scipy's optimize
costs the leader CPU time and memory while its group waits).  With T per element, each of the
k peers with b_i > 0 sends and receives the whole vector whatever its share: T >= 1 / b_i.  A
share then fits under T up to its cap (T * b_i - 1) / (n - 2), and the caps must add up to 1:
T >= (n - 2 + k) / sum(b).  The optimum is the larger of the two bounds, with shares
proportional to the caps at that T (exactly the caps when the second bound decides; with two
peers the split does not matter, and shares follow the bandwidths).
"""

from __future__ import annotations

import numpy as np


def optimal_shares(bandwidths: list[float]) -> tuple[np.ndarray, float]:
    """Fractions w (sum 1) and the LP's bound on T per element (T / P) for the given bandwidths.

    Peers with bandwidth 0 (client mode: they cannot accept connections) get no share; auxiliary
    peers, which have bandwidth but no data, are ordinary entries here.
    """
    b = np.asarray(bandwidths, dtype=np.float64)
    if b.ndim != 1 or len(b) == 0:
        raise ValueError("need at least one bandwidth")
    if np.any(b < 0) or not np.all(np.isfinite(b)):
        raise ValueError(f"bandwidths must be finite and >= 0, got {bandwidths}")
    active = b > 0
    if not active.any():
        raise ValueError("at least one peer must accept connections (bandwidth > 0) to reduce a part")
    n, k, total = len(b), int(active.sum()), float(b[active].sum())
    bound = 1.0 / float(b[active].min())
    if n <= 2:
        return b / total, bound
    bound = max(bound, (n - 2 + k) / total)
    caps = np.where(active, np.clip(bound * b - 1.0, 0.0, None), 0.0)
    return caps / caps.sum(), bound


def part_sizes(total: int, shares: np.ndarray) -> list[int]:
    """Integer sizes proportional to ``shares`` that add up to ``total`` (largest remainder)."""
    shares = np.asarray(shares, dtype=np.float64)
    raw = shares / shares.sum() * total
    sizes = np.floor(raw).astype(np.int64)
    remainder = total - int(sizes.sum())
    order = np.argsort(-(raw - sizes), kind="stable")
    for i in order[:remainder]:
        sizes[i] += 1
    return [int(s) for s in sizes]


def load_balanced_parts(total: int, bandwidths: list[float]) -> list[int]:
    shares, _ = optimal_shares(bandwidths)
    return part_sizes(total, shares)
