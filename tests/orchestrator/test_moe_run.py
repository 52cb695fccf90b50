"""A mixture-of-experts run under the supervisor, on a real local Ray: 2 trainers and 3 expert
servers on a 2 x 4 grid with 2 replicas; one server is preempted mid-training; then everything is
killed and the run resumed, its experts restored from their checkpoints."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import psutil
import pytest

ray = pytest.importorskip("ray")

from experts.declare import get_expert_holders  # noqa: E402
from orchestrator.config.schema import ClusterConfig  # noqa: E402
from orchestrator.fleet.supervisor import SupervisorCore  # noqa: E402
from orchestrator.runs.store import RunStore  # noqa: E402
from tests.orchestrator.run_checks import query  # noqa: E402

# alone: five instances on two cores already; beside another test its 3-s reachability checks and the
# k_min share of forward passes measure the machine's load rather than the hand-off
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("ray_session"), pytest.mark.alone]

UIDS = [f"ffn.{i}.{j}" for i in range(2) for j in range(4)]


def moe_config(tmp_path: Path) -> ClusterConfig:
    trace = tmp_path / "trace.csv"
    # nobody is preempted by the market: the test preempts the first expert server on cue, once every
    # expert has two servers and the trainers are training
    trace.write_text("notice_after_s,kill_after_s\n" + ",\n" * 9)
    prices = {"on_demand_price_per_hour": 1.0, "spot_price_per_hour": {"a": 0.3}}
    return ClusterConfig.model_validate({
        "cluster_name": "moe", "runs_dir": str(tmp_path / "runs"),
        "provider": {"type": "local", "zones": ["a"], "time_scale": 10.0, "provisioning_delay_s": 10.0,
                     "trace_file": str(trace)},
        "available_node_types": {"srv": {"role": "experts", "min_workers": 3, "max_workers": 3, **prices},
                                 "trn": {"min_workers": 2, "max_workers": 2, **prices}},
        "training": {"task": "moe-charlm", "task_options": {"layers": 1, "context": 16, "batch_size": 8},
                     "target_batch_size": 32, "min_matchmaking_time_s": 0.5, "averaging_timeout_s": 10.0},
        "experts": {"grid": [2, 4], "hidden_dim": 32, "k_best": 4, "k_min": 2, "replicas": 2,
                    "average_every_s": 2.0, "declare_period_s": 1.0},
        "spot": {"notice_period_s": 40.0},  # 4 s real from notice to kill
        "checkpoint": {"every_s": 30.0},
    })


def unreachable(core: SupervisorCore) -> list[str]:
    """The experts that no holder in their DHT record answers for, each with what every holder's call
    raised.  A caller tries the record's holders in turn (``moe.py``'s fail-over), so a record that
    still names a server just killed, beside a live replica, leaves the expert reachable."""
    async def check(node) -> list[str]:
        found = await get_expert_holders(node, UIDS, latest=True)
        missing = []
        for uid, addresses in found.items():
            errors = []
            for address in addresses:
                try:
                    await node.p2p.call(address, "expert.info", {"uid": uid}, timeout=3.0)
                    break
                except Exception as e:
                    errors.append(f"{address}: {type(e).__name__}: {e}")
            else:
                missing.append(f"{uid} ({'; '.join(errors) or 'no holder declared'})")
        return missing
    return core.dht.run_coroutine(check)


def handoffs(run_dir: Path, instance_like: str = "%") -> list[dict]:
    import json

    rows = query(run_dir, "SELECT instance_id, detail FROM events WHERE kind = 'expert_handoff' "
                          "AND instance_id LIKE ?", instance_like)
    return [{"instance": i, **json.loads(d)} for i, d in rows]


def losses(run_dir: Path) -> list[float]:
    return [loss for (loss,) in query(run_dir, "SELECT loss FROM progress WHERE loss IS NOT NULL ORDER BY epoch")]


def kill_everything(core: SupervisorCore) -> None:
    """Every instance SIGKILLed, the supervisor gone without releasing or checkpointing anything."""
    provider = core.policy.provider
    for process in [*provider.processes.values(), *provider.workers.values()]:  # actors, then their workers
        with contextlib.suppress(psutil.NoSuchProcess):  # a worker ends with its actor: maybe gone already
            process.kill()
    core.detach()


def test_experts_outlive_a_preempted_server_and_a_resume_after_losing_everything(tmp_path, wait_for):
    config = moe_config(tmp_path)
    RunStore.create(config).close()
    run_dir = config.run_dir()
    core: SupervisorCore | None = SupervisorCore(config, run_dir)
    core.start()
    resumed: SupervisorCore | None = None
    try:
        wait_for(lambda: core.experts.summary()["min_replicas"] == 2, 90, "every expert on two servers")
        # k_min is judged from the trainers' first statistics after that: before, the five instances were
        # still booting on this machine's two cores, and forward passes that timed out then say nothing
        # about surviving a preemption.  A trainer reports its calls with its next epoch record, so the
        # calls counted when the last server took its experts may not include those made while it booted
        booted_calls = core.experts.summary()["calls"]
        wait_for(lambda: core.experts.summary()["calls"] > booted_calls, 60, "the trainers' next statistics")
        replicated = core.experts.summary()
        first = {}
        for h in handoffs(run_dir):
            first.setdefault(h["uid"], h["source"])
        assert first == dict.fromkeys(UIDS, "fresh")  # a new run: each expert starts fresh, then is copied
        assert not [h for h in handoffs(run_dir) if h["source"] == "checkpoint"]
        wait_for(lambda: len(losses(run_dir)) >= 2, 90, "the trainers' first epochs")
        assert not unreachable(core)

        # one expert server is noticed, then killed: its experts move while it still serves them
        victim = "moe-srv-0000"  # the first expert server: their node type comes first
        assert core.policy.live[victim].node_type == "srv"
        core.policy.provider.preempt(victim, core.clock())
        wait_for(lambda: victim in core.policy.noticed, 30, "the notice")
        while query(run_dir, "SELECT end_reason FROM instances WHERE id = ?", victim) != [("preempted",)]:
            assert not unreachable(core), "an expert was unreachable during the notice"
            time.sleep(0.2)  # sampling reachability while the preemption unfolds, not synchronizing
        replacement = "moe-srv-0005"
        deadline = time.monotonic() + 60
        while not handoffs(run_dir, replacement) or core.experts.summary()["min_replicas"] < 2:
            assert not unreachable(core), "an expert was unreachable after the kill"
            assert time.monotonic() < deadline, "the replacement never took experts"
            time.sleep(0.2)
        live_servers = {core.experts.addresses[i] for i in core.experts.addresses}
        for h in handoffs(run_dir, replacement):  # loaded from a live replica, checksum verified at hand-off
            assert h["source"] == "replica" and h["donor"] in live_servers, h
            assert len(h["params_checksum"]) == 64
        reassigned = {h["uid"] for h in handoffs(run_dir) if h["instance"] not in (victim, replacement)
                      and h["source"] == "replica"}
        victim_held = {h["uid"] for h in handoffs(run_dir, victim)}
        assert victim_held <= reassigned | {h["uid"] for h in handoffs(run_dir, replacement)}
        epochs_at_kill = len(losses(run_dir))
        wait_for(lambda: len(losses(run_dir)) >= epochs_at_kill + 3, 90, "training to go on")
        curve = losses(run_dir)
        assert sum(curve[-3:]) / 3 < sum(curve[:2]) / 2, f"the loss did not fall: {curve}"
        now = core.experts.summary()
        calls = now["calls"] - replicated["calls"]
        assert calls > 0, "no forward pass was reported across the preemption"
        kmin = (now["calls_meeting_k_min"] - replicated["calls_meeting_k_min"]) / calls
        assert kmin > 0.9, (kmin, calls, now["kmin_fraction"])

        # lose everything; the resumed run's new servers load every expert from its checkpoint
        wait_for(lambda: len(query(run_dir, "SELECT 1 FROM events WHERE kind = 'expert_checkpoint'")) >= 2, 60,
                 "expert checkpoints")
        kill_everything(core)
        core = None
        saved = {uid: (run_dir / "checkpoints" / "experts" / f"{uid}.pt").read_bytes() for uid in UIDS}
        before = len(handoffs(run_dir))
        resumed = SupervisorCore(config, run_dir)
        resumed.start()
        wait_for(lambda: resumed.experts.summary()["min_replicas"] == 2, 120, "the resumed run's experts")
        # the supervisor writes its events in batches: the hand-offs reach the store a tick after the servers
        wait_for(lambda: {h["uid"] for h in handoffs(run_dir)[before:] if h["source"] == "checkpoint"} >= set(UIDS),
                 30, "every expert's hand-off from its checkpoint in the run store")
        restored = handoffs(run_dir)[before:]
        assert {h["uid"] for h in restored if h["source"] == "checkpoint"} == set(UIDS)
        for h in restored:
            if h["source"] == "checkpoint":
                assert h["params_checksum"] == checkpoint_params(config, h["uid"], saved[h["uid"]])
    finally:
        if resumed is not None:
            resumed.stop()
        elif core is not None:
            core.stop()


def checkpoint_params(config: ClusterConfig, uid: str, data: bytes) -> str:
    """The parameter checksum of an expert loaded from its checkpoint file's bytes."""
    from experts.handoff import load_state_bytes, params_checksum
    from workers.expert_host import ExpertGridSpec, fresh_expert

    e = config.experts
    spec = ExpertGridSpec(uid_prefix=e.uid_prefix, grid=e.grid, kind=e.kind, hidden_dim=e.hidden_dim, lr=e.lr)
    backend = fresh_expert(spec, uid)
    backend.load_state_dict(load_state_bytes(data, uid))
    return params_checksum(backend.module)
