"""Ray heads for the tests (``orchestrator.host.ray_head``), each as on a head machine of its own:
the tests of a cluster that outlives its command, and the one head that the test modules using
``ray_session`` share."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

from orchestrator.host.ray_head import RayHead
from orchestrator.providers.bootstrap import ray_auth_token

ROOT = Path(__file__).resolve().parents[1]


def ensure_machine_token(env: dict[str, str]) -> None:
    """Make the machine's Ray token where token authentication is on and there is none yet: a local
    ``ray.init`` makes it, ``ray start`` does not."""
    if env.get("RAY_AUTH_MODE", "").lower() == "token" and ray_auth_token() is None:
        ray = Path(sys.executable).with_name("ray")
        subprocess.run([str(ray), "get-auth-token", "--generate"], env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=True, timeout=60)


def ray_head(name: str, log: Path, num_cpus: int = 1, own_token: bool = True) -> RayHead:
    """A head that is up, with its own temp dir: with token authentication and a token of its own, or
    with ``own_token=False`` this process's Ray settings (see ``conftest.py``: the machine's token), so
    that this process connects as to a local ``ray.init``.  ``close()`` it after."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    if own_token:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
    else:
        ensure_machine_token(env)
    # short: Ray's socket paths must fit in 107 bytes
    head = RayHead(Path(f"/tmp/ssw-{name}-{os.getpid()}"), log, env, num_cpus=num_cpus)
    try:
        head.wait_ready(60)
    except BaseException:
        head.close()
        raise
    return head
