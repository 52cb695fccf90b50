"""Expert names on a grid: ``prefix.i0.i1…``, and the DHT keys of their prefixes.

A uid is a prefix (one or more dot-separated parts, the last not a number) followed by one or more
integer coordinates: ``ffn.3.7`` is coordinate (3, 7) of grid ``ffn``.  The DHT key of the prefix
that fixes the first ``d`` coordinates is ``"ffn."`` (d = 0), ``"ffn.3."`` (d = 1), …; its subkeys
are the next coordinate.
"""

from __future__ import annotations

import itertools
import re

DELIMITER = "."
_COORD = re.compile(r"0|[1-9][0-9]*")


def parse_uid(uid: str) -> tuple[str, tuple[int, ...]]:
    """``"ffn.3.7"`` -> ``("ffn", (3, 7))``; ValueError naming the uid if it is not a grid name."""
    if not isinstance(uid, str):
        raise ValueError(f"expert uid must be a string, got {type(uid).__name__}")
    parts = uid.split(DELIMITER)
    n = len(parts)
    while n > 0 and _COORD.fullmatch(parts[n - 1]):
        n -= 1
    if n == 0 or n == len(parts) or any(not p or "/" in p for p in parts[:n]):
        raise ValueError(f"expert uid {uid!r} must look like prefix.i0.i1... (a name, then integer coordinates)")
    return DELIMITER.join(parts[:n]), tuple(int(p) for p in parts[n:])


def normalize_prefix(prefix: str) -> str:
    """``"ffn"`` or ``"ffn."`` -> ``"ffn"``; ValueError if it cannot start a grid name."""
    name = prefix[:-1] if prefix.endswith(DELIMITER) else prefix
    parse_uid(f"{name}{DELIMITER}0")
    return name


def make_uid(prefix: str, coords: tuple[int, ...] | list[int]) -> str:
    return DELIMITER.join([prefix, *map(str, coords)])


def prefix_key(prefix: str, coords: tuple[int, ...] | list[int] = ()) -> str:
    """DHT key listing the live next coordinates after ``coords``: ``prefix_key("ffn", (3,)) == "ffn.3."``."""
    return make_uid(prefix, coords) + DELIMITER


def expand_pattern(pattern: str) -> list[str]:
    """``"ffn.[0:2].[0:3]"`` -> every uid of that 2x3 grid; a plain coordinate stays as it is."""
    prefix_parts, ranges = [], []
    for part in pattern.split(DELIMITER):
        m = re.fullmatch(r"\[(\d+):(\d+)\]", part)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2))
            if hi <= lo:
                raise ValueError(f"empty range {part!r} in expert pattern {pattern!r}")
            ranges.append(range(lo, hi))
        elif ranges or _COORD.fullmatch(part):
            if not _COORD.fullmatch(part):
                raise ValueError(f"expert pattern {pattern!r}: {part!r} must be an integer or a [lo:hi] range")
            ranges.append(range(int(part), int(part) + 1))
        else:
            prefix_parts.append(part)
    if not prefix_parts or not ranges:
        raise ValueError(f"expert pattern {pattern!r} must look like prefix.[0:4].[0:4]")
    prefix = DELIMITER.join(prefix_parts)
    uids = [make_uid(prefix, coords) for coords in itertools.product(*ranges)]
    for uid in uids[:1]:
        parse_uid(uid)
    return uids
