"""Where a peer listens: ``host:port``, optionally pinned to an identity as ``peerid@host:port``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .identity import PeerID


@dataclass(frozen=True)
class PeerAddress:
    host: str
    port: int
    peer_id: PeerID | None = None

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("PeerAddress needs a host")
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError(f"PeerAddress port must be 1..65535, got {self.port!r}")

    @classmethod
    def parse(cls, text: str | PeerAddress) -> PeerAddress:
        """Parse ``host:port``, ``[v6]:port`` or ``peerid@host:port``; errors name the bad text."""
        if isinstance(text, PeerAddress):
            return text
        if not isinstance(text, str):
            raise ValueError(f"peer address must be a string, got {type(text).__name__}")
        return _parse(text)

    @classmethod
    def _parse_uncached(cls, text: str) -> PeerAddress:
        peer_id = None
        rest = text.strip()
        if "@" in rest:
            pid, rest = rest.split("@", 1)
            peer_id = PeerID.from_string(pid)
        host, sep, port = rest.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"peer address must look like host:port, got {text!r}")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        return cls(host, int(port), peer_id)

    def without_id(self) -> PeerAddress:
        return PeerAddress(self.host, self.port)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        base = f"{host}:{self.port}"
        return f"{self.peer_id}@{base}" if self.peer_id else base


@lru_cache(maxsize=4096)
def _parse(text: str) -> PeerAddress:
    return PeerAddress._parse_uncached(text)
