"""In-process peers for the optimizers' tests: DHTs on loopback, each with its own identity and the
signature validator the collaborative optimizers require."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dht import DHT, SignatureValidator
from p2p import Identity


def signed_dhts(n: int, initial: list[str] | None = None, options: Callable[[Identity], dict[str, Any]] | None = None,
                into: list[DHT] | None = None) -> list[DHT]:
    """``n`` DHTs joined through ``initial``, else through the first of them; ``options(identity)``
    adds a peer's own keyword arguments (its membership, say).  Each is appended to ``into`` as soon
    as it exists, so that a caller's cleanup shuts down those made before a failure."""
    made = into if into is not None else []
    first = len(made)
    for _ in range(n):
        identity = Identity()
        peers = initial if initial is not None else (made[first].addresses if len(made) > first else [])
        made.append(DHT(peers, host="127.0.0.1", identity=identity, validators=[SignatureValidator(identity)],
                        **(options(identity) if options is not None else {})))
    return made[first:]
