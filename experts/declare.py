"""Expert records in the DHT: who hosts which expert, and which grid prefixes have live experts.

For uid ``ffn.3.7`` hosted at ADDR a server stores, in one ``store_many`` traversal:

* key ``"ffn.3.7"`` subkey ADDR -> ADDR: one subkey per holder, so every replica of an expert is
  listed at once and a caller whose server died can try another without waiting for a
  re-declaration;
* key ``"ffn."`` subkey ``3`` -> ADDR and key ``"ffn.3."`` subkey ``7`` -> ADDR (the live next
  coordinates under each prefix, which beam search reads one dimension at a time; the address
  there is one holder, the newest writer's).

Servers re-declare before the expiration passes.  Withdrawing stores ``None`` with a newer
expiration under the server's own subkey of the uid and, for the last prefix subkey, points it at
another live holder if there is one (else ``None``); readers skip ``None``.  Shallower prefix
subkeys are shared with other experts (maybe on other servers), so they are left to expire.

Any member may write these records, so readers that care pass ``trusted_servers`` (see ``trust.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from dht import DHTNode

from .grid import make_uid, parse_uid, prefix_key
from .trust import TrustPolicy, is_trusted

Record = tuple[str, "int | str", "str | None"]  # (key, subkey, value)


def _prefix_records(uid: str, value: str | None, last_only: bool) -> list[Record]:
    prefix, coords = parse_uid(uid)
    depths = [len(coords) - 1] if last_only else range(len(coords))
    return [(prefix_key(prefix, coords[:d]), coords[d], value) for d in depths]


async def _store(node: DHTNode, records: list[Record], expiration_time: float) -> bool:
    unique = {(key, sub): value for key, sub, value in records}  # prefixes shared by several uids once
    ok = await node.store_many([k for k, _ in unique], list(unique.values()), expiration_time,
                               [s for _, s in unique])
    return all(ok)


async def declare_experts(node: DHTNode, uids: Sequence[str], address: str, expiration_time: float) -> bool:
    """Store ``address`` as a holder of every uid, and the uids' prefixes pointing at it; True if
    every record was accepted."""
    records: list[Record] = []
    for uid in uids:
        records.append((uid, address, address))
        records += _prefix_records(uid, address, last_only=False)
    return await _store(node, records, expiration_time)


async def withdraw_experts(node: DHTNode, uids: Sequence[str], address: str, expiration_time: float) -> bool:
    """Remove ``address`` from the holders of every uid (``expiration_time`` must be newer than its
    declaration); each uid's last prefix subkey names another live holder, or None if none is left."""
    others = await get_expert_holders(node, uids, latest=True)
    records: list[Record] = []
    for uid in uids:
        records.append((uid, address, None))
        rest = [a for a in others[uid] if a != address]
        records += _prefix_records(uid, rest[0] if rest else None, last_only=True)
    return await _store(node, records, expiration_time)


def holders(entry_value: object) -> list[str]:
    """The live holders in a uid record, newest declaration first (withdrawn ones skipped)."""
    if not isinstance(entry_value, dict):
        return []
    live = [(getattr(item, "expiration_time", 0.0), sub) for sub, item in entry_value.items()
            if isinstance(sub, str) and getattr(item, "value", None) == sub]
    return [sub for _, sub in sorted(live, reverse=True)]


async def get_expert_holders(node: DHTNode, uids: Sequence[str], latest: bool = False,
                             trusted_servers: TrustPolicy | None = None) -> dict[str, list[str]]:
    """Every live holder's address of each uid, newest declaration first (empty where nobody
    declares it, or nobody ``trusted_servers`` trusts for it)."""
    found = await node.get_many(list(uids), latest=latest)
    out: dict[str, list[str]] = {}
    for uid in uids:
        item = found.get(uid)
        out[uid] = [a for a in holders(item.value if item is not None else None)
                    if is_trusted(trusted_servers, uid, a)]
    return out


async def get_experts(node: DHTNode, uids: Sequence[str], latest: bool = False,
                      trusted_servers: TrustPolicy | None = None) -> dict[str, str | None]:
    """One holder's address per uid (the newest declaration), or None where it is not declared
    (or withdrawn everywhere, or declared only at servers that ``trusted_servers`` does not trust)."""
    found = await get_expert_holders(node, uids, latest, trusted_servers)
    return {uid: addresses[0] if addresses else None for uid, addresses in found.items()}


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


__all__ = ["children", "declare_experts", "get_expert_holders", "get_experts", "holders", "make_uid",
           "withdraw_experts"]
