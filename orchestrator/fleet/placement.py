"""Which expert server holds which expert: every expert on ``replicas`` servers, loads even.

Pure bookkeeping, no Ray and no network, so the rules are testable on their own; ``experts.py``
carries the plans out.  A server that was noticed (it will be preempted) no longer counts as a
replica, so its experts get new homes while it can still hand their state over.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Plan:
    """Experts to load on servers (``assign``), and moves: after ``(server, uid)`` loaded, the
    server in ``moves`` drops that expert (it had more than its share)."""

    assign: dict[str, list[str]] = field(default_factory=dict)
    moves: dict[tuple[str, str], str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.assign)

    def add(self, server: str, uid: str) -> None:
        self.assign.setdefault(server, []).append(uid)


def plan_placement(uids: list[str], replicas: int, holders: dict[str, set[str]], servers: list[str],
                   max_moves: int = 4) -> Plan:
    """Assignments that give every expert ``replicas`` holders among ``servers`` (the usable
    ones: up, not leaving), least-loaded servers first; then, while one server holds two experts
    more than another, up to ``max_moves`` moves from the fullest to the emptiest."""
    plan = Plan()
    if not servers:
        return plan
    usable = set(servers)
    held = {uid: holders.get(uid, set()) & usable for uid in uids}
    load = {s: sum(s in h for h in held.values()) for s in sorted(servers)}
    want = min(replicas, len(servers))
    for uid in uids:
        for _ in range(want - len(held[uid])):
            server = min((s for s in load if s not in held[uid]), key=lambda s: (load[s], s))
            held[uid] = held[uid] | {server}
            load[server] += 1
            plan.add(server, uid)
    for _ in range(max_moves):
        full = max(load, key=lambda s: (load[s], s))
        empty = min(load, key=lambda s: (load[s], s))
        if load[full] - load[empty] < 2:
            break
        movable = [uid for uid in uids if full in held[uid] and empty not in held[uid]
                   and uid not in plan.assign.get(full, [])]
        if not movable:
            break
        uid = movable[0]
        held[uid] = (held[uid] - {full}) | {empty}
        load[full] -= 1
        load[empty] += 1
        plan.add(empty, uid)
        plan.moves[(empty, uid)] = full
    return plan

