"""An exact average over more peers than one group holds: groups of groups, and the result back down.

``GroupPlan`` splits a swarm's sorted member list into runs of ``group_size`` (level 0), those
groups into runs of ``group_size`` groups (level 1), and so on until one group remains: the top.
Each group meets under its own key (``<key>.<level>.<index>``; the top under ``<key>`` itself), so
the keys change from round to round as in Moshpit All-Reduce.  A group
averages its members' values weighted by their weights; its representative (the member with the
smallest id) takes the group's average one level up, weighted by the group's total weight; the top's
members then hold the weighted mean over everyone, with the same bits.  On the way back each
representative hands those bits to the group it came from (``DecentralizedAverager.broadcast``), so
every peer ends with exactly the top's values: with N peers and groups of M, ``ceil(log_M N)``
rounds up and as many down, every group at most M.

Why a way back rather than more Moshpit rounds: after d Moshpit rounds every peer holds the global
mean, but each group sums in its own order, so two groups' means differ in their last bits, and
collaborative training needs bit-identical parameters.  Here one group computes the mean once.

Failures: a member missing from its group (dead, or late past matchmaking) is left out of that
group's average, and the others carry on without it.  A planned group waits for all its members up to
its matchmaking deadline (they come over a few seconds, as their views see the batch complete), and
counts only with a strict majority of them (``quorum_of``), the top likewise with a majority of the
planned groups: late members meeting after their group closed must not count as a second group, since
two tops would step to different parameters.  So each planned group forms at most once and one top at
most counts, unless the members' plans disagree (different views of who is live); a peer whose group
misses its quorum does not step, and loads the state of those that did.  A group whose round did not
complete stops there: its representative tells the group below at once (``broadcast(failed=True)``),
so nobody below waits out the timeout.  Every peer that completes holds the top's bits; the rest do
not step (the caller's rule, as with one group).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from p2p import PeerID

from .averager import DecentralizedAverager, StepResult
from .matchmaking import Planned

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupPlan:
    """Which group each member averages in, level by level; every member of a swarm computes the
    same plan from the same member list."""

    members: tuple[PeerID, ...]  # sorted by id: the order every member agrees on
    group_size: int

    @classmethod
    def of(cls, members: Sequence[PeerID], group_size: int) -> GroupPlan:
        if group_size < 2:
            raise ValueError(f"group_size must be at least 2, got {group_size}")
        return cls(tuple(sorted(set(members), key=lambda p: p.digest)), group_size)

    @property
    def levels(self) -> list[int]:
        """How many units each level groups, from the members up to the top's (at most group_size)."""
        counts = [len(self.members)]
        while counts[-1] > self.group_size:
            counts.append(math.ceil(counts[-1] / self.group_size))
        return counts

    def rank(self, peer: PeerID) -> int:
        return self.members.index(peer)

    def group_of(self, unit: int, count: int) -> int:
        """The group of unit ``unit`` of ``count``: consecutive runs of ``group_size`` units.  Fixed runs
        rather than balanced sizes, so that two members whose lists differ by a peer disagree only
        about the units at the runs' edges, not about every group after the difference's size."""
        return unit // self.group_size

    def size_of(self, group: int, count: int) -> int:
        return min(self.group_size, count - group * self.group_size)

    def members_of(self, group: int) -> tuple[PeerID, ...]:
        """The members planned for level 0's group ``group``."""
        return self.members[group * self.group_size:(group + 1) * self.group_size]


@dataclass
class GroupedResult:
    """What a grouped average did for one peer."""

    complete: bool  # we hold the top's values
    top_group_id: str = ""  # the top's group id, for the peers that were in it
    levels: list[StepResult] = field(default_factory=list)  # our group at each level we took part in
    received: StepResult | None = None  # the way back into our highest group, if we were not its representative
    handed_down: list[StepResult] = field(default_factory=list)  # our broadcasts to the groups below
    reason: str = ""  # why not complete

    @property
    def group_sizes(self) -> list[int]:
        return [r.group_size for r in self.levels]

    @property
    def matchmaking_time(self) -> float:
        return sum(r.matchmaking_time for r in self._rounds())

    @property
    def allreduce_time(self) -> float:
        return sum(r.allreduce_time for r in self._rounds())

    def _rounds(self) -> list[StepResult]:
        return [*self.levels, *([self.received] if self.received else []), *self.handed_down]


async def average_in_groups(averager: DecentralizedAverager, plan: GroupPlan, weight: float, key: str,
                            timeout: float, abort: asyncio.Event | None = None) -> GroupedResult:
    """Average ``averager``'s tensors with every member of ``plan`` (this peer among them), in place.

    Within ``timeout`` seconds in all.  On success every member holds the same bits: the weighted
    mean over the members that took part.  A peer that does not complete keeps whatever its last
    round left in its tensors (a group's mean, or a part of one): the caller must not use them."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    me = averager.peer_id
    counts = plan.levels
    unit, level = plan.rank(me), 0
    result = GroupedResult(complete=False)
    carried: list[tuple[StepResult, int]] = []  # the groups we represent below the current one, and our index there
    while True:
        count = counts[level]
        top = level == len(counts) - 1
        group = 0 if top else plan.group_of(unit, count)
        group_key = key if top else f"{key}.{level}.{group}"
        target = count if top else plan.size_of(group, count)
        quorum = quorum_of(target)
        planned = Planned(plan.members_of(group) if level == 0 and not top else (), unit)
        step = await averager.step(weight, timeout=max(deadline - loop.time(), 1e-3), group_key=group_key,
                                   target_group_size=target, abort=abort, min_group_size=quorum,
                                   patience=_patience(averager, level), planned=planned,
                                   # a representative weighs its group's total: up to every peer's
                                   weight_ratio_scale=1.0 if level == 0 else float(counts[0]))
        result.levels.append(step)
        logger.debug("%s: level %d group %s of %d planned: %d members (matchmaking %.2f s, round %.2f s)",
                     group_key, level, group, target, step.group_size, step.matchmaking_time, step.allreduce_time)
        if step.group_size < quorum:
            result.reason = (f"level {level}: our group held {step.group_size} of {target} planned "
                             f"{'groups' if level else 'peers'}, fewer than {quorum}")
            await _declare_gone(averager, plan, key, level, group, deadline - loop.time())
            break
        if step.averaged and not step.complete:
            result.reason = f"level {level}: parts {step.unaveraged_parts} of our group did not come back"
            await _declare_gone(averager, plan, key, level, group, deadline - loop.time())
            break
        if top:
            result.complete = True
            result.top_group_id = step.group_id
            break
        if step.averaged:
            assert step.group is not None
            source = _representative(step)
            if source != step.my_index:
                result.received = await averager.broadcast(step.group, source, max(deadline - loop.time(), 1e-3))
                result.complete = result.received.complete and step.group.peer_ids[source] not in \
                    result.received.failed_peers
                if not result.complete:
                    result.reason = f"level {level}: our representative handed down nothing"
                break
            carried.append((step, step.my_index))
            weight = sum(w for p, w in zip(step.group.peer_ids, step.group.weights, strict=True)
                         if p not in step.failed_peers)
        unit, level = group, level + 1
    for step, index in reversed(carried):  # the way back: our bits to each group we represented
        assert step.group is not None
        handed = await averager.broadcast(step.group, index, max(deadline - loop.time(), 1e-3),
                                          failed=not result.complete)
        result.handed_down.append(handed)
    return result


async def _declare_gone(averager: DecentralizedAverager, plan: GroupPlan, key: str, level: int, group: int,
                        lasts: float) -> None:
    """Our group at ``level`` will not go up: tell the leader of the group above, which would otherwise
    wait its whole patience for it (the top of a 256-peer swarm, 14 s at the defaults)."""
    counts = plan.levels
    if level + 1 >= len(counts):
        return  # the top: nobody above waits
    above = level + 1
    parent_key = key if above == len(counts) - 1 else f"{key}.{above}.{plan.group_of(group, counts[above])}"
    await averager.matchmaker.declare_gone(parent_key, group, max(lasts, 1.0))


def quorum_of(planned: int) -> int:
    """The fewest of a group's ``planned`` members it must hold to count: a strict majority.  Members
    come late (their views saw the batch complete later, or their group waited for a missing member);
    late ones meeting after their group closed must not count as a second group, least of all at the
    top, where two groups of one epoch would step to different parameters."""
    return planned // 2 + 1


def _patience(averager: DecentralizedAverager, level: int) -> float:
    """How long a level's leader waits for its whole planned group: members of level 0 come as their
    views see the batch complete; those of a level above come once their groups below formed, each of
    which may have waited its own whole time for a member that never came."""
    whole = averager.min_matchmaking_time + 2 * averager.request_timeout  # one level's matchmaking at most
    return (level + 1) * whole


def _representative(step: StepResult) -> int:
    """Who of a formed group takes its average up: the member with the smallest id (every member
    knows the group as formed, so they agree without a word)."""
    return min(range(step.group_size), key=lambda i: step.group_peers[i].digest)
