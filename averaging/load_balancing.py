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


CLAIM_FACTOR = 4.0


def claims_within_reason(bandwidths: list[float], factor: float = CLAIM_FACTOR) -> list[float]:
    """Declared bandwidths with each capped at ``factor`` x the median of the positive ones.

    A declaration is a peer's own word, and the LP hands the largest parts to the largest claims: a
    member declaring 1 Tbit/s among 100 Mbit/s peers would reduce the whole vector, and so decide
    every value of the average.  Capped, a claim buys at most a few times an honest peer's share
    (with n peers, a part of at most about ``factor`` / (n - 1 + ``factor``) of the vector); honest
    links that really differ by more than ``factor`` split a little less well than the LP would like.
    """
    positive = sorted(b for b in bandwidths if b > 0)
    if not positive:
        return list(bandwidths)
    mid = len(positive) // 2
    median = positive[mid] if len(positive) % 2 else (positive[mid - 1] + positive[mid]) / 2
    return [min(b, factor * median) for b in bandwidths]


SHARE_FACTOR = 2.0


def bounded_shares(shares: np.ndarray, active: np.ndarray, factor: float = SHARE_FACTOR) -> np.ndarray:
    """``shares`` with none above ``factor`` / k of the vector (k: the ``active`` peers, which accept
    connections), the excess
    spread over the others in proportion to their shares (or equally, where they have none).

    The LP gives the whole vector to the fastest peer once the others are saturated just sending
    and receiving it; a peer that reduces everything decides every value of the average.
    """
    shares = np.asarray(shares, dtype=np.float64).copy()
    active = np.asarray(active, dtype=bool)
    k = int(active.sum())
    cap = min(1.0, factor / max(k, 1))
    for _ in range(k):
        over = shares > cap
        if not over.any():
            break
        excess = float((shares[over] - cap).sum())
        shares[over] = cap
        room = active & (shares < cap)
        base = np.where(room, shares, 0.0)
        shares += excess * (base / base.sum() if base.sum() > 0 else room / room.sum())
    return shares / shares.sum()


def load_balanced_parts(total: int, bandwidths: list[float], bounded: bool = False) -> list[int]:
    """Part sizes by the LP; ``bounded``: declared (untrusted) bandwidths, each claim capped relative
    to the group's (``claims_within_reason``) and no part over ``SHARE_FACTOR`` / k of the vector."""
    if bounded:
        shares, _ = optimal_shares(claims_within_reason(bandwidths))
        return part_sizes(total, bounded_shares(shares, np.asarray(bandwidths) > 0))
    shares, _ = optimal_shares(bandwidths)
    return part_sizes(total, shares)
