"""A run with membership on (the default), on a real local Ray: its workers train as members; a
stranger is refused by the run's bootstrap peer and by its workers, with or without a certificate
from another authority; a volunteer with a token from ``spotswarm token issue`` takes part; and
the supervisor renews the workers' certificates over their open connections before they expire."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from dht import DHTNode  # noqa: E402
from orchestrator.cli import token as token_cli  # noqa: E402
from orchestrator.config.schema import ClusterConfig  # noqa: E402
from orchestrator.fleet.supervisor import SupervisorCore  # noqa: E402
from orchestrator.runs.store import RunStore  # noqa: E402
from p2p import P2P, Identity, NotAMember, PeerID  # noqa: E402
from p2p.membership import Authority, Certificate, Membership  # noqa: E402

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("ray_session"), pytest.mark.heavy]
TTL = 12.0  # renewed when 6 s are left: the test sees a renewal within seconds


def config(tmp_path: Path) -> ClusterConfig:
    return ClusterConfig.model_validate({
        "cluster_name": "m", "runs_dir": str(tmp_path / "runs"),
        "provider": {"type": "local", "zones": ["a"], "time_scale": 1.0, "provisioning_delay_s": 0.0},
        "available_node_types": {"small": {"min_workers": 2, "max_workers": 2, "preemption": {"distribution": "none"}}},
        "training": {"task": "synthetic", "target_batch_size": 64, "min_matchmaking_time_s": 0.5,
                     "averaging_timeout_s": 10.0},
        "checkpoint": {"every_s": 600.0}, "dashboard": {"enabled": False},
        "membership": {"ttl_s": TTL},
    })


async def _refused(address: str, membership: Membership | None, identity: Identity | None = None) -> str:
    node = await P2P.create(client_mode=True, identity=identity, membership=membership)
    try:
        with pytest.raises(NotAMember) as refusal:
            await node.call(address, "dht.ping", None, timeout=10)
        return str(refusal.value)
    finally:
        await node.shutdown()


async def _volunteer_sees(address: str, identity: Identity, token: str) -> int:
    cert = Certificate.from_token(token)
    node = await DHTNode.create([address], identity=identity, client_mode=True,
                                p2p_options={"membership": Membership(cert.run, cert.authority, cert)})
    try:
        found = await node.get("m.progress", latest=True)
        return sum(1 for item in found.value.values() if item.value is not None) if found else 0
    finally:
        await node.shutdown()


def test_only_members_take_part_and_certificates_are_renewed(tmp_path, wait_for, capsys):
    cfg = config(tmp_path)
    RunStore.create(cfg).close()
    run_dir = cfg.run_dir()
    core = SupervisorCore(cfg, run_dir)
    core.start()
    try:
        wait_for(lambda: core.epoch >= 2, 120, "the members to train two epochs")
        workers = [core.policy.workers.running(i) for i in list(core.live.values())]
        assert all(w and w["address"] for w in workers)
        p2p = core.dht.node.p2p

        # strangers: no certificate, and a well-formed one from another authority
        other = Authority(Identity(), "m")
        forged_identity = Identity()
        forged = Membership("m", other.public_key, other.issue(forged_identity.peer_id, 3600))
        for address in [core.address] + [w["address"] for w in workers]:
            assert "no membership certificate" in asyncio.run(_refused(address, None))
            assert "authority" in asyncio.run(_refused(address, forged, forged_identity))

        # a volunteer with a token from `spotswarm token issue` sees the members' progress
        key = tmp_path / "volunteer.key"
        args = argparse.Namespace(run=str(run_dir), ttl="1h", peer=None, identity_out=str(key), role=None)
        capsys.readouterr()
        assert token_cli.issue(args) == 0
        token = capsys.readouterr().out.strip()
        assert Certificate.from_token(token).roles == ("volunteer",)
        assert asyncio.run(_volunteer_sees(core.address, Identity.from_file(key, create=False), token)) >= 2

        # renewal: the workers' certificates, as the supervisor's peer sees them, move past the first ones
        ids = [PeerID.from_string(w["peer_id"]) for w in workers]
        first = {pid: p2p.peer_certificate(pid) for pid in ids}
        assert all(c is not None and "worker" in c.roles for c in first.values())
        wait_for(lambda: all((c := p2p.peer_certificate(pid)) is not None and c.expires > first[pid].expires
                             for pid in ids), 30, "renewed certificates to arrive on the open connections")
        epoch = core.epoch
        wait_for(lambda: core.epoch >= epoch + 1, 60, "training to go on after the renewal")
        assert all(p2p.peer_certificate(pid).expires > time.time() + TTL / 3 for pid in ids)
    finally:
        core.stop()


def test_tokens_that_do_not_fit_are_clear_errors(tmp_path, capsys):
    from orchestrator.fleet.authority import parse_duration
    from orchestrator.instance.dht_peer import run_dht_peer

    assert [parse_duration(t) for t in ("90", "90s", "15m", "12h", "7d")] == [90, 90, 900, 43200, 604800]
    for bad in ("", "-5m", "1w", "0", "soon"):
        with pytest.raises(ValueError, match="not a duration"):
            parse_duration(bad)

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("cluster_name: r\navailable_node_types: {small: {}}\n")
    args = argparse.Namespace(run=str(run_dir), ttl="1h", peer=None, identity_out=str(tmp_path / "k"), role=None)
    assert token_cli.issue(args) == 2
    assert "no authority.key" in capsys.readouterr().err
    assert not (tmp_path / "k").exists()  # nothing made for a token that was never issued

    authority = Authority.from_file(run_dir / "authority.key", "r")
    # a volunteer's join line names the run's byzantine level: a peer of another level averages with nobody
    (run_dir / "config.yaml").write_text("cluster_name: r\navailable_node_types: {small: {}}\n"
                                         "training: {byzantine: verify}\n")
    assert token_cli.issue(args) == 0
    assert " --byzantine verify " in capsys.readouterr().err
    someone = Identity()
    token = authority.issue(someone.peer_id, 60).to_token()
    assert token_cli.show(argparse.Namespace(token=token)) == 0
    shown = capsys.readouterr().out
    assert "run:       r" in shown and str(someone.peer_id) in shown
    assert token_cli.show(argparse.Namespace(token="not-a-token")) == 2
    # a bootstrap peer started with a token issued for another key says so and starts nothing
    assert run_dht_peer("127.0.0.1", 0, [], str(tmp_path / "mine.key"), membership_token=token) == 2
    assert "issued for peer" in capsys.readouterr().err
