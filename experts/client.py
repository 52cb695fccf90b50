"""Where synchronous torch code sends expert calls from: a P2P endpoint on an event-loop thread.

``RemoteExpert`` and ``RemoteMixtureOfExperts`` are called from ordinary threads (a training loop,
autograd's backward); they hand coroutines to the client's loop and block on the result.  A client
either owns its loop thread and a client-mode peer (``ExpertClient.create()``), or borrows a DHT's
(``ExpertClient.from_dht(dht)``) so one process keeps one endpoint.
"""

from __future__ import annotations

import threading
from typing import Any

from dht import DHT
from p2p import P2P
from p2p.loop_thread import BlockingFace


class ExpertClient(BlockingFace):
    """``run(coro)`` / ``submit(coro)`` on the client's loop, from any thread but that loop's."""

    def __init__(self, p2p: P2P | None = None, dht: DHT | None = None, **p2p_options: Any) -> None:
        """Borrow ``p2p`` and its loop, or, without one, own a loop thread and a client-mode endpoint."""
        super().__init__(None if p2p is None else p2p.loop, thread_name="spotswarm-expert-client")
        self.dht = dht
        self.p2p = p2p if p2p is not None else self._start(P2P.create(client_mode=True, **p2p_options), 30)

    @classmethod
    def create(cls, **p2p_options: Any) -> ExpertClient:
        """A client with its own loop thread and a client-mode P2P endpoint."""
        return cls(**p2p_options)

    @classmethod
    def from_dht(cls, dht: DHT) -> ExpertClient:
        """Call through the DHT's own P2P endpoint and loop (shut down with the DHT)."""
        return cls(dht.node.p2p, dht=dht)

    async def _aclose(self) -> None:
        await self.p2p.shutdown()


_default: ExpertClient | None = None
_default_lock = threading.Lock()


def default_client() -> ExpertClient:
    """This process's shared client, created on first use (its loop thread is a daemon)."""
    global _default
    with _default_lock:
        if _default is None or _default._closed:
            _default = ExpertClient.create()
        return _default
