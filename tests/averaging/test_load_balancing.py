"""The DeDLOC linear program's closed-form optimum, against scipy's LP solver, and integer part sizes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog

from averaging import load_balanced_parts, optimal_shares, part_sizes

pytestmark = pytest.mark.timeout(60)


def solve_lp(b: np.ndarray) -> tuple[np.ndarray, float]:
    """DeDLOC's LP as a solver sees it (see averaging/load_balancing.py): the reference."""
    n = len(b)
    active = b > 0
    c = np.zeros(n + 1)  # variables: w_1..w_n, T; minimize T
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
    assert result.success, result.message
    return result.x[:n], float(result.x[-1])


def round_time(shares, bandwidths):
    n = len(bandwidths)
    return max((1 + (n - 2) * w) / b for w, b in zip(shares, bandwidths, strict=True) if b > 0)


def test_equal_bandwidths_give_equal_parts():
    assert load_balanced_parts(1000, [100.0] * 4) == [250, 250, 250, 250]


def test_client_mode_peers_reduce_nothing_and_sizes_add_up():
    bandwidths = [200.0, 100.0, 50.0, 0.0]
    sizes = load_balanced_parts(10_001, bandwidths)
    assert sizes[3] == 0 and sum(sizes) == 10_001
    # the slowest peer's own traffic fixes T here, so several splits are optimal: check optimality
    _, bound = optimal_shares(bandwidths)
    assert round_time(np.array(sizes) / 10_001, bandwidths) == pytest.approx(bound, rel=1e-3)


def test_lp_solution_is_optimal_against_a_grid_search():
    bandwidths = [200.0, 100.0, 50.0, 25.0]
    shares, bound = optimal_shares(bandwidths)
    assert shares.sum() == pytest.approx(1.0) and (shares >= 0).all()
    assert round_time(shares, bandwidths) == pytest.approx(bound, rel=1e-6)
    grid = np.linspace(0, 1, 41)
    best = min(round_time((a, b, c, 1 - a - b - c), bandwidths)
               for a, b, c in itertools.product(grid, grid, grid) if a + b + c <= 1 + 1e-12)
    assert bound <= best + 1e-9


def test_part_sizes_round_by_largest_remainder():
    assert part_sizes(10, np.array([1 / 3, 1 / 3, 1 / 3])) == [4, 3, 3]
    assert sum(part_sizes(7, np.array([0.5, 0.25, 0.25]))) == 7


def test_bad_bandwidths_are_refused():
    with pytest.raises(ValueError, match="at least one peer"):
        optimal_shares([0.0, 0.0])
    with pytest.raises(ValueError):
        optimal_shares([1.0, -1.0])


@pytest.mark.parametrize("bandwidths", [[100.0] * 4, [50.0, 50.0, 0.0], [80.0, 0.0, 80.0, 80.0, 0.0], [10.0, 10.0],
                                        [200.0, 100.0, 50.0, 25.0], [1000.0, 1.0, 1.0], [7.0, 0.0], [3.0]])
def test_the_closed_form_matches_the_lp(bandwidths):
    check_against_the_lp(bandwidths)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.just(0.0), st.floats(1e-3, 1e6)), min_size=1, max_size=12)  # what a member may declare
       .filter(lambda bandwidths: any(b > 0 for b in bandwidths)))
def test_fuzz_the_closed_form_matches_the_lp(bandwidths):
    check_against_the_lp(bandwidths)


def check_against_the_lp(bandwidths: list[float]) -> None:
    shares, bound = optimal_shares(bandwidths)
    if len(bandwidths) == 1:  # alone: nothing to send, and the whole vector is ours to "reduce"
        assert shares.tolist() == [1.0]
        return
    _, lp_bound = solve_lp(np.asarray(bandwidths))
    assert bound == pytest.approx(lp_bound, rel=1e-7)
    assert round_time(shares, bandwidths) == pytest.approx(bound, rel=1e-9)  # the shares reach it
    assert shares.sum() == pytest.approx(1.0) and (shares >= 0).all()
    assert all(shares[i] == 0 for i, b in enumerate(bandwidths) if b == 0)
