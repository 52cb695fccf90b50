"""Find each input's k best live experts by searching the DHT's grid prefixes one dimension at a time.

An expert's score is the sum of its coordinates' scores.  Every input row keeps a frontier of
prefixes ranked by an upper bound (score so far plus the best possible score of the remaining
dimensions); each round the ``beam_size`` best unexpanded prefixes of every row go one dimension
deeper, and all rows share one ``get_many`` per round for the prefix records they need.  A full uid
at the top of a row's frontier beats every bound left, so it is final: the answer is the exact
top-k among declared experts (dead subtrees only cost extra rounds).  With scores that do not
mislead, it takes one round per grid dimension.  With ``trusted_servers``, a full uid whose declared
server the policy does not trust is left out, as if it were not declared; ``exclude(uid, address)``
leaves out more (a mixture's experts at servers it saw fail).

A round's cost grows with the prefixes it reads (at most ``rows x beam_size``, and never more than
the grid has) times their records' size (one subkey per live next coordinate).  A ``PrefixCache``
shared by a mixture's searches reuses records read less than ``max_age`` seconds ago and re-reads
those past half that age in the background, so a trainer's searches wait for the DHT only for
prefixes they never read (or not for ``max_age``), whatever the number of experts.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from dht import DHTNode

from .declare import children
from .grid import make_uid, prefix_key
from .trust import TrustPolicy, is_trusted

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FoundExpert:
    uid: str
    address: str
    coords: tuple[int, ...]
    score: float


class PrefixCache:
    """Prefix records (``{next coordinate: address}``) that searches read, reused for ``max_age`` s.

    Why: a trainer searches the same prefixes on every forward pass, and reading them costs DHT
    round trips and work proportional to the grid's width.  A record at most ``max_age`` old misses
    experts declared since (for at most that long) and may name one that died since, which a call
    finds out (a mixture then passes over that server; see ``RemoteMixtureOfExperts``).  Records
    older than ``refresh_after`` (default half of ``max_age``) are still used, and read again in
    the background, so a search that runs often never waits for them."""

    def __init__(self, max_age: float = 10.0, refresh_after: float | None = None, max_entries: int = 65536,
                 recheck_after: float = 1.0) -> None:
        self.max_age, self.max_entries = max_age, max_entries
        self.recheck_after = recheck_after  # a record naming an excluded server: read again at most this often
        self.refresh_after = max_age / 2 if refresh_after is None else refresh_after
        self._records: dict[str, tuple[float, dict[int, str]]] = {}
        self.refreshing: set[str] = set()  # keys being read again in the background
        self.hits = self.misses = 0

    def get(self, key: str) -> dict[int, str] | None:
        """The record read less than ``max_age`` ago, else None."""
        return self.lookup(key)[0]

    def lookup(self, key: str) -> tuple[dict[int, str] | None, bool]:
        """The record read less than ``max_age`` ago (else None), and whether it is due to be read again."""
        item = self._records.get(key)
        age = None if item is None else time.monotonic() - item[0]
        if item is None or age is None or age >= self.max_age:
            self.misses += 1
            return None, False
        self.hits += 1
        return item[1], age >= self.refresh_after and key not in self.refreshing

    def age(self, key: str) -> float:
        """Seconds since ``key`` was read (infinite if it is not cached)."""
        item = self._records.get(key)
        return float("inf") if item is None else time.monotonic() - item[0]

    def put(self, key: str, live: dict[int, str]) -> None:
        if len(self._records) >= self.max_entries:  # forget the stale ones, or everything if none is
            now = time.monotonic()
            self._records = {k: v for k, v in self._records.items() if now - v[0] < self.max_age}
            if len(self._records) >= self.max_entries:
                self._records.clear()
        self._records[key] = (time.monotonic(), live)

    def clear(self) -> None:
        self._records.clear()


@dataclass
class _Siblings:
    """Child prefixes of one prefix not on the frontier yet, best first: they go on it one at a time
    (a wide grid's first dimension would otherwise put all its prefixes on every row's frontier)."""

    bounds: list[float]
    coords: list[tuple[int, ...]]
    next: int = 0


@dataclass
class _Row:
    """One input row's search: a frontier heap of (-bound, tiebreak, coords, what), ``what`` being an
    address (a full uid), None (a prefix to expand) or ``_Siblings`` (more prefixes, the best's bound)."""

    scores: list[np.ndarray]
    rest: list[float]  # rest[d] = best possible sum of scores over dimensions d, d+1, ...
    heap: list[tuple[float, int, tuple[int, ...], str | _Siblings | None]] = field(default_factory=list)
    found: list[tuple[float, tuple[int, ...], str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.heap.append((-self.rest[0], 0, (), None))


async def find_best_experts(node: DHTNode, prefix: str, grid_scores: Sequence[np.ndarray], k: int,
                            beam_size: int | None = None, max_rounds: int = 64,
                            trusted_servers: TrustPolicy | None = None,
                            exclude: Callable[[str, str], bool] | None = None,
                            prefix_cache: PrefixCache | None = None) -> list[list[FoundExpert]]:
    """For each row of ``grid_scores[d]`` (shape ``[rows, grid_size[d]]``), up to ``k`` live experts,
    best first.  Rows with fewer than ``k`` declared (and trusted, not excluded) experts get all
    they have.  Each round reads the prefixes that no row read yet with one ``get_many`` (fewer
    with ``prefix_cache``)."""
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
    cache: dict[tuple[int, ...], _Kids] = {}
    counter = itertools.count(1)

    for _ in range(max_rounds):
        wanted: dict[int, list[tuple[int, ...]]] = {}
        for i, row in enumerate(rows):
            expand = _settle(row, k, beam, counter)
            if expand:
                wanted[i] = expand
        if not wanted:
            break
        missing = sorted({c for expand in wanted.values() for c in expand if c not in cache})
        if missing:
            records = await _read_prefixes(node, prefix, missing, sizes, prefix_cache)
            recheck: dict[str, tuple[int, ...]] = {}
            for c in missing:
                live = records[c]
                if len(c) + 1 == depth:  # full uids: keep the trusted ones that are not excluded
                    live = _trusted(prefix, c, live, trusted_servers)
                    kept = _not_excluded(prefix, c, live, exclude)
                    key = prefix_key(prefix, c)
                    if len(kept) < len(live) and prefix_cache is not None \
                            and prefix_cache.age(key) >= prefix_cache.recheck_after:
                        recheck[key] = c  # a record naming a server that failed: read it again, it may have moved
                    live = kept
                cache[c] = _Kids(np.fromiter(live, dtype=np.int64, count=len(live)), list(live.values()))
            if recheck:
                assert prefix_cache is not None
                _refresh_soon(node, recheck, sizes, prefix_cache)
        for i, expand in wanted.items():
            for coords in expand:
                _push_children(rows[i], coords, cache[coords], depth, k, counter)
    else:
        for row in rows:  # out of rounds: settle what is final
            _settle(row, k, 0, counter)
    return [[FoundExpert(make_uid(prefix, c), a, c, s) for s, c, a in row.found] for row in rows]


async def _read_prefixes(node: DHTNode, prefix: str, coords: list[tuple[int, ...]], sizes: list[int],
                         prefix_cache: PrefixCache | None) -> dict[tuple[int, ...], dict[int, str]]:
    """The live next coordinates under each prefix: from the cache where it is fresh, the rest with
    one ``get_many``."""
    out: dict[tuple[int, ...], dict[int, str]] = {}
    fetch: dict[str, tuple[int, ...]] = {}
    due: dict[str, tuple[int, ...]] = {}
    for c in coords:
        key = prefix_key(prefix, c)
        cached, stale = prefix_cache.lookup(key) if prefix_cache is not None else (None, False)
        if cached is None:
            fetch[key] = c
        else:
            out[c] = cached
            if stale:
                due[key] = c
    if due and prefix_cache is not None:
        _refresh_soon(node, due, sizes, prefix_cache)
    if fetch:
        out.update(await _fetch(node, fetch, sizes, prefix_cache))
    return out


async def _fetch(node: DHTNode, keys: dict[str, tuple[int, ...]], sizes: list[int],
                 prefix_cache: PrefixCache | None, alpha: int | None = None) -> dict[tuple[int, ...], dict[int, str]]:
    """Read prefix records with one ``get_many``: ``{coords: {next coordinate: address}}``."""
    found = await node.get_many(list(keys), alpha=alpha)
    out: dict[tuple[int, ...], dict[int, str]] = {}
    for key, c in keys.items():
        item = found.get(key)
        out[c] = children(item.value if item is not None else None, sizes[len(c)])
        if prefix_cache is not None:
            prefix_cache.put(key, out[c])
    return out


def _refresh_soon(node: DHTNode, keys: dict[str, tuple[int, ...]], sizes: list[int], cache: PrefixCache) -> None:
    """Read these cached records again in the background (those not being read already)."""
    keys = {key: c for key, c in keys.items() if key not in cache.refreshing}
    if keys:
        cache.refreshing.update(keys)
        node.spawn(_refresh(node, keys, sizes, cache))


async def _refresh(node: DHTNode, keys: dict[str, tuple[int, ...]], sizes: list[int], cache: PrefixCache) -> None:
    """Read cached records again in the background, one replica asked at a time (nobody waits for
    it); a record that cannot be read expires as it would have."""
    try:
        await _fetch(node, keys, sizes, cache, alpha=1)
    except Exception as e:  # noqa: BLE001 - a background read: the next search reads them itself
        logger.debug("refreshing %d prefix records failed: %r", len(keys), e)
    finally:
        cache.refreshing.difference_update(keys)


def _trusted(prefix: str, coords: tuple[int, ...], live: dict[int, str],
             policy: TrustPolicy | None) -> dict[int, str]:
    """The full uids under ``coords`` declared at servers ``policy`` trusts for them."""
    if policy is None:
        return live
    return {i: a for i, a in live.items() if is_trusted(policy, make_uid(prefix, (*coords, i)), a)}


def _not_excluded(prefix: str, coords: tuple[int, ...], live: dict[int, str],
                  exclude: Callable[[str, str], bool] | None) -> dict[int, str]:
    if exclude is None:
        return live
    return {i: a for i, a in live.items() if not exclude(make_uid(prefix, (*coords, i)), a)}


@dataclass(frozen=True)
class _Kids:
    """A prefix's live next coordinates as an array (scored for every row at once) and their addresses."""

    subs: np.ndarray
    addresses: list[str]


def _push_children(row: _Row, coords: tuple[int, ...], kids: _Kids, depth: int, k: int,
                   counter: itertools.count) -> None:
    """Put the live children of prefix ``coords`` on the row's frontier.  Children that are full uids
    are final once on top, so only the ``k - found`` best of them can still be chosen: the others
    are left out, which keeps a wide grid's rounds from pushing a whole row of the grid per prefix."""
    if not kids.addresses:
        return
    d = len(coords)
    partial = sum(float(row.scores[j][coords[j]]) for j in range(d))
    scores = row.scores[d][kids.subs] + partial
    if d + 1 == depth:
        picked = range(len(kids.addresses))
        room = k - len(row.found)
        if room < len(kids.addresses):
            picked = np.argsort(-scores, kind="stable")[:room].tolist()  # ties: in the record's order, as before
        subs, values = kids.subs.tolist(), scores.tolist()
        for j in picked:
            heapq.heappush(row.heap, (-values[j], next(counter), (*coords, subs[j]), kids.addresses[j]))
    else:  # prefixes: the best on the frontier now, the others behind it one at a time
        order = np.argsort(-scores, kind="stable")
        bounds = (scores[order] + row.rest[d + 1]).tolist()
        siblings = _Siblings(bounds, [(*coords, c) for c in kids.subs[order].tolist()])
        _push_sibling(row, siblings, counter)


def _push_sibling(row: _Row, siblings: _Siblings, counter: itertools.count) -> None:
    """The next of ``siblings`` onto the frontier, and the rest behind it under the next one's bound."""
    i = siblings.next
    heapq.heappush(row.heap, (-siblings.bounds[i], next(counter), siblings.coords[i], None))
    siblings.next = i + 1
    if i + 1 < len(siblings.bounds):
        heapq.heappush(row.heap, (-siblings.bounds[i + 1], next(counter), siblings.coords[i + 1], siblings))


def _settle(row: _Row, k: int, beam: int, counter: itertools.count) -> list[tuple[int, ...]]:
    """Move final uids from the top of the frontier to ``found``; pop up to ``beam`` prefixes to expand."""
    expand: list[tuple[int, ...]] = []
    held = []
    while row.heap and len(row.found) < k and len(expand) < beam:
        item = heapq.heappop(row.heap)
        neg, _, coords, what = item
        if what is None:
            expand.append(coords)
        elif isinstance(what, _Siblings):
            _push_sibling(row, what, counter)  # the next sibling, with the same bound: popped next
        elif expand:
            held.append(item)  # a prefix above it is being expanded: it is not final yet
        else:
            row.found.append((-neg, coords, what))
    if beam == 0:
        while row.heap and len(row.found) < k and isinstance(row.heap[0][3], str):
            neg, _, coords, address = heapq.heappop(row.heap)
            row.found.append((-neg, coords, address))
    for item in held:
        heapq.heappush(row.heap, item)
    return expand  # non-empty only while found < k: found grows only before the first prefix is popped
