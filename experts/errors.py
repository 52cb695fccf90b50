"""Typed errors of the experts layer, so a caller can tell its own mistake from a dead expert.

Errors raised by a server's handler reach the caller as ``p2p.RemoteError(type_name, message)``;
:func:`from_remote` turns the ones defined here back into the same local exception type.
"""

from __future__ import annotations

from p2p import RemoteError


class ExpertError(Exception):
    """Base class of every error raised by the experts layer."""


class ExpertSchemaError(ExpertError, ValueError):
    """Inputs do not match the expert's declared schema; the message names the expert and the schema."""


class ExpertRequestTooLarge(ExpertError, ValueError):
    """A request is over the server's limit (rows per request); the server refused it and keeps serving."""


class UnknownExpert(ExpertError, LookupError):
    """The server hosts no expert with that uid."""


class NonFiniteValues(ExpertError, ValueError):
    """Tensors sent to an expert (or computed by it) hold NaN or infinity; refused before they could
    reach the model or its optimizer.  The message names the expert and which tensor."""


class ExpertCallFailed(ExpertError):
    """The expert could not be reached, or did not answer in time; ``__cause__`` has the p2p error."""


class NotEnoughExperts(ExpertError):
    """Fewer experts answered than a mixture's ``k_min`` (or ``backward_k_min``) demands."""


_BY_NAME: dict[str, type[ExpertError]] = {
    cls.__name__: cls for cls in (ExpertSchemaError, ExpertRequestTooLarge, UnknownExpert, NonFiniteValues)
}


def from_remote(error: RemoteError) -> Exception:
    """The local exception for a remote handler's error: one of ours by type name, else the RemoteError."""
    cls = _BY_NAME.get(error.type_name)
    if cls is None:
        return error
    local = cls(error.message)
    local.__cause__ = error
    return local
