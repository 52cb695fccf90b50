"""The sequence ``bench_dht.py`` runs on both libraries: the plan (everything random, drawn up front
from one seeded RNG), its operations in order, and the figures from their latencies.  Ours runs it
in ``bench_dht.py``, the reference library in ``_hivemind_dht_worker.py`` (its own virtualenv), so
this module uses the standard library only.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Iterator, Sequence

from _common import percentile


def make_plan(n: int, n_keys: int, n_new: int, seed: int) -> dict:
    """Everything random about a run, drawn up front from one seeded RNG (JSON-serializable)."""
    rng = random.Random(seed)
    bootstrap = [[]] + [rng.sample(range(i), min(i, 2)) for i in range(1, n)]
    keys = [f"bench/{seed}/key/{j}" for j in range(n_keys + n_new)]
    values = [{"j": j, "writer": 0, "score": round(rng.random(), 6), "tag": f"v{rng.randrange(1 << 30):08x}"}
              for j in range(n_keys + n_new)]
    store_from = [rng.randrange(n) for _ in range(n_keys)]
    for j, p in enumerate(store_from):
        values[j]["writer"] = p
    get_from = [rng.randrange(n) for _ in range(n_keys)]
    killed = sorted(rng.sample(range(n), max(1, round(n / 10)) if n >= 5 else 0))
    dead = set(killed)
    alive = [i for i in range(n) if i not in dead]
    churn_get_from = [rng.choice(alive) for _ in range(n_keys)]
    new_store_from = [rng.choice(alive) for _ in range(n_new)]
    for j, p in enumerate(new_store_from):
        values[n_keys + j]["writer"] = p
    new_get_from = [rng.choice(alive) for _ in range(n_new)]
    return {"n": n, "n_keys": n_keys, "n_new": n_new, "seed": seed, "bootstrap": bootstrap,
            "keys": keys, "values": values, "store_from": store_from, "get_from": get_from,
            "killed": killed, "churn_get_from": churn_get_from,
            "new_store_from": new_store_from, "new_get_from": new_get_from}


def operations(plan: dict, after_kill: bool) -> Iterator[tuple[str, str, int, int]]:
    """``(phase, "store" | "get", peer, key index)`` in order: before the kill, stores then gets of
    every key (0% churn); after it, gets of the old keys, then store + get pairs of new ones."""
    n_keys = plan["n_keys"]
    if not after_kill:
        for j in range(n_keys):
            yield "store", "store", plan["store_from"][j], j
        for j in range(n_keys):
            yield "get", "get", plan["get_from"][j], j
        return
    for j in range(n_keys):
        yield "churn_get_old", "get", plan["churn_get_from"][j], j
    for j in range(plan["n_new"]):
        yield "churn_store", "store", plan["new_store_from"][j], n_keys + j
        yield "churn_get_new", "get", plan["new_get_from"][j], n_keys + j


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def start_figures(plan: dict, start_lat: Sequence[float], start_total: float) -> dict:
    n = plan["n"]
    return {"n_peers": n, "n_keys": plan["n_keys"], "n_new_keys_churn": plan["n_new"],
            "start_ms_per_peer": sum(start_lat) / n * 1e3, "start_p99_ms": _ms(percentile(start_lat, 0.99)),
            "start_total_s": start_total}


class Tally:
    """Every operation's latency and outcome, by phase, and the figures they make."""

    def __init__(self, plan: dict) -> None:
        self.plan = plan
        self.lat: dict[str, list[float]] = collections.defaultdict(list)
        self.ok: collections.Counter = collections.Counter()
        self.errors: collections.Counter = collections.Counter()

    def add(self, phase: str, op: str, key: int, seconds: float, result: object) -> None:
        """``result``: what the store or get returned, or the exception it raised."""
        self.lat[phase].append(seconds)
        if isinstance(result, BaseException):
            self.errors[type(result).__name__] += 1
        elif op == "store":
            self.ok[phase] += result is True
        else:
            self.ok[phase] += result is not None and result.value == self.plan["values"][key]

    def _latency(self, prefix: str, phases: Sequence[str], suffix: str = "") -> dict:
        samples = [x for phase in phases for x in self.lat[phase]]
        return {f"{prefix}_p50_ms{suffix}": _ms(percentile(samples, 0.5)),
                f"{prefix}_p99_ms{suffix}": _ms(percentile(samples, 0.99))}

    def figures(self) -> dict:
        n_keys, n_new, ok = self.plan["n_keys"], self.plan["n_new"], self.ok
        return {**self._latency("store", ["store"]), "store_accepted": ok["store"] / n_keys,
                **self._latency("get", ["get"]), "get_success": ok["get"] / n_keys,
                "killed": len(self.plan["killed"]),
                "get_success_churn10": (ok["churn_get_old"] + ok["churn_get_new"]) / (n_keys + n_new),
                "get_success_churn10_old": ok["churn_get_old"] / n_keys,
                "get_success_churn10_new": ok["churn_get_new"] / n_new if n_new else None,
                **self._latency("get", ["churn_get_old", "churn_get_new"], "_churn10"),
                **self._latency("store", ["churn_store"], "_churn10"),
                "op_errors": dict(self.errors)}
