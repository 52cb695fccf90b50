"""DeDLOC load balancing: how much of the vector each peer reduces, from measured bandwidths.

Peer i reduces a share w_i of the P-element vector. With n peers, the time of the round is
bounded by each peer's traffic over its bandwidth b_i; DeDLOC's linear program is

    minimize T  subject to  T >= P * (1 + (n - 2) * w_i) / b_i   for peers with b_i > 0,
                            sum(w) = 1,  w >= 0,  w_i = 0 for peers with b_i = 0,

and the shares are rounded to integer part sizes that add up to P.
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
    n = len(b)
    if n == 1:
        return np.ones(1), 1.0 / b[0]
    if np.all(b[active] == b[active][0]):
        # the common case has a closed-form optimum (equal shares among the peers that accept
        # connections), which spares the leader scipy's import: 0.2 s and ~40 MB per process
        w = active / active.sum()
        return w, float((1 + (n - 2) * w[active][0]) / b[active][0])
    return solve_lp(b)


def solve_lp(b: np.ndarray) -> tuple[np.ndarray, float]:
    """The LP itself, for bandwidths ``b`` already checked by ``optimal_shares``."""
    from scipy.optimize import linprog  # imported here: see optimal_shares

    n = len(b)
    active = b > 0
    # variables: w_1..w_n, T ; minimize T
    c = np.zeros(n + 1)
    c[-1] = 1.0
    rows, rhs = [], []
    for i in np.flatnonzero(active):
        row = np.zeros(n + 1)
        row[i] = (n - 2) / b[i]
        row[-1] = -1.0
        rows.append(row)
        rhs.append(-1.0 / b[i])
    a_eq = np.concatenate([np.ones(n), [0.0]])[None, :]
    bounds = [(0, None) if active[i] else (0, 0) for i in range(n)] + [(0, None)]
    result = linprog(c, A_ub=np.array(rows), b_ub=np.array(rhs), A_eq=a_eq, b_eq=[1.0], bounds=bounds,
                     method="highs")
    if not result.success:  # cannot happen for valid input; fall back to proportional shares
        w = b / b.sum()
        return w, float(np.max((1 + (n - 2) * w[active]) / b[active]))
    w = np.clip(result.x[:n], 0, None)
    return w / w.sum(), float(result.x[-1])


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
