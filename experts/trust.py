"""Which servers a client believes for which expert uids.

Any member of a run can write any expert record in the DHT, so a record saying "``ffn.3.7`` is at
ADDR" proves nothing about ADDR.  A client that knows which servers were assigned which experts
passes a policy ``(uid, peer id) -> bool``; a declared server it does not trust is skipped as if the
expert were absent.  Records carry ``peerid@host:port`` addresses and the p2p handshake proves the
peer id when dialing such an address, so nobody can answer in a trusted server's name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from p2p import PeerAddress, PeerID

from .grid import DELIMITER

logger = logging.getLogger(__name__)

TrustPolicy = Callable[[str, PeerID], bool]


class AssignedServers:
    """Trust, for each uid, only the servers assigned to its longest matching prefix.

    ``{"ffn.0": {a}, "ffn.1": {b, c}, "ffn": {d}}``: ``ffn.0.5`` is trusted only on ``a``, ``ffn.1.2``
    on ``b`` or ``c``, ``ffn.2.0`` on ``d``.  A prefix matches whole name parts (``ffn.1`` does not
    match ``ffn.10.0``); a trailing dot is allowed; a uid no prefix matches is trusted nowhere.
    """

    def __init__(self, mapping: Mapping[str, Iterable[PeerID | str]]) -> None:
        self.assigned: dict[str, frozenset[PeerID]] = {
            prefix.removesuffix(DELIMITER): frozenset(_peer_id(p) for p in peers) for prefix, peers in mapping.items()}

    def servers_for(self, uid: str) -> frozenset[PeerID]:
        best: str | None = None
        for prefix in self.assigned:
            if (uid == prefix or uid.startswith(prefix + DELIMITER)) and (best is None or len(prefix) > len(best)):
                best = prefix
        return self.assigned[best] if best is not None else frozenset()

    def __call__(self, uid: str, peer_id: PeerID) -> bool:
        return peer_id in self.servers_for(uid)

    def __repr__(self) -> str:
        shown = {prefix: sorted(map(str, peers)) for prefix, peers in self.assigned.items()}
        return f"AssignedServers({shown})"


def _peer_id(peer: PeerID | str) -> PeerID:
    """A PeerID from a PeerID, its string, or a ``peerid@host:port`` address."""
    if isinstance(peer, PeerID):
        return peer
    if "@" in peer:
        address = PeerAddress.parse(peer)
        assert address.peer_id is not None
        return address.peer_id
    return PeerID.from_string(peer)


def is_trusted(policy: TrustPolicy | None, uid: str, address: str) -> bool:
    """Whether ``policy`` trusts the server declared at ``address`` for ``uid`` (no policy: yes).

    An address without a peer id cannot be proven at the handshake, so a policy never trusts it."""
    if policy is None:
        return True
    try:
        peer_id = PeerAddress.parse(address).peer_id
    except ValueError:
        peer_id = None
    if peer_id is None:
        logger.debug("skipping expert %s: its declared address %r names no peer id", uid, address)
        return False
    if not policy(uid, peer_id):
        logger.debug("skipping expert %s: its declared server %s is not trusted for it", uid, peer_id)
        return False
    return True
