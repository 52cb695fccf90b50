"""Matchmaking against a member's lies: silent leaders it declares, bandwidth it claims."""

from __future__ import annotations

import asyncio
import os

import msgpack
import pytest
import torch

from averaging import DecentralizedAverager
from averaging.load_balancing import SHARE_FACTOR, claims_within_reason, load_balanced_parts
from dht import DHTNode
from dht.validation import owner_marker
from p2p import Identity, PeerID

pytestmark = pytest.mark.timeout(60)


async def silent_socket() -> tuple[asyncio.Server, list[asyncio.StreamWriter]]:
    """A listener that accepts connections and never says a word."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    return await asyncio.start_server(hold, "127.0.0.1", 0), held


async def test_declared_leaders_that_never_answer_do_not_stop_the_group_forming():
    first = await DHTNode.create()
    nodes = [first] + [await DHTNode.create([str(first.address)]) for _ in range(3)]
    rogues = [await DHTNode.create([str(first.address)]) for _ in range(5)]  # five members, one declaration each
    server, held = await silent_socket()
    port = server.sockets[0].getsockname()[1]
    averagers = [DecentralizedAverager([torch.full((8,), float(i))], n, "mm", target_group_size=4,
                                       min_matchmaking_time=5.0) for i, n in enumerate(nodes)]
    try:
        now = first.clock.now()
        for rogue in rogues:  # declared well before anyone honest: each would be tried as the leader first
            subkey = owner_marker(rogue.p2p.identity.public_key) + str(rogue.peer_id)
            await rogue.store("mm.mm.all", {"a": f"{rogue.peer_id}@127.0.0.1:{port}", "t": now - 60, "bw": 100.0,
                                            "h": ""}, now + 60, subkey=subkey)
        # a dead leader used to cost a follower its whole request timeout; 5 of them, the whole window
        results = await asyncio.gather(*(a.step(timeout=6.0) for a in averagers))
        assert [r.group_size for r in results] == [4, 4, 4, 4]
        assert all(torch.equal(a.tensors[0], torch.full((8,), 1.5)) for a in averagers)
    finally:
        for a in averagers:
            await a.shutdown()
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()
        await asyncio.gather(*(n.shutdown() for n in reversed(rogues + nodes)))


async def test_a_silent_leader_is_skipped_once_live_candidates_answered_not_after_the_timeout():
    from averaging.leader_probe import LeaderProbes
    from p2p import P2P

    honest = [await P2P.create() for _ in range(3)]
    me = await P2P.create()
    server, held = await silent_socket()
    silent = (PeerID(os.urandom(32)), f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
    probes = LeaderProbes(me.connect, timeout=30.0)
    loop = asyncio.get_running_loop()
    try:
        probes.start([silent, *((p.peer_id, str(p.address)) for p in honest)])
        started = loop.time()
        assert not await probes.answers(*silent)
        waited = loop.time() - started
        assert all([await probes.answers(p.peer_id, str(p.address)) for p in honest])
        assert waited < 5.0  # the answering candidates set the bar (0.1 s here), not the 30-s timeout
    finally:
        await probes.close()
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()
        for p in [me, *honest]:
            await p.shutdown()


async def test_a_member_floods_a_key_with_declarations_in_any_name_and_only_its_own_counts():
    """Issue 52: 1024 fake declarations stopped every group forming for the whole window.  Where members
    are not trusted, declarations are signed subkeys ``[owner:<key>]<peer id>``: one member holds at most
    its share of a key, and of what it writes only the declaration in its own name is read."""
    first = await DHTNode.create()
    nodes = [first] + [await DHTNode.create([str(first.address)]) for _ in range(3)]
    rogue = await DHTNode.create([str(first.address)])
    averagers = [DecentralizedAverager([torch.full((8,), float(i))], n, "mm", target_group_size=4,
                                       min_matchmaking_time=5.0, byzantine="clip") for i, n in enumerate(nodes)]
    try:
        now = first.clock.now()
        marker = owner_marker(rogue.p2p.identity.public_key)
        stored = 0
        for _ in range(1024):  # in other (made-up) peers' names, under its own signature
            fake = PeerID(os.urandom(32))
            stored += bool(await rogue.store("mm.mm.all", {"a": f"{fake}@127.0.0.1:9", "t": now - 60, "bw": 100.0,
                                                           "h": ""}, now + 60, subkey=marker + str(fake)))
        unsigned = PeerID(os.urandom(32))  # and unsigned, as any peer id
        await rogue.store("mm.mm.all", {"a": f"{unsigned}@127.0.0.1:9", "t": now - 60, "bw": 100.0, "h": ""},
                          now + 60, subkey=str(unsigned))
        found = await first.get("mm.mm.all", latest=True)
        share = max(int(first.storage.max_subkeys * first.storage.owner_share), first.storage.min_owner_subkeys)
        assert len(found.value) <= share + 1 and stored <= share  # its share of the key, and the unsigned one
        started = asyncio.get_running_loop().time()
        results = await asyncio.gather(*(a.step(timeout=6.0) for a in averagers))
        assert [r.group_size for r in results] == [4, 4, 4, 4]
        # the group closed when full, not after the 5 s window (each fake would cost a probe's second)
        assert asyncio.get_running_loop().time() - started < 3.0
    finally:
        for a in averagers:
            await a.shutdown()
        await asyncio.gather(*(n.shutdown() for n in reversed([*nodes, rogue])))


def test_a_huge_bandwidth_claim_buys_at_most_a_bounded_part():
    numel, n = 4000, 4
    honest = [100.0] * (n - 1)
    sizes = load_balanced_parts(numel, [*honest, 1e6], bounded=True)
    assert sizes[-1] <= SHARE_FACTOR / n * numel  # the LP alone gives it all 4000
    assert sum(sizes) == numel
    assert all(s > 0 for s in sizes[:-1])  # every honest peer still reduces a part of its own
    # honest declarations are left as they are
    assert claims_within_reason([50.0, 100.0, 150.0]) == [50.0, 100.0, 150.0]
    assert claims_within_reason([0.0, 0.0]) == [0.0, 0.0]


def test_a_run_that_does_not_trust_its_trainers_refuses_unsigned_declarations():
    from dht.routing import serialize_key
    from dht.validation import DHTRecord, SchemaValidator, ValidationError
    from workers.run_keys import run_validators

    identity = Identity()

    def schema(byzantine: str) -> SchemaValidator:
        return next(v for v in run_validators("r", identity, byzantine) if isinstance(v, SchemaValidator))

    def declaration(key: str, subkey: str) -> DHTRecord:
        return DHTRecord(serialize_key(key), serialize_key(subkey),
                         msgpack.packb({"a": None, "t": 1.0, "bw": 0.0, "h": ""}), 1e12)

    bare, signed = str(identity.peer_id), owner_marker(identity.public_key) + str(identity.peer_id)
    with pytest.raises(ValidationError, match="signed matchmaking keys"):
        schema("verify").validate(declaration("r_grad.mm.e1", bare))
    schema("verify").validate(declaration("r_grad.mm.e1", signed))
    schema("off").validate(declaration("r_grad.mm.e1", bare))  # a trusted fleet's declarations cost no signature
    # an expert host's own averaging keys are not a trainer's: they stay open
    schema("verify").validate(declaration("r_xffn_0.mm.all", bare))
