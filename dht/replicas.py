"""The replica sets of keys a peer writes or reads again and again, found once and reused.

A lookup costs a traversal (several ``find`` calls); a peer that declares under the same few
matchmaking keys every step, or reads its progress key ten times a second, would pay it every
time for the same answer.  A set is reused for ``reuse_for`` seconds while none of its peers failed
a call (a failed call drops the contact from the routing table, see ``DHTNode.still_reachable``),
so churn costs one lookup, and a peer that joined nearer to the key takes over within ``reuse_for``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .node import DHTNode
from .routing import Contact

REUSED_FOR = 10.0  # seconds a replica set is reused while all of its peers answer


class ReplicaSets:
    def __init__(self, node: DHTNode, reuse_for: float = REUSED_FOR) -> None:
        self.node = node
        self.reuse_for = reuse_for
        # key -> (reused until, loop time; the set; the routing table's size when it was found)
        self._sets: dict[Any, tuple[float, list[Contact | None], int]] = {}

    async def of(self, key: Any) -> list[Contact | None]:
        """The replicas of ``key`` (None: this node), looked up again only when stale or broken."""
        now = asyncio.get_running_loop().time()
        reused = self._sets.get(key)
        if reused is not None and now < reused[0] and self.node.still_reachable(reused[1]) \
                and (len(reused[1]) >= self.node.num_replicas or len(self.node.routing) == reused[2]):
            return reused[1]
        replicas = await self.node.nearest_replicas(key)
        known = len(self.node.routing)
        self._sets = {k: v for k, v in self._sets.items() if v[0] > now}  # keys that changed (Moshpit's, epochs')
        self._sets[key] = (now + self.reuse_for, replicas, known)
        return replicas
