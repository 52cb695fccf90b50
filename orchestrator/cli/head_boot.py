"""``spotswarm head-boot URI``: the head machine's side of ``spotswarm up`` from a laptop, run by the head's
boot script after the config's boot commands.

It takes the launch from the run's archive (the config, ``up`` or ``resume``, the authority key: never
from user data), starts the Ray head in the machine's own session with token authentication (a fresh
token: the workers get it in their boot scripts from the supervisor), runs ``up`` or ``resume`` with
``--address`` there (the supervisor detached on that cluster), and once the run stops, stops Ray and
releases its own machine: a run that ended costs nothing more.  Its lines go to the machine's console,
where the laptop reads a failed boot from (``BOOT_FAILED``).
"""

from __future__ import annotations

import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from orchestrator.providers.bootstrap import BOOT_MARK, HEAD_INSTANCE_ENV

if TYPE_CHECKING:
    from orchestrator.config.schema import ClusterConfig
    from orchestrator.host.ray_head import RayHead

HOME_ENV = "SPOTSWARM_HOME"  # where the head keeps the run (default /var/lib/spotswarm)
DEFAULT_HOME = "/var/lib/spotswarm"
RAY_START_S = 120.0


def _say(text: str) -> None:
    print(f"{BOOT_MARK} {text}", flush=True)


@dataclass
class BootedHead:
    """What the boot prepared: the run's config (and its file here), its run directory, the launch document,
    and the Ray head started for it, at ``address``."""

    config: ClusterConfig
    config_path: Path
    run_dir: Path
    launch: dict
    head: RayHead
    address: str


def boot_head(uri: str, endpoint_url: str | None) -> int:
    """Boot the head and run the launch; the run's exit status (a failure before the run: ``BOOT_FAILED``, 1)."""
    try:
        booted = _prepare(uri, endpoint_url)
    except Exception as e:  # noqa: BLE001 - whatever stops the boot is the laptop's to show
        _say(f"FAILED: {type(e).__name__}: {e}")
        return 1
    return _run(booted)


def _prepare(uri: str, endpoint_url: str | None) -> BootedHead:
    from orchestrator.cli.cluster import restore_run
    from orchestrator.config.checks import load_cluster_config
    from orchestrator.fleet.authority import AUTHORITY_FILE
    from orchestrator.host.ray_head import RayHead
    from orchestrator.runs.durable import RunArchive

    home = Path(os.environ.get(HOME_ENV, DEFAULT_HOME))
    home.mkdir(parents=True, exist_ok=True)
    os.chdir(home)
    _say(f"taking the launch from {uri}")
    archive = RunArchive(uri, endpoint_url)
    launch = archive.launch()
    key = archive.authority_key()
    if key is None:
        raise RuntimeError(f"{uri}: the launch has no authority key")
    config_path = home / "cluster.yaml"
    config_path.write_text(launch["config_yaml"])
    config = load_cluster_config(config_path)
    run_dir = config.run_dir().resolve()
    if launch["command"] == "resume" and not (run_dir / "run.sqlite").exists():
        epoch = restore_run(config, run_dir)
        _say(f"restored run {config.cluster_name} from {uri} at checkpoint epoch {epoch}")
    run_dir.mkdir(parents=True, exist_ok=True)
    key_path = run_dir / AUTHORITY_FILE
    key_path.unlink(missing_ok=True)
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
                       HEAD_INSTANCE_ENV: launch["head"]})
    temp = Path(os.environ.get("SPOTSWARM_NODE_TMP", "/tmp/ray"))  # short: Ray's socket paths
    head = RayHead(temp, home / "ray-head.log", dict(os.environ), num_cpus=os.cpu_count() or 1, new_session=False)
    address = head.wait_ready(RAY_START_S)
    _say(f"Ray head at {address} (token authentication); {launch['command']} of run {config.cluster_name} starts")
    return BootedHead(config, config_path, run_dir, launch, head, address)


def _run(booted: BootedHead) -> int:
    from orchestrator.cli import cluster
    from orchestrator.config.tags import INSTANCE_TAG
    from orchestrator.fleet.registry import terminate_cloud_run

    console = Console(file=sys.stdout, force_terminal=False, width=120)
    code = 1
    try:
        launch = booted.launch
        if launch["command"] == "resume":
            code = cluster.resume(str(booted.run_dir), launch.get("duration"), console, address=booted.address)
        else:
            code = cluster.up(str(booted.config_path), launch.get("duration"), console, address=booted.address)
    except Exception as e:  # noqa: BLE001 - said on the console, then the machine is released all the same
        _say(f"the run ended on an error: {type(e).__name__}: {e}")
    finally:
        booted.head.stop(grace_s=10)
    _say(f"the run stopped ({code}); releasing this head")
    try:
        terminate_cloud_run(booted.config, tags={INSTANCE_TAG: booted.launch["head"]})
    except Exception as e:  # noqa: BLE001
        _say(f"could not release this head ({e}); `spotswarm down` terminates it")
    return code
