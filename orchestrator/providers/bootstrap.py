"""The boot scripts of a run's machines: the one place that says how a machine joins a run.

Every provider runs a worker's (EC2 user data, a GCE startup script, the local simulator's ``nodes``
mode): it starts a Ray node that joins the head and advertises a resource named after the
instance, so the supervisor's worker actor for that instance lands on that machine and no other.
The head that ``spotswarm up`` launches runs the head's: ``spotswarm head-boot``, which takes the
run from its archive.  Both first run the config's Ray boot commands, each line on the console
(where ``up`` reads a failed boot from), a failure named by a ``BOOT_FAILED`` line.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from orchestrator.config.schema import ClusterConfig
from orchestrator.providers.base import instance_resource

# Ray takes these as flags of their own, not in --resources.
_BUILTIN = {"CPU": "--num-cpus", "GPU": "--num-gpus", "memory": "--memory"}

BOOT_MARK = "spotswarm-boot:"  # a boot script's own lines on the machine's console
BOOT_FAILED = f"{BOOT_MARK} FAILED"
HEAD_INSTANCE_ENV = "SPOTSWARM_HEAD_INSTANCE"  # on a head that ``up`` launched: its instance id (the run's name)

# The first global IPv4 address of the machine (or network namespace) the script runs in.
NODE_IP_SHELL = "$(ip -4 -o addr show scope global | awk '{print $4}' | cut -d/ -f1 | head -n1)"


def ray_auth_token() -> str | None:
    """The head's token when Ray's token authentication is on (joining nodes must present it)."""
    token = os.environ.get("RAY_AUTH_TOKEN")
    if token:
        return token.strip()
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return None
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def ray_start_args(config: ClusterConfig, node_type: str, head_address: str, instance_id: str) -> list[str]:
    resources = dict(config.available_node_types[node_type].resources)
    # no log monitor: it streams the node's logs to drivers, and spotswarm's never ask for them
    # (log_to_driver is off); on a node that boots to replace a lost one it is a second of CPU saved
    args = ["start", f"--address={head_address}", "--block", "--disable-usage-stats", "--include-log-monitor=false"]
    for name, flag in _BUILTIN.items():
        if name in resources:
            value = resources.pop(name)
            args.append(f"{flag}={int(value)}")
    if "--num-cpus" not in " ".join(args):
        args.append("--num-cpus=1")  # a worker actor needs none; Ray's own tasks need a slot
    resources[instance_resource(instance_id)] = 1
    args.append(f"--resources={json.dumps(resources, separators=(',', ':'), sort_keys=True)}")
    return args


def boot_commands(config: ClusterConfig, role: str, node_type: str | None = None) -> list[tuple[str, str]]:
    """Ray's boot commands for a ``head`` or ``worker`` machine of ``node_type`` in Ray's order, each
    named by its key and position (``setup_commands[1]``; a node type's own list, as in Ray's YAML, by its
    place: ``available_node_types.gpu.worker_setup_commands[0]``)."""
    own = config.available_node_types.get(node_type) if node_type is not None else None
    steps: list[tuple[str, str]] = []
    for key in ("initialization_commands", "setup_commands", f"{role}_setup_commands"):
        commands, name = getattr(config, key), key
        overriding = getattr(own, key, None) if own is not None and key != "setup_commands" else None
        if overriding is not None:
            commands, name = overriding, f"available_node_types.{node_type}.{key}"
        steps += [(f"{name}[{i}]", command) for i, command in enumerate(commands)]
    return steps


def _step_lines(config: ClusterConfig, role: str, node_type: str | None) -> list[str]:
    """Shell lines running the boot commands in order, each logged and its output on the console; the
    first failure ends the boot with a ``BOOT_FAILED`` line naming it."""
    steps = boot_commands(config, role, node_type)
    if not steps:
        return []
    lines = [
        "spotswarm_step() {  # one boot command in a shell of its own, as Ray runs each",
        f'  echo "{BOOT_MARK} $1: $2"',
        '  bash -c "$2"; local rc=$?',
        f'  if [ "$rc" -ne 0 ]; then echo "{BOOT_FAILED}: $1 exited with status $rc: $2"; exit "$rc"; fi',
        "}",
    ]
    return lines + [f"spotswarm_step {shlex.quote(name)} {shlex.quote(command)}" for name, command in steps]


def render_head_script(config: ClusterConfig, archive_uri: str, endpoint_url: str | None = None) -> str:
    """The boot script of the head that ``spotswarm up`` launches: the boot commands, then
    ``spotswarm head-boot``, which takes the run's config and authority key from the archive (never
    from this script: user data is readable by anyone who may describe the instance), starts the
    Ray head with token authentication and the supervisor, and stays up while the run does."""
    command = ["spotswarm", "head-boot", archive_uri]
    if endpoint_url:
        command += ["--endpoint-url", endpoint_url]
    lines = [
        "#!/usr/bin/env bash",
        f"# spotswarm: the head of run {config.cluster_name}",
        "set -uo pipefail",
        f'echo "{BOOT_MARK} the head of run {config.cluster_name} boots"',
        *_step_lines(config, "head", config.head_node_type),
        f"exec {' '.join(shlex.quote(c) for c in command)}",
        "",
    ]
    return "\n".join(lines)


def render_boot_script(config: ClusterConfig, node_type: str, head_address: str, instance_id: str, *,
                       auth_token: str | None = "$RAY_AUTH_TOKEN", ray_command: str = "ray",
                       node_ip: str | None = None) -> str:
    """A bash script that joins the machine to the run's Ray cluster and blocks while it is up.

    ``auth_token``: the head's token (None when token authentication is off); the default keeps
    the secret out of printed scripts by reading it from the environment.  ``node_ip``: the
    address other machines reach this one at (default: Ray's own guess)."""
    if node_type not in config.available_node_types:
        known = ", ".join(sorted(config.available_node_types))
        raise ValueError(f"node type {node_type!r} is not in available_node_types ({known})")
    args = ray_start_args(config, node_type, head_address, instance_id)
    command = " ".join([shlex.quote(ray_command), *(shlex.quote(a) for a in args)])
    # several nodes on one machine (the local simulator) need a temp dir each, or their sockets clash
    command += ' --temp-dir="${SPOTSWARM_NODE_TMP:-/tmp/ray}"'
    if node_ip == NODE_IP_SHELL:
        command += f' --node-ip-address="{NODE_IP_SHELL}"'
    elif node_ip:
        command += f" --node-ip-address={shlex.quote(node_ip)}"
    lines = [
        "#!/usr/bin/env bash",
        f"# spotswarm: instance {instance_id} ({node_type}) of run {config.cluster_name}",
        "set -euo pipefail",
    ]
    steps = _step_lines(config, "worker", node_type)
    if steps:  # a failing command must reach its own report, not end the script at once
        lines += ["set +e", *steps, "set -e"]
    if auth_token == "$RAY_AUTH_TOKEN":
        lines += ["export RAY_AUTH_MODE=token", 'export RAY_AUTH_TOKEN="${RAY_AUTH_TOKEN:?the Ray head token}"']
    elif auth_token is not None:
        lines += ["export RAY_AUTH_MODE=token", f"export RAY_AUTH_TOKEN={shlex.quote(auth_token)}"]
    lines += [f"exec {command}", ""]
    return "\n".join(lines)
