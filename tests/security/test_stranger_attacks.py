"""A stranger with nothing but one bootstrap address and a fresh key, against a run's members (real
peers on loopback, membership on as in every run): before membership it could join an averaging
group and move every honest result from 2.0 to about 10^6, take over an expert's uid, and publish a
validly signed progress record for epoch 10^6.  Now every one of its calls is refused at the
handshake, with a certificate or without, and the members' results are exactly what they would be
without it."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from averaging import DecentralizedAverager
from dht import DHTNode, SignatureValidator
from experts.declare import declare_experts, get_experts
from p2p import P2P, Identity, NotAMember
from p2p.membership import Authority, Membership
from workers.progress import PeerProgress, ProgressTracker
from workers.run_keys import run_validators

RUN = "r"
pytestmark = pytest.mark.timeout(60)


def membership(authority: Authority, identity: Identity) -> Membership:
    return Membership(RUN, authority.public_key, authority.issue(identity.peer_id, 600, roles=("worker",)))


@pytest.fixture
async def run():
    """``await run(n)``: n members of one run, joined through the first; shut down after."""
    authority = Authority(Identity(), RUN)
    created: list[DHTNode] = []

    async def factory(n: int) -> tuple[Authority, list[DHTNode]]:
        for _ in range(n):
            identity = Identity()
            initial = [str(created[0].address)] if created else []
            created.append(await DHTNode.create(initial, identity=identity, validators=run_validators(RUN, identity),
                                                p2p_options={"membership": membership(authority, identity)}))
        return authority, list(created)

    yield factory
    await asyncio.gather(*(node.shutdown() for node in reversed(created)))


async def stranger_nodes() -> list[DHTNode]:
    """A stranger as it can be: a fresh key and no certificate, and one with a well-formed certificate
    signed by an authority of its own for the same run name."""
    nobody = await DHTNode.create()
    forger_identity = Identity()
    forged = membership(Authority(Identity(), RUN), forger_identity)
    forger = await DHTNode.create(identity=forger_identity, p2p_options={"membership": forged})
    return [nobody, forger]


async def test_a_stranger_cannot_join_the_swarm(run):
    _, members = await run(2)
    for stranger in await stranger_nodes():
        try:
            with pytest.raises(NotAMember, match="refused this peer as a member"):
                await stranger.bootstrap([str(members[0].address)])
            assert stranger.p2p.connected_peers() == []
        finally:
            await stranger.shutdown()
    assert all(m.p2p.num_connections == 1 for m in members)  # each other only


async def test_a_stranger_cannot_move_an_all_reduce(run):
    _, members = await run(3)
    tensors = [torch.full((1000,), 2.0) for _ in members]
    averagers = [DecentralizedAverager([t], m, f"{RUN}_avg", target_group_size=4, min_matchmaking_time=1.0)
                 for t, m in zip(tensors, members, strict=True)]
    strangers = await stranger_nodes()
    poison = torch.full((1000,), 1e6)
    hostile = [DecentralizedAverager([poison.clone()], s, f"{RUN}_avg", target_group_size=4, min_matchmaking_time=1.0)
               for s in strangers]
    try:
        # the stranger knows a member's address and the matchmaking method: it calls it directly
        for s in strangers:
            with pytest.raises(NotAMember):
                await s.p2p.call(members[0].address, averagers[0].matchmaker.method,
                                 {"k": "all", "schema": [[1000]], "bw": 100.0, "w": 1.0, "a": None}, timeout=5)
        results = await asyncio.gather(*(a.step(timeout=20) for a in averagers),
                                       *(h.step(timeout=5) for h in hostile), return_exceptions=True)
        honest, theirs = results[:3], results[3:]
        assert all(not isinstance(r, BaseException) and r.group_size == 3 for r in honest), honest
        assert all(torch.equal(t, torch.full((1000,), 2.0)) for t in tensors)  # exactly 2.0, not 10^6
        assert all(isinstance(r, BaseException) or r.group_size == 1 for r in theirs)  # alone, if anything
    finally:
        await asyncio.gather(*(a.shutdown() for a in averagers + hostile))
        await asyncio.gather(*(s.shutdown() for s in strangers))


async def test_a_stranger_cannot_take_an_expert_uid_or_move_the_epoch(run):
    _, members = await run(2)
    honest_server = str(members[1].address)
    assert await declare_experts(members[1], ["ffn.0.1"], honest_server, time.time() + 60)
    trackers = [ProgressTracker(m, RUN, 256, SignatureValidator(m.p2p.identity)) for m in members]
    for t in trackers:
        await t.report(PeerProgress(epoch=7, samples=10, samples_per_second=5.0, time=time.time()))
    strangers = await stranger_nodes()
    try:
        for s in strangers:
            # it writes through its own node, which knows the member's address from a failed bootstrap ...
            with pytest.raises(NotAMember):
                await s.bootstrap([str(members[0].address)])
            liar = ProgressTracker(s, RUN, 256, SignatureValidator(s.p2p.identity))
            await liar.report(PeerProgress(epoch=10**6, samples=10**9, samples_per_second=1e9, time=time.time()))
            await declare_experts(s, ["ffn.0.1"], f"{s.p2p.peer_id}@127.0.0.1:1", time.time() + 3600)
            # ... and straight at the member, whatever it sends
            for method in ("dht.store", "dht.find"):
                with pytest.raises(NotAMember):
                    await s.p2p.call(members[0].address, method, {"a": None, "r": []}, timeout=5)
        for m, t in zip(members, trackers, strict=True):
            assert (await get_experts(m, ["ffn.0.1"], latest=True)) == {"ffn.0.1": honest_server}
            progress = await t.global_progress()
            assert progress.epoch == 7 and progress.num_peers == 2
    finally:
        await asyncio.gather(*(s.shutdown() for s in strangers))


async def test_an_expert_server_with_a_token_serves_members_only(tmp_path):
    from experts.config import ExpertServerConfig, start_server
    from orchestrator.instance.expert_server import _membership_problem

    authority = Authority(Identity(), RUN)
    key = tmp_path / "server.key"
    token = authority.issue(Identity.from_file(key).peer_id, 600, roles=("experts:ffn.",)).to_token()
    config = ExpertServerConfig(expert_cls="ffn", hidden_dim=8, expert_uids=["ffn.0.0"], no_dht=True,
                                identity=str(key), membership_token=token)
    assert _membership_problem(config) is None
    someone_elses = authority.issue(Identity().peer_id, 600).to_token()
    assert "issued for peer" in _membership_problem(config.model_copy(update={"membership_token": someone_elses}))
    server = await start_server(config)
    member_identity = Identity()
    member = await P2P.create(client_mode=True, identity=member_identity,
                              membership=membership(authority, member_identity))
    stranger = await P2P.create(client_mode=True)
    try:
        info = await member.call(server.address, "expert.info", {"uid": "ffn.0.0"}, timeout=10)
        assert info is not None
        with pytest.raises(NotAMember):
            await stranger.call(server.address, "expert.info", {"uid": "ffn.0.0"}, timeout=10)
    finally:
        for node in (member, stranger):
            await node.shutdown()
        await server.shutdown()
