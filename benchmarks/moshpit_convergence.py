"""Network-free simulation of decentralized averaging: Moshpit All-Reduce against the baselines.

Reproduces the convergence experiment of the Moshpit SGD paper (Ryabinin et al., 2021, Fig. 3 left):
N = 1024 peers each hold one random float64 scalar (standard normal); the goal is that every peer
ends up holding the mean of the *initial* values.  The metric is, after every round, the mean over
all N peers of the squared error ``(estimate_i - mean(x0))**2``; the figure reported is the number
of rounds after which that MSE first drops below 1e-9, averaged over seeds.  A configuration where
some seed does not get there within ``--max-rounds`` is reported as ``> cap``.

Failure model (identical for every algorithm): in every round each peer independently fails with
probability p, i.e. it does not take part in that round at all.  A failed peer sends nothing,
receives nothing, keeps its current value (and, for Moshpit, its grid key; for PushSum, its (s, w)
pair) unchanged, and takes part again in the next round unless it fails again.  Nobody is removed
for good.  The failure draws are common random numbers: for a given seed every algorithm sees the
same failure pattern (and the same initial values), and the pattern at a larger p contains the one
at a smaller p (peer i fails in round t iff ``U[t, i] < p`` with one shared uniform matrix U).

Algorithms (one function each, ``simulate_<name>``):

moshpit
    Peers sit on a d = 2, M = 32 grid (32 x 32 = 1024); the keys start as a random permutation of
    the grid cells.  Round t uses dimension j = t mod d: peers whose keys agree on every coordinate
    except j form a group; the live members of a group replace their values by the exact mean of
    their values, and then set coordinate j to their index within the group of live members, in a
    random order (Algorithm 1 of the paper: ``C_i <- (C_i[1:], index_in_group)``, written here with
    a rotating dimension instead of a shift).  Failed peers keep their old coordinate j, so with
    failures groups can become larger or smaller than M.  Without failures this is exact after d
    rounds.
allreduce_restarts
    Every round is one all-reduce over all N peers.  If any peer fails in a round the whole round
    is wasted and every value stays as it was, so it only succeeds in a round with zero failures.
gossip
    Peers sit on a ring.  Every round each live peer i averages with its live ring neighbours using
    symmetric (Metropolis-style) weights: for each ring edge (i, i+1) whose two ends are both live,
    each end moves 1/3 of the difference towards the other, i.e. x_i += sum_j (x_j - x_i) / 3 over
    live neighbours j.  With no failures that is x_i <- (x_{i-1} + x_i + x_{i+1}) / 3.  The mixing
    matrix is symmetric and doubly stochastic in every round, so the mean is preserved exactly.
pushsum
    Every peer keeps (s, w), initially (x0_i, 1); its estimate is s / w.  Every round each live peer
    keeps half of (s, w) and sends the other half to one live peer chosen uniformly at random among
    the other live peers.  The sums of s and of w are preserved exactly.
random_groups
    Every round all N peers are shuffled into N / 32 random groups of 32; the live members of each
    group replace their values by the exact mean of their values.

Everything is vectorized with numpy over the 1024 peers; all randomness comes from numpy Generators
seeded from ``numpy.random.SeedSequence(seed)``, so a run is deterministic.

    python benchmarks/moshpit_convergence.py [--quick] [--seeds N] [--max-rounds R] [--plot PATH]

Prints a table (algorithm x p -> mean rounds to MSE < 1e-9), writes a PNG of MSE vs round, and
prints as its last line one JSON object with keys ``rounds_<algo>_p<p>``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

GRID_DIM = 2
GRID_SIZE = 32
N_PEERS = GRID_SIZE**GRID_DIM
GROUP_SIZE = 32
TOLERANCE = 1e-9
FAILURE_PROBS: tuple[float, ...] = (0.0, 0.001, 0.005, 0.01)
DEFAULT_PLOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "moshpit_convergence.png")

# alive: (rounds, N) bool, True where the peer takes part in that round
Simulator = Callable[[np.ndarray, np.ndarray, np.random.Generator], np.ndarray]


def mse(estimates: np.ndarray, target: float) -> float:
    """Mean over peers of the squared error against the true mean."""
    return float(np.mean((estimates - target) ** 2))


def average_live_groups(values: np.ndarray, groups: np.ndarray, live: np.ndarray) -> np.ndarray:
    """Return a copy of ``values`` where each live peer holds the mean over the live peers of its group."""
    out = values.copy()
    g = groups[live]
    if g.size == 0:
        return out
    n_groups = int(g.max()) + 1
    sums = np.bincount(g, weights=values[live], minlength=n_groups)
    counts = np.bincount(g, minlength=n_groups)
    out[live] = sums[g] / counts[g]
    return out


def random_rank_within_groups(groups: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """For each element, its position 0..size-1 within its group, in a uniformly random order."""
    order = np.lexsort((rng.random(groups.size), groups))
    sorted_groups = groups[order]
    starts = np.flatnonzero(np.r_[True, sorted_groups[1:] != sorted_groups[:-1]])
    first_of_group = np.repeat(starts, np.diff(np.r_[starts, groups.size]))
    ranks = np.empty(groups.size, dtype=np.int64)
    ranks[order] = np.arange(groups.size) - first_of_group
    return ranks


def mse_curve(x0: np.ndarray, alive: np.ndarray,
              step: Callable[[int, np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
    """MSE against the true mean after rounds 0..R, where round t's estimates are ``step(t, x, live)``."""
    target = float(x0.mean())
    x = x0.copy()
    out = [mse(x, target)]
    for t, live in enumerate(alive):
        x = step(t, x, live)
        out.append(mse(x, target))
    return np.asarray(out)


def simulate_moshpit(
    x0: np.ndarray,
    alive: np.ndarray,
    rng: np.random.Generator,
    grid_dim: int = GRID_DIM,
    grid_size: int = GRID_SIZE,
) -> np.ndarray:
    """Moshpit All-Reduce on a ``grid_size ** grid_dim`` grid; returns MSE after rounds 0..R."""
    n = x0.size
    if grid_size**grid_dim != n:
        raise ValueError(f"grid {grid_size}^{grid_dim} does not hold {n} peers")
    cells = rng.permutation(n)
    keys = np.stack(np.unravel_index(cells, (grid_size,) * grid_dim), axis=1).astype(np.int64)

    def step(t: int, x: np.ndarray, live: np.ndarray) -> np.ndarray:
        j = t % grid_dim
        others = np.delete(keys, j, axis=1)
        _, groups = np.unique(others, axis=0, return_inverse=True)
        groups = groups.reshape(-1)
        x = average_live_groups(x, groups, live)
        keys[live, j] = random_rank_within_groups(groups[live], rng)
        return x

    return mse_curve(x0, alive, step)


def simulate_allreduce_restarts(x0: np.ndarray, alive: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Global all-reduce that only succeeds in a round where no peer fails."""
    return mse_curve(x0, alive, lambda _t, x, live: np.full_like(x, x.mean()) if live.all() else x)


def simulate_gossip(x0: np.ndarray, alive: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Ring gossip with symmetric 1/3 weights on edges whose two ends are live."""
    def step(_t: int, x: np.ndarray, live: np.ndarray) -> np.ndarray:
        right_edge = live & np.roll(live, -1)  # edge (i, i+1) usable
        flow = np.where(right_edge, (np.roll(x, -1) - x) / 3.0, 0.0)  # what i gains over edge (i, i+1)
        return x + flow - np.roll(flow, 1)

    return mse_curve(x0, alive, step)


def simulate_pushsum(x0: np.ndarray, alive: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """PushSum: each live peer keeps half of (s, w) and pushes half to a random other live peer."""
    n = x0.size
    s = x0.copy()
    w = np.ones(n)

    def step(_t: int, _x: np.ndarray, live: np.ndarray) -> np.ndarray:
        senders = np.flatnonzero(live)
        if senders.size >= 2:
            pick = rng.integers(0, senders.size - 1, size=senders.size)
            pick += pick >= np.arange(senders.size)  # skip oneself
            receivers = senders[pick]
            s_half = s[senders] / 2.0
            w_half = w[senders] / 2.0
            s[senders] = s_half
            w[senders] = w_half
            s[:] += np.bincount(receivers, weights=s_half, minlength=n)
            w[:] += np.bincount(receivers, weights=w_half, minlength=n)
        return s / w

    return mse_curve(x0, alive, step)


def simulate_random_groups(
    x0: np.ndarray, alive: np.ndarray, rng: np.random.Generator, group_size: int = GROUP_SIZE
) -> np.ndarray:
    """Each round: shuffle all peers into groups of ``group_size``; live members of a group average."""
    n = x0.size

    def step(_t: int, x: np.ndarray, live: np.ndarray) -> np.ndarray:
        groups = np.empty(n, dtype=np.int64)
        groups[rng.permutation(n)] = np.arange(n) // group_size
        return average_live_groups(x, groups, live)

    return mse_curve(x0, alive, step)


ALGORITHMS: dict[str, Simulator] = {
    "moshpit": simulate_moshpit,
    "allreduce_restarts": simulate_allreduce_restarts,
    "gossip": simulate_gossip,
    "pushsum": simulate_pushsum,
    "random_groups": simulate_random_groups,
}


def rounds_to_reach(curve: np.ndarray, tol: float = TOLERANCE) -> int | None:
    """First round index r (curve[r] is the MSE after r rounds) with MSE < tol, or None."""
    hits = np.flatnonzero(curve < tol)
    return int(hits[0]) if hits.size else None


@dataclass
class Cell:
    """Results of one (algorithm, p) pair over all seeds."""

    rounds: list[int | None]
    curves: np.ndarray  # (seeds, max_rounds + 1)

    @property
    def all_reached(self) -> bool:
        return all(r is not None for r in self.rounds)

    @property
    def n_reached(self) -> int:
        return sum(r is not None for r in self.rounds)

    def mean_rounds(self) -> float | None:
        return float(np.mean(self.rounds)) if self.all_reached else None


def run_experiment(
    seeds: int, max_rounds: int, probs: tuple[float, ...] = FAILURE_PROBS, tol: float = TOLERANCE
) -> dict[tuple[str, float], Cell]:
    """Simulate every (algorithm, p) over ``seeds`` seeds with common initial values and failures."""
    raw: dict[tuple[str, float], tuple[list[int | None], list[np.ndarray]]] = {
        (a, p): ([], []) for a in ALGORITHMS for p in probs
    }
    for seed in range(seeds):
        children = np.random.SeedSequence(seed).spawn(2 + len(ALGORITHMS))
        x0 = np.random.default_rng(children[0]).standard_normal(N_PEERS)
        uniforms = np.random.default_rng(children[1]).random((max_rounds, N_PEERS))
        for p in probs:
            alive = uniforms >= p
            for k, (name, simulate) in enumerate(ALGORITHMS.items()):
                curve = simulate(x0, alive, np.random.default_rng(children[2 + k]))
                raw[(name, p)][0].append(rounds_to_reach(curve, tol))
                raw[(name, p)][1].append(curve)
    return {key: Cell(rounds, np.stack(curves)) for key, (rounds, curves) in raw.items()}


def p_label(p: float) -> str:
    return f"{p:g}"


def format_cell(cell: Cell, max_rounds: int) -> str:
    if cell.all_reached:
        lo, hi = min(cell.rounds), max(cell.rounds)  # type: ignore[type-var]
        spread = f"{lo}" if lo == hi else f"{lo}-{hi}"
        return f"{cell.mean_rounds():.1f} ({spread})"
    return f"> {max_rounds} ({cell.n_reached}/{len(cell.rounds)})"


def format_table(results: dict[tuple[str, float], Cell], probs: tuple[float, ...], max_rounds: int) -> str:
    header = ["algorithm"] + [f"p={p_label(p)}" for p in probs]
    rows = [[name] + [format_cell(results[(name, p)], max_rounds) for p in probs] for name in ALGORITHMS]
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def median_curve(curves: np.ndarray, floor: float = 1e-32) -> np.ndarray:
    """Per-round median over seeds, floored so exact zeros show on a log axis."""
    return np.maximum(np.median(curves, axis=0), floor)


def save_plot(
    results: dict[tuple[str, float], Cell], probs: tuple[float, ...], path: str, seeds: int, tol: float = TOLERANCE
) -> None:
    """One subplot per p: median MSE over seeds vs round, log y, symlog x (linear up to round 10)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = 2
    nrows = (len(probs) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(12, 4.5 * nrows), squeeze=False, sharey=True)
    for ax, p in zip(axes.flat, probs, strict=False):
        for name in ALGORITHMS:
            curve = median_curve(results[(name, p)].curves)
            ax.plot(np.arange(curve.size), curve, label=name, lw=1.6, marker="." if curve.size <= 60 else None)
        ax.axhline(tol, color="grey", ls="--", lw=1)
        ax.set_yscale("log")
        ax.set_xscale("symlog", linthresh=10)
        ax.set_xlim(0, curve.size - 1)
        ax.set_xticks([t for t in (0, 1, 2, 3, 4, 5, 6, 8, 10, 20, 50, 100, 200, 500) if t < curve.size])
        ax.set_xticklabels([str(t) for t in ax.get_xticks().astype(int)])
        ax.set_ylim(1e-33, 10)
        ax.set_title(f"p = {p_label(p)} per-round failure probability")
        ax.set_xlabel("round (linear up to 10, log beyond)")
        ax.set_ylabel("MSE vs mean of initial values")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
    for ax in list(axes.flat)[len(probs) :]:
        ax.set_visible(False)
    fig.suptitle(
        f"Decentralized averaging, N = {N_PEERS} peers: median MSE over {seeds} seeds "
        f"(floored at 1e-32; dashed: {tol:g})"
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figures_json(
    results: dict[tuple[str, float], Cell], probs: tuple[float, ...], seeds: int, max_rounds: int, wall_s: float
) -> dict[str, object]:
    """``rounds_<algo>_p<p>``: mean rounds over seeds, or the string "> cap" when some seed missed."""
    figures: dict[str, object] = {}
    for name in ALGORITHMS:
        for p in probs:
            cell = results[(name, p)]
            mean = cell.mean_rounds()
            figures[f"rounds_{name}_p{p_label(p)}"] = round(mean, 2) if mean is not None else f"> {max_rounds}"
    for name in ALGORITHMS:
        for p in probs:
            figures[f"seeds_reached_{name}_p{p_label(p)}"] = results[(name, p)].n_reached
    figures.update(
        n_peers=N_PEERS,
        grid=f"{GRID_SIZE}^{GRID_DIM}",
        tol=TOLERANCE,
        seeds=seeds,
        max_rounds=max_rounds,
        wall_s=round(wall_s, 2),
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 seeds, 100-round cap (under 60 s)")
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds (default 10, --quick 3)")
    parser.add_argument("--max-rounds", type=int, default=None, help="round cap (default 200, --quick 100)")
    parser.add_argument("--plot", default=DEFAULT_PLOT, help="PNG path for MSE vs round")
    args = parser.parse_args()
    seeds = args.seeds if args.seeds is not None else (3 if args.quick else 10)
    max_rounds = args.max_rounds if args.max_rounds is not None else (100 if args.quick else 200)
    if seeds < 1 or max_rounds < 1:
        parser.error("--seeds and --max-rounds must be positive")

    start = time.perf_counter()
    results = run_experiment(seeds, max_rounds)
    wall_s = time.perf_counter() - start
    save_plot(results, FAILURE_PROBS, args.plot, seeds)

    print(f"rounds to MSE < {TOLERANCE:g}, N = {N_PEERS}, mean over {seeds} seeds (min-max), cap {max_rounds}")
    print("'> cap (k/n)': k of n seeds got there within the cap")
    print(format_table(results, FAILURE_PROBS, max_rounds))
    print(f"simulation {wall_s:.1f} s; plot: {args.plot}")
    print(json.dumps(figures_json(results, FAILURE_PROBS, seeds, max_rounds, wall_s)))


if __name__ == "__main__":
    main()
