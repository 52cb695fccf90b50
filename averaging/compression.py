"""Which codec a tensor's chunks travel with; the codecs themselves are in ``p2p.codecs``."""

from __future__ import annotations

from p2p.codecs import Codec


def choose(numel: int, preferred: Codec, min_numel: int = 1 << 14) -> Codec:
    """Size-adaptive rule: small tensors (biases, norms) travel exact, large ones use ``preferred``."""
    return Codec.NONE if numel < min_numel else preferred
