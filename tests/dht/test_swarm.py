"""A real swarm on loopback: every peer its own TCP endpoint, all in one event loop."""

from __future__ import annotations

import asyncio
import random
import time

import msgpack
import pydantic
import pytest

from dht import DHTNode, RecordTooLarge, ReplicaSets, SchemaValidator, SignatureValidator, ValidationError
from dht.routing import key_id, node_id_of, serialize_key
from p2p import P2P, Identity

pytestmark = pytest.mark.timeout(120)
HOUR = 3600


async def test_store_from_any_peer_get_from_any_other(make_swarm):
    nodes = await make_swarm(64)
    rng = random.Random(1)
    exp = time.time() + HOUR
    for i in range(40):
        assert await rng.choice(nodes).store(f"key{i}", {"i": i, "blob": bytes(range(i))}, exp)
    for i in range(40):
        got = await rng.choice(nodes).get(f"key{i}")
        assert got is not None and got.value == {"i": i, "blob": bytes(range(i))}
        assert got.expiration_time == exp
    assert await nodes[5].get("never stored") is None


async def test_batched_store_many_and_get_many(make_swarm):
    nodes = await make_swarm(32)
    exp = time.time() + HOUR
    keys = [("tuple", i) for i in range(50)]
    assert all(await nodes[0].store_many(keys, [i * i for i in range(50)], exp))
    got = await nodes[31].get_many(keys)
    assert {k[1]: v.value for k, v in got.items()} == {i: i * i for i in range(50)}


async def test_a_get_asking_one_replica_at_a_time_finds_the_same_with_fewer_calls(make_swarm):
    nodes = await make_swarm(24)
    exp = time.time() + HOUR
    keys = [f"prefix.{i}." for i in range(20)]
    assert all(await nodes[0].store_many(keys, list(range(20)), exp))
    reader = await DHTNode.create([str(nodes[5].address)], client_mode=True)
    try:
        sent = []
        for alpha in (None, 1):
            before = reader.stats["dht.find"]
            got = await reader.get_many(keys, alpha=alpha)
            assert {k: v.value for k, v in got.items()} == {k: i for i, k in enumerate(keys)}
            sent.append(reader.stats["dht.find"] - before)
        assert reader.stats["get_many"] == 2 and reader.stats["keys_traversed"] == 40
        assert sent[1] < sent[0], sent  # a background read's cost: one replica asked per key, not alpha = 3
    finally:
        await reader.shutdown()


async def test_a_store_at_the_replicas_found_before_looks_nothing_up_and_lands_where_a_lookup_would(make_swarm):
    nodes = await make_swarm(16)
    writer, reader = nodes[3], nodes[11]
    exp = time.time() + HOUR
    replicas = await writer.nearest_replicas("declared")
    assert len(replicas) == writer.num_replicas
    finds = 0
    call_find = writer._call_find

    async def counting(*args, **kwargs):
        nonlocal finds
        finds += 1
        return await call_find(*args, **kwargs)

    writer._call_find = counting  # observing the writer's own lookups, nothing replaced
    assert await writer.store("declared", "first", exp, subkey="me", at=replicas)
    assert await writer.store("declared", None, exp + 1, subkey="me", at=replicas)  # withdrawn
    assert finds == 0
    # read before any lookup: a get(latest=True) would itself copy the record to replicas that lacked it
    holders = {n.node_id for n in nodes if n.storage.get(key_id(serialize_key("declared"))) is not None}
    assert {c.node_id if c is not None else writer.node_id for c in replicas} <= holders
    got = await reader.get("declared", latest=True)  # a full lookup from elsewhere sees the withdrawal
    assert got is not None and got.value["me"].value is None


async def test_a_read_at_known_replicas_asks_each_once_without_contacts_and_sees_what_a_lookup_sees(make_swarm):
    nodes = await make_swarm(16)
    writer, reader = nodes[2], nodes[9]
    exp = time.time() + HOUR
    for i, n in enumerate(nodes[:6]):
        assert await n.store("polled", {"i": i}, exp, subkey=f"peer{i}")
    replicas = await reader.nearest_replicas("polled")
    reader.p2p.traffic.reset()
    got = await reader.get("polled", at=replicas)
    find = reader.p2p.traffic.by_method["dht.find"]  # counts the calls it made and any it served
    asked = sum(c is not None for c in replicas)
    assert (find.messages_out, find.messages_in) == (asked, asked)  # one call per replica, no lookup
    answers = find.bytes_in
    looked_up = await writer.get("polled", latest=True)
    assert got is not None and looked_up is not None
    assert {k: v.value for k, v in got.value.items()} == {k: v.value for k, v in looked_up.value.items()}
    assert len(got.value) == 6
    reader.p2p.traffic.reset()
    await reader.get("polled", latest=True)
    assert reader.p2p.traffic.by_method["dht.find"].bytes_in > answers  # a lookup's answers carry contacts


async def test_later_expiration_wins_across_the_swarm(make_swarm):
    nodes = await make_swarm(24)
    now = time.time()
    assert await nodes[1].store("k", "new", now + 2 * HOUR)
    assert not await nodes[2].store("k", "old", now + HOUR)  # every replica refuses the older one
    assert (await nodes[3].get("k", latest=True)).value == "new"


async def test_records_expire(make_swarm):
    clock = [1_000_000.0]
    # a clock that stands still does not advance with time.monotonic(), as the swarm clock's samples
    # assume: no correction, every node reads the shared clock as it is
    nodes = await make_swarm(16, clock=lambda: clock[0], clock_drift=0.0, clock_sample_interval=0)
    assert await nodes[0].store("short", 1, clock[0] + 10)
    assert await nodes[0].store("long", 2, clock[0] + 100)
    assert (await nodes[9].get("short")).value == 1
    clock[0] += 50  # time passes for every node (they share the clock)
    assert await nodes[9].get("short") is None and await nodes[4].get("short", latest=True) is None
    assert (await nodes[9].get("long")).value == 2


async def test_subkeys_from_many_writers_merge_into_one_lookup(make_swarm):
    nodes = await make_swarm(40)
    exp = time.time() + HOUR
    await asyncio.gather(*(n.store("progress", {"epoch": i}, exp, subkey=f"peer{i}")
                           for i, n in enumerate(nodes[:20])))
    got = await nodes[39].get("progress", latest=True)
    assert {k: v.value for k, v in got.value.items()} == {f"peer{i}": {"epoch": i} for i in range(20)}


async def test_records_survive_a_quarter_of_the_peers_dying(make_swarm):
    # 8 replicas: the chance that all of one key's replicas are among the 16 killed is about 1e-5
    nodes = await make_swarm(64, num_replicas=8)
    rng = random.Random(7)
    exp = time.time() + HOUR
    for i in range(30):
        assert await rng.choice(nodes).store(f"survivor{i}", i, exp)
    victims = rng.sample(nodes[1:], 16)
    await asyncio.gather(*(v.shutdown() for v in victims))
    alive = [n for n in nodes if n not in victims]
    for i in range(30):
        got = await rng.choice(alive).get(f"survivor{i}")
        assert got is not None and got.value == i, f"survivor{i} lost"


async def test_a_late_joiner_finds_old_records(make_swarm):
    nodes = await make_swarm(32)
    exp = time.time() + HOUR
    for i in range(20):
        await nodes[i].store(f"old{i}", i, exp)
    late = await DHTNode.create([str(nodes[17].address)])
    make_swarm.created.append(late)
    for i in range(20):
        assert (await late.get(f"old{i}")).value == i


async def _signed_swarm(make_swarm, n):
    """Each peer validates signatures and signs with its own identity (p2p and records share the key)."""
    nodes = []
    identities = [Identity() for _ in range(n)]
    first = await DHTNode.create(identity=identities[0], validators=[SignatureValidator(identities[0])])
    make_swarm.created.append(first)
    nodes.append(first)
    for ident in identities[1:]:
        node = await DHTNode.create([str(first.address)], identity=ident, validators=[SignatureValidator(ident)])
        make_swarm.created.append(node)
        nodes.append(node)
    return nodes, identities


async def test_forged_signed_record_is_refused_by_every_replica(make_swarm):
    nodes, identities = await _signed_swarm(make_swarm, 24)
    alice, mallory = nodes[0], nodes[1]
    marker = SignatureValidator(identities[0]).marker
    exp = time.time() + HOUR
    assert await alice.store("progress", {"epoch": 5}, exp, subkey=marker)
    with pytest.raises(ValidationError):  # mallory's own node will not even sign it
        await mallory.store("progress", {"epoch": 999}, exp + 10, subkey=marker)
    # mallory bypasses her node and sends raw store requests, unsigned and with her signature
    forged_value = b"\xc1" + msgpack.packb([msgpack.packb({"epoch": 999}), [identities[1].sign(b"x" * 10)]])
    raw = [[serialize_key("progress"), serialize_key(marker), forged_value, exp + 10]]
    replies = await asyncio.gather(*(mallory.p2p.call(n.address, "dht.store", {"r": raw}) for n in nodes[2:]))
    assert all(isinstance(r[0], str) and "signature" in r[0] for r in replies)
    got = await nodes[7].get("progress", latest=True)
    assert {k: v.value for k, v in got.value.items()} == {marker: {"epoch": 5}}


class Progress(pydantic.BaseModel):
    epoch: int
    samples_per_second: float


async def test_schema_violation_is_refused_with_a_readable_reason(make_swarm):
    nodes = await make_swarm(12, validators=[SchemaValidator({"progress": Progress})])
    exp = time.time() + HOUR
    assert await nodes[0].store("progress", {"epoch": 1, "samples_per_second": 2.5}, exp, subkey="a")
    with pytest.raises(ValidationError, match=r"epoch.*(integer|int)"):
        await nodes[0].store("progress", {"epoch": "one", "samples_per_second": 2.5}, exp, subkey="b")
    bad = [[serialize_key("progress"), serialize_key("c"), msgpack.packb({"epoch": 1}), exp]]
    reply = await nodes[1].p2p.call(nodes[2].address, "dht.store", {"r": bad})
    assert "Progress" in reply[0] and "samples_per_second" in reply[0]
    got = await nodes[5].get("progress", latest=True)
    assert list(got.value) == ["a"]


async def test_oversize_values_are_refused(make_swarm):
    nodes = await make_swarm(8, max_value_bytes=1000)
    exp = time.time() + HOUR
    with pytest.raises(RecordTooLarge, match="value of 1003 bytes exceeds the limit of 1000"):
        await nodes[0].store("big", b"x" * 1000, exp)
    with pytest.raises(RecordTooLarge, match="key"):
        await nodes[0].store("k" * 2000, 1, exp)
    raw = [[serialize_key("big"), None, b"x" * 5000, exp]]
    reply = await nodes[0].p2p.call(nodes[1].address, "dht.store", {"r": raw})
    assert "over 1000 bytes" in reply[0]
    assert await nodes[3].get("big") is None


async def test_a_peer_answering_garbage_does_not_break_lookups(make_swarm):
    nodes = await make_swarm(24)
    liar = await P2P.create()

    async def garbage(request, ctx):
        return {"not": "what you asked"} if random.random() < 0.5 else [[b"\x00", "junk"]] * 3

    for method in ("dht.find", "dht.store", "dht.ping"):
        liar.register(method, garbage)
    try:
        # announce the liar to every node, so it sits in their routing tables
        await asyncio.gather(*(liar.call(n.address, "dht.ping", {"a": liar.listen_address_str}) for n in nodes))
        liar_id = node_id_of(liar.peer_id)
        assert sum(liar_id in n.routing for n in nodes) >= len(nodes) // 2  # the liar is in most tables
        exp = time.time() + HOUR
        rng = random.Random(3)
        for i in range(25):
            assert await rng.choice(nodes).store(f"g{i}", i, exp)
        for i in range(25):
            assert (await rng.choice(nodes).get(f"g{i}")).value == i
    finally:
        await liar.shutdown()


async def test_nodes_check_owner_signatures_even_without_validators(make_swarm):
    nodes = await make_swarm(6)  # no validators given
    marker = SignatureValidator(Identity()).marker
    exp = time.time() + HOUR
    unsigned = [[serialize_key("k"), serialize_key(marker), msgpack.packb(1), exp]]
    replies = await asyncio.gather(*(nodes[0].p2p.call(n.address, "dht.store", {"r": unsigned}) for n in nodes[1:]))
    assert all(isinstance(r[0], str) and "signature" in r[0] for r in replies)
    own = SignatureValidator(nodes[0].p2p.identity).marker  # a node signs what its own identity owns
    assert await nodes[0].store("k", 2, exp, subkey=own)
    assert {k: v.value for k, v in (await nodes[3].get("k", latest=True)).value.items()} == {own: 2}


async def test_max_expiration_is_configurable(make_swarm):
    nodes = await make_swarm(3, max_expiration=60)
    with pytest.raises(ValueError, match="max_expiration=60"):
        await nodes[0].store("k", 1, time.time() + 120)
    assert await nodes[0].store("k", 1, time.time() + 50)
    raw = [[serialize_key("k2"), None, msgpack.packb(1), time.time() + 120]]
    assert await nodes[0].p2p.call(nodes[1].address, "dht.store", {"r": raw}) == [False]


async def test_a_replica_set_found_alone_is_found_again_once_others_join(make_swarm):
    """A run's first peer finds itself the only replica of its progress key; reused as it was, its
    records would stay on itself alone, and a newcomer reading at other replicas would not see them."""
    first = (await make_swarm(1))[0]
    sets = ReplicaSets(first)
    assert await sets.of("run.progress") == [None]
    others = [await DHTNode.create([str(first.address)]) for _ in range(3)]
    make_swarm.created.extend(others)
    replicas = await sets.of("run.progress")
    assert len(replicas) == 4 and None in replicas  # every peer, not just the first
    assert await first.store("run.progress", "first's record", time.time() + HOUR, at=replicas)
    for node in others:
        near = (await ReplicaSets(node).of("run.progress"))[:3]
        got = await node.get("run.progress", at=near)
        assert got is not None and got.value == "first's record"


async def test_an_initial_peer_too_busy_to_answer_at_first_is_tried_again(make_swarm):
    """A joiner's first handshake with its only initial peer times out (a busy head): it tries again
    and joins, instead of failing to start."""
    (node,) = await make_swarm(1)
    await node.store("k", "v", time.time() + HOUR)
    accepted: list[asyncio.StreamWriter] = []

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def front(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        if len(accepted) == 1:
            return  # the first connection gets no answer at all
        up_reader, up_writer = await asyncio.open_connection(node.address.host, node.address.port)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    proxy = await asyncio.start_server(front, "127.0.0.1", 0)
    host, port = proxy.sockets[0].getsockname()[:2]
    try:
        joiner = await DHTNode.create([f"{host}:{port}"], rpc_timeout=2.0)  # the silent first try costs this
        make_swarm.created.append(joiner)
        assert len(accepted) >= 2 and joiner.routing.get(node.node_id) is not None
        assert (await joiner.get("k")).value == "v"
    finally:
        for writer in accepted:
            writer.close()
        proxy.close()
        await proxy.wait_closed()


async def test_an_initial_peer_that_refuses_the_connection_is_not_tried_again(make_swarm, caplog):
    probe = await P2P.create()
    address = str(probe.address)
    await probe.shutdown()
    with caplog.at_level("INFO", logger="dht.node"), pytest.raises(Exception, match="none of the 1 initial peers"):
        await DHTNode.create([address], rpc_timeout=0.5)
    assert not [r for r in caplog.records if "did not answer" in r.message]  # refused: nothing listens there
