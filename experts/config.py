"""An expert server described as data (a YAML file, CLI flags): what to host and how to serve it.

``ExpertServerConfig`` validates field by field (errors name the field); ``build_backends`` turns it
into experts and ``serve`` runs the server until told to stop.  The ``spotswarm expert-server``
command is a thin shell around these.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import logging
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from p2p import Identity, Limits
from p2p.devices import DeviceName, pick_device
from p2p.membership import Membership

from .backend import ExpertBackend
from .grid import expand_pattern, parse_uid
from .server import ExpertServer

logger = logging.getLogger(__name__)


class ExpertServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    expert_cls: str = Field("ffn", description="expert kind: ffn, transformer, nop, or one a custom module registers")
    hidden_dim: int = Field(1024, gt=0, description="hidden size of each expert")
    expert_uids: list[str] | None = Field(None, description="exact uids, e.g. [ffn.0.0, ffn.0.1]")
    expert_pattern: str | None = Field(None, description="every uid of a grid, e.g. ffn.[0:4].[0:4]")
    custom_module: str | None = Field(None, description="a .py file that registers expert kinds")
    optimizer: Literal["adam", "sgd", "none"] = Field("adam", description="each expert's optimizer")
    lr: float = Field(1e-3, ge=0, description="learning rate")
    optimizer_update_period: int = Field(1, ge=1, description="backward batches per optimizer step")
    max_grad_norm: float | None = Field(None, gt=0, description="clip each step's gradient norm to this")
    max_batch_size: int = Field(4096, gt=0, description="rows per batch, and per request at most")
    batch_timeout: float = Field(0.0, ge=0, description="seconds a batch may wait to fill up")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(0, ge=0, lt=65536, description="port to listen on; 0 is any free port")
    announce_host: str | None = Field(None, description="host to declare in the DHT, if not the listening one")
    initial_peers: list[str] = Field(default_factory=list, description="DHT peers to join; none: start a new DHT")
    no_dht: bool = Field(False, description="serve without declaring in any DHT")
    identity: str | None = Field(None, description="private key file; created if missing, keeps the peer id")
    membership_token: str | None = Field(None, description="a run's certificate for this identity (spotswarm "
                                         "token issue): serve and declare to that run's members only")
    update_period: float = Field(30.0, gt=0, description="seconds between DHT declarations")
    expiration: float | None = Field(None, gt=0, description="lifetime of a declaration (default 2x update_period)")
    checkpoint_dir: str | None = Field(None, description="load checkpoints from and save them to this directory")
    checkpoint_period: float | None = Field(None, gt=0, description="seconds between checkpoint saves")
    max_message_mib: int | None = Field(None, gt=0, description="largest request accepted, in MiB")
    seed: int | None = Field(None, description="seed for the experts' initial weights")
    num_threads: int | None = Field(None, gt=0, description="torch threads for the experts' work")
    device: DeviceName = Field("auto", description="where the experts compute: auto (a GPU when torch sees one), "
                               "cpu or cuda")

    @model_validator(mode="after")
    def _one_source_of_uids(self) -> ExpertServerConfig:
        if (self.expert_uids is None) == (self.expert_pattern is None):
            raise ValueError("give exactly one of expert_uids and expert_pattern")
        for uid in self.uids():
            parse_uid(uid)
        return self

    def uids(self) -> list[str]:
        return list(self.expert_uids) if self.expert_uids is not None else expand_pattern(self.expert_pattern or "")


def load_custom_module(path: str | Path) -> None:
    """Import a Python file so the expert kinds it registers become available."""
    path = Path(path).resolve()
    name = "spotswarm_custom_experts_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return  # already imported: its kinds are registered
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import custom expert module {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


def _optimizer(config: ExpertServerConfig) -> Callable | None:
    if config.optimizer == "none":
        return None
    cls = torch.optim.Adam if config.optimizer == "adam" else torch.optim.SGD
    return lambda params: cls(params, lr=config.lr)


def build_backends(config: ExpertServerConfig) -> list[ExpertBackend]:
    if config.custom_module:
        load_custom_module(config.custom_module)
    if config.seed is not None:
        torch.manual_seed(config.seed)
        random.seed(config.seed)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = pick_device(config.device)
    return [ExpertBackend.from_kind(uid, config.expert_cls, config.hidden_dim, optimizer=_optimizer(config),
                                    device=device, max_batch_size=config.max_batch_size,
                                    update_period=config.optimizer_update_period, max_grad_norm=config.max_grad_norm)
            for uid in config.uids()]


async def start_server(config: ExpertServerConfig) -> ExpertServer:
    limits = None
    if config.max_message_mib:
        size = config.max_message_mib << 20
        # the node-wide budget for frames in flight must admit one whole request too
        limits = Limits(max_message_bytes=size, max_frame_bytes=size,
                        max_pending_frame_bytes=max(size, Limits.max_pending_frame_bytes))
    identity = Identity.from_file(config.identity) if config.identity else Identity()
    membership = Membership.from_token(config.membership_token, identity) if config.membership_token else None
    return await ExpertServer.create(
        build_backends(config), host=config.host, port=config.port, announce_host=config.announce_host,
        initial_peers=None if config.no_dht else config.initial_peers, identity=identity, limits=limits,
        p2p_options={"membership": membership} if membership else None,
        batch_timeout=config.batch_timeout, update_period=config.update_period, expiration=config.expiration,
        checkpoint_dir=config.checkpoint_dir, checkpoint_period=config.checkpoint_period)


async def serve(config: ExpertServerConfig, stop: asyncio.Event, on_ready: Callable[[ExpertServer], None]) -> None:
    """Run a server until ``stop`` is set, then shut it down (withdrawing its experts)."""
    server = await start_server(config)
    try:
        on_ready(server)
        await stop.wait()
    finally:
        await server.shutdown()
