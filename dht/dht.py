"""DHT: the synchronous face of a DHTNode, for training loops and scripts.

Threading model: the node lives on its own event loop in a background thread (``BlockingFace``).
Each blocking method submits a coroutine to that loop and waits for it; with
``return_future=True`` it returns a ``concurrent.futures.Future`` instead.  Upper layers that are
async themselves run code on the node's loop with ``run_coroutine``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from p2p import PeerAddress
from p2p.loop_thread import BlockingFace

from .clock import SwarmClock
from .node import DHTNode
from .records import ValueWithExpiration

T = TypeVar("T")


class DHT(BlockingFace):
    """A DHT peer usable from ordinary (non-async) code.

    ``DHT(initial_peers=["host:port"], client_mode=False, validators=[...])``; keyword options are
    those of :meth:`DHTNode.create` (host, port, identity, num_replicas, rpc_timeout, ...).
    ``loop``: run the node on this event loop (running in another thread) instead of a thread of its
    own, so that many peers of one process share one loop (a swarm simulated in few processes).
    """

    def __init__(self, initial_peers: Sequence[str | PeerAddress] = (), *, client_mode: bool = False,
                 validators: Sequence[Any] = (), startup_timeout: float = 60.0,
                 loop: asyncio.AbstractEventLoop | None = None, **options: Any) -> None:
        super().__init__(loop, thread_name="spotswarm-dht")
        self.node: DHTNode = self._start(
            DHTNode.create(initial_peers, client_mode=client_mode, validators=validators, **options), startup_timeout)

    # ---- identity ------------------------------------------------------------------------------
    @property
    def peer_id(self):
        return self.node.peer_id

    @property
    def addresses(self) -> list[str]:
        """Where others can reach this peer (``peerid@host:port``); empty in client mode."""
        return [str(self.node.address)] if self.node.address else []

    @property
    def clock(self) -> SwarmClock:
        """The swarm clock (any thread): expiration times and cross-peer times are by ``clock.now()``."""
        return self.node.clock

    # ---- records -------------------------------------------------------------------------------
    def store(self, key: Any, value: Any, expiration_time: float, subkey: Any = None,
              return_future: bool = False) -> bool | concurrent.futures.Future[bool]:
        return self._call(self.node.store(key, value, expiration_time, subkey), return_future)

    def store_many(self, keys: Sequence[Any], values: Sequence[Any], expiration_time: float | Sequence[float],
                   subkeys: Sequence[Any] | None = None, return_future: bool = False) -> Any:
        return self._call(self.node.store_many(keys, values, expiration_time, subkeys), return_future)

    def get(self, key: Any, latest: bool = False,
            return_future: bool = False) -> ValueWithExpiration | None | concurrent.futures.Future:
        return self._call(self.node.get(key, latest), return_future)

    def get_many(self, keys: Sequence[Any], latest: bool = False, return_future: bool = False) -> Any:
        return self._call(self.node.get_many(keys, latest), return_future)

    def run_coroutine(self, fn: Callable[[DHTNode], Awaitable[T]], return_future: bool = False) -> Any:
        """Run ``fn(node)`` on the DHT's event loop (for layers built on top of the node)."""
        async def runner() -> T:
            return await fn(self.node)
        return self._call(runner(), return_future)

    def spawn(self, fn: Callable[[DHTNode], Awaitable[Any]]) -> None:
        """Start ``fn(node)`` on the DHT's event loop without waiting for it (from any thread): work
        the caller must not wait on, owned by the node, so it ends with the node at the latest."""
        node = self.node
        self.loop.call_soon_threadsafe(lambda: node.spawn(fn(node)))

    def renew_certificate(self, certificate: Any) -> None:
        """Hand this node's renewed membership certificate to its open and future connections
        (``P2P.renew_certificate``; ValueError if it is not a valid certificate of this peer)."""
        async def renew() -> None:
            self.node.p2p.renew_certificate(certificate)
        self.run(renew())

    def _call(self, coro: Any, return_future: bool) -> Any:
        return self.submit(coro) if return_future else self.run(coro)

    def shutdown(self) -> None:
        if not self._closed and self._thread is None:  # on a borrowed loop the node is still ours to close
            self.run(self._aclose(), self.shutdown_timeout)
        super().shutdown()

    async def _aclose(self) -> None:
        await self.node.shutdown()
