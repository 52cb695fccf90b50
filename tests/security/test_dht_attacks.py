"""Hostile members against the DHT: they hold valid identities and sign their own records, and try
to wipe, poison or bloat the run's shared keys.  Real peers over loopback; every attack is sent
with the raw STORE RPC, past the attacker's own writer checks."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from averaging.matchmaking import Matchmaker
from dht import DHT, CompositeValidator, DHTNode, DHTRecord, SignatureValidator
from dht.routing import key_id, serialize_key
from experts import declare_experts, get_experts, withdraw_experts
from orchestrator.instance.dht_peer import start_dht_peer
from p2p import Identity, PeerAddress
from workers.progress import PeerProgress, ProgressTracker
from workers.run_keys import run_validators
from workers.state import StateSharer

pytestmark = pytest.mark.timeout(30)
RUN = "atk"
PROGRESS = f"{RUN}.progress"
DAY = 86400.0
TEN_YEARS = 10 * 365 * DAY
ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.fixture
async def swarm():
    """``await swarm(n, rules=True, **options)``: n honest peers of run RUN (each with the run's
    validators), and ``swarm.attacker()``: a member whose node checks nothing and stores anything."""
    created: list[DHTNode] = []

    async def make(n: int, rules: bool = True, **options) -> list[DHTNode]:
        nodes = []
        for _ in range(n):
            identity = Identity()
            validators = run_validators(RUN, identity) if rules else [SignatureValidator(identity)]
            boot = [str(created[0].address)] if created else []
            node = await DHTNode.create(boot, identity=identity, validators=validators, **options)
            created.append(node)
            nodes.append(node)
        return nodes

    async def attacker() -> DHTNode:
        node = await DHTNode.create([str(created[0].address)], verify_signatures=False)
        created.append(node)
        return node

    make.attacker = attacker
    yield make
    await asyncio.gather(*(node.shutdown() for node in created))


def report(i: int) -> PeerProgress:
    return PeerProgress(epoch=3, samples=10 + i, samples_per_second=1.5 * i, time=1000.0 + i, loss=0.25 * i)


async def honest_reports(nodes: list[DHTNode]) -> dict[str, PeerProgress]:
    """Each node publishes its progress the way workers do (a signed subkey of <run>.progress)."""
    out = {}
    for i, node in enumerate(nodes):
        signer = next(v for v in node.validator.validators if isinstance(v, SignatureValidator))
        tracker = ProgressTracker(node, RUN, 100, signer)
        await tracker.report(report(i))
        out[tracker.subkey] = report(i)
    return out


async def read_progress(node: DHTNode) -> dict[str, PeerProgress]:
    return await ProgressTracker(node, RUN, 100, SignatureValidator(Identity())).peers()


async def send_raw(attacker: DHTNode, nodes: list[DHTNode], records: list[list]) -> list[list]:
    """The STORE RPC to every node, as the attacker crafted it; each node's per-record replies."""
    return await asyncio.gather(*(attacker.p2p.call(n.address, "dht.store", {"r": records}) for n in nodes))


def signed(identity: Identity, key: str, subkey: str, value: object, exp: float) -> list:
    """A record its writer really signed (members can sign their own subkeys)."""
    rec = CompositeValidator([SignatureValidator(identity)]).sign(
        DHTRecord(serialize_key(key), serialize_key(subkey), msgpack.packb(value), exp))
    return [rec.key, rec.subkey, rec.value, rec.expiration_time]


def held(node: DHTNode, key: str):
    return node.storage.get(key_id(serialize_key(key)))


async def test_a_ten_year_plain_value_cannot_wipe_the_progress_dictionary(swarm):
    nodes = await swarm(5)
    attacker = await swarm.attacker()
    honest = await honest_reports(nodes[:3])
    with pytest.raises(ValueError, match="max_expiration"):  # its own API tells a writer the mistake
        await attacker.store(PROGRESS, "wiped", time.time() + TEN_YEARS)
    before = [held(node, PROGRESS) for node in nodes]
    assert sum(entry is not None and len(entry.subkeys) == 3 for entry in before) >= 4  # the replicas
    for exp in (time.time() + TEN_YEARS, time.time() + 60):  # far ahead, or merely later than every subkey
        replies = await send_raw(attacker, nodes, [[serialize_key(PROGRESS), None, msgpack.packb("wiped"), exp]])
        assert all(isinstance(r[0], str) and "refused a plain value" in r[0] for r in replies), replies
    assert [held(node, PROGRESS) for node in nodes] == before
    assert await read_progress(nodes[4]) == honest


async def test_without_schemas_a_plain_value_still_cannot_replace_a_live_dictionary(swarm):
    nodes = await swarm(4, rules=False)
    attacker = await swarm.attacker()
    exp = time.time() + 60
    for i, node in enumerate(nodes):
        assert await node.store("shared", {"n": i}, exp, subkey=f"peer{i}")
    replies = await send_raw(attacker, nodes, [[serialize_key("shared"), None, msgpack.packb("wiped"), exp + 3600]])
    assert [r[0] for r in replies] == [False] * len(nodes)
    got = await nodes[2].get("shared", latest=True)
    assert {k: v.value for k, v in got.value.items()} == {f"peer{i}": {"n": i} for i in range(4)}


async def test_expirations_beyond_a_day_are_refused_and_a_day_is_fine(swarm):
    nodes = await swarm(4, rules=False)
    attacker = await swarm.attacker()
    far = time.time() + TEN_YEARS
    replies = await send_raw(attacker, nodes, [[serialize_key("anything"), None, msgpack.packb(1), far],
                                               [serialize_key("dict"), serialize_key("s"), msgpack.packb(1), far]])
    assert all(r == [False, False] for r in replies), replies
    assert all(held(n, "anything") is None and held(n, "dict") is None for n in nodes)
    with pytest.raises(ValueError, match="max_expiration=86400"):
        await nodes[0].store("anything", 1, time.time() + 2 * DAY)
    day = time.time() + DAY
    assert await nodes[0].store("anything", 2, day)
    got = await nodes[3].get("anything", latest=True)
    assert got is not None and (got.value, got.expiration_time) == (2, day)


async def test_an_undecodable_subkey_costs_readers_only_that_subkey(swarm, caplog):
    nodes = await swarm(4, rules=False)
    attacker = await swarm.attacker()
    exp = time.time() + 60
    for i in range(3):
        assert await nodes[i].store("mixed", [i, "ok"], exp, subkey=f"peer{i}")
    garbage = [[serialize_key("mixed"), serialize_key("evil"), b"\xc1\xc1 not msgpack", exp],
               [serialize_key("mixed"), b"\xc1", msgpack.packb(1), exp],  # an undecodable subkey
               [serialize_key("mixed"), msgpack.packb([1, 2]), msgpack.packb(1), exp]]  # fine: a tuple subkey
    replies = await send_raw(attacker, nodes, garbage)
    assert all(isinstance(r[0], str) and "msgpack" in r[0] and isinstance(r[1], str) for r in replies), replies
    # a replica that skipped those checks (the attacker's own, or any old peer) serves them anyway
    for node in (attacker, nodes[3]):
        for key, sk, value, expiration in garbage[:2]:
            assert node.storage.store(key_id(key), key, sk, value, expiration)
    expected = {f"peer{i}": [i, "ok"] for i in range(3)} | {(1, 2): 1}
    for reader in (nodes[3], nodes[1]):  # the garbage in its own storage, or only from others
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="dht.node"):
            got = await reader.get("mixed", latest=True)
        assert {k: v.value for k, v in got.value.items()} == expected
        assert any("'mixed'" in r.getMessage() and "msgpack" in r.getMessage() for r in caplog.records)


async def test_schema_violating_progress_is_refused_everywhere(swarm):
    nodes = await swarm(5)
    attacker = await swarm.attacker()
    honest = await honest_reports(nodes[:2])
    mallory = Identity()
    subkey = f"{SignatureValidator(mallory).marker}{mallory.peer_id}"
    good = report(9).model_dump()
    exp = time.time() + 30
    bad = [signed(mallory, PROGRESS, subkey, {**good, "epoch": "x"}, exp),
           signed(mallory, PROGRESS, subkey, {**good, "epoch": -1}, exp),
           signed(mallory, PROGRESS, subkey, {**good, "samples_per_second": float("inf")}, exp),
           [serialize_key(PROGRESS), serialize_key(str(mallory.peer_id)), msgpack.packb(good), exp]]  # no owner
    replies = await send_raw(attacker, nodes, bad)
    for r in replies:
        assert all(isinstance(x, str) for x in r), r
        assert "epoch" in r[0] and "epoch" in r[1] and "samples_per_second" in r[2] and "owner" in r[3]
    # the attacker's own replica holds one anyway: readers drop it
    attacker.storage.store(key_id(serialize_key(PROGRESS)), *bad[1])
    for node in nodes:
        assert await read_progress(node) == honest


async def test_a_subkey_flood_stops_at_the_per_key_caps(swarm):
    nodes = await swarm(4, max_subkeys=8, max_key_total_bytes=8000)
    attacker = await swarm.attacker()
    honest = await honest_reports(nodes[:3])
    exp = time.time() + 30
    flood = []
    for i in range(20):
        sybil = Identity()
        flood.append(signed(sybil, PROGRESS, f"{SignatureValidator(sybil).marker}{sybil.peer_id}",
                            report(i).model_dump(), exp))
    before = [len(held(node, PROGRESS).subkeys) for node in nodes]
    replies = await send_raw(attacker, nodes, flood)
    for node, n, r in zip(nodes, before, replies, strict=True):
        assert r == [True] * (8 - n) + [False] * (20 - 8 + n)  # filled up to the cap, not one more
        subkeys = held(node, PROGRESS).subkeys
        assert len(subkeys) == 8 and all(serialize_key(k) in subkeys for k in honest if n == 3)
    got = await read_progress(nodes[3])
    assert {k: got[k] for k in honest} == honest and len(got) <= 4 * 8

    # bytes: a few padded values fill max_key_total_bytes long before max_subkeys
    fat = []
    for _ in range(6):
        sybil = Identity()
        fat.append(signed(sybil, f"{RUN}.state", f"{SignatureValidator(sybil).marker}{sybil.peer_id}",
                          {"epoch": 1, "a": "127.0.0.1:1", "pad": "x" * 3000}, exp))
    replies = await send_raw(attacker, nodes, fat)
    assert all(r == [True, True, False, False, False, False] for r in replies), replies


async def test_the_default_caps_bound_one_key(swarm):
    (node,) = await swarm(1, rules=False)
    attacker = await swarm.attacker()
    exp = time.time() + 30
    key = serialize_key("open")
    flood = [[key, serialize_key(f"s{i}"), msgpack.packb(i), exp] for i in range(1100)]
    (reply,) = await send_raw(attacker, [node], flood)
    assert reply == [True] * 1024 + [False] * 76
    big = [[serialize_key("big"), serialize_key(i), msgpack.packb(b"x" * 1_000_000), exp] for i in range(3)]
    (reply,) = await send_raw(attacker, [node], big)
    assert reply == [True, True, False]  # 2 MiB per key


@pytest.mark.parametrize("run", [None, RUN])
async def test_a_spotswarm_dht_peer_refuses_forged_owner_subkeys(swarm, run):
    peer = await start_dht_peer("127.0.0.1", 0, [], run=run)
    try:
        (alice,) = await swarm(1)
        attacker = await swarm.attacker()
        marker = SignatureValidator(alice.p2p.identity).marker
        exp = time.time() + 30
        forged = signed(Identity(), "anything", "x", 1, exp)  # someone else's signature ...
        forged[1] = serialize_key(f"{marker}{alice.peer_id}")  # ... on alice's subkey
        unsigned = [serialize_key(PROGRESS), forged[1], msgpack.packb(report(0).model_dump()), exp]
        (reply,) = await send_raw(attacker, [peer], [forged, unsigned])
        assert all(isinstance(r, str) and "signature" in r for r in reply), reply
        assert held(peer, "anything") is None and held(peer, PROGRESS) is None
        plain = [serialize_key(PROGRESS), None, msgpack.packb("wiped"), exp]  # the run's rules, with --run
        (reply,) = await send_raw(attacker, [peer], [plain])
        assert (reply[0] is True) == (run is None)
    finally:
        await peer.shutdown()


async def test_every_honest_writer_of_a_run_passes_its_rules(swarm):
    """The rules refuse what attackers send and nothing the run's own code writes."""
    nodes = await swarm(3)
    honest = await honest_reports(nodes[:2])
    signer = next(v for v in nodes[0].validator.validators if isinstance(v, SignatureValidator))
    tracker = ProgressTracker(nodes[0], RUN, 100, signer)
    await tracker.withdraw()
    state = StateSharer(nodes[1], RUN, signer=next(v for v in nodes[1].validator.validators
                                                   if isinstance(v, SignatureValidator)),
                        get_state=lambda: (0, {}))
    try:
        await state.advertise(4)
        assert await StateSharer(nodes[2], RUN, SignatureValidator(Identity()), lambda: (0, {})).donors() == [
            (4, str(nodes[1].address))]
        await state.withdraw()
    finally:
        state.close()
    assert await read_progress(nodes[2]) == {k: v for k, v in honest.items() if k != tracker.subkey}

    # a lone peer looking for a group: it declares itself, finds nobody and withdraws (its own node
    # checks every record it writes against the same rules, so a refusal would raise here)
    matchmaker = Matchmaker(nodes[0], f"{RUN}_grad", [], "h", 4, target_group_size=2, min_group_size=2,
                            min_matchmaking_time=0.1, request_timeout=0.2, bandwidth=100.0)
    try:
        loop = asyncio.get_running_loop()
        assert await matchmaker.form_group("e1", loop.time() + 0.3) is None
    finally:
        await matchmaker.close()  # waits for the withdrawal to land
    got = await nodes[2].get(f"{RUN}_grad.mm.e1", latest=True)
    assert {k: v.value for k, v in got.value.items()} == {str(nodes[0].peer_id): None}
    # a group below that will not come says so under the key above (averaging/grouped.py)
    matchmaker = Matchmaker(nodes[0], f"{RUN}_grad", [], "h", 4, target_group_size=2, min_group_size=2,
                            min_matchmaking_time=0.1, request_timeout=0.2, bandwidth=100.0)
    try:
        await matchmaker.declare_gone("e2", 3, 30.0)
    finally:
        await matchmaker.close()
    got = await nodes[2].get(f"{RUN}_grad.mm.e2", latest=True)
    assert [v.value["g"] for v in got.value.values()] == [3]

    exp = time.time() + 30
    assert await declare_experts(nodes[0], ["ffn.0.1", "ffn.1.0"], str(nodes[0].address), exp)
    assert await get_experts(nodes[2], ["ffn.0.1"]) == {"ffn.0.1": str(nodes[0].address)}
    assert await withdraw_experts(nodes[0], ["ffn.0.1"], str(nodes[0].address), exp + 1)


@pytest.mark.timeout(60)
def test_the_spotswarm_dht_command_installs_the_runs_rules():
    cmd = [sys.executable, "-m", "orchestrator.cli.main", "dht", "--run", RUN]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = proc.stdout.readline()
        assert line.startswith("DHT peer listening at "), line
        address = PeerAddress.parse(line.split()[-1])
        exp = time.time() + 30
        alice = SignatureValidator(Identity()).marker
        records = [[serialize_key(PROGRESS), None, msgpack.packb("wiped"), exp],
                   [serialize_key(PROGRESS), serialize_key(alice), msgpack.packb(report(0).model_dump()), exp]]
        with DHT() as attacker:
            reply = attacker.run_coroutine(lambda n: n.p2p.call(address, "dht.store", {"r": records}))
        assert "refused a plain value" in reply[0] and "signature" in reply[1], reply
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
