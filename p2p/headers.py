"""Names for what a message header holds: its keys, the message kinds, the protocol version.

Every message is a msgpack map (``wire.py``) whose keys are short strings; these constants are
those strings, so the code says ``header[METHOD]`` and the bytes on the wire stay ``"m"``.
``docs/protocol.md`` describes each key and kind under the same names.
"""

from __future__ import annotations

VERSION = 1  # the protocol version a HELLO announces and requires

# ---- message kinds (the value under KIND) ---------------------------------------------------------
HELLO, PROOF, OPEN, DATA, END, ERROR, CANCEL, GOAWAY, RENEW = range(1, 10)

# ---- keys every message has -----------------------------------------------------------------------
STREAM = "s"  # stream id; 0 for connection-level messages (HELLO, PROOF, GOAWAY, RENEW)
KIND = "t"  # message kind, one of the kinds above

# ---- calls (OPEN, DATA, ERROR) --------------------------------------------------------------------
METHOD = "m"  # OPEN: the method name
DEADLINE = "d"  # OPEN: seconds the call has left
FIRST_ITEM = "i"  # OPEN: 1 when PAYLOAD holds the call's first item
END_OF_ITEMS = "e"  # OPEN, DATA: 1 when the sender sends no more items on this stream (half-close)
PAYLOAD = "p"  # OPEN, DATA: the item
AUTH = "a"  # OPEN: the value of the caller's AuthHook
ERROR_TYPE = "x"  # ERROR: the exception's type name
ERROR_MESSAGE = "msg"  # ERROR: its text

# ---- connection-level messages (HELLO, PROOF, GOAWAY, RENEW) --------------------------------------
PROTOCOL_VERSION = "v"  # HELLO: VERSION
PUBLIC_KEY = "pk"  # HELLO: the sender's raw 32-byte Ed25519 public key
NONCE = "n"  # HELLO: 16 random bytes the other side signs
CLIENT_MODE = "c"  # HELLO: 1 when the sender accepts no connections
LISTEN = "l"  # HELLO: the sender's listen address "host:port" (None in client mode)
LAST_STREAM = "l"  # GOAWAY: the largest stream id of the receiver's that the sender saw
SIGNATURE = "sig"  # PROOF: the sender's signature over the other side's nonce and its own key
CERTIFICATE = "m"  # HELLO, RENEW: the sender's membership certificate (OPEN uses "m" as METHOD)


def error_header(sid: int, type_name: str, message: str) -> dict:
    """An ERROR on stream ``sid`` (0: the connection itself) saying ``type_name: message``."""
    return {STREAM: sid, KIND: ERROR, ERROR_TYPE: type_name, ERROR_MESSAGE: message}
