"""Expert records in the DHT: who hosts which expert, and which grid prefixes have live experts.

For uid ``ffn.3.7`` hosted at ADDR a server stores, in one ``store_many`` traversal:

* key ``"ffn.3.7"`` -> ADDR (direct lookup by uid);
* key ``"ffn."`` subkey ``3`` -> ADDR and key ``"ffn.3."`` subkey ``7`` -> ADDR (the live next
  coordinates under each prefix, which beam search reads one dimension at a time).

It re-declares before the expiration passes.  Withdrawing stores ``None`` with a newer expiration
under the uid key and the last prefix subkey; readers skip ``None``.  Shallower prefix subkeys are
shared with other experts (maybe on other servers), so they are left to expire instead.

Any member may write these records, so readers that care pass ``trusted_servers`` (see ``trust.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from dht import DHTNode

from .grid import make_uid, parse_uid, prefix_key
from .trust import TrustPolicy, is_trusted


def _records(uids: Sequence[str], value: str | None, withdraw: bool) -> list[tuple[str, int | None, str | None]]:
    records: dict[tuple[str, int | None], str | None] = {}
    for uid in uids:
        prefix, coords = parse_uid(uid)
        records[(uid, None)] = value
        depths = [len(coords) - 1] if withdraw else range(len(coords))
        for d in depths:
            records[(prefix_key(prefix, coords[:d]), coords[d])] = value
    return [(key, sub, v) for (key, sub), v in records.items()]


async def declare_experts(node: DHTNode, uids: Sequence[str], address: str, expiration_time: float) -> bool:
    """Store every uid and its prefixes pointing at ``address``; True if every record was accepted."""
    records = _records(uids, address, withdraw=False)
    ok = await node.store_many([k for k, _, _ in records], [v for _, _, v in records], expiration_time,
                               [s for _, s, _ in records])
    return all(ok)


async def withdraw_experts(node: DHTNode, uids: Sequence[str], expiration_time: float) -> bool:
    """Overwrite the uid keys and their last prefix subkeys with None (``expiration_time`` must be newer)."""
    records = _records(uids, None, withdraw=True)
    ok = await node.store_many([k for k, _, _ in records], [None] * len(records), expiration_time,
                               [s for _, s, _ in records])
    return all(ok)


async def get_experts(node: DHTNode, uids: Sequence[str], latest: bool = False,
                      trusted_servers: TrustPolicy | None = None) -> dict[str, str | None]:
    """The address of each uid's server, or None where it is not declared (or withdrawn, or declared
    at a server that ``trusted_servers`` does not trust for it)."""
    found = await node.get_many(list(uids), latest=latest)
    out: dict[str, str | None] = {}
    for uid in uids:
        item = found.get(uid)
        address = item.value if item is not None and isinstance(item.value, str) else None
        out[uid] = address if address is not None and is_trusted(trusted_servers, uid, address) else None
    return out


def children(entry_value: object, size: int | None = None) -> dict[int, str]:
    """Live next coordinates in a prefix record: ``{coordinate: address}``, skipping withdrawn ones."""
    if not isinstance(entry_value, dict):
        return {}
    out: dict[int, str] = {}
    for sub, item in entry_value.items():
        value = getattr(item, "value", None)
        if isinstance(sub, int) and not isinstance(sub, bool) and sub >= 0 and (size is None or sub < size) \
                and isinstance(value, str):
            out[sub] = value
    return out


__all__ = ["children", "declare_experts", "get_experts", "make_uid", "withdraw_experts"]
