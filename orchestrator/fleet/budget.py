"""The run's spending limits (``budget``: dollars per hour, dollars in all), judged against what the run
store says was spent, so a restarted supervisor keeps counting where the last one stopped."""

from __future__ import annotations

from orchestrator.config.schema import ClusterConfig
from orchestrator.runs.store import RunStore


class Budget:
    def __init__(self, config: ClusterConfig, store: RunStore) -> None:
        self.config = config
        self.store = store
        self._spent: tuple[float, int, float] | None = None  # (now, the store's instance writes, dollars)

    def spent(self, now: float) -> float:
        """Dollars spent by ``now``, summed by the store once per moment and state of its instances: a
        tick weighs every launch against it, and a fleet of a thousand launches a thousand."""
        key = (now, self.store.instance_writes)
        if self._spent is None or self._spent[:2] != key:
            self._spent = (*key, self.store.dollars_spent(now))
        return self._spent[2]

    def allows(self, rate: float, price: float, now: float) -> bool:
        """Whether one more instance at ``price`` (dollars per hour) fits, the fleet spending ``rate``."""
        budget = self.config.budget
        if budget.max_dollars_per_hour is not None and rate + price > budget.max_dollars_per_hour + 1e-9:
            return False
        if budget.max_total_dollars is not None:
            spent = self.spent(now)
            horizon_h = max(self.config.checkpoint.every_s, 60.0) / 3600  # room to notice and stop in time
            if spent + (rate + price) * horizon_h > budget.max_total_dollars:
                return False
        return True

    def exhausted(self, rate: float, margin_s: float, now: float) -> float | None:
        """The dollars spent once the total is reached, with ``margin_s`` of spending at ``rate`` kept in
        reserve (room for the instances' next ticks); None while there is room, or with no total."""
        total = self.config.budget.max_total_dollars
        if total is None:
            return None
        spent = self.spent(now)
        return spent if spent + rate * margin_s / 3600 >= total else None
