"""Find each input's k best live experts by searching the DHT's grid prefixes one dimension at a time.

An expert's score is the sum of its coordinates' scores.  Every input row keeps a frontier of
prefixes ranked by an upper bound (score so far plus the best possible score of the remaining
dimensions); each round the ``beam_size`` best unexpanded prefixes of every row go one dimension
deeper, and all rows share one ``get_many`` per round for the prefix records they need.  A full uid
at the top of a row's frontier beats every bound left, so it is final: the answer is the exact
top-k among declared experts (dead subtrees only cost extra rounds).  With scores that do not
mislead, it takes one round per grid dimension.  With ``trusted_servers``, a full uid whose declared
server the policy does not trust is left out, as if it were not declared.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dht import DHTNode

from .declare import children
from .grid import make_uid, prefix_key
from .trust import TrustPolicy, is_trusted


@dataclass(frozen=True)
class FoundExpert:
    uid: str
    address: str
    coords: tuple[int, ...]
    score: float


@dataclass
class _Row:
    """One input row's search: a frontier heap of (-bound, tiebreak, coords, address or None for a prefix)."""

    scores: list[np.ndarray]
    rest: list[float]  # rest[d] = best possible sum of scores over dimensions d, d+1, ...
    heap: list[tuple[float, int, tuple[int, ...], str | None]] = field(default_factory=list)
    found: list[tuple[float, tuple[int, ...], str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.heap.append((-self.rest[0], 0, (), None))


async def find_best_experts(node: DHTNode, prefix: str, grid_scores: Sequence[np.ndarray], k: int,
                            beam_size: int | None = None, max_rounds: int = 64,
                            trusted_servers: TrustPolicy | None = None) -> list[list[FoundExpert]]:
    """For each row of ``grid_scores[d]`` (shape ``[rows, grid_size[d]]``), up to ``k`` live experts,
    best first.  Rows with fewer than ``k`` declared (and trusted) experts get all they have."""
    if k < 1:
        raise ValueError("k must be at least 1")
    dims = [np.asarray(s, dtype=np.float64) for s in grid_scores]
    if not dims or any(s.ndim != 2 or s.shape[0] != dims[0].shape[0] for s in dims):
        raise ValueError("grid_scores must be one [rows, grid_size[d]] array per dimension, same rows")
    sizes = [s.shape[1] for s in dims]
    depth = len(dims)
    beam = beam_size or k
    rows = []
    for r in range(dims[0].shape[0]):
        best = [float(s[r].max()) for s in dims]
        rest = [sum(best[d:]) for d in range(depth)] + [0.0]
        rows.append(_Row([s[r] for s in dims], rest))
    cache: dict[tuple[int, ...], dict[int, str]] = {}
    counter = itertools.count(1)

    for _ in range(max_rounds):
        wanted: dict[int, list[tuple[int, ...]]] = {}
        for i, row in enumerate(rows):
            expand = _settle(row, k, beam)
            if expand:
                wanted[i] = expand
        if not wanted:
            break
        missing = sorted({c for expand in wanted.values() for c in expand if c not in cache})
        if missing:
            keys = [prefix_key(prefix, c) for c in missing]
            found = await node.get_many(keys)
            for c, key in zip(missing, keys, strict=True):
                item = found.get(key)
                cache[c] = children(item.value if item is not None else None, sizes[len(c)])
                if len(c) + 1 == depth:  # these children are full uids: keep the trusted ones
                    cache[c] = {i: a for i, a in cache[c].items()
                                if is_trusted(trusted_servers, make_uid(prefix, (*c, i)), a)}
        for i, expand in wanted.items():
            row = rows[i]
            for coords in expand:
                d = len(coords)
                partial = sum(float(row.scores[j][coords[j]]) for j in range(d))
                for c, address in cache[coords].items():
                    child = (*coords, c)
                    score = partial + float(row.scores[d][c])
                    if d + 1 == depth:
                        heapq.heappush(row.heap, (-score, next(counter), child, address))
                    else:
                        heapq.heappush(row.heap, (-(score + row.rest[d + 1]), next(counter), child, None))
    else:
        for row in rows:  # out of rounds: settle what is final
            _settle(row, k, 0)
    return [[FoundExpert(make_uid(prefix, c), a, c, s) for s, c, a in row.found] for row in rows]


def _settle(row: _Row, k: int, beam: int) -> list[tuple[int, ...]]:
    """Move final uids from the top of the frontier to ``found``; pop up to ``beam`` prefixes to expand."""
    expand: list[tuple[int, ...]] = []
    held = []
    while row.heap and len(row.found) < k and len(expand) < beam:
        item = heapq.heappop(row.heap)
        neg, _, coords, address = item
        if address is None:
            expand.append(coords)
        elif expand:
            held.append(item)  # a prefix above it is being expanded: it is not final yet
        else:
            row.found.append((-neg, coords, address))
    if beam == 0:
        while row.heap and len(row.found) < k and row.heap[0][3] is not None:
            neg, _, coords, address = heapq.heappop(row.heap)
            row.found.append((-neg, coords, address))
    for item in held:
        heapq.heappush(row.heap, item)
    return expand  # non-empty only while found < k: found grows only before the first prefix is popped
