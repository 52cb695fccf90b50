"""The run's authority: the key that says who is a member of a run, kept with the run's state.

The supervisor holds it (``<run dir>/authority.key``, mode 0600), so a resumed run keeps its
authority and the workers it adopts stay members.  Every instance's worker gets a certificate for
its own peer id when its actor starts and a fresh one when half of the old one's lifetime is left;
volunteers get one from ``spotswarm token issue``.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from p2p import PeerID
from p2p.membership import Authority, Certificate, Membership

logger = logging.getLogger(__name__)

AUTHORITY_FILE = "authority.key"
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def run_authority(run_dir: Path, run: str) -> Authority:
    """The run's authority key, created on the run's first start."""
    return Authority.from_file(Path(run_dir) / AUTHORITY_FILE, run)


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``15m``, ``12h`` or ``7d``."""
    match = _DURATION.match(text)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"not a duration: {text!r} (expected e.g. 3600, 90s, 15m, 12h or 7d)")
    return float(match.group(1)) * _UNITS[match.group(2)]


@dataclass
class _Held:
    peer_id: PeerID
    expires: float
    roles: tuple[str, ...]


class Certifier:
    """Issues members' certificates and knows which ones are due for renewal."""

    def __init__(self, authority: Authority, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        self.authority = authority
        self.ttl_s = ttl_s
        self.clock = clock
        self._held: dict[str, _Held] = {}  # holder (instance id, "supervisor") -> its newest certificate

    def issue(self, holder: str, peer_id: PeerID | str, roles: tuple[str, ...] = ("worker",)) -> Certificate:
        pid = peer_id if isinstance(peer_id, PeerID) else PeerID.from_string(peer_id)
        cert = self.authority.issue(pid, self.ttl_s, roles=roles, now=self.clock())
        self._held[holder] = _Held(pid, cert.expires, tuple(roles))
        return cert

    def know(self, holder: str, peer_id: PeerID | str, roles: tuple[str, ...] = ("worker",)) -> None:
        """A holder whose certificate we did not issue (an adopted worker): renew it at once."""
        if holder not in self._held:
            pid = peer_id if isinstance(peer_id, PeerID) else PeerID.from_string(peer_id)
            self._held[holder] = _Held(pid, 0.0, roles)

    def forget(self, holder: str) -> None:
        self._held.pop(holder, None)

    def holders(self) -> list[str]:
        return list(self._held)

    def renew_due(self) -> list[tuple[str, Certificate]]:
        """Fresh certificates for the holders with less than half of a lifetime left."""
        horizon = self.clock() + self.ttl_s / 2
        due = [(h, held) for h, held in self._held.items() if held.expires <= horizon]
        return [(h, self.issue(h, held.peer_id, held.roles)) for h, held in due]

    def membership(self, holder: str, peer_id: PeerID, roles: tuple[str, ...]) -> Membership:
        """A membership for a peer this process runs itself (the supervisor's DHT peer)."""
        return Membership(self.authority.run, self.authority.public_key, self.issue(holder, peer_id, roles))
