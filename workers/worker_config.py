"""A training peer's settings, apart from the peer itself: the orchestrator validates configs and
builds the ``worker`` command line from them without importing torch."""

from __future__ import annotations

from typing import Any, Literal

import pydantic

from p2p.devices import DeviceName
from p2p.route import RelayRoute

# workers.task.BUILTIN_TASKS makes them (tests/workers/test_rival_task.py keeps both equal)
BUILTIN_TASK_NAMES = ("synthetic", "charlm", "moe-charlm")


def check_route(text: str | None) -> str | None:
    """A peer's dialing route in emulated regions, as ``RelayRoute``'s text (``relay=HOST:PORT
    source=HOST remote=...``): one that parses (its ValueError says what is wrong), kept as text."""
    if text is not None:
        RelayRoute.parse(text)
    return text


def check_overlap(overlap: bool, info: pydantic.ValidationInfo) -> bool:
    """Only DiLoCo's rounds run in the background: said for another mode, overlap would change nothing."""
    mode = info.data.get("mode", info.data.get("averaging"))  # the worker's key, the cluster YAML's
    if overlap and mode is not None and mode != "diloco":
        raise ValueError(f"overlaps DiLoCo's outer rounds with training, but the mode is {mode!r} (use mode "
                         "diloco, or remove overlap)")
    return overlap


class WorkerConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    run: str = pydantic.Field("spotswarm", pattern=r"^[A-Za-z0-9_-]+$", description="peers of one run train together")
    task: str = pydantic.Field("synthetic", description=f"built-in task ({', '.join(BUILTIN_TASK_NAMES)}) or "
                               "module.path:callable")
    task_options: dict[str, Any] = pydantic.Field({}, description="keyword arguments of the task's factory")
    mode: Literal["collaborative", "moshpit", "diloco"] = pydantic.Field(
        "collaborative", description="how peers combine work")
    initial_peers: list[str] = pydantic.Field([], description="peers to join through")
    host: str = pydantic.Field("127.0.0.1", description="address to listen on")
    announce_host: str | None = pydantic.Field(None, description="the address other machines reach (default: host)")
    port: int = pydantic.Field(0, ge=0, le=65535, description="port to listen on; 0 is any free port")
    route: str | None = pydantic.Field(None, description="emulated regions (the local simulator's provider.links): "
                                       "dial these hosts through the regions' relay, 'relay=HOST:PORT source=HOST "
                                       "remote=HOST,...' (p2p/route.py)")
    client_mode: bool = pydantic.Field(False, description="accept no connections (behind NAT)")
    identity_path: str | None = pydantic.Field(None, description="private key file (keeps the peer id)")
    target_batch_size: int = pydantic.Field(256, gt=0, description="global batch per optimizer step (collaborative)")
    swarm_size: int = pydantic.Field(16, ge=1, description="the most training peers the run expects: sizes its "
                                     "progress keys (every peer of a run must give the same)")
    # "fp16": the old name of "float16", accepted until the next release
    compression: Literal["none", "float16", "bfloat16", "uniform8", "blockwise8", "fp16"] = pydantic.Field(
        "none", description="gradient codec")
    byzantine: Literal["off", "clip", "verify"] = pydantic.Field(
        "off", description="how far averaging trusts its reducers: off, clip (CenteredClip), verify (clip and audits)")
    min_matchmaking_time: float = pydantic.Field(2.0, gt=0, description="seconds to gather an averaging group")
    averaging_timeout: float = pydantic.Field(30.0, gt=0, description="seconds an averaging round may take")
    bandwidth: float | None = pydantic.Field(None, gt=0, allow_inf_nan=False,
                                             description="Mbit/s to declare for load balancing (default: measured)")
    moshpit_grid: list[int] = pydantic.Field([2, 2], description="Moshpit grid (mode moshpit)")
    group_size: int = pydantic.Field(
        16, ge=2, description="the largest averaging group: collaborative runs with more live peers average in "
        "groups of groups (averaging/grouped.py); moshpit: also at most max(moshpit_grid)")
    averaging_period: int = pydantic.Field(10, gt=0, description="local steps between Moshpit averaging rounds")
    inner_steps: int = pydantic.Field(50, ge=1, description="diloco: inner steps per peer and outer round")
    round_peers: int = pydantic.Field(1, ge=1, description="diloco: the peers a round is sized for (its samples: "
                                      "inner_steps x the task's batch x round_peers)")
    outer_lr: float = pydantic.Field(0.7, gt=0, allow_inf_nan=False, description="diloco: the outer SGD's rate")
    outer_momentum: float = pydantic.Field(0.9, ge=0, lt=1, description="diloco: the outer SGD's Nesterov momentum")
    overlap: bool = pydantic.Field(False, description="diloco: all-reduce a round while the next inner phase "
                                   "trains (its outer step lands up to a round late)")
    max_epochs: int | None = pydantic.Field(None, gt=0, description="stop after this many global epochs")
    max_seconds: float | None = pydantic.Field(None, gt=0, description="stop after this many seconds")
    seed: int = pydantic.Field(0, description="this peer's data order (the initial weights come from the run)")
    device: DeviceName = pydantic.Field("auto", description="where the model trains: auto (a GPU when torch sees "
                                        "one), cpu or cuda")
    min_peers: int = pydantic.Field(1, ge=1, description="wait until this many peers are up before training")
    min_peers_timeout: float = pydantic.Field(120.0, gt=0, description="seconds to wait for min_peers at most")
    report_file: str | None = pydantic.Field(None, description="append one JSON line per epoch")
    report_every_s: float | None = pydantic.Field(None, gt=0, description="also append a progress line "
                                                  '({"kind": "progress", ...}: the loss since the last one) this often')
    param_digests: bool = pydantic.Field(False, description="keep a digest of all parameters per epoch in history")
    membership_token: str | None = pydantic.Field(None, description="the run's certificate for this peer "
                                                  "(spotswarm token issue): with it, only members take part")

    _route = pydantic.field_validator("route")(check_route)
    _overlap = pydantic.field_validator("overlap")(check_overlap)
