"""Roles in certificates are enforced: a method names the roles it is served to (P2P.register), expert
servers and their state are for the run's workers, not for volunteers.  Real peers on loopback."""

from __future__ import annotations

import asyncio

import pytest

from experts.handoff import STATE
from experts.remote import call_info
from experts.server import INFO, ExpertServer
from p2p import P2P, Authority, Identity, Membership
from p2p.errors import RemoteError
from p2p.membership import SUPERVISOR, VOLUNTEER, WORKER
from tests.security.test_expert_attacks import scale_backend

RUN = "roles"


@pytest.fixture
async def peers():
    authority = Authority(Identity(), RUN)
    made: list[P2P] = []

    async def make(*roles: str, **options) -> P2P:
        identity = Identity()
        membership = Membership(RUN, authority.public_key, authority.issue(identity.peer_id, 3600, roles))
        node = await P2P.create(identity=identity, membership=membership, **options)
        made.append(node)
        return node

    make.authority = authority  # type: ignore[attr-defined]
    yield make
    await asyncio.gather(*(n.shutdown() for n in made))


async def echo(request, ctx):
    return request


@pytest.mark.timeout(30)
async def test_a_method_served_to_some_roles_refuses_the_others_by_name(peers):
    server = await peers(WORKER, host="127.0.0.1")
    server.register("only.workers", echo, roles={WORKER, SUPERVISOR})
    server.register("anyone", echo)
    worker, volunteer, nobody = await peers(WORKER), await peers(VOLUNTEER), await peers()
    address = str(server.address)
    assert await worker.call(address, "only.workers", 1) == 1
    for caller, held in ((volunteer, "volunteer"), (nobody, "no role")):
        with pytest.raises(RemoteError, match=f"only.workers is served to roles supervisor, worker; the caller's "
                                              f"certificate names {held}"):
            await caller.call(address, "only.workers", 1)
        assert await caller.call(address, "anyone", 2) == 2  # the refusal changed nothing else


@pytest.mark.timeout(30)
async def test_open_mode_peers_check_no_roles():
    server = await P2P.create(host="127.0.0.1")
    client = await P2P.create()
    try:
        server.register("only.workers", echo, roles={WORKER})
        assert await client.call(str(server.address), "only.workers", 3) == 3
    finally:
        await client.shutdown()
        await server.shutdown()


@pytest.mark.timeout(30)
async def test_a_volunteer_serves_no_experts_takes_no_expert_state_and_is_not_used_as_an_expert(peers):
    authority = peers.authority
    identity = Identity()
    volunteer_cert = Membership(RUN, authority.public_key, authority.issue(identity.peer_id, 3600, [VOLUNTEER]))
    with pytest.raises(ValueError, match="names roles volunteer, which do not cover experts ffn.0"):
        await ExpertServer.create([scale_backend("ffn.0")], identity=identity,
                                  p2p_options={"membership": volunteer_cert})
    identity = Identity()
    worker_cert = Membership(RUN, authority.public_key, authority.issue(identity.peer_id, 3600, [WORKER]))
    server = await ExpertServer.create([scale_backend("ffn.0")], identity=identity,
                                       p2p_options={"membership": worker_cert})
    try:
        address = str(server.p2p.address)
        volunteer, worker = await peers(VOLUNTEER), await peers(WORKER)
        assert (await call_info(volunteer, address, "ffn.0", timeout=10)).uid == "ffn.0"  # volunteers train with it
        with pytest.raises(RemoteError, match="expert.state is served to roles"):
            await volunteer.call(address, STATE, {"uid": "ffn.0"}, timeout=10)
        assert isinstance(await worker.call(address, STATE, {"uid": "ffn.0"}, timeout=10), dict)
        scoped = await peers("experts:ffn.")  # a standalone expert server's role: hand-offs between servers
        assert isinstance(await scoped.call(address, STATE, {"uid": "ffn.0"}, timeout=10), dict)
        # a volunteer whose own code serves an expert anyway: members' clients do not call it
        rogue = await peers(VOLUNTEER, host="127.0.0.1")
        rogue.register(INFO, echo)
        with pytest.raises(Exception, match="only workers serve experts"):
            await call_info(worker, str(rogue.address), "ffn.0", timeout=10)
    finally:
        await server.shutdown()


def test_an_experts_role_covers_the_uids_under_its_prefix_only():
    from p2p.membership import serves_experts

    assert serves_experts(("experts:ffn.",), "ffn.0.3") and not serves_experts(("experts:ffn.",), "mlp.0")
    assert serves_experts(("worker",), "mlp.0") and serves_experts(("supervisor",))
    assert not serves_experts(("volunteer",)) and not serves_experts(())
