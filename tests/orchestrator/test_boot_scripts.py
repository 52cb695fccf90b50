"""The boot scripts run by bash as a machine runs them: Ray's boot commands in Ray's order (the head's
and the workers' own last), each line on the console, the first failure named and the rest not run; a
head's script then hands over to ``spotswarm head-boot``, which says on the console why it cannot boot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from orchestrator.config.schema import ClusterConfig
from orchestrator.providers.bootstrap import BOOT_FAILED, render_boot_script, render_head_script


def config(tmp_path: Path, types: dict | None = None, **commands: list[str]) -> ClusterConfig:
    """The run's config with the top-level boot ``commands``; ``types``: node types' own keys, by type."""
    node_types = {"head": {"max_workers": 0}, "w": {"min_workers": 1, "max_workers": 1},
                  "gpu": {"min_workers": 0, "max_workers": 1}}
    for name, keys in (types or {}).items():
        node_types[name] = {**node_types[name], **keys}
    return ClusterConfig.model_validate({
        "cluster_name": "boot", "provider": {"type": "local", "zones": ["a"]}, "head_node_type": "head",
        "available_node_types": node_types, **commands})


def run(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "boot.sh"
    path.write_text(script)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "SPOTSWARM_HOME": str(tmp_path / "home"), "RAY_AUTH_TOKEN": "t"}
    return subprocess.run(["bash", str(path)], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)


def order_commands(log: Path) -> dict[str, list[str]]:
    step = f"echo $0 >> {log}"
    return {key: [step.replace("$0", f"{key}-{i}") for i in range(2)]
            for key in ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands")}


def test_the_heads_script_runs_rays_commands_in_order_then_head_boot_says_why_it_cannot_boot(tmp_path):
    log = tmp_path / "order.log"
    script = render_head_script(config(tmp_path, **order_commands(log)), str(tmp_path / "no-archive"))
    done = run(script, tmp_path)
    assert done.returncode == 1
    assert log.read_text().split() == ["initialization_commands-0", "initialization_commands-1", "setup_commands-0",
                                       "setup_commands-1", "head_setup_commands-0", "head_setup_commands-1"]
    lines = done.stdout.splitlines()
    assert lines[0] == "spotswarm-boot: the head of run boot boots"
    assert lines[1].startswith("spotswarm-boot: initialization_commands[0]: echo initialization_commands-0 >> ")
    assert lines[-1] == f"{BOOT_FAILED}: ArchiveMissing: {tmp_path / 'no-archive'}: no launch there " \
                        f"(no {tmp_path / 'no-archive' / 'launch' / 'launch.json'})"


def test_a_failing_command_ends_the_boot_named_and_the_rest_never_runs(tmp_path):
    log = tmp_path / "order.log"
    commands = order_commands(log)
    commands["setup_commands"].insert(1, "echo broken image >&2; exit 7")
    for script in (render_head_script(config(tmp_path, **commands), str(tmp_path / "archive")),
                   render_boot_script(config(tmp_path, **commands), "w", "127.0.0.1:1", "w-0")):
        log.unlink(missing_ok=True)
        done = run(script, tmp_path)
        assert done.returncode == 7
        assert log.read_text().split() == ["initialization_commands-0", "initialization_commands-1", "setup_commands-0"]
        assert done.stdout.splitlines()[-1] == \
            f"{BOOT_FAILED}: setup_commands[1] exited with status 7: echo broken image >&2; exit 7"
        assert "broken image" in done.stderr


def test_a_workers_script_runs_its_own_commands_and_not_the_heads(tmp_path):
    log = tmp_path / "order.log"
    commands = order_commands(log)
    commands["worker_setup_commands"].append("exit 4")  # ray start is never reached
    done = run(render_boot_script(config(tmp_path, **commands), "w", "127.0.0.1:1", "w-0"), tmp_path)
    assert done.returncode == 4
    assert log.read_text().split() == ["initialization_commands-0", "initialization_commands-1", "setup_commands-0",
                                       "setup_commands-1", "worker_setup_commands-0", "worker_setup_commands-1"]


def test_without_commands_the_scripts_are_as_before(tmp_path):
    script = render_boot_script(config(tmp_path), "w", "127.0.0.1:1", "w-0")
    assert "spotswarm_step" not in script and "set +e" not in script


def test_a_node_types_own_commands_replace_the_top_level_ones_for_its_machines(tmp_path):
    """As in Ray's YAML: a node type's initialization_commands and worker_setup_commands stand in for the
    top-level lists of the same name on its machines (the head's type's initialization_commands too);
    setup_commands stay shared, and another type keeps the top-level lists."""
    log = tmp_path / "order.log"
    own = {"initialization_commands": [f"echo gpu-init >> {log}"],
           "worker_setup_commands": [f"echo gpu-setup >> {log}", "exit 5"]}
    cfg = config(tmp_path, types={"gpu": own, "head": {"initialization_commands": [f"echo head-init >> {log}"]}},
                 **order_commands(log))
    done = run(render_boot_script(cfg, "gpu", "127.0.0.1:1", "gpu-0"), tmp_path)
    assert done.returncode == 5
    assert log.read_text().split() == ["gpu-init", "setup_commands-0", "setup_commands-1", "gpu-setup"]
    assert done.stdout.splitlines()[-1] == \
        f"{BOOT_FAILED}: available_node_types.gpu.worker_setup_commands[1] exited with status 5: exit 5"

    log.unlink()
    cfg = config(tmp_path, types={"gpu": own}, **order_commands(log))
    run(render_boot_script(cfg, "w", "127.0.0.1:1", "w-0").replace("ray start", "exit 0 #"), tmp_path)
    assert log.read_text().split()[:2] == ["initialization_commands-0", "initialization_commands-1"]

    log.unlink()
    cfg = config(tmp_path, types={"head": {"initialization_commands": [f"echo head-init >> {log}"]}},
                 **order_commands(log))
    run(render_head_script(cfg, str(tmp_path / "no-archive")), tmp_path)
    assert log.read_text().split() == ["head-init", "setup_commands-0", "setup_commands-1", "head_setup_commands-0",
                                       "head_setup_commands-1"]
