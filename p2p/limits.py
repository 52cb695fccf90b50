"""Hard limits of one connection, checked before any buffer is allocated."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Limits:
    """What a peer accepts from the other side of a connection.

    Each number bounds memory that a remote peer can make us allocate; a message over any of
    them closes the connection (or, for ``max_streams``, refuses that one call).
    """

    max_header_bytes: int = 8 * MiB
    max_frame_bytes: int = 1 * GiB
    max_frames: int = 4096
    max_message_bytes: int = 2 * GiB
    max_streams: int = 4096
    # Received-but-unconsumed bytes per connection before we stop reading from its socket.
    max_buffered_bytes: int = 8 * MiB

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Limits.{name} must be a positive int, got {value!r}")
