"""Expert servers whose expert set changes while they run, and the ``expert.state`` hand-off RPC."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch

from dht import DHT
from experts import (
    BackgroundExpertServer,
    ExpertBackend,
    ExpertCallFailed,
    ExpertClient,
    ExpertServer,
    RemoteExpert,
    UnknownExpert,
    fetch_expert_state,
    get_experts,
    load_state_bytes,
    params_checksum,
    state_bytes,
)
from experts.batching import BatchScheduler, TaskPool
from experts.runtime import Runtime

pytestmark = pytest.mark.timeout(60)


def ffn(uid: str) -> ExpertBackend:
    return ExpertBackend.from_kind(uid, "ffn", 8, optimizer=lambda p: torch.optim.Adam(p, lr=1e-2))


@pytest.fixture
def client():
    c = ExpertClient.create()
    yield c
    c.shutdown()


@pytest.fixture
def boot():
    d = DHT()
    yield d
    d.shutdown()


def lookup(dht: DHT, uids: list[str]) -> dict[str, str | None]:
    return dht.run_coroutine(lambda node: get_experts(node, uids, latest=True))


def test_a_server_started_empty_serves_added_experts_and_forgets_removed_ones(boot, client):
    reader = DHT(initial_peers=boot.addresses, client_mode=True)
    server = BackgroundExpertServer([], initial_peers=boot.addresses, update_period=30)
    try:
        assert server.server.stats == {}
        assert lookup(reader, ["ffn.0.0"]) == {"ffn.0.0": None}
        server.add_experts([ffn("ffn.0.0"), ffn("ffn.0.1")])
        assert lookup(reader, ["ffn.0.0", "ffn.0.1"]) == {"ffn.0.0": server.address, "ffn.0.1": server.address}
        x = torch.randn(3, 8, requires_grad=True)
        RemoteExpert("ffn.0.1", server.address, client)(x).sum().backward()
        RemoteExpert("ffn.0.0", server.address, client)(torch.randn(5, 8))
        stats = server.server.stats
        assert (stats["ffn.0.1"]["requests_forward"], stats["ffn.0.1"]["requests_backward"]) == (1, 1)
        assert stats["ffn.0.0"]["rows_per_batch"] == 5.0 and stats["ffn.0.0"]["forward_batches"] == 1
        assert stats["ffn.0.0"]["requests_backward"] == 0 and stats["ffn.0.1"]["samples_backward"] == 3

        with pytest.raises(ValueError, match=r"'ffn\.0\.0' is already hosted"):
            server.add_experts([ffn("ffn.0.0")])
        with pytest.raises(ValueError, match=r"'ffn\.1\.1' is not hosted"):
            server.remove_experts(["ffn.1.1"])

        server.remove_experts(["ffn.0.1"])
        with pytest.raises(UnknownExpert, match=r"ffn\.0\.1"):
            RemoteExpert("ffn.0.1", server.address, client)(torch.randn(2, 8))
        assert lookup(reader, ["ffn.0.0", "ffn.0.1"]) == {"ffn.0.0": server.address, "ffn.0.1": None}
        assert sorted(server.server.stats) == ["ffn.0.0"]
        assert server.run(server.server.redeclare())

        server.add_experts([ffn("ffn.0.1")])  # hosted again: declared again, newer than the withdrawal
        assert lookup(reader, ["ffn.0.1"]) == {"ffn.0.1": server.address}
        assert RemoteExpert("ffn.0.1", server.address, client)(torch.randn(2, 8)).shape == (2, 8)
    finally:
        server.shutdown()
        reader.shutdown()


def test_shutdown_without_withdrawal_leaves_the_records_for_a_replica_to_take_over(boot):
    reader = DHT(initial_peers=boot.addresses, client_mode=True)
    kept = BackgroundExpertServer([ffn("ffn.0.0")], initial_peers=boot.addresses, update_period=30)
    gone = BackgroundExpertServer([ffn("ffn.1.0")], initial_peers=boot.addresses, update_period=30)
    try:
        kept_address = kept.address
        kept.shutdown(withdraw=False)
        gone.shutdown()
        assert lookup(reader, ["ffn.0.0", "ffn.1.0"]) == {"ffn.0.0": kept_address, "ffn.1.0": None}
    finally:
        kept.shutdown()
        gone.shutdown()
        reader.shutdown()


async def test_requests_queued_for_a_removed_expert_fail_with_unknown_expert():
    runtime = Runtime()
    scheduler = BatchScheduler(runtime)  # not started: requests stay queued
    pool = scheduler.add_pool(TaskPool("ffn.0.0/forward", lambda xs: xs, 16))
    waiting = [asyncio.ensure_future(scheduler.submit(pool, [torch.zeros(2, 4)], 2)) for _ in range(2)]
    await asyncio.sleep(0)  # let them reach the queue
    assert len(pool.queue) == 2
    scheduler.remove_pool(pool, lambda: UnknownExpert("expert 'ffn.0.0' was removed from this server"))
    for task in waiting:
        with pytest.raises(UnknownExpert, match="was removed"):
            await asyncio.wait_for(task, 5)
    assert pool not in scheduler.pools and not pool.queue
    runtime.shutdown()


class CorruptingServer(ExpertServer):
    """Sends a state whose checksum does not match its bytes."""

    async def rpc_state(self, request, ctx):
        reply = await super().rpc_state(request, ctx)
        reply["checksum"] = hashlib.sha256(b"something else").hexdigest()
        return reply


def test_expert_state_hands_over_the_exact_state_with_its_checksums(client):
    backend = ffn("ffn.2.3")
    with BackgroundExpertServer([backend]) as server:
        x = torch.randn(4, 8, requires_grad=True)
        RemoteExpert("ffn.2.3", server.address, client)(x).pow(2).sum().backward()  # one Adam step
        got = client.run(fetch_expert_state(client.p2p, server.address, "ffn.2.3"))
        assert got.uid == "ffn.2.3" and got.state["uid"] == "ffn.2.3" and got.state["optimizer_steps"] == 1
        assert got.params_checksum == params_checksum(backend.module)
        assert got.checksum == hashlib.sha256(state_bytes(backend)).hexdigest()

        copy = ffn("ffn.2.3")
        copy.load_state_dict(got.state)
        assert params_checksum(copy.module) == got.params_checksum
        assert copy.optimizer.state_dict()["state"][0]["step"] == 1

        with pytest.raises(ExpertCallFailed, match=r"'ffn\.9\.9' from .*UnknownExpert"):
            client.run(fetch_expert_state(client.p2p, server.address, "ffn.9.9"))
    with pytest.raises(ExpertCallFailed, match=r"'ffn\.2\.3' from .*unreachable"):
        client.run(fetch_expert_state(client.p2p, server.address, "ffn.2.3", timeout=5))

    with BackgroundExpertServer([ffn("ffn.2.3")], server_cls=CorruptingServer) as bad:
        with pytest.raises(ExpertCallFailed, match=rf"'ffn\.2\.3' from {bad.address}: checksum mismatch"):
            client.run(fetch_expert_state(client.p2p, bad.address, "ffn.2.3"))


def test_state_bytes_are_checked_for_their_expert():
    data = state_bytes(ffn("ffn.0.0"))
    assert load_state_bytes(data, "ffn.0.0")["uid"] == "ffn.0.0"
    with pytest.raises(ValueError, match=r"sent for expert 'ffn\.0\.1' belongs to expert 'ffn\.0\.0'"):
        load_state_bytes(data, "ffn.0.1")
    with pytest.raises(ValueError, match=r"state of expert 'ffn\.0\.0' could not be decoded"):
        load_state_bytes(b"not a checkpoint", "ffn.0.0")
