"""Placement of a run's experts on its expert servers, and the YAML that asks for them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.config.schema import ClusterConfig
from orchestrator.fleet.placement import plan_placement

pytestmark = pytest.mark.timeout(60)

GRID = [f"ffn.{i}.{j}" for i in range(2) for j in range(4)]


def apply(plan, holders: dict[str, set[str]]) -> dict[str, set[str]]:
    """The holders after a plan ran: assignments added, moved experts dropped by their old server."""
    out = {uid: set(h) for uid, h in holders.items()}
    for server, uids in plan.assign.items():
        for uid in uids:
            out.setdefault(uid, set()).add(server)
            if (server, uid) in plan.moves:
                out[uid].discard(plan.moves[(server, uid)])
    return out


def loads(holders: dict[str, set[str]], servers: list[str]) -> dict[str, int]:
    return {s: sum(s in h for h in holders.values()) for s in servers}


def test_a_new_grid_gets_two_replicas_on_distinct_servers_evenly():
    plan = plan_placement(GRID, 2, {}, ["a", "b", "c"])
    holders = apply(plan, {})
    assert all(len(holders[uid]) == 2 for uid in GRID)
    assert sorted(loads(holders, ["a", "b", "c"]).values()) == [5, 5, 6]
    assert not plan.moves


def test_a_lost_server_s_experts_go_to_the_survivors_then_back_to_its_replacement():
    holders = apply(plan_placement(GRID, 2, {}, ["a", "b", "c"]), {})
    lost = {uid for uid, h in holders.items() if "a" in h}
    holders = {uid: h - {"a"} for uid, h in holders.items()}
    plan = plan_placement(GRID, 2, holders, ["b", "c"])  # a is gone: every expert still has one holder
    assert set(sum(plan.assign.values(), [])) == lost  # exactly its experts are reassigned
    holders = apply(plan, holders)
    assert all(holders[uid] == {"b", "c"} for uid in GRID)
    for _ in range(5):  # the replacement d arrives: moves (bounded per plan) even the load out
        plan = plan_placement(GRID, 2, holders, ["b", "c", "d"])
        if not plan:
            break
        assert all(uid in plan.assign["d"] for (_, uid) in plan.moves)
        holders = apply(plan, holders)
    assert all(len(holders[uid]) == 2 for uid in GRID)
    assert max(loads(holders, ["b", "c", "d"]).values()) - min(loads(holders, ["b", "c", "d"]).values()) <= 1


def test_a_noticed_server_is_not_counted_so_its_experts_get_new_homes_first():
    holders = apply(plan_placement(GRID, 2, {}, ["a", "b", "c"]), {})
    plan = plan_placement(GRID, 2, holders, ["b", "c"])  # a was noticed: usable are b and c
    assert {uid for uids in plan.assign.values() for uid in uids} == {uid for uid, h in holders.items() if "a" in h}


def test_fewer_servers_than_replicas_place_each_expert_on_every_server_and_none_places_nothing():
    holders = apply(plan_placement(GRID, 2, {}, ["a"]), {})
    assert all(holders[uid] == {"a"} for uid in GRID)
    assert not plan_placement(GRID, 2, {}, [])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.lists(st.sampled_from("abcdef"), min_size=1, max_size=6, unique=True),
       st.dictionaries(st.sampled_from(GRID), st.sets(st.sampled_from("abcdefgh"), max_size=4)))
def test_any_plan_gives_every_expert_its_replicas_on_distinct_usable_servers(replicas, servers, holders):
    holders = apply(plan_placement(GRID, replicas, holders, servers), holders)
    for uid in GRID:
        assert len(holders[uid] & set(servers)) >= min(replicas, len(servers))


# ---- YAML ------------------------------------------------------------------------------------
def moe_cluster(**overrides) -> dict:
    data = {"cluster_name": "m",
            "available_node_types": {"srv": {"role": "experts", "min_workers": 3, "max_workers": 3},
                                     "trn": {"min_workers": 2, "max_workers": 2}},
            "training": {"task": "moe-charlm"}, "experts": {"grid": [2, 4], "replicas": 2}}
    data.update(overrides)
    return data


def test_a_moe_run_config_gives_trainers_the_grid_and_servers_their_share():
    config = ClusterConfig.model_validate(moe_cluster())
    assert config.experts.uids() == GRID
    assert config.max_trainers() == 2
    options = config.worker_config(["peer"]).task_options
    assert options["grid"] == [2, 4] and options["k_best"] == 4 and options["dim"] == 64
    host = config.expert_host_config(["peer"])
    assert host["experts"]["grid"] == [2, 4] and host["run"] == "m"


@pytest.mark.parametrize("change, message", [
    ({"training": {"task": "synthetic"}}, "uses no experts"),
    ({"available_node_types": {"trn": {"min_workers": 1, "max_workers": 1}}, "training": {"task": "moe-charlm"}},
     "no node type has role: experts"),
    ({"available_node_types": {"srv": {"role": "experts", "max_workers": 3}}}, "a run needs trainers too"),
    ({"experts": {"replicas": 4}}, "at most 3 expert servers"),
    ({"experts": {"grid": [2, 2], "k_best": 5}}, "exceeds the grid's 4 experts"),
    ({"experts": {"k_min": 5}}, "may not exceed k_best"),
    ({"experts": {"grid": [0, 4]}}, "every dimension of the grid"),
])
def test_a_moe_config_that_cannot_run_is_refused_naming_why(change, message):
    with pytest.raises(ValueError, match=message):
        ClusterConfig.model_validate(moe_cluster(**change))
